// Helpers shared by the method implementations (private to csrc/core/method).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/message.h"

namespace gradsparse::method_util {

inline void check_density(const char* method, double density) {
  GS_CHECK(std::isfinite(density) && density > 0.0 && density <= 1.0, ValueError, method,
           ": density must be in (0, 1], got ", density, "; for example density=0.01 sends 1% of each bucket");
}

inline constexpr double kInfinity = std::numeric_limits<double>::infinity();

/// The error-feedback update of the whole bucket, selecting nothing; returns the non-finite count.
inline int64_t update_pass(Device& device, const BucketView& bucket) {
  return device.select(bucket, SelectRule{kInfinity, false, Range{0, 0}, true, false}).nonfinite;
}

/// An empty selection (a header-only message).
inline Selection nothing(Device& device, const BucketView& bucket, int64_t nonfinite) {
  Selection s = device.emit(bucket, {}, {}, false);
  s.nonfinite = nonfinite;
  return s;
}

/// The whole bucket as a range.
inline Range whole(const BucketView& bucket) { return Range{0, bucket.numel}; }

/// The values of a message, read to the host as float.
inline std::vector<float> message_values(Device& device, const Selection& s, const BucketView& bucket) {
  const MessageLayout layout(static_cast<uint64_t>(s.count), index_bytes_for(bucket.numel), bucket.dtype);
  const size_t size = dtype_size(bucket.dtype);
  std::vector<unsigned char> raw(static_cast<size_t>(s.count) * size);
  device.copy_to_host(raw.data(), s.message.as<unsigned char>() + layout.values_offset, raw.size());
  std::vector<float> out(static_cast<size_t>(s.count));
  dispatch_dtype(bucket.dtype, [&](auto t) {
    using T = decltype(t);
    const auto* v = reinterpret_cast<const T*>(raw.data());
    for (size_t j = 0; j < out.size(); ++j) out[j] = Num<T>::to_float(v[j]);
  });
  return out;
}

/// Positions (into `c`) of the `k` candidates of largest magnitude (ties: lowest index), in
/// ascending index order.
inline std::vector<size_t> largest(const Candidates& c, size_t k) {
  std::vector<size_t> order(c.size());
  std::iota(order.begin(), order.end(), size_t{0});
  k = std::min(k, order.size());
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](size_t a, size_t b) {
                      const float ma = std::fabs(c.value[a]), mb = std::fabs(c.value[b]);
                      return ma != mb ? ma > mb : c.index[a] < c.index[b];
                    });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

/// The candidates at the given positions, as a message.
inline Selection emit_subset(Device& device, const BucketView& bucket, const Candidates& c,
                             const std::vector<size_t>& positions, bool zero) {
  std::vector<int64_t> index(positions.size());
  std::vector<float> value(positions.size());
  for (size_t j = 0; j < positions.size(); ++j) {
    index[j] = c.index[positions[j]];
    value[j] = c.value[positions[j]];
  }
  return device.emit(bucket, index, value, zero);
}

}  // namespace gradsparse::method_util
