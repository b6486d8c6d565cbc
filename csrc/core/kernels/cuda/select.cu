// CUDA selection kernels. The per-element logic (error-feedback update, selection value, key) is
// the same __host__ __device__ code the CPU kernels run (numeric.h, kernels.h).
//
// Selection by key (also used to collect candidates): pass 1 applies the update where asked and
// counts the selected elements per tile; a device scan turns the counts into output offsets;
// pass 2 re-reads each tile's selection values (identical by construction, see selection_value)
// and writes the pairs in index order.
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

/// Element `item` of thread `t` in tile `tile`: striped, so each row of 256 is coalesced and the
/// rows are visited in index order.
__device__ __forceinline__ int64_t tile_element(int64_t tile, int item, int t) {
  return tile * kTile + int64_t{item} * kThreads + t;
}

template <typename T>
__device__ __forceinline__ bool selected(Source<T> src, int64_t i, Range range, uint32_t key, T& v) {
  v = src.value(i);
  return i >= range.begin && i < range.end && Num<T>::key(v) >= key;
}

template <typename T>
__global__ void select_count_kernel(Source<T> src, int64_t n, uint32_t key, Range range,
                                    unsigned long long* tile_counts, unsigned long long* nonfinite) {
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const int64_t tile = blockIdx.x;
  unsigned long long hits = 0, bad = 0;
  for (int item = 0; item < kItems; ++item) {
    const int64_t i = tile_element(tile, item, threadIdx.x);
    if (i >= n) break;
    if (src.update && src.residual != nullptr) {
      bool finite;
      src.update_element(i, finite);
      bad += !finite;
    } else if (src.residual == nullptr) {
      bad += !is_finite(src.grad[i]);
    }
    T v;
    hits += selected(src, i, range, key, v);
  }
  const unsigned long long tile_hits = Reduce(storage).Sum(hits);
  __syncthreads();
  const unsigned long long tile_bad = Reduce(storage).Sum(bad);
  if (threadIdx.x == 0) {
    tile_counts[tile] = tile_hits;
    if (tile_bad > 0) atomicAdd(nonfinite, tile_bad);
  }
}

template <typename T, typename I>
__global__ void select_write_kernel(Source<T> src, int64_t n, uint32_t key, Range range, bool zero,
                                    const unsigned long long* tile_offsets, I* out_idx, T* out_val) {
  using Scan = cub::BlockScan<unsigned int, kThreads>;
  __shared__ typename Scan::TempStorage storage;
  const int64_t tile = blockIdx.x;
  unsigned long long position = tile_offsets[tile];
  for (int item = 0; item < kItems; ++item) {
    const int64_t i = tile_element(tile, item, threadIdx.x);
    T v{};
    const unsigned int flag = i < n ? selected(src, i, range, key, v) : 0u;
    unsigned int offset, row_total;
    Scan(storage).ExclusiveSum(flag, offset, row_total);
    __syncthreads();
    if (flag) {
      out_idx[position + offset] = static_cast<I>(i);
      out_val[position + offset] = v;
      if (zero && src.residual != nullptr) src.residual[i] = Num<T>::zero();
    }
    position += row_total;
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

/// Pass 1 and the scan: per-tile offsets (tiles + 1 entries, the last being the total) and the
/// non-finite count.
template <typename T>
void count_tiles(CudaDevice& device, Source<T> src, int64_t n, uint32_t key, Range range,
                 Scratch<unsigned long long>& offsets, int64_t& total, int64_t& nonfinite) {
  const int64_t tiles = (n + kTile - 1) / kTile;
  Scratch<unsigned long long> counts(device, tiles + 2);  // [tiles] = 0 sentinel, [tiles + 1] = nonfinite
  device.fill_zero(counts.get(), (tiles + 2) * sizeof(unsigned long long));
  select_count_kernel<T><<<static_cast<unsigned int>(tiles), kThreads, 0, device.stream()>>>(
      src, n, key, range, counts.get(), counts.get() + tiles + 1);
  check_launch();
  size_t temp_bytes = 0;
  GS_CUDA_CHECK(
      cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, counts.get(), offsets.get(), tiles + 1, device.stream()));
  Scratch<unsigned char> temp(device, temp_bytes);
  GS_CUDA_CHECK(
      cub::DeviceScan::ExclusiveSum(temp.get(), temp_bytes, counts.get(), offsets.get(), tiles + 1, device.stream()));
  total = static_cast<int64_t>(read_scalar(device, offsets.get() + tiles));
  nonfinite = static_cast<int64_t>(read_scalar(device, counts.get() + tiles + 1));
}

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
  const int64_t tiles = (n + kTile - 1) / kTile;
  Scratch<unsigned long long> offsets(device, tiles + 1);
  count_tiles<T>(device, src, n, key, range, offsets, stats.count, stats.nonfinite);
  const PairSpan span = sink(stats.count);
  if (stats.count > 0) {
    Source<T> read = src;
    read.update = false;  // the update is done: pass 2 reads the updated values
    select_write_kernel<T, I><<<static_cast<unsigned int>(tiles), kThreads, 0, device.stream()>>>(
        read, n, key, range, zero, offsets.get(), static_cast<I*>(span.indices), static_cast<T*>(span.values));
    check_launch();
  }
  device.synchronize();  // scratch is released on return
  return stats;
}

template <typename T>
void collect(CudaDevice& device, Source<T> src, int64_t n, Range range, uint32_t key, std::vector<int64_t>& index,
             std::vector<float>& value) {
  GS_CHECK(!src.update, ValueError, "collect reads values only; apply the error-feedback update first");
  index.clear();
  value.clear();
  if (n == 0) return;
  const int64_t tiles = (n + kTile - 1) / kTile;
  Scratch<unsigned long long> offsets(device, tiles + 1);
  int64_t total = 0, nonfinite = 0;
  count_tiles<T>(device, src, n, key, range, offsets, total, nonfinite);
  if (total == 0) return;
  Scratch<int64_t> idx(device, total);
  Scratch<T> val(device, total);
  select_write_kernel<T, int64_t><<<static_cast<unsigned int>(tiles), kThreads, 0, device.stream()>>>(
      src, n, key, range, false, offsets.get(), idx.get(), val.get());
  check_launch();
  index = to_host(device, idx.get(), total);
  const std::vector<T> raw = to_host(device, val.get(), total);
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
    device.synchronize();
  }
  stats.nonfinite = static_cast<int64_t>(read_scalar(device, bad.get()));
  stats.count = k;
  const PairSpan span = sink(k);
  if (k > 0) {
    Source<T> read = src;
    read.update = false;
    topk_gather_kernel<T, I><<<blocks_for(k), kThreads, 0, stream>>>(
        read, chosen.get(), k, static_cast<I*>(span.indices), static_cast<T*>(span.values));
    check_launch();
  }
  device.synchronize();  // scratch is released on return
  return stats;
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
