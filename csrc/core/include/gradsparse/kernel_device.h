// KernelDevice: the Device operations written once for every backend. A backend (CpuDevice,
// CudaDevice) derives from KernelDevice<Backend> and supplies memory operations and typed kernels
// (k_select, k_moments, ...); this class does the dtype and index-width dispatch and turns
// thresholds into keys with the dtype's rounding. It never lays out or parses a message: the
// selection kernels write through a sink, the pair kernels read a MessageView (message.h).
#pragma once

#include <algorithm>
#include <numeric>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/kernels.h"
#include "gradsparse/message.h"

namespace gradsparse {

template <typename Backend>
class KernelDevice : public Device {
 public:
  SelectStats select_pairs(const BucketView& bucket, const SelectRule& rule, int index_bytes,
                           const PairSink& sink) override {
    const Range range = resolve(rule.range, bucket.numel);
    return dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      const uint32_t key = rule.strict ? key_above<T>(rule.threshold) : key_at_least<T>(rule.threshold);
      return dispatch_index(index_bytes, [&](auto i) {
        using I = decltype(i);
        return self().template k_select<T, I>(source<T>(bucket, rule.update), bucket.numel, key, range, rule.zero,
                                              sink);
      });
    });
  }

  SelectStats topk_pairs(const BucketView& bucket, int64_t k, bool update, bool zero, int index_bytes,
                         const PairSink& sink) override {
    return dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      return dispatch_index(index_bytes, [&](auto i) {
        using I = decltype(i);
        return self().template k_topk<T, I>(source<T>(bucket, update), bucket.numel, k, zero, sink);
      });
    });
  }

  Moments moments(const BucketView& bucket, bool update) override {
    return dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      return self().template k_moments<T>(source<T>(bucket, update), bucket.numel);
    });
  }

  std::vector<int64_t> count(const BucketView& bucket, Range range, const std::vector<double>& thresholds,
                             bool strict) override {
    range = resolve(range, bucket.numel);
    return dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      std::vector<uint32_t> keys(thresholds.size());
      for (size_t j = 0; j < keys.size(); ++j)
        keys[j] = strict ? key_above<T>(thresholds[j]) : key_at_least<T>(thresholds[j]);
      std::vector<size_t> order(keys.size());
      std::iota(order.begin(), order.end(), size_t{0});
      std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return keys[a] < keys[b]; });
      std::vector<uint32_t> sorted(keys.size());
      for (size_t j = 0; j < order.size(); ++j) sorted[j] = keys[order[j]];
      std::vector<int64_t> sorted_counts(keys.size(), 0), counts(keys.size(), 0);
      self().template k_count<T>(source<T>(bucket, false), bucket.numel, range, sorted, sorted_counts);
      for (size_t j = 0; j < order.size(); ++j) counts[order[j]] = sorted_counts[j];
      return counts;
    });
  }

  Exceedance exceedance(const BucketView& bucket, double threshold, bool strict, double scale,
                        BlockSample sample) override {
    return dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      const uint32_t key = strict ? key_above<T>(threshold) : key_at_least<T>(threshold);
      return self().template k_exceedance<T>(source<T>(bucket, false), bucket.numel, key, scale, sample);
    });
  }

  double log_sum(const BucketView& bucket, double scale, double eps, BlockSample sample) override {
    return dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      return self().template k_log_sum<T>(source<T>(bucket, false), bucket.numel, scale, eps, sample);
    });
  }

  Candidates collect(const BucketView& bucket, Range range, double threshold, bool strict) override {
    range = resolve(range, bucket.numel);
    return dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      const uint32_t key = strict ? key_above<T>(threshold) : key_at_least<T>(threshold);
      Candidates c;
      self().template k_collect<T>(source<T>(bucket, false), bucket.numel, range, key, c.index, c.value);
      return c;
    });
  }

  double sample_abs_sum(const BucketView& bucket, const std::vector<int64_t>& positions) override {
    for (int64_t p : positions)
      GS_CHECK(p >= 0 && p < bucket.numel, ValueError, "sample position ", p, " is outside the bucket");
    return dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      return self().template k_sample_abs_sum<T>(source<T>(bucket, false), positions);
    });
  }

  void gather_values(const BucketView& bucket, const MessageView& at, void* values) override {
    on_pairs(at, [&](auto t, auto i) {
      using T = decltype(t);
      using I = decltype(i);
      self().template k_gather<T, I>(source<T>(bucket, false), static_cast<const I*>(at.indices()), at.count,
                                     static_cast<T*>(values));
    });
  }

  void zero_at(const BucketView& bucket, const MessageView& message) override {
    if (bucket.residual == nullptr) return;
    on_pairs(message, [&](auto t, auto i) {
      using T = decltype(t);
      using I = decltype(i);
      self().template k_zero_at<T, I>(static_cast<T*>(bucket.residual), static_cast<const I*>(message.indices()),
                                      message.count);
    });
  }

  void assign(const MessageView& message, void* out) override {
    on_pairs(message, [&](auto t, auto i) {
      using T = decltype(t);
      using I = decltype(i);
      self().template k_assign<T, I>(static_cast<T*>(out), message.dense_size, static_cast<const I*>(message.indices()),
                                     static_cast<const T*>(message.values()), message.count);
    });
  }

  void scatter_add(const MessageView& message, void* out, float divisor) override {
    on_pairs(message, [&](auto t, auto i) {
      using T = decltype(t);
      using I = decltype(i);
      self().template k_scatter_add<T, I>(static_cast<T*>(out), message.dense_size,
                                          static_cast<const I*>(message.indices()),
                                          static_cast<const T*>(message.values()), message.count, divisor,
                                          /*strictly_ascending=*/true);
    });
  }

  void scatter_add_float32(const MessageView& message, float* out, float divisor) override {
    on_pairs(message, [&](auto t, auto i) {
      using T = decltype(t);
      using I = decltype(i);
      self().template k_scatter_add<T, I>(out, message.dense_size, static_cast<const I*>(message.indices()),
                                          static_cast<const T*>(message.values()), message.count, divisor,
                                          /*strictly_ascending=*/true);
    });
  }

  void divide(DType dtype, void* data, int64_t numel, float divisor) override {
    dispatch_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      self().template k_divide<T>(static_cast<T*>(data), numel, divisor);
    });
  }

  void round_to(DType dtype, const float* in, void* out, int64_t numel) override {
    dispatch_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      self().template k_round_to<T>(in, static_cast<T*>(out), numel);
    });
  }

  void momentum(const BucketView& bucket) override {
    dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      self().template k_momentum<T>(static_cast<T*>(bucket.grad), static_cast<T*>(bucket.velocity),
                                    static_cast<const T*>(bucket.residual), bucket.numel, bucket.momentum,
                                    bucket.momentum_masking);
    });
  }

 protected:
  /// Where a kernel reads the bucket (kernels.h Source); the update, when asked, applies the
  /// bucket's momentum correction too.
  template <typename T>
  static Source<T> source(const BucketView& bucket, bool update) {
    const bool momentum = update && bucket.velocity != nullptr;
    return Source<T>{static_cast<T*>(bucket.residual),
                     static_cast<const T*>(bucket.grad),
                     update,
                     momentum ? static_cast<T*>(bucket.velocity) : nullptr,
                     bucket.momentum,
                     bucket.momentum_masking};
  }

 private:
  Backend& self() { return static_cast<Backend&>(*this); }

  static Range resolve(Range r, int64_t n) { return r.end < 0 ? Range{r.begin, n} : r; }

  /// Calls `kernel(T{}, I{})` for a message's value and index types; a CorruptMessageError a
  /// kernel throws (a bad index) names the message's sender.
  template <typename Kernel>
  static void on_pairs(const MessageView& message, Kernel&& kernel) {
    if (message.count == 0) return;
    try {
      dispatch_dtype(message.dtype,
                     [&](auto t) { dispatch_index(message.index_bytes, [&](auto i) { kernel(t, i); }); });
    } catch (const CorruptMessageError& e) {
      if (message.source_rank < 0) throw;
      throw CorruptMessageError(str(message_source(message.source_rank), ": ", e.what()));
    }
  }
};

}  // namespace gradsparse
