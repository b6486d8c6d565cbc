// Device: where a bucket lives and how the core computes on it. Exchanges and methods are written
// once against this interface; CpuDevice runs the CPU kernels, CudaDevice (kernels/cuda) launches
// the CUDA kernels on one stream. All pointers handed to a Device live in its memory.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "gradsparse/common.h"
#include "gradsparse/message.h"

namespace gradsparse {

enum class DeviceKind { kCPU, kCUDA };

/// An owned allocation in some device's memory, released by its deleter (move-only).
class Buffer {
 public:
  Buffer() = default;
  Buffer(void* data, size_t bytes, std::function<void(void*)> release)
      : data_(data), bytes_(bytes), release_(std::move(release)) {}
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept {
    if (this != &o) {
      reset();
      data_ = std::exchange(o.data_, nullptr);
      bytes_ = std::exchange(o.bytes_, 0);
      release_ = std::move(o.release_);
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { reset(); }

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(data_);
  }
  void reset() {
    if (data_ != nullptr && release_) release_(data_);
    data_ = nullptr;
    bytes_ = 0;
  }

 private:
  void* data_ = nullptr;
  size_t bytes_ = 0;
  std::function<void(void*)> release_;
};

/// One rank's packed selection for one bucket: a message (message.h) in device memory.
struct Selection {
  Buffer message;         ///< at least `bytes` bytes
  size_t bytes = 0;       ///< size of the message
  int64_t count = 0;      ///< number of (index, value) pairs
  int64_t nonfinite = 0;  ///< elements whose residual + grad was NaN or Inf
};

/// A dense bucket as the core sees it: `grad` is also where the averaged result is written.
struct BucketView {
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  void* grad = nullptr;      ///< the bucket's gradient; overwritten with the exchange's result
  void* residual = nullptr;  ///< error-feedback residual of the same shape, or nullptr (no EF)
};

class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceKind kind() const = 0;
  /// Ordinal of the device (the CUDA device number; 0 for the CPU).
  virtual int index() const { return 0; }

  /// Memory on this device, at least 64-byte aligned.
  virtual Buffer allocate(size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  /// Waits until all work queued on this device by this object is done.
  virtual void synchronize() = 0;

  /// Fused error feedback + threshold selection into a packed message (kernels.h semantics).
  virtual Selection select_threshold(const BucketView& bucket, double threshold) = 0;
  /// Fused error feedback + exact top-k into a packed message (kernels.h semantics).
  virtual Selection select_topk(const BucketView& bucket, int64_t k) = 0;

  /// Validates a received message (header; every index in range and strictly ascending) and adds
  /// its values / divisor into `out` (numel elements of dtype). Throws CorruptMessageError without
  /// writing on bad input.
  virtual void scatter_add_message(DType dtype, void* out, int64_t numel, const void* message, size_t bytes,
                                   float divisor, int source_rank) = 0;
  /// data /= divisor.
  virtual void divide(DType dtype, void* data, int64_t numel, float divisor) = 0;
};

/// The CPU device: host memory, OpenMP kernels.
class CpuDevice final : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::kCPU; }
  Buffer allocate(size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override {}
  Selection select_threshold(const BucketView& bucket, double threshold) override;
  Selection select_topk(const BucketView& bucket, int64_t k) override;
  void scatter_add_message(DType dtype, void* out, int64_t numel, const void* message, size_t bytes, float divisor,
                           int source_rank) override;
  void divide(DType dtype, void* data, int64_t numel, float divisor) override;
};

/// Reads the header of a message in device memory (one small device-to-host copy on CUDA).
MessageHeader read_device_header(Device& device, const void* message, size_t bytes, DType dtype, uint64_t numel,
                                 int source_rank);

}  // namespace gradsparse
