// The CUDA side of engine jobs: the engine thread runs each job on a pool stream of the bucket's
// device, after the stream that submitted it, and completes the future with that stream current
// so consumers are ordered after the job (CUDA-aware future).
#include <c10/cuda/CUDAGuard.h>

#include "cuda_support.h"
#include "engine.h"

namespace gradsparse::torch_adapter {
namespace {

class CudaJobDevice final : public JobDevice {
 public:
  CudaJobDevice(const at::Tensor& grad, const std::vector<at::Tensor>& state)
      : device_index_(grad.device().index()), grad_(grad), state_(state) {
    c10::cuda::CUDAGuard guard(device_index_);
    GS_CUDA_CHECK(cudaEventCreateWithFlags(&submitted_, cudaEventDisableTiming));
    const cudaError_t recorded = cudaEventRecord(submitted_, c10::cuda::getCurrentCUDAStream(device_index_).stream());
    if (recorded != cudaSuccess) (void)cudaEventDestroy(submitted_);  // no destructor runs for a throwing constructor
    GS_CUDA_CHECK(recorded);
  }
  ~CudaJobDevice() override { (void)cudaEventDestroy(submitted_); }
  CudaJobDevice(const CudaJobDevice&) = delete;
  CudaJobDevice& operator=(const CudaJobDevice&) = delete;

  void run(const std::function<void(Device&)>& body) override {
    c10::cuda::CUDAGuard guard(device_index_);
    c10::cuda::CUDAStream stream = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device_index_);
    GS_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), submitted_, 0));
    // The bucket, residual and velocity are used on our stream; tell the caching allocator.
    c10::cuda::CUDACachingAllocator::recordStream(grad_.storage().data_ptr(), stream);
    for (const at::Tensor& t : state_) c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream);
    c10::cuda::CUDAStreamGuard stream_guard(stream);
    CudaDevice device = torch_cuda_device(stream);
    body(device);
  }

  std::vector<c10::Device> future_devices() const override { return {c10::Device(c10::kCUDA, device_index_)}; }

 private:
  c10::DeviceIndex device_index_;
  at::Tensor grad_;
  std::vector<at::Tensor> state_;    // residual and velocity
  cudaEvent_t submitted_ = nullptr;  // recorded on the submitting stream
};

}  // namespace

std::unique_ptr<JobDevice> make_cuda_job_device(const at::Tensor& grad, const std::vector<at::Tensor>& state) {
  return std::make_unique<CudaJobDevice>(grad, state);
}

}  // namespace gradsparse::torch_adapter
