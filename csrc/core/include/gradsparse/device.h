// Device: where a bucket lives and how the core computes on it. Exchanges and methods are written
// once against this interface; CpuDevice (cpu_device.h) runs the CPU kernels, CudaDevice
// (cuda_device.h) launches the CUDA kernels on one stream. All pointers handed to a Device live
// in its memory; host vectors are named as such.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
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

struct Selection;

/// A dense bucket as the core sees it: `grad` is also where the averaged result is written.
struct BucketView {
  DType dtype = DType::kFloat32;
  int64_t numel = 0;
  void* grad = nullptr;      ///< the bucket's gradient; overwritten with the exchange's result
  void* residual = nullptr;  ///< error-feedback residual of the same shape, or nullptr (no EF)
  void* velocity = nullptr;  ///< momentum correction's velocity of the same shape, or nullptr (none)
  /// The velocity's factor (used when there is a velocity) and momentum factor masking (the
  /// velocity restarts where the residual is zero, numeric.h), for the Device calls that take the
  /// view. reduce_bucket overwrites both from its ReduceOptions, the one place its callers set them.
  float momentum = 0.0f;
  bool momentum_masking = false;
  /// Where set (reduce_bucket, ReduceOptions::keep_taken), an exchange that rewrites the residual
  /// itself after the data moved (union + all-reduce, SparDL: Exchange::selection_zeroes() false)
  /// records here the residual's values at the positions it rewrites, just before rewriting them.
  Selection* taken = nullptr;
};

/// One rank's packed selection for one bucket: a message (message.h) in device memory.
struct Selection {
  Buffer message;         ///< at least `bytes` bytes
  size_t bytes = 0;       ///< size of the message
  int64_t count = 0;      ///< number of (index, value) pairs
  int64_t nonfinite = 0;  ///< elements whose residual + grad was NaN or Inf
  uint32_t kth_key = 0;   ///< select_topk with count >= 1: the key of the least magnitude taken
  /// Every rank's control word, by rank, when the method already agreed them in a collective of
  /// its selection (MiCRO and ExDyna, with their band counts): the exchange then skips its own
  /// (agree). Empty otherwise.
  std::vector<ControlWord> agreed;
  /// index_digest() of the selection's indices, where the method drew them on the host (Random-k,
  /// Random-block): the shared exchange then reads no message back to hash them.
  std::optional<int64_t> index_digest;

  /// The view of this rank's own message, laid out here for a bucket (or block) of `dense_size`
  /// elements of `dtype`: nothing to validate, nothing to copy.
  MessageView view(DType dtype, int64_t dense_size) const {
    return MessageView{message.as<unsigned char>(),
                       dtype,
                       dense_size,
                       count,
                       index_bytes_for(static_cast<uint64_t>(dense_size)),
                       nonfinite,
                       -1};
  }
  /// The same for a selection made from `bucket`.
  MessageView view(const BucketView& bucket) const { return view(bucket.dtype, bucket.numel); }
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
  HostBuffer<int64_t> index;
  HostBuffer<float> value;
  /// The scan that listed them zeroed in the residual those whose key reaches this (kNoKey: none);
  /// OnePass (one_pass.h) then leaves the residual as the step's selection wants it.
  uint32_t zeroed = kNoKey;
  size_t size() const { return index.size(); }
};

/// What one pass over a bucket tells a threshold estimator (Device::scan).
struct Scan {
  /// `above` of a scan with capacity 0, which lists nothing and so counts nothing.
  static constexpr int64_t kNotCounted = -1;
  Moments moments;        ///< of the whole bucket
  int64_t above = 0;      ///< elements of the range with |v| >= the scan's lower bound, or kNotCounted
  Candidates candidates;  ///< all of them, or none when they exceeded the capacity
  bool complete() const { return static_cast<int64_t>(candidates.size()) == above; }
};

/// Where a bucket lives and how the core computes on it: memory and kernels. Every pass below
/// reads the selection values (kernels.h); `update` fuses the error-feedback update into it (the
/// first pass of a step does; later passes read the updated residual). Kernels that produce pairs
/// write them through a PairSink and those that consume them take a MessageView: how a message is
/// laid out and validated is the Message unit's business (message.h), which also provides the
/// selections-as-messages helpers at the end of this class.
class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceKind kind() const = 0;
  /// Ordinal of the device (the CUDA device number; 0 for the CPU).
  virtual int index() const { return 0; }

  // Memory.
  /// Memory on this device, at least 64-byte aligned. Its bytes() may exceed the request (a
  /// device may round it up): copy what was asked for, not bytes().
  virtual Buffer allocate(size_t bytes) = 0;
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  virtual void fill_zero(void* dst, size_t bytes) = 0;
  /// Waits until all work queued on this device by this object is done.
  virtual void synchronize() = 0;

  // Selection kernels: the pairs go to `sink` in ascending index order, indices `index_bytes` wide.
  /// Threshold selection (SelectRule).
  virtual SelectStats select_pairs(const BucketView& bucket, const SelectRule& rule, int index_bytes,
                                   const PairSink& sink) = 0;
  /// Exact top-k (ties: lowest index); with `update` the error-feedback update is fused in; with
  /// `zero` the selected residual entries are zeroed.
  virtual SelectStats topk_pairs(const BucketView& bucket, int64_t k, bool update, bool zero, int index_bytes,
                                 const PairSink& sink) = 0;

  // Statistics kernels.
  /// Moments of the selection values (float64 sums).
  virtual Moments moments(const BucketView& bucket, bool update) = 0;
  /// counts[j] = number of elements of `range` with |v| >= thresholds[j] (> when strict).
  virtual std::vector<int64_t> count(const BucketView& bucket, Range range, const std::vector<double>& thresholds,
                                     bool strict) = 0;
  /// Moments of y = |v| * scale over the elements of `sample` with |v| >= threshold (> when strict).
  virtual Exceedance exceedance(const BucketView& bucket, double threshold, bool strict, double scale,
                                BlockSample sample) = 0;
  /// Sum of ln(|v| * scale + eps) over the elements of `sample`.
  virtual double log_sum(const BucketView& bucket, double scale, double eps, BlockSample sample) = 0;
  /// The elements of `range` with |v| >= threshold (> when strict).
  virtual Candidates collect(const BucketView& bucket, Range range, double threshold, bool strict) = 0;
  /// One pass for a threshold estimator (with `update`: the first pass of a step): the moments of
  /// the whole bucket and the elements of `range` with |v| >= lower, listed when they are at most
  /// `capacity` (< 0: any number). With capacity 0 nothing is listed and nothing counted (above is
  /// Scan::kNotCounted, the scan incomplete): only the moments. Without `sums` the moments hold
  /// only `nonfinite` (the sums zero), for a method that reads no statistic: a device may then skip
  /// their arithmetic. A device may also zero in the residual the listed candidates with |v| >=
  /// `zero_from` while it has them in cache, saying so in `candidates.zeroed`: for a step whose
  /// selection will zero about those (OnePass, one_pass.h, then writes back the few it left and
  /// zeroes the few it added). This default makes the passes one by one and zeroes nothing.
  virtual Scan scan(const BucketView& bucket, bool update, Range range, double lower, int64_t capacity, bool sums,
                    double zero_from = HUGE_VAL);
  /// The keys (numeric.h Num<T>::key, in the bucket's dtype) of the elements of `sample` with |v| >=
  /// `floor`, in index order; with `update`, of the values the update will give, computed without
  /// writing them (read-only either way). A look at the bucket before the pass that updates it,
  /// for an estimate that only saves time (OnePass's k-th largest): a device whose own pass does
  /// not gain from one returns none, as this default does.
  virtual std::vector<uint32_t> sample_keys(const BucketView& /*bucket*/, bool /*update*/, BlockSample /*sample*/,
                                            double /*floor*/) {
    return {};
  }
  /// Sum of |v| at the positions (host vector; repeats allowed).
  virtual double sample_abs_sum(const BucketView& bucket, const std::vector<int64_t>& positions) = 0;

  // Pair kernels, on messages whose header was validated (or laid out here).
  /// values[j] = the selection value at the message's j-th index (values: count elements of dtype).
  virtual void gather_values(const BucketView& bucket, const MessageView& at, void* values) = 0;
  /// Zeroes the residual at the message's indices.
  virtual void zero_at(const BucketView& bucket, const MessageView& message) = 0;
  /// out[index] = value for every pair (out: message.dense_size elements of its dtype).
  virtual void assign(const MessageView& message, void* out) = 0;
  /// out[index] += value / divisor for every pair. Every index is checked first (in range,
  /// strictly ascending): a bad one throws CorruptMessageError naming the sender, without writing.
  virtual void scatter_add(const MessageView& message, void* out, float divisor) = 0;
  /// scatter_add into float32 sums (out: message.dense_size float32 values), which round_to
  /// rounds once to the message's dtype (exchange.h add_messages).
  virtual void scatter_add_float32(const MessageView& message, float* out, float divisor) = 0;
  /// data /= divisor.
  virtual void divide(DType dtype, void* data, int64_t numel, float divisor) = 0;
  /// out = in rounded to `dtype` (to nearest even), elementwise.
  virtual void round_to(DType dtype, const float* in, void* out, int64_t numel) = 0;
  /// Momentum correction as a pass of its own (numeric.h momentum_step), for dense steps:
  /// velocity = factor * velocity + grad, then grad = velocity, element by element, with the
  /// bucket's factor and masking. Sparse steps fuse it into their first pass instead (every
  /// kernel's update: kernels.h Source::update_element).
  virtual void momentum(const BucketView& bucket) = 0;

  // Selections as messages: the kernels above, laid out by the Message unit (exchange/message.cpp).
  /// Threshold selection into a packed message.
  Selection select(const BucketView& bucket, const SelectRule& rule);
  /// Exact top-k into a packed message (topk_pairs).
  Selection select_topk(const BucketView& bucket, int64_t k, bool update = true, bool zero = true);
  /// Fused error feedback + threshold selection over the whole bucket (|v| >= threshold).
  Selection select_threshold(const BucketView& bucket, double threshold) {
    check_threshold(threshold, "Device::select_threshold");
    return select(bucket, SelectRule{threshold, false, Range{0, -1}, true, true});
  }
  /// A message of the given pairs (indices ascending); zeroes the residual there when `zero`.
  Selection emit(const BucketView& bucket, const HostPairs& pairs, bool zero);
  Selection emit(const BucketView& bucket, const std::vector<int64_t>& index, const std::vector<float>& value,
                 bool zero) {
    return emit(bucket, HostPairs(index, &value), zero);
  }
  /// A message holding the selection values at `index` (ascending, host vector).
  Selection gather(const BucketView& bucket, const std::vector<int64_t>& index);
};

/// Validates the header of a message of `bytes` bytes in `device`'s memory (one small copy to
/// the host on CUDA) against the bucket it is for; returns its view. Throws CorruptMessageError
/// naming `source_rank` and the broken field.
MessageView read_message(Device& device, const void* data, size_t bytes, DType expected_dtype,
                         uint64_t expected_dense_size, int source_rank);

/// Bytes of `device`'s memory on the host: read in place from a CPU device's memory, copied from
/// others (one copy, one wait).
class HostBytes {
 public:
  HostBytes(Device& device, const void* data, size_t bytes);
  HostBytes(const HostBytes&) = delete;  // data() may point into copy_: a copy would point into another's
  HostBytes& operator=(const HostBytes&) = delete;
  HostBytes(HostBytes&&) = default;  // a moved vector keeps its storage
  HostBytes& operator=(HostBytes&&) = default;
  const unsigned char* data() const { return data_; }

 private:
  std::vector<unsigned char> copy_;
  const unsigned char* data_;
};

/// A message's pairs on the host (HostBytes).
class HostMessage {
 public:
  HostMessage(Device& device, const MessageView& message);
  /// A message already in host memory (read in place).
  explicit HostMessage(const MessageView& host_message) : view_(host_message) {}
  /// The pairs of this rank's own selection from `bucket`.
  HostMessage(Device& device, const Selection& selection, const BucketView& bucket)
      : HostMessage(device, selection.view(bucket)) {}

  const MessageView& view() const { return view_; }
  int64_t size() const { return view_.count; }
  template <typename I>
  const I* indices() const {
    return static_cast<const I*>(view_.indices());
  }
  template <typename T>
  const T* values() const {
    return static_cast<const T*>(view_.values());
  }
  /// Every index, widened.
  std::vector<int64_t> index_list() const;
  /// Every value, exact as float.
  std::vector<float> value_list() const;
  /// Checks that every index lies inside the message's dense_size, strictly ascending; throws
  /// CorruptMessageError naming the sender and the first bad position.
  void check_indices() const;

 private:
  std::optional<HostBytes> bytes_;  ///< none for a message already in host memory
  MessageView view_;
};

}  // namespace gradsparse
