// Helpers shared by the method implementations (private to csrc/core/method).
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/message.h"
#include "gradsparse/parallel.h"

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

/// The non-negative value of T whose key is `key`.
template <typename T>
T from_key(uint32_t key) {
  if constexpr (std::is_same_v<T, float>) {
    return bits_float(key);
  } else {
    return T{static_cast<uint16_t>(key)};
  }
}

/// The magnitude whose key (of a value of `dtype`) is `key`, as a double.
inline double key_value(DType dtype, uint32_t key) {
  return dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    return static_cast<double>(Num<T>::to_float(from_key<T>(key)));
  });
}

/// The smallest value of the bucket's dtype that is >= x, as a double (+inf when no finite value
/// is; 0 for x <= 0). For a value v of the dtype, `|v| >= x` compared in float64 is exactly
/// `|v| >= dtype_ceil(x)` compared in the dtype, which a key comparison (SelectRule, count) does.
inline double dtype_ceil(DType dtype, double x) {
  if (!(x > 0.0)) return x <= 0.0 ? 0.0 : x;  // NaN stays NaN
  return dispatch_dtype(dtype, [&](auto t) -> double {
    using T = decltype(t);
    const auto value = [](uint32_t key) { return static_cast<double>(Num<T>::to_float(from_key<T>(key))); };
    if (!(x <= static_cast<double>(std::numeric_limits<float>::max()))) return kInfinity;
    uint32_t key = Num<T>::key(Num<T>::from_float(static_cast<float>(x)));  // within a step or two
    if (key >= Num<T>::kInfKey) key = Num<T>::kInfKey - 1;
    while (key > 0 && value(key - 1) >= x) --key;
    while (key < Num<T>::kInfKey && value(key) < x) ++key;
    return key >= Num<T>::kInfKey ? kInfinity : value(key);
  });
}

/// An empty selection (a header-only message).
inline Selection nothing(Device& device, const BucketView& bucket, int64_t nonfinite) {
  Selection s = device.emit(bucket, {}, {}, false);
  s.nonfinite = nonfinite;
  return s;
}

/// The whole bucket as a range.
inline Range whole(const BucketView& bucket) { return Range{0, bucket.numel}; }

/// The k-th largest of `keys` (1 <= k <= keys.size()): two counting rounds over 16-bit halves.
/// `keys`: a HostBuffer<uint32_t>, or FloatKeys (below); both give keys[j] and keys.size().
template <typename Keys>
uint32_t kth_largest_key(const Keys& keys, int64_t k) {
  GS_ASSERT(k >= 1 && k <= static_cast<int64_t>(keys.size()));
  std::vector<int64_t> hist(65536, 0);
  for (size_t j = 0; j < keys.size(); ++j) ++hist[keys[j] >> 16];
  int64_t above = 0;  // keys above the bins passed so far
  uint32_t high = 65535;
  for (; high > 0 && above + hist[high] < k; --high) above += hist[high];
  std::fill(hist.begin(), hist.end(), 0);
  for (size_t j = 0; j < keys.size(); ++j)
    if ((keys[j] >> 16) == high) ++hist[keys[j] & 0xffffu];
  uint32_t low = 65535;
  for (; low > 0 && above + hist[low] < k; --low) above += hist[low];
  return (high << 16) | low;
}

/// The positions of the k largest of `keys` (1 <= k <= keys.size(); ties: the lowest positions),
/// ascending; `kth_key` gets the k-th largest key, and `ties_cut`, where given, whether keys equal
/// to it were left out (else the positions are those of every key from it up).
template <typename Keys>
Positions largest_positions(const Keys& keys, int64_t k, uint32_t& kth_key, bool* ties_cut = nullptr) {
  kth_key = kth_largest_key(keys, k);
  const uint32_t kth = kth_key;
  Positions out = positions_where(keys.size(), [&](size_t j) { return keys[j] >= kth; });
  if (ties_cut != nullptr) *ties_cut = static_cast<int64_t>(out.size()) > k;
  if (static_cast<int64_t>(out.size()) > k) {  // more ties at the k-th key than are taken
    int64_t ties = k;                          // those taken: k minus the keys above the k-th
    for (size_t j : out) ties -= keys[j] > kth ? 1 : 0;
    size_t kept = 0;  // the lowest positions among the ties
    for (size_t j : out)
      if (keys[j] > kth || ties-- > 0) out[kept++] = j;
    out.resize(kept);
  }
  return out;
}

/// The float32 keys (|v| bits) of float values, read from the values where they lie (a key is
/// one mask of the value's bits: writing them out first cost SAGE 0.7 ms a step over 1.2 million
/// candidates). For values of any bucket dtype, exact as floats, they order as the dtype's keys do.
struct FloatKeys {
  const float* values;
  size_t count;
  size_t size() const { return count; }
  uint32_t operator[](size_t j) const { return Num<float>::key(values[j]); }
};

/// The FloatKeys key from which a float value v has |v| >= x compared in float64: the key of x
/// raised to float32 (dtype_ceil).
inline uint32_t float_key_at_least(double x) {
  return Num<float>::key(static_cast<float>(dtype_ceil(DType::kFloat32, x)));
}

/// FloatKeys of a container of floats (which must outlive them).
template <typename Values>
FloatKeys float_keys(const Values& values) {
  return FloatKeys{values.data(), values.size()};
}

/// The least magnitude among the values of a selection by Device::select_topk (+inf when it has
/// none), exact for every bucket dtype: the k-th largest, which the selection found as a key (no
/// read of its message).
inline double least_magnitude(const BucketView& bucket, const Selection& s) {
  return s.count == 0 ? kInfinity : key_value(bucket.dtype, s.kth_key);
}

/// The k pairs of largest magnitude of a selection's message (1 <= k <= s.count; ties: lowest
/// index), as a new message in ascending index order; `kth` gets the k-th largest magnitude. The
/// residual is not touched.
inline Selection largest_of_message(Device& device, const BucketView& bucket, const Selection& s, int64_t k,
                                    double& kth) {
  GS_ASSERT(k >= 1 && k <= s.count);
  const HostMessage in(device, s, bucket);
  const std::vector<int64_t> index = in.index_list();
  const std::vector<float> value = in.value_list();  // exact for every bucket dtype, in the same order
  uint32_t kth_key;
  const Positions chosen = largest_positions(float_keys(value), k, kth_key);
  kth = static_cast<double>(from_key<float>(kth_key));
  GS_ASSERT(static_cast<int64_t>(chosen.size()) == k);
  return device.emit(bucket, HostPairs(index, value, chosen), /*zero=*/false);
}

/// |v| at each of `positions` (repeats allowed; in their order) with v the selection values after
/// the error-feedback update (with momentum correction when the bucket has a velocity), read
/// before the update runs: the update of those elements is computed here (as the kernels compute
/// it), so a later pass can fuse the update of the bucket. Their sum in order equals
/// Device::sample_abs_sum after the update.
inline std::vector<double> sample_magnitudes_before_update(Device& device, const BucketView& bucket,
                                                           const std::vector<int64_t>& positions) {
  std::vector<int64_t> unique(positions);
  std::sort(unique.begin(), unique.end());
  unique.erase(std::unique(unique.begin(), unique.end()), unique.end());
  const Selection residual = device.gather(bucket, unique);
  std::vector<float> value = HostMessage(device, residual, bucket).value_list();
  if (bucket.residual != nullptr) {
    // Gathered values read a non-finite gradient as 0. Without momentum the sum then keeps the
    // residual there, as the update does; with it the sum differs from the update's, but a
    // non-finite gradient aborts the step on every rank (ruling 5), so the sample is not used.
    auto at_positions = [&](void* data) {
      const BucketView only{bucket.dtype, bucket.numel, data, nullptr};
      return HostMessage(device, device.gather(only, unique), only).value_list();
    };
    const std::vector<float> grad = at_positions(bucket.grad);
    const std::vector<float> velocity =
        bucket.velocity != nullptr ? at_positions(bucket.velocity) : std::vector<float>{};
    dispatch_dtype(bucket.dtype, [&](auto t) {
      using T = decltype(t);
      for (size_t j = 0; j < value.size(); ++j) {  // exact: the values came from T
        const T u = velocity.empty() ? T{} : Num<T>::from_float(velocity[j]);
        value[j] =
            Num<T>::to_float(updated_value(Num<T>::from_float(value[j]), Num<T>::from_float(grad[j]),
                                           velocity.empty() ? nullptr : &u, bucket.momentum, bucket.momentum_masking));
      }
    });
  }
  std::vector<double> magnitudes;
  magnitudes.reserve(positions.size());
  for (int64_t p : positions) {
    const size_t j = static_cast<size_t>(std::lower_bound(unique.begin(), unique.end(), p) - unique.begin());
    magnitudes.push_back(std::fabs(static_cast<double>(value[j])));
  }
  return magnitudes;
}

/// The candidates at the given positions, as a message.
inline Selection emit_subset(Device& device, const BucketView& bucket, const Candidates& c, const Positions& positions,
                             bool zero) {
  return device.emit(bucket, HostPairs(c.index, c.value, positions), zero);
}

}  // namespace gradsparse::method_util
