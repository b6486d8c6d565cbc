// CUDA statistics kernels: every block writes its partial result, and the host adds the
// partials in block order (deterministic, float64), as the CPU kernels do.
#include <algorithm>
#include <cmath>
#include <limits>

#include "common.cuh"

namespace gradsparse {
namespace cuda {
namespace {

using namespace detail;

struct MomentsPartial {
  double sum_abs, sum, sum_sq, max_abs;
  unsigned long long nonfinite;
};

struct MomentsOp {
  __device__ MomentsPartial operator()(const MomentsPartial& a, const MomentsPartial& b) const {
    return {a.sum_abs + b.sum_abs, a.sum + b.sum, a.sum_sq + b.sum_sq, a.max_abs > b.max_abs ? a.max_abs : b.max_abs,
            a.nonfinite + b.nonfinite};
  }
};

template <typename T>
__global__ void moments_kernel(Source<T> src, int64_t n, MomentsPartial* partials) {
  using Reduce = cub::BlockReduce<MomentsPartial, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  MomentsPartial m{0.0, 0.0, 0.0, 0.0, 0};
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    if (src.update && src.residual != nullptr) {
      bool finite;
      src.update_element(i, finite);
      m.nonfinite += !finite;
    } else if (src.residual == nullptr) {
      m.nonfinite += !is_finite(src.grad[i]);
    }
    const double v = Num<T>::to_float(src.value(i));
    const double a = fabs(v);
    m.sum_abs += a;
    m.sum += v;
    m.sum_sq += v * v;
    m.max_abs = a > m.max_abs ? a : m.max_abs;
  }
  const MomentsPartial total = Reduce(storage).Reduce(m, MomentsOp());
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <typename T>
__global__ void count_keys_kernel(Source<T> src, int64_t n, Range range, const uint32_t* keys, int m,
                                  unsigned long long* counts) {
  extern __shared__ unsigned long long bins[];  // bins[j]: keys in [keys[j], keys[j+1])
  for (int j = threadIdx.x; j < m; j += blockDim.x) bins[j] = 0;
  __syncthreads();
  for (int64_t i = range.begin + static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < range.end;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const uint32_t key = Num<T>::key(src.value(i));
    if (key < keys[0]) continue;
    int lo = 0, hi = m;  // the last j with keys[j] <= key
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (keys[mid] <= key) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    atomicAdd(&bins[lo], 1ull);
  }
  __syncthreads();
  for (int j = threadIdx.x; j < m; j += blockDim.x)
    if (bins[j] > 0) atomicAdd(&counts[j], bins[j]);
}

struct ExceedancePartial {
  unsigned long long count;
  double sum, sum_sq, min;
};

struct ExceedanceOp {
  __device__ ExceedancePartial operator()(const ExceedancePartial& a, const ExceedancePartial& b) const {
    return {a.count + b.count, a.sum + b.sum, a.sum_sq + b.sum_sq, a.min < b.min ? a.min : b.min};
  }
};

template <typename T>
__global__ void exceedance_kernel(Source<T> src, int64_t m, BlockSample sample, uint32_t key, double scale,
                                  ExceedancePartial* partials) {
  using Reduce = cub::BlockReduce<ExceedancePartial, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  ExceedancePartial e{0, 0.0, 0.0, INFINITY};
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < m;
       j += static_cast<int64_t>(gridDim.x) * kThreads) {
    const T v = src.value(sample.element(j));
    if (Num<T>::key(v) < key) continue;
    const double y = fabs(static_cast<double>(Num<T>::to_float(v))) * scale;
    e.count += 1;
    e.sum += y;
    e.sum_sq += y * y;
    e.min = y < e.min ? y : e.min;
  }
  const ExceedancePartial total = Reduce(storage).Reduce(e, ExceedanceOp());
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <typename T>
__global__ void log_sum_kernel(Source<T> src, int64_t m, BlockSample sample, double scale, double eps,
                               double* partials) {
  using Reduce = cub::BlockReduce<double, kThreads>;
  __shared__ typename Reduce::TempStorage storage;
  double s = 0.0;
  for (int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; j < m;
       j += static_cast<int64_t>(gridDim.x) * kThreads)
    s += log(fabs(static_cast<double>(Num<T>::to_float(src.value(sample.element(j))))) * scale + eps);
  const double total = Reduce(storage).Sum(s);
  if (threadIdx.x == 0) partials[blockIdx.x] = total;
}

template <typename T>
__global__ void sample_kernel(Source<T> src, const int64_t* positions, int64_t count, double* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j < count) out[j] = fabs(static_cast<double>(Num<T>::to_float(src.value(positions[j]))));
}

}  // namespace

template <typename T>
Moments moments(CudaDevice& device, Source<T> src, int64_t n) {
  Moments total;
  if (n == 0) return total;
  const unsigned int grid = grid_for(n);
  Scratch<MomentsPartial> partials(device, grid);
  moments_kernel<T><<<grid, kThreads, 0, device.stream()>>>(src, n, partials.get());
  check_launch();
  for (const MomentsPartial& m : to_host(device, partials.get(), grid)) {
    total.sum_abs += m.sum_abs;
    total.sum += m.sum;
    total.sum_sq += m.sum_sq;
    total.max_abs = std::max(total.max_abs, m.max_abs);
    total.nonfinite += static_cast<int64_t>(m.nonfinite);
  }
  return total;
}

template <typename T>
void count_keys(CudaDevice& device, Source<T> src, int64_t n, Range range, const std::vector<uint32_t>& keys,
                std::vector<int64_t>& counts) {
  GS_CHECK(!src.update, ValueError, "count_keys reads values only; apply the error-feedback update first");
  check_range(range, n, "count_keys");  // as the CPU kernel: a range past the bucket would be read
  counts.assign(keys.size(), 0);
  if (keys.empty() || range.end <= range.begin) return;
  // One bin of 8 bytes per key in shared memory, within the 48 KB a launch gets without opting in
  // (the methods ask about 258 at most; past it the launch failed). More keys are counted a chunk
  // at a time: the count of a key (elements at least it) needs no key of another chunk.
  constexpr size_t kMostKeys = 48 * 1024 / sizeof(unsigned long long);
  for (size_t first = 0; first < keys.size(); first += kMostKeys) {
    const int m = static_cast<int>(std::min(kMostKeys, keys.size() - first));
    Scratch<uint32_t> device_keys(device, m);
    Scratch<unsigned long long> device_counts(device, m);
    device.copy_from_host(device_keys.get(), keys.data() + first, m * sizeof(uint32_t));
    device.fill_zero(device_counts.get(), m * sizeof(unsigned long long));
    count_keys_kernel<T>
        <<<grid_for(range.end - range.begin), kThreads, m * sizeof(unsigned long long), device.stream()>>>(
            src, n, range, device_keys.get(), m, device_counts.get());
    check_launch();
    const auto bins = to_host(device, device_counts.get(), m);
    int64_t* chunk = counts.data() + first;
    for (int j = 0; j < m; ++j) chunk[j] = static_cast<int64_t>(bins[j]);
    for (int j = m - 2; j >= 0; --j) chunk[j] += chunk[j + 1];  // at least keys[first + j]
  }
}

template <typename T>
Exceedance exceedance(CudaDevice& device, Source<T> src, int64_t n, uint32_t key, double scale, BlockSample sample) {
  GS_CHECK(!src.update, ValueError, "exceedance reads values only; apply the error-feedback update first");
  const int64_t m = sample.size(n);
  if (m == 0) return Exceedance{};
  const unsigned int grid = grid_for(m);
  Scratch<ExceedancePartial> partials(device, grid);
  exceedance_kernel<T><<<grid, kThreads, 0, device.stream()>>>(src, m, sample, key, scale, partials.get());
  check_launch();
  return Exceedance::combine(to_host(device, partials.get(), grid));
}

template <typename T>
double log_sum(CudaDevice& device, Source<T> src, int64_t n, double scale, double eps, BlockSample sample) {
  GS_CHECK(!src.update, ValueError, "log_sum reads values only; apply the error-feedback update first");
  const int64_t m = sample.size(n);
  if (m == 0) return 0.0;
  const unsigned int grid = grid_for(m);
  Scratch<double> partials(device, grid);
  log_sum_kernel<T><<<grid, kThreads, 0, device.stream()>>>(src, m, sample, scale, eps, partials.get());
  check_launch();
  double total = 0.0;
  for (double s : to_host(device, partials.get(), grid)) total += s;
  return total;
}

template <typename T>
double sample_abs_sum(CudaDevice& device, Source<T> src, const std::vector<int64_t>& positions) {
  GS_CHECK(!src.update, ValueError, "sample_abs_sum reads values only; apply the error-feedback update first");
  const int64_t count = static_cast<int64_t>(positions.size());
  if (count == 0) return 0.0;
  Scratch<int64_t> device_positions(device, count);
  Scratch<double> values(device, count);
  device.copy_from_host(device_positions.get(), positions.data(), count * sizeof(int64_t));
  sample_kernel<T>
      <<<blocks_for(count), kThreads, 0, device.stream()>>>(src, device_positions.get(), count, values.get());
  check_launch();
  double total = 0.0;
  for (double v : to_host(device, values.get(), count)) total += v;  // in sample order, as on the CPU
  return total;
}

#define GS_INSTANTIATE_CUDA_STATISTICS(T)                                                            \
  template Moments moments<T>(CudaDevice&, Source<T>, int64_t);                                      \
  template void count_keys<T>(CudaDevice&, Source<T>, int64_t, Range, const std::vector<uint32_t>&,  \
                              std::vector<int64_t>&);                                                \
  template Exceedance exceedance<T>(CudaDevice&, Source<T>, int64_t, uint32_t, double, BlockSample); \
  template double log_sum<T>(CudaDevice&, Source<T>, int64_t, double, double, BlockSample);          \
  template double sample_abs_sum<T>(CudaDevice&, Source<T>, const std::vector<int64_t>&);

GS_INSTANTIATE_CUDA_STATISTICS(float)
GS_INSTANTIATE_CUDA_STATISTICS(Half)
GS_INSTANTIATE_CUDA_STATISTICS(BFloat16)

}  // namespace cuda
}  // namespace gradsparse
