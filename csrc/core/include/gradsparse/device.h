// Device: where a bucket lives and how the core computes on it. Exchanges and methods are written
// once against this interface; CpuDevice (cpu_device.h) runs the CPU kernels, CudaDevice
// (cuda_device.h) launches the CUDA kernels on one stream. All pointers handed to a Device live
// in its memory; host vectors are named as such.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "gradsparse/common.h"
#include "gradsparse/kernels.h"
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

/// Which elements a threshold selection takes (docs/method-spec.md section 1).
struct SelectRule {
  double threshold = 0.0;  ///< compared with |v| after rounding to the bucket dtype
  bool strict = false;     ///< |v| > threshold instead of |v| >= threshold
  Range range{0, -1};      ///< eligible elements; end < 0 means the whole bucket
  bool update = false;     ///< fuse the error-feedback update (the first pass of a step)
  bool zero = true;        ///< zero the selected residual entries (the union exchange zeroes later)
};

/// Elements of a bucket copied to the host for a method to decide on: ascending indices and
/// their selection values (exact as float for every bucket dtype).
struct Candidates {
  std::vector<int64_t> index;
  std::vector<float> value;
  size_t size() const { return index.size(); }
};

/// Where a bucket lives and how the core computes on it. Every pass below reads the selection
/// values (kernels.h); `update` fuses the error-feedback update into it (the first pass of a
/// step does; later passes read the updated residual).
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

  /// Threshold selection into a packed message.
  virtual Selection select(const BucketView& bucket, const SelectRule& rule) = 0;
  /// Exact top-k into a packed message (ties: lowest index); with `update` the error-feedback
  /// update is fused in. Selected residual entries are zeroed.
  virtual Selection select_topk(const BucketView& bucket, int64_t k, bool update = true) = 0;
  /// Fused error feedback + threshold selection over the whole bucket (|v| >= threshold).
  Selection select_threshold(const BucketView& bucket, double threshold) {
    return select(bucket, SelectRule{threshold, false, Range{0, -1}, true, true});
  }

  /// Moments of the selection values (float64 sums).
  virtual Moments moments(const BucketView& bucket, bool update) = 0;
  /// counts[j] = number of elements of `range` with |v| >= thresholds[j] (> when strict).
  virtual std::vector<int64_t> count(const BucketView& bucket, Range range, const std::vector<double>& thresholds,
                                     bool strict) = 0;
  /// Moments of y = |v| * scale over the elements with |v| >= threshold (> when strict).
  virtual Exceedance exceedance(const BucketView& bucket, double threshold, bool strict, double scale) = 0;
  /// Sum of ln(|v| * scale + eps) over the bucket.
  virtual double log_sum(const BucketView& bucket, double scale, double eps) = 0;
  /// The elements of `range` with |v| >= threshold (> when strict).
  virtual Candidates collect(const BucketView& bucket, Range range, double threshold, bool strict) = 0;
  /// Sum of |v| at the positions (host vector; repeats allowed).
  virtual double sample_abs_sum(const BucketView& bucket, const std::vector<int64_t>& positions) = 0;

  /// A message of the given pairs (indices ascending); zeroes the residual there when `zero`.
  virtual Selection emit(const BucketView& bucket, const std::vector<int64_t>& index, const std::vector<float>& value,
                         bool zero) = 0;
  /// A message holding the selection values at `index` (ascending, host vector).
  virtual Selection gather(const BucketView& bucket, const std::vector<int64_t>& index) = 0;
  /// Zeroes the residual at the indices of a message (validated like a received one).
  virtual void zero_at(const BucketView& bucket, const void* message, size_t bytes) = 0;
  /// out[index] = value for every pair of a message (validated like a received one).
  virtual void assign_message(DType dtype, void* out, int64_t numel, const void* message, size_t bytes) = 0;

  /// Validates a received message (header; every index in range and strictly ascending) and adds
  /// its values / divisor into `out` (numel elements of dtype). Throws CorruptMessageError without
  /// writing on bad input.
  virtual void scatter_add_message(DType dtype, void* out, int64_t numel, const void* message, size_t bytes,
                                   float divisor, int source_rank) = 0;
  /// data /= divisor.
  virtual void divide(DType dtype, void* data, int64_t numel, float divisor) = 0;
};

/// Reads the header of a message in device memory (one small device-to-host copy on CUDA).
MessageHeader read_device_header(Device& device, const void* message, size_t bytes, DType dtype, uint64_t numel,
                                 int source_rank);

}  // namespace gradsparse
