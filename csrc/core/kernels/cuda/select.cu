// CUDA selection kernels. The per-element logic (error-feedback update, selection value, key) is
// the same __host__ __device__ code the CPU kernels run (numeric.h, kernels.h).
//
// Selection by key (also used to collect candidates): pass 1 reads each tile once, applies the
// update where asked, counts the selected elements per tile and records them in a bit mask (one
// bit per element, 1/32 of a float32 bucket's bytes); a device scan turns the tile counts into
// output offsets; pass 2 reads the mask and only the selected elements, and writes the pairs in
// index order. The host waits once, for the count (the sink sizes the output by it); the scratch
// is released in stream order, so the call returns with pass 2 still queued.
// Top-k: keys of the selection values are radix-sorted descending with their indices (stable, so
// equal magnitudes keep the lowest indices first), the first k indices are sorted ascending, and
// the pairs are gathered.
#include "common.cuh"

namespace gradsparse {
namespace cuda {
namespace {

using namespace detail;
constexpr int kItems = 16;  // elements per thread per tile
constexpr int64_t kTile = int64_t{kThreads} * kItems;
constexpr int kWarp = 32;
constexpr int kMaskWords = static_cast<int>(kTile / kWarp);  // 32-bit mask words per tile

/// Element `item` of thread `t` in tile `tile`: striped, so each row of 256 is coalesced and the
/// rows are visited in index order; the 32 elements of one warp in one row are one mask word,
/// word i / 32.
__device__ __forceinline__ int64_t tile_element(int64_t tile, int item, int t) {
  return tile * kTile + int64_t{item} * kThreads + t;
}

/// Pass 1: the update (where asked) and the selection of one tile. Every item is read before any
/// is written, so a thread has all its loads in flight at once; the update itself is the shared
/// element rule, applied to registers. On an H200 at 25M float32 elements this pass takes 98 us,
/// 1.4x torch's residual add (70 us); the loop that read and wrote item by item took 100 us, so
/// the gap to the add lies elsewhere (docs/benchmarks.md, "On a GPU").
template <typename T>
__global__ void select_count_kernel(Source<T> src, int64_t n, uint32_t key, Range range,
                                    unsigned long long* tile_counts, unsigned int* mask,
                                    unsigned long long* nonfinite) {
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const int64_t tile = blockIdx.x;
  const bool update = src.update && src.residual != nullptr;
  unsigned long long hits = 0, bad = 0;
  T value[kItems];
  if (update) {
    T residual[kItems], grad[kItems], velocity[kItems];
#pragma unroll
    for (int item = 0; item < kItems; ++item) {
      const int64_t i = tile_element(tile, item, threadIdx.x);
      if (i < n) {
        residual[item] = src.residual[i];
        grad[item] = src.grad[i];
        if (src.velocity != nullptr) velocity[item] = src.velocity[i];
      }
    }
#pragma unroll
    for (int item = 0; item < kItems; ++item) {
      const int64_t i = tile_element(tile, item, threadIdx.x);
      if (i < n) {
        const Source<T> one{&residual[item], &grad[item], true, src.velocity != nullptr ? &velocity[item] : nullptr,
                            src.momentum,    src.masking};
        bool finite;
        one.update_element(0, finite);
        bad += !finite;
        value[item] = residual[item];
        src.residual[i] = residual[item];
        if (src.velocity != nullptr) src.velocity[i] = velocity[item];
      }
    }
  } else {
#pragma unroll
    for (int item = 0; item < kItems; ++item) {
      const int64_t i = tile_element(tile, item, threadIdx.x);
      if (i < n) {
        value[item] = src.value(i);
        if (src.residual == nullptr) bad += !is_finite(src.grad[i]);
      }
    }
  }
#pragma unroll
  for (int item = 0; item < kItems; ++item) {
    const int64_t i = tile_element(tile, item, threadIdx.x);
    const bool flag = i < n && i >= range.begin && i < range.end && Num<T>::key(value[item]) >= key;
    const unsigned int word = __ballot_sync(0xffffffffu, flag);
    if (threadIdx.x % kWarp == 0) mask[i / kWarp] = word;
    hits += flag;
  }
  const unsigned long long tile_hits = Reduce(storage).Sum(hits);
  __syncthreads();
  const unsigned long long tile_bad = Reduce(storage).Sum(bad);
  if (threadIdx.x == 0) {
    tile_counts[tile] = tile_hits;
    if (tile_bad > 0) atomicAdd(nonfinite, tile_bad);
  }
}

/// Pass 2: one thread per mask word of a tile (kMaskWords threads); a tile without selected
/// elements returns at once. The values are read again (the updated residual, or the gradient);
/// they are the values pass 1 selected by (selection_value reads the same value every time).
template <typename T, typename I>
__global__ void select_write_kernel(Source<T> src, bool zero, const unsigned long long* tile_offsets,
                                    const unsigned int* mask, I* out_idx, T* out_val) {
  using Scan = cub::BlockScan<unsigned int, kMaskWords>;
  __shared__ typename Scan::TempStorage storage;
  const int64_t tile = blockIdx.x;
  const unsigned long long first = tile_offsets[tile];
  if (tile_offsets[tile + 1] == first) return;  // the same for the whole block
  const int64_t word = tile * kMaskWords + threadIdx.x;
  unsigned int bits = mask[word], offset;
  Scan(storage).ExclusiveSum(static_cast<unsigned int>(__popc(bits)), offset);
  unsigned long long position = first + offset;
  for (; bits != 0; bits &= bits - 1, ++position) {
    const int64_t i = word * kWarp + (__ffs(bits) - 1);
    out_idx[position] = static_cast<I>(i);
    out_val[position] = src.value(i);
    if (zero && src.residual != nullptr) src.residual[i] = Num<T>::zero();
  }
}

template <typename T, typename K, typename I>
__global__ void topk_keys_kernel(Source<T> src, int64_t n, K* keys, I* indices, unsigned long long* nonfinite) {
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  unsigned long long bad = 0;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) {
    if (src.update && src.residual != nullptr) {
      bool finite;
      src.update_element(i, finite);
      bad = !finite;
    } else if (src.residual == nullptr) {
      bad = !is_finite(src.grad[i]);
    }
    keys[i] = static_cast<K>(Num<T>::key(src.value(i)));
    indices[i] = static_cast<I>(i);
  }
  const unsigned long long block_bad = Reduce(storage).Sum(bad);
  if (threadIdx.x == 0 && block_bad > 0) atomicAdd(nonfinite, block_bad);
}

template <typename T, typename I>
__global__ void topk_gather_kernel(Source<T> src, const I* chosen, int64_t k, I* out_idx, T* out_val) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= k) return;
  const int64_t i = static_cast<int64_t>(chosen[j]);
  out_idx[j] = chosen[j];
  out_val[j] = src.value(i);
  if (src.residual != nullptr) src.residual[i] = Num<T>::zero();
}

/// Pass 1 and the scan, with their scratch: per-tile offsets (tiles + 1 entries, the last being
/// the total) followed by the non-finite count, so one read brings both to the host.
struct TileCounts {
  int64_t tiles;
  Scratch<unsigned long long> words;  // [0, tiles]: counts, 0 sentinel; [tiles + 1, 2 tiles + 2]: offsets, nonfinite
  Scratch<unsigned int> mask;
  int64_t total = 0, nonfinite = 0;

  template <typename T>
  TileCounts(CudaDevice& device, Source<T> src, int64_t n, uint32_t key, Range range)
      : tiles((n + kTile - 1) / kTile), words(device, 2 * tiles + 3), mask(device, tiles * kMaskWords) {
    unsigned long long* counts = words.get();
    device.fill_zero(counts, (2 * tiles + 3) * sizeof(unsigned long long));
    select_count_kernel<T><<<static_cast<unsigned int>(tiles), kThreads, 0, device.stream()>>>(
        src, n, key, range, counts, mask.get(), offsets() + tiles + 1);
    check_launch();
    size_t temp_bytes = 0;
    GS_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, counts, offsets(), tiles + 1, device.stream()));
    Scratch<unsigned char> temp(device, temp_bytes);
    GS_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp.get(), temp_bytes, counts, offsets(), tiles + 1, device.stream()));
    unsigned long long both[2];
    device.copy_to_host(both, offsets() + tiles, sizeof(both));
    total = static_cast<int64_t>(both[0]);
    nonfinite = static_cast<int64_t>(both[1]);
  }
  unsigned long long* offsets() const { return words.get() + tiles + 1; }

  /// Pass 2: the pairs of the selected elements, in index order, into `out_idx` / `out_val`.
  template <typename T, typename I>
  void write(CudaDevice& device, Source<T> src, bool zero, I* out_idx, T* out_val) const {
    if (total == 0) return;
    src.update = false;  // the update is done: pass 2 reads the updated values
    select_write_kernel<T, I><<<static_cast<unsigned int>(tiles), kMaskWords, 0, device.stream()>>>(
        src, zero, offsets(), mask.get(), out_idx, out_val);
    check_launch();
  }
};

}  // namespace

template <typename T, typename I>
SelectStats select(CudaDevice& device, Source<T> src, int64_t n, uint32_t key, Range range, bool zero,
                   const PairSink& sink) {
  GS_CHECK(n >= 0, ValueError, "select: n must be >= 0, got ", n);
  SelectStats stats;
  if (n == 0) {
    sink(0);
    return stats;
  }
  const TileCounts counts(device, src, n, key, range);
  stats.count = counts.total;
  stats.nonfinite = counts.nonfinite;
  const PairSpan span = sink(stats.count);
  counts.write(device, src, zero, static_cast<I*>(span.indices), static_cast<T*>(span.values));
  return stats;  // no wait: the scratch goes back to the stream-ordered allocator behind pass 2
}

template <typename T>
void collect(CudaDevice& device, Source<T> src, int64_t n, Range range, uint32_t key, std::vector<int64_t>& index,
             std::vector<float>& value) {
  GS_CHECK(!src.update, ValueError, "collect reads values only; apply the error-feedback update first");
  index.clear();
  value.clear();
  if (n == 0) return;
  const TileCounts counts(device, src, n, key, range);
  if (counts.total == 0) return;
  Scratch<int64_t> idx(device, counts.total);
  Scratch<T> val(device, counts.total);
  counts.write(device, src, false, idx.get(), val.get());
  index = to_host(device, idx.get(), counts.total);
  const std::vector<T> raw = to_host(device, val.get(), counts.total);
  value.resize(raw.size());
  for (size_t j = 0; j < raw.size(); ++j) value[j] = Num<T>::to_float(raw[j]);
}

template <typename T, typename I>
SelectStats select_topk(CudaDevice& device, Source<T> src, int64_t n, int64_t k, const PairSink& sink) {
  GS_CHECK(n >= 0, ValueError, "select_topk: n must be >= 0, got ", n);
  GS_CHECK(k >= 0, ValueError, "select_topk: k must be >= 0, got ", k);
  k = k < n ? k : n;
  SelectStats stats;
  cudaStream_t stream = device.stream();
  using K = uint32_t;
  Scratch<unsigned long long> bad(device, 1);
  device.fill_zero(bad.get(), sizeof(unsigned long long));
  Scratch<K> keys_in(device, n), keys_out(device, n);
  Scratch<I> idx_in(device, n), idx_out(device, n), chosen(device, k);
  if (n > 0) {
    topk_keys_kernel<T, K, I><<<blocks_for(n), kThreads, 0, stream>>>(src, n, keys_in.get(), idx_in.get(), bad.get());
    check_launch();
  }
  if (k > 0) {
    // Stable descending sort by magnitude key: ties keep ascending index order.
    size_t temp_bytes = 0;
    GS_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(nullptr, temp_bytes, keys_in.get(), keys_out.get(),
                                                            idx_in.get(), idx_out.get(), n, 0, Num<T>::kKeyBits,
                                                            stream));
    Scratch<unsigned char> temp(device, temp_bytes);
    GS_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(temp.get(), temp_bytes, keys_in.get(), keys_out.get(),
                                                            idx_in.get(), idx_out.get(), n, 0, Num<T>::kKeyBits,
                                                            stream));
    // The k chosen indices, ascending.
    size_t temp2_bytes = 0;
    GS_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, temp2_bytes, idx_out.get(), chosen.get(), k, 0,
                                                 int(sizeof(I) * 8), stream));
    Scratch<unsigned char> temp2(device, temp2_bytes);
    GS_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(temp2.get(), temp2_bytes, idx_out.get(), chosen.get(), k, 0,
                                                 int(sizeof(I) * 8), stream));
  }
  stats.nonfinite = static_cast<int64_t>(read_scalar(device, bad.get()));  // waits for the sorts
  stats.count = k;
  const PairSpan span = sink(k);
  if (k > 0) {
    Source<T> read = src;
    read.update = false;
    topk_gather_kernel<T, I><<<blocks_for(k), kThreads, 0, stream>>>(
        read, chosen.get(), k, static_cast<I*>(span.indices), static_cast<T*>(span.values));
    check_launch();
  }
  return stats;  // no wait: the scratch goes back to the stream-ordered allocator behind the gather
}

#define GS_INSTANTIATE_CUDA_SELECT(T, I)                                                                      \
  template SelectStats select<T, I>(CudaDevice&, Source<T>, int64_t, uint32_t, Range, bool, const PairSink&); \
  template SelectStats select_topk<T, I>(CudaDevice&, Source<T>, int64_t, int64_t, const PairSink&);
#define GS_INSTANTIATE_CUDA_SELECT_TYPE(T)                                                          \
  GS_INSTANTIATE_CUDA_SELECT(T, uint32_t)                                                           \
  GS_INSTANTIATE_CUDA_SELECT(T, uint64_t)                                                           \
  GS_INSTANTIATE_CUDA_SELECT(T, int64_t)                                                            \
  template void collect<T>(CudaDevice&, Source<T>, int64_t, Range, uint32_t, std::vector<int64_t>&, \
                           std::vector<float>&);

GS_INSTANTIATE_CUDA_SELECT_TYPE(float)
GS_INSTANTIATE_CUDA_SELECT_TYPE(Half)
GS_INSTANTIATE_CUDA_SELECT_TYPE(BFloat16)

}  // namespace cuda
}  // namespace gradsparse
