#include "gradsparse/cpu_device.h"

#include <cstdlib>
#include <cstring>
#include <new>

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

Scan CpuDevice::scan(const BucketView& bucket, bool update, Range range, double lower, int64_t capacity, bool sums) {
  if (range.end < 0) range.end = bucket.numel;
  return dispatch_dtype(bucket.dtype, [&](auto t) {
    using T = decltype(t);
    Scan s;
    s.moments = cpu::scan<T>(source<T>(bucket, update), bucket.numel, range, key_at_least<T>(lower), capacity, sums,
                             s.above, s.candidates.index, s.candidates.value);
    if (capacity == 0) s.above = Scan::kNotCounted;  // as every device answers a scan that lists nothing
    return s;
  });
}

}  // namespace gradsparse
