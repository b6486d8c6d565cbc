// CUDA selection kernels. The per-element logic (error-feedback update, selection value, key) is
// the same __host__ __device__ code the CPU kernels run (numeric.h, kernels.h).
//
// A bucket is cut into tiles of kTile elements, one block each; a thread reads its share in runs
// of 16 bytes when the arrays allow (tile_values).
// Selection by key (also used to collect candidates): pass 1 reads each tile once, applies the
// update where asked, counts the selected elements and the non-finite sums per tile and records
// the selected elements in a bit mask (one bit per element, 1/32 of a float32 bucket's bytes); a
// device scan turns the tile counts into output offsets; pass 2 reads the mask and only the
// selected elements, and writes the pairs in index order. The host waits once, for the count (the
// sink sizes the output by it); the call returns with pass 2 still queued, its scratch (one
// allocation) released in stream order.
// Top-k: a radix select finds the k-th largest key on the device, one 11-bit digit at a time (a
// histogram of the digit among the keys that share the digits found so far; the first also
// applies the update), as the CPU kernel does with two digits. Then one pass marks the keys above
// it and the keys equal to it, and pass 2 writes the keys above and the lowest-index ties up to
// k. The count is k, known in advance: the host waits only for the non-finite count, at the end.
#include <functional>
#include <optional>

#include "common.cuh"

namespace gradsparse {
namespace cuda {
namespace {

using namespace detail;
constexpr int kItems = 16;  // elements per thread per tile
constexpr int64_t kTile = int64_t{kThreads} * kItems;
constexpr int kWarp = 32;
constexpr int kMaskWords = static_cast<int>(kTile / kWarp);  // 32-bit mask words per tile

/// Two counts per tile: the selected elements and the non-finite sums (selection by key), or the
/// keys above the k-th and those equal to it (top-k). Scanned, the counts of the tiles before.
struct CountPair {
  unsigned long long selected, other;
};
struct AddCountPairs {
  __host__ __device__ CountPair operator()(const CountPair& a, const CountPair& b) const {
    return {a.selected + b.selected, a.other + b.other};
  }
};

/// Writes a tile's two counts (block-wide sums), and the scan's sentinel after the last tile.
__device__ __forceinline__ void store_tile_counts(CountPair mine, CountPair* counts) {
  using Reduce = cub::BlockReduce<CountPair, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const CountPair tile = Reduce(storage).Reduce(mine, AddCountPairs());
  if (threadIdx.x == 0) {
    counts[blockIdx.x] = tile;
    if (blockIdx.x == 0) counts[gridDim.x] = CountPair{0, 0};
  }
}

/// W elements of one thread in one row of a tile: one 16-byte access where W > 1.
template <typename T, int W>
struct Run {
  T at[W];
};
template <typename T, int W>
__device__ __forceinline__ Run<T, W> load_run(const T* p) {
  Run<T, W> run;
  if constexpr (W == 1) {
    run.at[0] = *p;
  } else {
    static_assert(sizeof(Run<T, W>) == sizeof(uint4));
    const uint4 bits = *reinterpret_cast<const uint4*>(p);
    memcpy(&run, &bits, sizeof(bits));
  }
  return run;
}
template <typename T, int W>
__device__ __forceinline__ void store_run(T* p, const Run<T, W>& run) {
  if constexpr (W == 1) {
    *p = run.at[0];
  } else {
    uint4 bits;
    memcpy(&bits, &run, sizeof(bits));
    *reinterpret_cast<uint4*>(p) = bits;
  }
}

/// How many elements of T one 16-byte access moves.
template <typename T>
constexpr int kRunLength = static_cast<int>(sizeof(uint4) / sizeof(T));

/// True when every array of `src` allows 16-byte accesses.
template <typename T>
bool runs_aligned(const Source<T>& src) {
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % sizeof(uint4) == 0; };
  return aligned(src.residual) && aligned(src.grad) && aligned(src.velocity);
}

/// Calls launch(std::integral_constant<int, W>) with W = 16-byte runs when `src` allows them, else 1.
template <typename T, typename Launch>
void with_run_length(const Source<T>& src, Launch&& launch) {
  if (runs_aligned(src)) {
    launch(std::integral_constant<int, kRunLength<T>>{});
  } else {
    launch(std::integral_constant<int, 1>{});
  }
}

/// A thread's share of a tile: kItems elements in kItems / W runs of W consecutive elements. The
/// tile's rows of kThreads * W elements are visited in index order, so a warp's run of 32 * W
/// elements is W mask words.
template <int W>
__device__ __forceinline__ int64_t run_start(int64_t tile, int row) {
  return tile * kTile + int64_t{row} * kThreads * W + int64_t{threadIdx.x} * W;
}

/// The selection values of a thread's share of tile `tile`, after the update where `src.update`
/// (the residual and the velocity written back). `bad` counts the non-finite sums, or without a
/// residual the non-finite gradients. Every run is read before any is written, so a thread has
/// all its loads in flight, and the update itself is the shared element rule applied to
/// registers. On an H200 at 25M float32 elements, pass 1 with W = 1 took 97 us against 73 us for
/// a plain add; with 16-byte runs 77 us (docs/benchmarks.md, "On a GPU"). `kReadOnly` leaves the
/// update out (`src.update` must be false), and its registers with it.
template <typename T, int W, bool kReadOnly = false>
__device__ __forceinline__ void tile_values(const Source<T>& src, int64_t n, int64_t tile,
                                            Run<T, W> (&value)[kItems / W], unsigned long long& bad) {
  constexpr int kRows = kItems / W;
  const bool with_velocity = src.velocity != nullptr;
  if (!kReadOnly && src.update && src.residual != nullptr) {
    Run<T, W> grad[kRows], velocity[kRows];
    Run<T, W>(&residual)[kRows] = value;
#pragma unroll
    for (int row = 0; row < kRows; ++row) {
      const int64_t i = run_start<W>(tile, row);
      if (i + W <= n) {
        residual[row] = load_run<T, W>(src.residual + i);
        grad[row] = load_run<T, W>(src.grad + i);
        if (with_velocity) velocity[row] = load_run<T, W>(src.velocity + i);
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) {
          if (i + j >= n) break;
          residual[row].at[j] = src.residual[i + j];
          grad[row].at[j] = src.grad[i + j];
          if (with_velocity) velocity[row].at[j] = src.velocity[i + j];
        }
      }
    }
#pragma unroll
    for (int row = 0; row < kRows; ++row) {
      const int64_t i = run_start<W>(tile, row);
#pragma unroll
      for (int j = 0; j < W; ++j) {
        if (i + j < n) {
          const Source<T> one{
              &residual[row].at[j], &grad[row].at[j], true, with_velocity ? &velocity[row].at[j] : nullptr,
              src.momentum,         src.masking};
          bool finite;
          one.update_element(0, finite);
          bad += !finite;
        }
      }
      if (i + W <= n) {
        store_run<T, W>(src.residual + i, residual[row]);
        if (with_velocity) store_run<T, W>(src.velocity + i, velocity[row]);
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) {
          if (i + j >= n) break;
          src.residual[i + j] = residual[row].at[j];
          if (with_velocity) src.velocity[i + j] = velocity[row].at[j];
        }
      }
    }
  } else {
    const T* read = src.residual != nullptr ? src.residual : src.grad;
#pragma unroll
    for (int row = 0; row < kRows; ++row) {
      const int64_t i = run_start<W>(tile, row);
      if (i + W <= n) {
        value[row] = load_run<T, W>(read + i);
      } else {
#pragma unroll
        for (int j = 0; j < W; ++j) {
          if (i + j >= n) break;
          value[row].at[j] = read[i + j];
        }
      }
    }
    if (src.residual == nullptr) {  // selection_value: a non-finite gradient reads as zero
#pragma unroll
      for (int row = 0; row < kRows; ++row) {
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const bool finite = run_start<W>(tile, row) + j >= n || is_finite(value[row].at[j]);
          bad += !finite;
          if (!finite) value[row].at[j] = Num<T>::zero();
        }
      }
    }
  }
}

/// Writes the warp's mask words of one row: `bits` holds the flags of this thread's run (bit j:
/// element i + j), `i` its first element.
template <int W>
__device__ __forceinline__ void write_mask_words(unsigned int bits, int64_t i, unsigned int* mask) {
  const int lane = threadIdx.x % kWarp;
  const int64_t start = i - int64_t{lane} * W;  // the warp's first element in this row
  if constexpr (W == 1) {
    const unsigned int word = __ballot_sync(0xffffffffu, bits != 0);
    if (lane == 0) mask[start / kWarp] = word;
  } else {
    constexpr int kLanesPerWord = kWarp / W;  // word q gathers the bits of lanes [q, q + 1) * kLanesPerWord
#if __CUDA_ARCH__ >= 800
#pragma unroll
    for (int q = 0; q < W; ++q) {
      const unsigned int word =
          __reduce_or_sync(0xffffffffu, lane / kLanesPerWord == q ? bits << (lane % kLanesPerWord * W) : 0u);
      if (lane == 0) mask[start / kWarp + q] = word;
    }
#else
    // Before sm_80 (no __reduce_or_sync): the same words by shuffles within each group of lanes,
    // whose first lane writes its word. (Compiled in CI for sm_75; not yet run on such a GPU.)
    unsigned int word = bits << (lane % kLanesPerWord * W);
#pragma unroll
    for (int d = 1; d < kLanesPerWord; d <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, d);
    if (lane % kLanesPerWord == 0) mask[start / kWarp + lane / kLanesPerWord] = word;
#endif
  }
}

/// Pass 1: the update (where asked) and the selection of one tile.
template <typename T, int W>
__global__ void select_count_kernel(Source<T> src, int64_t n, uint32_t key, Range range, CountPair* counts,
                                    unsigned int* mask) {
  constexpr int kRows = kItems / W;
  unsigned long long hits = 0, bad = 0;
  Run<T, W> value[kRows];
  tile_values<T, W>(src, n, blockIdx.x, value, bad);
#pragma unroll
  for (int row = 0; row < kRows; ++row) {
    const int64_t i = run_start<W>(blockIdx.x, row);
    unsigned int bits = 0;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const int64_t e = i + j;
      bits |=
          static_cast<unsigned int>(e < n && e >= range.begin && e < range.end && Num<T>::key(value[row].at[j]) >= key)
          << j;
    }
    hits += __popc(bits);
    write_mask_words<W>(bits, i, mask);
  }
  store_tile_counts(CountPair{hits, bad}, counts);
}

__device__ __forceinline__ unsigned long long smaller(unsigned long long a, unsigned long long b) {
  return a < b ? a : b;
}

/// Pass 2: one thread per mask word of a tile (kMaskWords threads); a tile without selected
/// elements returns at once. The values are read again (the updated residual, or the gradient);
/// they are the values pass 1 selected by (selection_value reads the same value every time).
/// With `tie_mask` (top-k), `mask` holds the keys above the k-th and a tile also takes its share
/// of the bucket's first `*tie_quota` ties in index order: the offsets count the keys above
/// (`selected`) and the ties (`other`) before each tile, and min(quota, ties before) were taken
/// before it.
template <typename T, typename I>
__global__ void select_write_kernel(Source<T> src, bool zero, const CountPair* offsets, const unsigned int* mask,
                                    const unsigned int* tie_mask, const unsigned long long* tie_quota, I* out_idx,
                                    T* out_val) {
  using Scan = cub::BlockScan<unsigned int, kMaskWords>;
  __shared__ typename Scan::TempStorage storage;
  const int64_t tile = blockIdx.x;
  unsigned long long first = offsets[tile].selected, end = offsets[tile + 1].selected, take = 0, ties = 0;
  if (tie_mask != nullptr) {
    const unsigned long long quota = *tie_quota, before = offsets[tile].other, after = offsets[tile + 1].other;
    const unsigned long long taken = smaller(quota, before);
    take = smaller(quota, after) - taken;
    ties = after - before;
    first += taken;
    end += taken + take;
  }
  if (end == first) return;  // the same for the whole block, as are take and ties
  const int64_t word = tile * kMaskWords + threadIdx.x;
  unsigned int bits = mask[word], offset;
  if (take > 0) {
    unsigned int tie_bits = tie_mask[word];
    if (take < ties) {  // keep the tile's first `take` ties
      Scan(storage).ExclusiveSum(static_cast<unsigned int>(__popc(tie_bits)), offset);
      __syncthreads();  // the storage is scanned again below
      unsigned int kept = 0;
      for (unsigned long long j = offset; tie_bits != 0 && j < take; ++j) {
        const unsigned int lowest = tie_bits & (0u - tie_bits);
        kept |= lowest;
        tie_bits ^= lowest;
      }
      tie_bits = kept;
    }
    bits |= tie_bits;
  }
  Scan(storage).ExclusiveSum(static_cast<unsigned int>(__popc(bits)), offset);
  unsigned long long position = first + offset;
  for (; bits != 0; bits &= bits - 1, ++position) {
    const int64_t i = word * kWarp + (__ffs(bits) - 1);
    out_idx[position] = static_cast<I>(i);
    out_val[position] = src.value(i);
    if (zero && src.residual != nullptr) src.residual[i] = Num<T>::zero();
  }
}

/// The radix select's digits: kDigitBits bits at a time from the key's highest bit.
constexpr int kDigitBits = 11;
constexpr int kBins = 1 << kDigitBits;

constexpr int radix_levels(int key_bits) { return (key_bits + kDigitBits - 1) / kDigitBits; }

/// What the radix select has found: the k-th largest key's digits so far (lower bits zero), and
/// how many of the keys that share them belong to the top k (after the last digit: how many of
/// the keys equal to the k-th are taken).
struct RadixState {
  uint32_t prefix;
  unsigned long long need;
};

/// One digit's histogram, bits [shift, high) of the key, over the keys whose bits from `high` up
/// equal the state's prefix; each block loops over tiles and adds its own histogram to `hist` at
/// the end. The first digit (kFirst, no state) also applies the update where `src.update` and
/// counts the non-finite values, as the selection by key does; the later ones only read, and read
/// a block's next tile while counting the current one. Each key is one atomic add to the block's
/// histogram in shared memory: on an H200 at 25M float32 elements the first digit took 97 us so,
/// 227 us when the lanes of a warp that share a digit were first merged (__match_any_sync).
template <typename T, int W, bool kFirst>
__global__ void __launch_bounds__(kThreads, 4)
    radix_histogram_kernel(Source<T> src, int64_t n, int shift, int high, const RadixState* state,
                           unsigned long long* hist, unsigned long long* nonfinite) {
  constexpr int kRows = kItems / W;
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  __shared__ unsigned int bins[kBins];
  for (int b = threadIdx.x; b < kBins; b += kThreads) bins[b] = 0;
  __syncthreads();
  const uint32_t prefix = kFirst ? 0u : state->prefix >> high;
  const uint32_t digit_mask = (1u << (high - shift)) - 1u;
  const int64_t tiles = (n + kTile - 1) / kTile;
  unsigned long long bad = 0;
  auto count = [&](int64_t tile, const Run<T, W>(&value)[kRows]) {
#pragma unroll
    for (int row = 0; row < kRows; ++row) {
#pragma unroll
      for (int j = 0; j < W; ++j) {
        const uint32_t key = Num<T>::key(value[row].at[j]);
        if (run_start<W>(tile, row) + j < n && (key >> high) == prefix)
          atomicAdd(&bins[(key >> shift) & digit_mask], 1u);
      }
    }
  };
  if constexpr (kFirst) {
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
      Run<T, W> value[kRows];
      tile_values<T, W>(src, n, tile, value, bad);
      count(tile, value);
    }
  } else {
    Run<T, W> value[kRows], next[kRows];
    if (blockIdx.x < tiles) tile_values<T, W, true>(src, n, blockIdx.x, next, bad);
    for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
#pragma unroll
      for (int row = 0; row < kRows; ++row) value[row] = next[row];
      if (tile + gridDim.x < tiles) tile_values<T, W, true>(src, n, tile + gridDim.x, next, bad);
      count(tile, value);
    }
  }
  __syncthreads();
  for (int b = threadIdx.x; b < kBins; b += kThreads)
    if (bins[b] != 0) atomicAdd(&hist[b], static_cast<unsigned long long>(bins[b]));
  if constexpr (kFirst) {
    const unsigned long long block_bad = Reduce(storage).Sum(bad);
    if (threadIdx.x == 0 && block_bad > 0) atomicAdd(nonfinite, block_bad);
  }
}

/// The digit of the k-th largest key: the highest bin at which the count from the top reaches
/// the need (one block, the bins highest first, kBins / kPickThreads consecutive ones per
/// thread). The first digit starts from k.
constexpr int kPickThreads = 256;
__global__ void __launch_bounds__(kPickThreads)
    radix_pick_kernel(const unsigned long long* hist, int shift, unsigned long long k, bool first, RadixState* state) {
  constexpr int kPer = kBins / kPickThreads;
  using Scan = cub::BlockScan<unsigned long long, kPickThreads>;
  __shared__ typename Scan::TempStorage storage;
  const unsigned long long need = first ? k : state->need;
  const uint32_t prefix = first ? 0u : state->prefix;
  unsigned long long count[kPer], through[kPer];
  for (int j = 0; j < kPer; ++j) count[j] = hist[kBins - 1 - (kPer * threadIdx.x + j)];
  Scan(storage).InclusiveSum(count, through);  // its barriers order every read above before the write
  for (int j = 0; j < kPer; ++j) {
    const unsigned long long above = through[j] - count[j];
    if (above < need && through[j] >= need) {
      state->prefix = prefix | (static_cast<uint32_t>(kBins - 1 - (kPer * threadIdx.x + j)) << shift);
      state->need = need - above;
    }
  }
}

/// Top-k's pass 1 (values already updated): the keys above the k-th in `above_mask`, the keys
/// equal to it in `tie_mask`, and their counts per tile.
template <typename T, int W>
__global__ void __launch_bounds__(kThreads, 4)
    topk_count_kernel(Source<T> src, int64_t n, const RadixState* state, CountPair* counts, unsigned int* above_mask,
                      unsigned int* tie_mask) {
  constexpr int kRows = kItems / W;
  const uint32_t kth = state->prefix;
  unsigned long long above = 0, ties = 0, bad = 0;
  Run<T, W> value[kRows];
  tile_values<T, W, true>(src, n, blockIdx.x, value, bad);
#pragma unroll
  for (int row = 0; row < kRows; ++row) {
    const int64_t i = run_start<W>(blockIdx.x, row);
    unsigned int above_bits = 0, tie_bits = 0;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      const uint32_t key = Num<T>::key(value[row].at[j]);
      const bool inside = i + j < n;
      above_bits |= static_cast<unsigned int>(inside && key > kth) << j;
      tie_bits |= static_cast<unsigned int>(inside && key == kth) << j;
    }
    above += __popc(above_bits);
    ties += __popc(tie_bits);
    write_mask_words<W>(above_bits, i, above_mask);
    write_mask_words<W>(tie_bits, i, tie_mask);
  }
  store_tile_counts(CountPair{above, ties}, counts);
}

/// One device allocation carved into arrays, each aligned to 256 bytes.
class Carving {
 public:
  template <typename U>
  size_t add(size_t count) {
    const size_t at = bytes_;
    bytes_ += (count * sizeof(U) + 255) / 256 * 256;
    return at;
  }
  void allocate(CudaDevice& device) { block_.emplace(device, bytes_); }
  template <typename U>
  U* at(size_t offset) const {
    return reinterpret_cast<U*>(block_->get() + offset);
  }

 private:
  size_t bytes_ = 0;
  std::optional<Scratch<unsigned char>> block_;
};

/// The tile counts, their scan and the selection mask of one selection, in one allocation.
struct Tiles {
  int64_t tiles;
  size_t scan_bytes = 0;
  Carving carving;
  size_t counts_at, offsets_at, mask_at, scan_at;

  /// `more` carves further arrays of the caller's (it is given the tile count).
  Tiles(CudaDevice& device, int64_t n, const std::function<void(Carving&, int64_t)>& more = nullptr)
      : tiles((n + kTile - 1) / kTile) {
    GS_CUDA_CHECK(cub::DeviceScan::ExclusiveScan(nullptr, scan_bytes, static_cast<CountPair*>(nullptr),
                                                 static_cast<CountPair*>(nullptr), AddCountPairs(), CountPair{0, 0},
                                                 tiles + 1, device.stream()));
    counts_at = carving.add<CountPair>(tiles + 1);
    offsets_at = carving.add<CountPair>(tiles + 1);
    mask_at = carving.add<unsigned int>(tiles * kMaskWords);
    scan_at = carving.add<unsigned char>(scan_bytes);
    if (more) more(carving, tiles);
    carving.allocate(device);
  }
  CountPair* counts() const { return carving.at<CountPair>(counts_at); }
  CountPair* offsets() const { return carving.at<CountPair>(offsets_at); }
  unsigned int* mask() const { return carving.at<unsigned int>(mask_at); }
  unsigned int blocks() const { return static_cast<unsigned int>(tiles); }

  /// offsets = the exclusive scan of counts; the last offset is the total.
  void scan(CudaDevice& device) {
    size_t bytes = scan_bytes;
    GS_CUDA_CHECK(cub::DeviceScan::ExclusiveScan(carving.at<unsigned char>(scan_at), bytes, counts(), offsets(),
                                                 AddCountPairs(), CountPair{0, 0}, tiles + 1, device.stream()));
  }
  /// The totals (waits for the stream).
  CountPair total(CudaDevice& device) const { return read_scalar(device, offsets() + tiles); }

  /// Pass 2: the pairs of the selected elements, in index order, into `out_idx` / `out_val`
  /// (with ties: select_write_kernel).
  template <typename T, typename I>
  void write(CudaDevice& device, Source<T> src, bool zero, I* out_idx, T* out_val,
             const unsigned int* tie_mask = nullptr, const unsigned long long* tie_quota = nullptr) const {
    src.update = false;  // the update is done: pass 2 reads the updated values
    select_write_kernel<T, I><<<blocks(), kMaskWords, 0, device.stream()>>>(src, zero, offsets(), mask(), tie_mask,
                                                                            tie_quota, out_idx, out_val);
    check_launch();
  }
};

/// Pass 1 and the scan of a selection by key.
template <typename T>
CountPair count_selected(CudaDevice& device, Tiles& t, Source<T> src, int64_t n, uint32_t key, Range range) {
  with_run_length(src, [&](auto w) {
    select_count_kernel<T, w()><<<t.blocks(), kThreads, 0, device.stream()>>>(src, n, key, range, t.counts(), t.mask());
  });
  check_launch();
  t.scan(device);
  return t.total(device);
}

}  // namespace

template <typename T, typename I>
SelectStats select(CudaDevice& device, Source<T> src, int64_t n, uint32_t key, Range range, bool zero,
                   const PairSink& sink) {
  GS_CHECK(n >= 0, ValueError, "select: n must be >= 0, got ", n);
  check_range(range, n, "select");  // as the CPU kernel (it clipped the range to the bucket)
  check_source(src, n, "select");
  SelectStats stats;
  if (n == 0) {
    sink(0);
    return stats;
  }
  Tiles tiles(device, n);
  const CountPair total = count_selected(device, tiles, src, n, key, range);
  stats.count = static_cast<int64_t>(total.selected);
  stats.nonfinite = static_cast<int64_t>(total.other);
  const PairSpan span = pairs_at(sink, stats.count);
  if (stats.count > 0) tiles.write(device, src, zero, static_cast<I*>(span.indices), static_cast<T*>(span.values));
  return stats;  // no wait: the scratch goes back to the stream-ordered allocator behind pass 2
}

template <typename T>
void collect(CudaDevice& device, Source<T> src, int64_t n, Range range, uint32_t key, HostBuffer<int64_t>& index,
             HostBuffer<float>& value) {
  GS_CHECK(!src.update, ValueError, "collect reads values only; apply the error-feedback update first");
  check_range(range, n, "collect");
  index.clear();
  value.clear();
  if (n == 0) return;
  Tiles tiles(device, n);
  const auto count = static_cast<int64_t>(count_selected(device, tiles, src, n, key, range).selected);
  if (count == 0) return;
  Scratch<int64_t> idx(device, count);
  Scratch<T> val(device, count);
  tiles.write(device, src, false, idx.get(), val.get());
  index.resize(static_cast<size_t>(count));  // copied in place: a HostBuffer is not zeroed first
  device.copy_to_host(index.data(), idx.get(), static_cast<size_t>(count) * sizeof(int64_t));
  const std::vector<T> raw = to_host(device, val.get(), count);
  value.resize(raw.size());
  for (size_t j = 0; j < raw.size(); ++j) value[j] = Num<T>::to_float(raw[j]);
}

template <typename T, typename I>
SelectStats select_topk(CudaDevice& device, Source<T> src, int64_t n, int64_t k, bool zero, const PairSink& sink) {
  GS_CHECK(n >= 0, ValueError, "select_topk: n must be >= 0, got ", n);
  GS_CHECK(k >= 0, ValueError, "select_topk: k must be >= 0, got ", k);
  check_source(src, n, "select_topk");
  k = k < n ? k : n;
  SelectStats stats;
  if (n == 0) {
    sink(0);
    return stats;
  }
  cudaStream_t stream = device.stream();
  constexpr int kLevels = radix_levels(Num<T>::kKeyBits);
  size_t hist_at = 0, state_at = 0, ties_at = 0;
  Tiles tiles(device, n, [&](Carving& c, int64_t count) {
    hist_at = c.add<unsigned long long>(kLevels * kBins + 2);  // the histograms, then Tail
    state_at = c.add<RadixState>(1);
    ties_at = c.add<unsigned int>(count * kMaskWords);
  });
  auto* hist = tiles.carving.at<unsigned long long>(hist_at);
  auto* state = tiles.carving.at<RadixState>(state_at);
  unsigned long long* nonfinite = hist + kLevels * kBins;
  device.fill_zero(hist, (kLevels * kBins + 2) * sizeof(unsigned long long));
  const Source<T> read{src.residual, src.grad};  // the values once the first histogram has updated them
  const unsigned int grid = resident_grid(device, tiles.blocks());
  for (int level = 0; level < kLevels && (level == 0 || k > 0); ++level) {
    const int high = Num<T>::kKeyBits - level * kDigitBits, shift = high > kDigitBits ? high - kDigitBits : 0;
    unsigned long long* h = hist + level * kBins;
    const Source<T>& pass = level == 0 ? src : read;
    with_run_length(pass, [&](auto w) {
      if (level == 0) {
        radix_histogram_kernel<T, w(), true>
            <<<grid, kThreads, 0, stream>>>(pass, n, shift, high, nullptr, h, nonfinite);
      } else {
        radix_histogram_kernel<T, w(), false><<<grid, kThreads, 0, stream>>>(pass, n, shift, high, state, h, nullptr);
      }
    });
    check_launch();
    if (k > 0) {
      radix_pick_kernel<<<1, kPickThreads, 0, stream>>>(h, shift, static_cast<unsigned long long>(k), level == 0,
                                                        state);
      check_launch();
    }
  }
  const PairSpan span = pairs_at(sink, k);
  if (k > 0) {
    unsigned int* tie_mask = tiles.carving.at<unsigned int>(ties_at);
    with_run_length(read, [&](auto w) {
      topk_count_kernel<T, w()>
          <<<tiles.blocks(), kThreads, 0, stream>>>(read, n, state, tiles.counts(), tiles.mask(), tie_mask);
    });
    check_launch();
    tiles.scan(device);
    tiles.write(device, read, zero, static_cast<I*>(span.indices), static_cast<T*>(span.values), tie_mask,
                &state->need);
  }
  // The non-finite count and the k-th key (the last digit's pick completes it) in one read, which
  // waits for the whole selection.
  struct Tail {
    unsigned long long nonfinite, kth_key;
  };
  if (k > 0) {
    GS_CUDA_CHECK(
        cudaMemcpyAsync(nonfinite + 1, &state->prefix, sizeof(state->prefix), cudaMemcpyDeviceToDevice, stream));
  }
  const Tail tail = read_scalar(device, reinterpret_cast<const Tail*>(nonfinite));
  stats.count = k;
  stats.nonfinite = static_cast<int64_t>(tail.nonfinite);
  stats.kth_key = static_cast<uint32_t>(tail.kth_key);
  return stats;
}

#define GS_INSTANTIATE_CUDA_SELECT(T, I)                                                                      \
  template SelectStats select<T, I>(CudaDevice&, Source<T>, int64_t, uint32_t, Range, bool, const PairSink&); \
  template SelectStats select_topk<T, I>(CudaDevice&, Source<T>, int64_t, int64_t, bool, const PairSink&);
#define GS_INSTANTIATE_CUDA_SELECT_TYPE(T) \
  GS_INSTANTIATE_CUDA_SELECT(T, uint32_t)  \
  GS_INSTANTIATE_CUDA_SELECT(T, uint64_t)  \
  GS_INSTANTIATE_CUDA_SELECT(T, int64_t)   \
  template void collect<T>(CudaDevice&, Source<T>, int64_t, Range, uint32_t, HostBuffer<int64_t>&, HostBuffer<float>&);

GS_INSTANTIATE_CUDA_SELECT_TYPE(float)
GS_INSTANTIATE_CUDA_SELECT_TYPE(Half)
GS_INSTANTIATE_CUDA_SELECT_TYPE(BFloat16)

}  // namespace cuda
}  // namespace gradsparse
