// What the fuzzers share: their input read as a stream of little-endian fields (past the end
// every read is zero, so an empty input is a valid, honest case), and deterministic buckets.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "gradsparse/kernels.h"

namespace gradsparse::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint8_t u8() { return at_ < size_ ? data_[at_++] : 0; }
  uint16_t u16() { return static_cast<uint16_t>(u8() | (u8() << 8)); }
  bool done() const { return at_ >= size_; }
  const uint8_t* rest() const { return data_ + at_; }
  size_t rest_size() const { return at_ < size_ ? size_ - at_ : 0; }

 private:
  const uint8_t* data_;
  size_t size_;
  size_t at_ = 0;
};

/// A bucket of `n` elements of `dtype` with values in about [-8, 8], from `seed`.
inline std::vector<unsigned char> random_bucket(DType dtype, int64_t n, uint32_t seed) {
  std::vector<unsigned char> bytes(static_cast<size_t>(n) * dtype_size(dtype));
  uint32_t x = seed * 2654435761u + 1;
  dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    auto* v = reinterpret_cast<T*>(bytes.data());
    for (int64_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      v[i] = Num<T>::from_float(static_cast<float>(static_cast<int32_t>(x >> 8) - (1 << 23)) / (1 << 20));
    }
  });
  return bytes;
}

}  // namespace gradsparse::fuzz
