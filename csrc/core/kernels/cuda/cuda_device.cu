#include <cstring>
#include <stdexcept>

#include "gradsparse/cuda_device.h"

namespace gradsparse {

void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(
        str("CUDA call failed: ", what, ": ", cudaGetErrorName(status), " (", cudaGetErrorString(status), ")"));
}

bool cuda_device_available() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky "no device" error
    return false;
  }
  return count > 0;
}

CudaDevice::CudaDevice(int device_index, cudaStream_t stream, Allocate allocate)
    : device_(device_index), stream_(stream), allocate_(std::move(allocate)) {}

Buffer CudaDevice::allocate(size_t bytes) {
  const size_t rounded = pad8(bytes == 0 ? 1 : bytes);
  if (allocate_) return allocate_(rounded, stream_);
  void* p = nullptr;
  GS_CUDA_CHECK(cudaMallocAsync(&p, rounded, stream_));
  cudaStream_t stream = stream_;
  return Buffer(p, bytes, [stream](void* q) { (void)cudaFreeAsync(q, stream); });
}

void CudaDevice::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (bytes == 0) return;
  GS_CUDA_CHECK(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_));
  GS_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaDevice::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  if (bytes == 0) return;
  GS_CUDA_CHECK(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_));
  // The host source may be a temporary: wait until it has been read.
  GS_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void CudaDevice::copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) GS_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_));
}

void CudaDevice::fill_zero(void* dst, size_t bytes) {
  if (bytes > 0) GS_CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, stream_));
}

void CudaDevice::synchronize() { GS_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

}  // namespace gradsparse
