// KernelDevice: the Device operations written once for every backend. A backend (CpuDevice,
// CudaDevice) derives from KernelDevice<Backend> and supplies memory operations and typed kernels
// (k_select, k_moments, ...); this class does the dtype and index-width dispatch, turns
// thresholds into keys with the dtype's rounding, and packs messages.
#pragma once

#include <algorithm>
#include <cstring>
#include <numeric>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/kernels.h"
#include "gradsparse/message.h"

namespace gradsparse {

template <typename Backend>
class KernelDevice : public Device {
 public:
  Selection select(const BucketView& bucket, const SelectRule& rule) override {
    const Range range = resolve(rule.range, bucket.numel);
    return into_message(bucket, [&](auto t, auto i, const PairSink& sink) {
      using T = decltype(t);
      using I = decltype(i);
      const uint32_t key = rule.strict ? key_above<T>(rule.threshold) : key_at_least<T>(rule.threshold);
      return self().template k_select<T, I>(source<T>(bucket, rule.update), bucket.numel, key, range, rule.zero, sink);
    });
  }

  Selection select_topk(const BucketView& bucket, int64_t k, bool update) override {
    return into_message(bucket, [&](auto t, auto i, const PairSink& sink) {
      using T = decltype(t);
      using I = decltype(i);
      return self().template k_topk<T, I>(source<T>(bucket, update), bucket.numel, k, sink);
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

  Exceedance exceedance(const BucketView& bucket, double threshold, bool strict, double scale) override {
    return dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      const uint32_t key = strict ? key_above<T>(threshold) : key_at_least<T>(threshold);
      return self().template k_exceedance<T>(source<T>(bucket, false), bucket.numel, key, scale);
    });
  }

  double log_sum(const BucketView& bucket, double scale, double eps) override {
    return dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      return self().template k_log_sum<T>(source<T>(bucket, false), bucket.numel, scale, eps);
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

  Selection emit(const BucketView& bucket, const std::vector<int64_t>& index, const std::vector<float>& value,
                 bool zero) override {
    GS_ASSERT(index.size() == value.size());
    Selection sel = host_message(bucket, index, &value);
    if (zero && bucket.residual != nullptr) zero_at(bucket, sel.message.data(), sel.bytes);
    return sel;
  }

  Selection gather(const BucketView& bucket, const std::vector<int64_t>& index) override {
    Selection sel = host_message(bucket, index, nullptr);
    auto* base = sel.message.template as<unsigned char>();
    const MessageLayout layout(static_cast<uint64_t>(index.size()), index_bytes_for(bucket.numel), bucket.dtype);
    if (!index.empty()) {
      dispatch_dtype(bucket.dtype, [&](auto t) {
        using T = decltype(t);
        dispatch_index(index_bytes_for(bucket.numel), [&](auto i) {
          using I = decltype(i);
          self().template k_gather<T, I>(
              source<T>(bucket, false), reinterpret_cast<const I*>(base + kMessageHeaderBytes),
              static_cast<int64_t>(index.size()), reinterpret_cast<T*>(base + layout.values_offset));
        });
      });
    }
    return sel;
  }

  void zero_at(const BucketView& bucket, const void* message, size_t bytes) override {
    if (bucket.residual == nullptr) return;
    const MessageHeader h = read_device_header(*this, message, bytes, bucket.dtype, bucket.numel, -1);
    const auto* base = static_cast<const unsigned char*>(message);
    dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      dispatch_index(h.index_bytes, [&](auto i) {
        using I = decltype(i);
        self().template k_zero_at<T, I>(static_cast<T*>(bucket.residual),
                                        reinterpret_cast<const I*>(base + kMessageHeaderBytes),
                                        static_cast<int64_t>(h.count));
      });
    });
  }

  void assign_message(DType dtype, void* out, int64_t numel, const void* message, size_t bytes) override {
    const MessageHeader h = read_device_header(*this, message, bytes, dtype, static_cast<uint64_t>(numel), -1);
    const MessageLayout layout(h.count, h.index_bytes, dtype);
    const auto* base = static_cast<const unsigned char*>(message);
    dispatch_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      dispatch_index(h.index_bytes, [&](auto i) {
        using I = decltype(i);
        self().template k_assign<T, I>(
            static_cast<T*>(out), numel, reinterpret_cast<const I*>(base + layout.indices_offset),
            reinterpret_cast<const T*>(base + layout.values_offset), static_cast<int64_t>(h.count));
      });
    });
  }

  void scatter_add_message(DType dtype, void* out, int64_t numel, const void* message, size_t bytes, float divisor,
                           int source_rank) override {
    const MessageHeader h = read_device_header(*this, message, bytes, dtype, static_cast<uint64_t>(numel), source_rank);
    const MessageLayout layout(h.count, h.index_bytes, dtype);
    const auto* base = static_cast<const unsigned char*>(message);
    try {
      dispatch_dtype(dtype, [&](auto t) {
        using T = decltype(t);
        dispatch_index(h.index_bytes, [&](auto i) {
          using I = decltype(i);
          self().template k_scatter_add<T, I>(static_cast<T*>(out), numel,
                                              reinterpret_cast<const I*>(base + layout.indices_offset),
                                              reinterpret_cast<const T*>(base + layout.values_offset),
                                              static_cast<int64_t>(h.count), divisor, /*strictly_ascending=*/true);
        });
      });
    } catch (const CorruptMessageError& e) {  // name the sender
      if (source_rank < 0) throw;
      throw CorruptMessageError(str(message_source(source_rank), ": ", e.what()));
    }
  }

  void divide(DType dtype, void* data, int64_t numel, float divisor) override {
    dispatch_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      self().template k_divide<T>(static_cast<T*>(data), numel, divisor);
    });
  }

 private:
  Backend& self() { return static_cast<Backend&>(*this); }

  static Range resolve(Range r, int64_t n) { return r.end < 0 ? Range{r.begin, n} : r; }

  template <typename T>
  static Source<T> source(const BucketView& bucket, bool update) {
    return Source<T>{static_cast<T*>(bucket.residual), static_cast<const T*>(bucket.grad), update};
  }

  /// Runs `kernel(T{}, I{}, sink)` with a sink that allocates the message once the count is
  /// known, zeroes it and writes its header.
  template <typename Kernel>
  Selection into_message(const BucketView& bucket, Kernel&& kernel) {
    const int index_bytes = index_bytes_for(static_cast<uint64_t>(bucket.numel));
    Selection sel;
    const PairSink sink = [&](int64_t count) {
      const MessageLayout layout(static_cast<uint64_t>(count), index_bytes, bucket.dtype);
      sel.message = allocate(layout.total_bytes);
      sel.bytes = layout.total_bytes;
      auto* base = sel.message.template as<unsigned char>();
      fill_zero(base, layout.total_bytes);  // deterministic padding bytes
      const MessageHeader h =
          make_header(bucket.dtype, index_bytes, static_cast<uint64_t>(bucket.numel), static_cast<uint64_t>(count));
      copy_from_host(base, &h, sizeof(h));
      return PairSpan{base + layout.indices_offset, base + layout.values_offset};
    };
    const SelectStats stats = dispatch_dtype(
        bucket.dtype, [&](auto t) { return dispatch_index(index_bytes, [&](auto i) { return kernel(t, i, sink); }); });
    sel.count = stats.count;
    sel.nonfinite = stats.nonfinite;
    return sel;
  }

  /// A message built on the host from ascending indices and (optionally) values, copied here.
  Selection host_message(const BucketView& bucket, const std::vector<int64_t>& index, const std::vector<float>* value) {
    const int index_bytes = index_bytes_for(static_cast<uint64_t>(bucket.numel));
    const uint64_t count = index.size();
    const MessageLayout layout(count, index_bytes, bucket.dtype);
    std::vector<unsigned char> host(layout.total_bytes, 0);
    const MessageHeader h = make_header(bucket.dtype, index_bytes, static_cast<uint64_t>(bucket.numel), count);
    std::memcpy(host.data(), &h, sizeof(h));
    for (size_t j = 0; j < index.size(); ++j) {
      GS_CHECK(index[j] >= 0 && index[j] < bucket.numel && (j == 0 || index[j - 1] < index[j]), ValueError,
               "message indices must be ascending and inside the bucket; index ", index[j], " at position ", j);
    }
    dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      dispatch_index(index_bytes, [&](auto i) {
        using I = decltype(i);
        auto* idx = reinterpret_cast<I*>(host.data() + layout.indices_offset);
        auto* val = reinterpret_cast<T*>(host.data() + layout.values_offset);
        for (size_t j = 0; j < index.size(); ++j) {
          idx[j] = static_cast<I>(index[j]);
          if (value != nullptr) val[j] = Num<T>::from_float((*value)[j]);
        }
      });
    });
    Selection sel;
    sel.message = allocate(layout.total_bytes);
    sel.bytes = layout.total_bytes;
    sel.count = static_cast<int64_t>(count);
    copy_from_host(sel.message.data(), host.data(), host.size());
    return sel;
  }
};

}  // namespace gradsparse
