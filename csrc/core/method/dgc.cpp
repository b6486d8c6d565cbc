// DGC's sampled threshold (docs/method-spec.md 4.5, SIDCo's dgcsampling): the threshold is the
// top-density quantile of a 1% sample of x = |v| / ||v||; too many exceedances are trimmed to the
// exact top k.
#include <algorithm>
#include <cmath>
#include <functional>
#include <optional>

#include "gradsparse/methods.h"
#include "gradsparse/rng.h"
#include "method_util.h"

namespace gradsparse {

DGC::DGC(double density, uint64_t seed, const std::string& exchange, bool reference)
    : EstimatingMethod("DGC", exchange, reference), density_(density), seed_(seed) {
  method_util::check_density("DGC", density);
}

Selection DGC::select(Device& device, const BucketView& bucket, Collective& /*group*/) {
  const int64_t n = bucket.numel;
  const double dn = static_cast<double>(n);
  const int64_t k = static_cast<int64_t>(std::ceil(density_ * dn));
  // The default mode reads no moment: its estimate rho ||v|| is the sample's s-th largest |v|
  // itself (the norm cancels), so its pass skips the sums (up to 0.3 of an add at 25M).
  OnePass pass(device, bucket, bound_, k, Listing::kEveryDevice, method_util::whole(bucket), /*sums=*/reference_);
  const Moments& m = pass.moments();
  start_step();
  if (n == 0) return method_util::nothing(device, bucket, m.nonfinite);
  const int64_t f = static_cast<int64_t>(std::ceil(0.01 * dn));
  const uint64_t stream = rng_stream(seed_, RngTag::kDgc, static_cast<uint64_t>(step_), kSharedLane);
  const int64_t s = static_cast<int64_t>(std::ceil(static_cast<double>(f) * density_));
  // The s-th largest of the sample's |v|: in the default mode from the hashed 1% sample (its
  // candidates hashed, no draws), unless it holds fewer than s elements; in the reference mode,
  // and in that case, from f distinct draws.
  std::optional<double> kth = reference_ ? std::nullopt : pass.kth_hashed(stream, s);
  if (!kth) {
    sample_distinct_bits(stream, f, n, sampled_);
    kth = pass.kth_sampled(sampled_, f, s);
  }
  if (!reference_) {
    // A zero vector selects nothing: where the sample's s-th is 0, whether any |v| > 0.
    if (!(*kth > 0.0) && pass.counts({0.0}, /*strict=*/true)[0] == 0)
      return method_util::nothing(device, bucket, m.nonfinite);
    return finish(pass, control_.threshold(pass, *kth, k), m.nonfinite);
  }
  const double norm = std::sqrt(m.sum_sq);
  if (!(norm > 0.0)) return method_util::nothing(device, bucket, m.nonfinite);
  threshold_ = *kth / norm * norm;  // rho ||v||, rho the s-th largest of the sample's |v| / ||v||
  Selection out = pass.select(threshold_, true, false);
  if (static_cast<double>(out.count) > 4.0 * k / 3.0) {
    double kth;
    out = method_util::largest_of_message(device, bucket, out, k, kth);
  }
  device.zero_at(bucket, out.view(bucket));
  out.nonfinite = m.nonfinite;
  bound_.learn(pass);
  return out;
}

void DGC::observe(const BucketView& bucket, const ExchangeResult& result) {
  EstimatingMethod::observe(bucket, result);
  ++step_;
}

MethodState DGC::state() const {
  MethodState state = EstimatingMethod::state();
  state["step"] = static_cast<double>(step_);
  return state;
}

void DGC::load_state(const MethodState& state) {
  const int64_t step = state.count("step") ? saved_count(state, "step") : step_;  // checked before anything loads
  EstimatingMethod::load_state(state);
  step_ = step;
}

}  // namespace gradsparse
