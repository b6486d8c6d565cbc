// Reads a fuzzer's input as a stream of little-endian fields; past the end every read is zero,
// so an empty input is a valid (honest) case.
#pragma once

#include <cstddef>
#include <cstdint>

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

}  // namespace gradsparse::fuzz
