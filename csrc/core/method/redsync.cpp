// RedSync (docs/method-spec.md 4.6, SIDCo's redsync): bisection of the threshold between the mean
// and the maximum magnitude; the at most three evaluations are counted from the step's one pass.
#include <cmath>
#include <map>

#include "gradsparse/methods.h"
#include "method_util.h"

namespace gradsparse {

RedSync::RedSync(double density, const std::string& exchange, bool reference)
    : EstimatingMethod("RedSync", exchange, reference), density_(density) {
  method_util::check_density("RedSync", density);
}

Selection RedSync::select(Device& device, const BucketView& bucket, Collective& /*group*/) {
  const int64_t n = bucket.numel;
  OnePass pass(device, bucket, bound_, target_count(density_, n));
  const Moments& m = pass.moments();
  start_step();
  if (n == 0) return method_util::nothing(device, bucket, m.nonfinite);
  const double k = static_cast<double>(target_count(density_, n));
  const double mean = m.sum_abs / static_cast<double>(n), max = m.max_abs;
  auto threshold_at = [&](double mid) { return mean + mid * (max - mean); };
  // Default mode: the bisection's first midpoint is the estimate.
  if (!reference_)
    return finish(pass, control_.threshold(pass, threshold_at(0.5), target_count(density_, n)), m.nonfinite);
  // Every midpoint the bisection can visit in three steps.
  const std::vector<double> mids{0.5, 0.25, 0.75, 0.125, 0.375, 0.625, 0.875};
  std::vector<double> thresholds;
  for (double mid : mids) thresholds.push_back(threshold_at(mid));
  OnePass::Counts counts = pass.counts(thresholds, true);
  std::map<double, size_t> at;
  for (size_t i = 0; i < mids.size(); ++i) at[mids[i]] = i;
  double lo = 0.0, hi = 1.0;
  while (hi - lo > 0.2) {
    const double mid = lo + (hi - lo) / 2.0;
    threshold_ = threshold_at(mid);
    const double c = static_cast<double>(counts[at.at(mid)]);
    if (k < c && c < 2.0 * k) break;
    if (c < k / 2.0) {
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return finish(pass, threshold_, m.nonfinite);
}

}  // namespace gradsparse
