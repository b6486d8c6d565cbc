// CudaDevice: the Device of a CUDA bucket. All its work is queued on one stream; operations whose
// result the host needs (a selection's count, a message header, statistics, candidates) copy a
// few bytes back and wait for the stream. The kernels (kernels/cuda) run the same per-element
// logic as the CPU kernels (numeric.h, kernels.h).
#pragma once

#include <cuda_runtime_api.h>

#include <functional>
#include <vector>

#include "gradsparse/kernel_device.h"
#include "gradsparse/kernels.h"

namespace gradsparse {

/// Throws std::runtime_error naming the failed CUDA call.
void cuda_check(cudaError_t status, const char* what);
#define GS_CUDA_CHECK(expr) ::gradsparse::cuda_check((expr), #expr)

/// True when the CUDA runtime sees at least one device.
bool cuda_device_available();

class CudaDevice;

namespace cuda {
// The CUDA kernels behind CudaDevice, with the semantics of their cpu:: twins (kernels.h).
// Pointers into the bucket are device pointers; vectors are host memory. The sink is called on
// the host with the final count and must return device pointers.
template <typename T, typename I>
SelectStats select(CudaDevice& device, Source<T> src, int64_t n, uint32_t key, Range range, bool zero,
                   const PairSink& sink);
template <typename T, typename I>
SelectStats select_topk(CudaDevice& device, Source<T> src, int64_t n, int64_t k, bool zero, const PairSink& sink);
template <typename T>
Moments moments(CudaDevice& device, Source<T> src, int64_t n);
template <typename T>
void count_keys(CudaDevice& device, Source<T> src, int64_t n, Range range, const std::vector<uint32_t>& keys,
                std::vector<int64_t>& counts);
template <typename T>
Exceedance exceedance(CudaDevice& device, Source<T> src, int64_t n, uint32_t key, double scale, BlockSample sample);
template <typename T>
double log_sum(CudaDevice& device, Source<T> src, int64_t n, double scale, double eps, BlockSample sample);
template <typename T>
void collect(CudaDevice& device, Source<T> src, int64_t n, Range range, uint32_t key, HostBuffer<int64_t>& index,
             HostBuffer<float>& value);
template <typename T>
double sample_abs_sum(CudaDevice& device, Source<T> src, const std::vector<int64_t>& positions);
template <typename T, typename I>
void gather(CudaDevice& device, Source<T> src, const I* indices, int64_t count, T* out);
template <typename T, typename I>
void zero_at(CudaDevice& device, T* residual, const I* indices, int64_t count);
/// Without `strictly_ascending`, duplicate indices are accumulated with atomics (their order, and
/// so the rounding, is not deterministic); with it, every element is written once.
template <typename T, typename I, typename O = T>
void scatter_add(CudaDevice& device, O* out, int64_t n, const I* indices, const T* values, int64_t count, float divisor,
                 bool strictly_ascending);
template <typename T, typename I>
void assign(CudaDevice& device, T* out, int64_t n, const I* indices, const T* values, int64_t count);
template <typename T>
void divide(CudaDevice& device, T* data, int64_t n, float divisor);
template <typename T>
void round_to(CudaDevice& device, const float* in, T* out, int64_t n);
template <typename T>
void momentum(CudaDevice& device, T* grad, T* velocity, const T* residual, int64_t n, float factor, bool masking);
}  // namespace cuda

class CudaDevice final : public KernelDevice<CudaDevice> {
 public:
  /// Allocation hook (the PyTorch adapter passes its caching allocator); the default uses
  /// cudaMallocAsync/cudaFreeAsync on the stream.
  using Allocate = std::function<Buffer(size_t bytes, cudaStream_t stream)>;

  CudaDevice(int device_index, cudaStream_t stream, Allocate allocate = nullptr);

  DeviceKind kind() const override { return DeviceKind::kCUDA; }
  int index() const override { return device_; }
  cudaStream_t stream() const { return stream_; }

  Buffer allocate(size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override;

  // Typed kernels used by KernelDevice.
  template <typename T, typename I>
  SelectStats k_select(Source<T> src, int64_t n, uint32_t key, Range range, bool zero, const PairSink& sink) {
    return cuda::select<T, I>(*this, src, n, key, range, zero, sink);
  }
  template <typename T, typename I>
  SelectStats k_topk(Source<T> src, int64_t n, int64_t k, bool zero, const PairSink& sink) {
    return cuda::select_topk<T, I>(*this, src, n, k, zero, sink);
  }
  template <typename T>
  Moments k_moments(Source<T> src, int64_t n) {
    return cuda::moments<T>(*this, src, n);
  }
  template <typename T>
  void k_count(Source<T> src, int64_t n, Range range, const std::vector<uint32_t>& keys, std::vector<int64_t>& counts) {
    cuda::count_keys<T>(*this, src, n, range, keys, counts);
  }
  template <typename T>
  Exceedance k_exceedance(Source<T> src, int64_t n, uint32_t key, double scale, BlockSample sample) {
    return cuda::exceedance<T>(*this, src, n, key, scale, sample);
  }
  template <typename T>
  double k_log_sum(Source<T> src, int64_t n, double scale, double eps, BlockSample sample) {
    return cuda::log_sum<T>(*this, src, n, scale, eps, sample);
  }
  template <typename T>
  void k_collect(Source<T> src, int64_t n, Range range, uint32_t key, HostBuffer<int64_t>& index,
                 HostBuffer<float>& value) {
    cuda::collect<T>(*this, src, n, range, key, index, value);
  }
  template <typename T>
  double k_sample_abs_sum(Source<T> src, const std::vector<int64_t>& positions) {
    return cuda::sample_abs_sum<T>(*this, src, positions);
  }
  template <typename T, typename I>
  void k_gather(Source<T> src, const I* indices, int64_t count, T* out) {
    cuda::gather<T, I>(*this, src, indices, count, out);
  }
  template <typename T, typename I>
  void k_zero_at(T* residual, const I* indices, int64_t count) {
    cuda::zero_at<T, I>(*this, residual, indices, count);
  }
  template <typename T, typename I, typename O>
  void k_scatter_add(O* out, int64_t n, const I* indices, const T* values, int64_t count, float divisor,
                     bool ascending) {
    cuda::scatter_add<T, I, O>(*this, out, n, indices, values, count, divisor, ascending);
  }
  template <typename T, typename I>
  void k_assign(T* out, int64_t n, const I* indices, const T* values, int64_t count) {
    cuda::assign<T, I>(*this, out, n, indices, values, count);
  }
  template <typename T>
  void k_divide(T* data, int64_t n, float divisor) {
    cuda::divide<T>(*this, data, n, divisor);
  }
  template <typename T>
  void k_round_to(const float* in, T* out, int64_t n) {
    cuda::round_to<T>(*this, in, out, n);
  }
  template <typename T>
  void k_momentum(T* grad, T* velocity, const T* residual, int64_t n, float factor, bool masking) {
    cuda::momentum<T>(*this, grad, velocity, residual, n, factor, masking);
  }

 private:
  int device_;
  cudaStream_t stream_;
  Allocate allocate_;
};

}  // namespace gradsparse
