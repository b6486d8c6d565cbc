// CudaDevice: the Device of a CUDA bucket. All its work is queued on one stream; operations whose
// result the host needs (a selection's count, a message header, a validation verdict) copy a few
// bytes back and wait for the stream.
#pragma once

#include <cuda_runtime_api.h>

#include <functional>

#include "gradsparse/device.h"
#include "gradsparse/kernels.h"

namespace gradsparse {

/// Throws std::runtime_error naming the failed CUDA call.
void cuda_check(cudaError_t status, const char* what);
#define GS_CUDA_CHECK(expr) ::gradsparse::cuda_check((expr), #expr)

/// True when the CUDA runtime sees at least one device.
bool cuda_device_available();

class CudaDevice final : public Device {
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
  Selection select_threshold(const BucketView& bucket, double threshold) override;
  Selection select_topk(const BucketView& bucket, int64_t k) override;
  void scatter_add_message(DType dtype, void* out, int64_t numel, const void* message, size_t bytes, float divisor,
                           int source_rank) override;
  void divide(DType dtype, void* data, int64_t numel, float divisor) override;

 private:
  int device_;
  cudaStream_t stream_;
  Allocate allocate_;
};

namespace cuda {
// The CUDA kernels behind CudaDevice, with the semantics of their cpu:: twins (kernels.h). The
// sink is called on the host with the final count and must return device pointers.
template <typename T, typename I>
SelectStats select_threshold(CudaDevice& device, T* residual, const T* grad, int64_t n, double threshold,
                             const PairSink& sink);
template <typename T, typename I>
SelectStats select_topk(CudaDevice& device, T* residual, const T* grad, int64_t n, int64_t k, const PairSink& sink);
/// Without `strictly_ascending`, duplicate indices are accumulated with atomics (their order, and
/// so the rounding, is not deterministic); with it, every element is written once.
template <typename T, typename I>
void scatter_add(CudaDevice& device, T* out, int64_t n, const I* indices, const T* values, int64_t count, float divisor,
                 bool strictly_ascending);
template <typename T>
void divide(CudaDevice& device, T* data, int64_t n, float divisor);
}  // namespace cuda

}  // namespace gradsparse
