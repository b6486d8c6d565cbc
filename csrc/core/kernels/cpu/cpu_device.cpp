#include <cstdlib>
#include <cstring>

#include "gradsparse/device.h"
#include "gradsparse/kernels.h"

namespace gradsparse {

Buffer CpuDevice::allocate(size_t bytes) {
  const size_t rounded = pad8(bytes == 0 ? 1 : bytes);
  const size_t aligned = (rounded + 63) & ~static_cast<size_t>(63);
  void* p = std::aligned_alloc(64, aligned);
  if (p == nullptr) throw std::bad_alloc();
  return Buffer(p, bytes, [](void* q) { std::free(q); });
}

void CpuDevice::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(host_dst, src, bytes);
}
void CpuDevice::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, host_src, bytes);
}
void CpuDevice::copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memmove(dst, src, bytes);
}
void CpuDevice::fill_zero(void* dst, size_t bytes) {
  if (bytes > 0) std::memset(dst, 0, bytes);
}

namespace {

/// Runs a CPU selection kernel with a sink that allocates the message once the count is known.
template <typename Kernel>
Selection select_into_message(CpuDevice& device, const BucketView& bucket, Kernel&& kernel) {
  const int index_bytes = index_bytes_for(static_cast<uint64_t>(bucket.numel));
  Selection sel;
  const PairSink sink = [&](int64_t count) {
    const MessageLayout layout(static_cast<uint64_t>(count), index_bytes, bucket.dtype);
    sel.message = device.allocate(layout.total_bytes);
    sel.bytes = layout.total_bytes;
    auto* base = sel.message.as<unsigned char>();
    std::memset(base, 0, layout.total_bytes);  // deterministic padding bytes
    const MessageHeader h =
        make_header(bucket.dtype, index_bytes, static_cast<uint64_t>(bucket.numel), static_cast<uint64_t>(count));
    std::memcpy(base, &h, sizeof(h));
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

Selection CpuDevice::select_threshold(const BucketView& bucket, double threshold) {
  return select_into_message(*this, bucket, [&](auto* residual, const auto* grad, auto index, const PairSink& sink) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(grad)>>;
    using I = decltype(index);
    return cpu::select_threshold<T, I>(residual, grad, bucket.numel, threshold, sink);
  });
}

Selection CpuDevice::select_topk(const BucketView& bucket, int64_t k) {
  return select_into_message(*this, bucket, [&](auto* residual, const auto* grad, auto index, const PairSink& sink) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(grad)>>;
    using I = decltype(index);
    return cpu::select_topk<T, I>(residual, grad, bucket.numel, k, sink);
  });
}

void CpuDevice::scatter_add_message(DType dtype, void* out, int64_t numel, const void* message, size_t bytes,
                                    float divisor, int source_rank) {
  const MessageHeader h = read_header(message, bytes, dtype, static_cast<uint64_t>(numel), source_rank);
  const MessageLayout layout(h.count, h.index_bytes, dtype);
  const auto* base = static_cast<const unsigned char*>(message);
  dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_index(h.index_bytes, [&](auto i) {
      using I = decltype(i);
      cpu::scatter_add<T, I>(static_cast<T*>(out), numel, reinterpret_cast<const I*>(base + layout.indices_offset),
                             reinterpret_cast<const T*>(base + layout.values_offset), static_cast<int64_t>(h.count),
                             divisor, /*strictly_ascending=*/true);
    });
  });
}

void CpuDevice::divide(DType dtype, void* data, int64_t numel, float divisor) {
  dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    cpu::divide<T>(static_cast<T*>(data), numel, divisor);
  });
}

}  // namespace gradsparse
