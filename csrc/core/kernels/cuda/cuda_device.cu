#include <cstring>
#include <stdexcept>

#include "gradsparse/cuda_device.h"
#include "gradsparse/kernels.h"

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

namespace {

/// Runs a CUDA selection with a sink that allocates the message on the device, writes its header
/// and zeroes the padding.
template <typename Kernel>
Selection select_into_message(CudaDevice& device, const BucketView& bucket, Kernel&& kernel) {
  const int index_bytes = index_bytes_for(static_cast<uint64_t>(bucket.numel));
  Selection sel;
  const PairSink sink = [&](int64_t count) {
    const MessageLayout layout(static_cast<uint64_t>(count), index_bytes, bucket.dtype);
    sel.message = device.allocate(layout.total_bytes);
    sel.bytes = layout.total_bytes;
    auto* base = sel.message.as<unsigned char>();
    device.fill_zero(base, layout.total_bytes);
    const MessageHeader h =
        make_header(bucket.dtype, index_bytes, static_cast<uint64_t>(bucket.numel), static_cast<uint64_t>(count));
    device.copy_from_host(base, &h, sizeof(h));
    return PairSpan{base + layout.indices_offset, base + layout.values_offset};
  };
  const SelectStats stats = dispatch_dtype(bucket.dtype, [&](auto t) {
    using T = decltype(t);
    return dispatch_index(index_bytes, [&](auto i) {
      using I = decltype(i);
      return kernel(static_cast<T*>(bucket.residual), static_cast<const T*>(bucket.grad), I{}, sink);
    });
  });
  sel.count = stats.count;
  sel.nonfinite = stats.nonfinite;
  return sel;
}

}  // namespace

Selection CudaDevice::select_threshold(const BucketView& bucket, double threshold) {
  return select_into_message(*this, bucket, [&](auto* residual, const auto* grad, auto index, const PairSink& sink) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(grad)>>;
    using I = decltype(index);
    return cuda::select_threshold<T, I>(*this, residual, grad, bucket.numel, threshold, sink);
  });
}

Selection CudaDevice::select_topk(const BucketView& bucket, int64_t k) {
  return select_into_message(*this, bucket, [&](auto* residual, const auto* grad, auto index, const PairSink& sink) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(grad)>>;
    using I = decltype(index);
    return cuda::select_topk<T, I>(*this, residual, grad, bucket.numel, k, sink);
  });
}

void CudaDevice::scatter_add_message(DType dtype, void* out, int64_t numel, const void* message, size_t bytes,
                                     float divisor, int source_rank) {
  const MessageHeader h = read_device_header(*this, message, bytes, dtype, static_cast<uint64_t>(numel), source_rank);
  const MessageLayout layout(h.count, h.index_bytes, dtype);
  const auto* base = static_cast<const unsigned char*>(message);
  dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_index(h.index_bytes, [&](auto i) {
      using I = decltype(i);
      cuda::scatter_add<T, I>(*this, static_cast<T*>(out), numel,
                              reinterpret_cast<const I*>(base + layout.indices_offset),
                              reinterpret_cast<const T*>(base + layout.values_offset), static_cast<int64_t>(h.count),
                              divisor, /*strictly_ascending=*/true);
    });
  });
}

void CudaDevice::divide(DType dtype, void* data, int64_t numel, float divisor) {
  dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    cuda::divide<T>(*this, static_cast<T*>(data), numel, divisor);
  });
}

}  // namespace gradsparse
