// CUDA selection kernels. The per-element logic (error-feedback update, selection value, key,
// threshold rule) is the same __host__ __device__ code the CPU kernels run (numeric.h).
//
// Threshold: pass 1 updates the residual and counts selected elements per tile; a device scan
// turns the counts into output offsets; pass 2 re-reads each tile's selection values (identical
// by construction, see selection_value) and writes the pairs in index order.
// Top-k: keys of the selection values are radix-sorted descending with their indices (stable, so
// equal magnitudes keep the lowest indices first), the first k indices are sorted ascending, and
// the pairs are gathered.
#include <cub/cub.cuh>

#include "gradsparse/cuda_device.h"
#include "gradsparse/numeric.h"

namespace gradsparse {
namespace cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 16;  // elements per thread per tile
constexpr int64_t kTile = int64_t{kThreads} * kItems;

/// Element `item` of thread `t` in tile `tile`: striped, so each row of 256 is coalesced and the
/// rows are visited in index order.
__device__ __forceinline__ int64_t tile_element(int64_t tile, int item, int t) {
  return tile * kTile + int64_t{item} * kThreads + t;
}

template <typename T>
__global__ void threshold_count_kernel(T* residual, const T* grad, int64_t n, uint32_t tkey,
                                       unsigned long long* tile_counts, unsigned long long* nonfinite) {
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  const int64_t tile = blockIdx.x;
  unsigned long long selected = 0, bad = 0;
  for (int item = 0; item < kItems; ++item) {
    const int64_t i = tile_element(tile, item, threadIdx.x);
    if (i >= n) break;
    bool finite;
    const T v = ef_step(residual, grad, i, finite);
    bad += !finite;
    selected += passes_threshold(Num<T>::key(v), tkey);
  }
  const unsigned long long tile_selected = Reduce(storage).Sum(selected);
  __syncthreads();
  const unsigned long long tile_bad = Reduce(storage).Sum(bad);
  if (threadIdx.x == 0) {
    tile_counts[tile] = tile_selected;
    if (tile_bad > 0) atomicAdd(nonfinite, tile_bad);
  }
}

template <typename T, typename I>
__global__ void threshold_write_kernel(T* residual, const T* grad, int64_t n, uint32_t tkey,
                                       const unsigned long long* tile_offsets, I* out_idx, T* out_val) {
  using Scan = cub::BlockScan<unsigned int, kThreads>;
  __shared__ typename Scan::TempStorage storage;
  const int64_t tile = blockIdx.x;
  unsigned long long position = tile_offsets[tile];
  for (int item = 0; item < kItems; ++item) {
    const int64_t i = tile_element(tile, item, threadIdx.x);
    T v{};
    unsigned int flag = 0;
    if (i < n) {
      v = selection_value(residual, grad, i);
      flag = passes_threshold(Num<T>::key(v), tkey);
    }
    unsigned int offset, row_total;
    Scan(storage).ExclusiveSum(flag, offset, row_total);
    __syncthreads();
    if (flag) {
      out_idx[position + offset] = static_cast<I>(i);
      out_val[position + offset] = v;
      if (residual != nullptr) residual[i] = Num<T>::zero();
    }
    position += row_total;
  }
}

template <typename T, typename K, typename I>
__global__ void topk_keys_kernel(T* residual, const T* grad, int64_t n, K* keys, I* indices,
                                 unsigned long long* nonfinite) {
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  unsigned long long bad = 0;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < n) {
    bool finite;
    const T v = ef_step(residual, grad, i, finite);
    bad = !finite;
    keys[i] = static_cast<K>(Num<T>::key(v));
    indices[i] = static_cast<I>(i);
  }
  const unsigned long long block_bad = Reduce(storage).Sum(bad);
  if (threadIdx.x == 0 && block_bad > 0) atomicAdd(nonfinite, block_bad);
}

template <typename T, typename I>
__global__ void gather_kernel(T* residual, const T* grad, const I* chosen, int64_t k, I* out_idx, T* out_val) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j >= k) return;
  const int64_t i = static_cast<int64_t>(chosen[j]);
  out_idx[j] = chosen[j];
  out_val[j] = selection_value(residual, grad, i);
  if (residual != nullptr) residual[i] = Num<T>::zero();
}

unsigned int grid_for(int64_t items, int64_t per_block) {
  return static_cast<unsigned int>((items + per_block - 1) / per_block);
}

/// Device scratch for CUB calls and counters, released at scope exit.
struct Scratch {
  CudaDevice& device;
  Buffer buffer;
  template <typename U>
  U* take(size_t count) {
    buffer = device.allocate(count * sizeof(U));
    return buffer.as<U>();
  }
};

template <typename U>
U read_scalar(CudaDevice& device, const U* src) {
  U value;
  device.copy_to_host(&value, src, sizeof(U));
  return value;
}

}  // namespace

template <typename T, typename I>
SelectStats select_threshold(CudaDevice& device, T* residual, const T* grad, int64_t n, double threshold,
                             const PairSink& sink) {
  GS_CHECK(n >= 0, ValueError, "select_threshold: n must be >= 0, got ", n);
  GS_CHECK(threshold >= 0.0, ValueError, "select_threshold: threshold must be >= 0, got ", threshold);
  SelectStats stats;
  if (n == 0) {
    sink(0);
    return stats;
  }
  const uint32_t tkey = threshold_key<T>(threshold);
  const int64_t tiles = (n + kTile - 1) / kTile;
  cudaStream_t stream = device.stream();

  Scratch counts_mem{device}, offsets_mem{device}, temp_mem{device};
  auto* counts = counts_mem.take<unsigned long long>(tiles + 2);  // [tiles] = 0 sentinel, [tiles+1] = nonfinite
  auto* offsets = offsets_mem.take<unsigned long long>(tiles + 1);
  device.fill_zero(counts, (tiles + 2) * sizeof(unsigned long long));
  threshold_count_kernel<T>
      <<<grid_for(tiles, 1), kThreads, 0, stream>>>(residual, grad, n, tkey, counts, counts + tiles + 1);
  GS_CUDA_CHECK(cudaGetLastError());
  size_t temp_bytes = 0;
  GS_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, temp_bytes, counts, offsets, tiles + 1, stream));
  void* temp = temp_mem.take<unsigned char>(temp_bytes);
  GS_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(temp, temp_bytes, counts, offsets, tiles + 1, stream));

  stats.count = static_cast<int64_t>(read_scalar(device, offsets + tiles));
  stats.nonfinite = static_cast<int64_t>(read_scalar(device, counts + tiles + 1));
  const PairSpan span = sink(stats.count);
  if (stats.count > 0) {
    threshold_write_kernel<T, I><<<grid_for(tiles, 1), kThreads, 0, stream>>>(
        residual, grad, n, tkey, offsets, static_cast<I*>(span.indices), static_cast<T*>(span.values));
    GS_CUDA_CHECK(cudaGetLastError());
  }
  return stats;
}

template <typename T, typename I>
SelectStats select_topk(CudaDevice& device, T* residual, const T* grad, int64_t n, int64_t k, const PairSink& sink) {
  GS_CHECK(n >= 0, ValueError, "select_topk: n must be >= 0, got ", n);
  GS_CHECK(k >= 0, ValueError, "select_topk: k must be >= 0, got ", k);
  k = k < n ? k : n;
  SelectStats stats;
  cudaStream_t stream = device.stream();
  using K = uint32_t;
  Scratch keys_in{device}, keys_out{device}, idx_in{device}, idx_out{device}, chosen_mem{device}, temp_mem{device},
      bad_mem{device};
  auto* bad = bad_mem.take<unsigned long long>(1);
  device.fill_zero(bad, sizeof(unsigned long long));
  I* chosen = nullptr;
  if (n > 0) {
    K* kin = keys_in.take<K>(n);
    K* kout = keys_out.take<K>(n);
    I* iin = idx_in.take<I>(n);
    I* iout = idx_out.take<I>(n);
    topk_keys_kernel<T, K, I><<<grid_for(n, kThreads), kThreads, 0, stream>>>(residual, grad, n, kin, iin, bad);
    GS_CUDA_CHECK(cudaGetLastError());
    if (k > 0) {
      // Stable descending sort by magnitude key: ties keep ascending index order.
      size_t temp_bytes = 0;
      GS_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(nullptr, temp_bytes, kin, kout, iin, iout, n, 0,
                                                              Num<T>::kKeyBits, stream));
      void* temp = temp_mem.take<unsigned char>(temp_bytes);
      GS_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(temp, temp_bytes, kin, kout, iin, iout, n, 0,
                                                              Num<T>::kKeyBits, stream));
      // The k chosen indices, ascending.
      chosen = chosen_mem.take<I>(k);
      size_t temp2 = 0;
      GS_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(nullptr, temp2, iout, chosen, k, 0, int(sizeof(I) * 8), stream));
      Scratch temp2_mem{device};
      void* t2 = temp2_mem.take<unsigned char>(temp2);
      GS_CUDA_CHECK(cub::DeviceRadixSort::SortKeys(t2, temp2, iout, chosen, k, 0, int(sizeof(I) * 8), stream));
      stats.nonfinite = static_cast<int64_t>(read_scalar(device, bad));  // also waits for the sort
    } else {
      stats.nonfinite = static_cast<int64_t>(read_scalar(device, bad));
    }
  }
  stats.count = k;
  const PairSpan span = sink(k);
  if (k > 0) {
    gather_kernel<T, I><<<grid_for(k, kThreads), kThreads, 0, stream>>>(
        residual, grad, chosen, k, static_cast<I*>(span.indices), static_cast<T*>(span.values));
    GS_CUDA_CHECK(cudaGetLastError());
  }
  device.synchronize();  // scratch buffers are released on return
  return stats;
}

#define GS_INSTANTIATE_CUDA_SELECT(T, I)                                                                    \
  template SelectStats select_threshold<T, I>(CudaDevice&, T*, const T*, int64_t, double, const PairSink&); \
  template SelectStats select_topk<T, I>(CudaDevice&, T*, const T*, int64_t, int64_t, const PairSink&);
#define GS_INSTANTIATE_CUDA_SELECT_TYPE(T) \
  GS_INSTANTIATE_CUDA_SELECT(T, uint32_t)  \
  GS_INSTANTIATE_CUDA_SELECT(T, uint64_t)  \
  GS_INSTANTIATE_CUDA_SELECT(T, int64_t)

GS_INSTANTIATE_CUDA_SELECT_TYPE(float)
GS_INSTANTIATE_CUDA_SELECT_TYPE(Half)
GS_INSTANTIATE_CUDA_SELECT_TYPE(BFloat16)

}  // namespace cuda
}  // namespace gradsparse
