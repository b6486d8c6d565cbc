// Gaussian-k (docs/method-spec.md 4.4): a normal fit of the values gives a first threshold, then
// a few rescalings steer the count towards k. The counts come from the step's one pass
// (gradsparse/one_pass.h).
#include <cmath>

#include "gradsparse/methods.h"
#include "method_util.h"

namespace gradsparse {

GaussianK::GaussianK(double density, const std::string& variant, const std::string& exchange, bool reference)
    : EstimatingMethod("GaussianK", exchange, reference), density_(density) {
  method_util::check_density("GaussianK", density);
  if (variant == "spardl") {
    variant_ = Variant::kSparDL;
  } else if (variant == "sidco") {
    variant_ = Variant::kSIDCo;
  } else {
    throw ValueError(str("GaussianK: variant must be \"spardl\" or \"sidco\", got \"", variant, "\""));
  }
}

Selection GaussianK::select(Device& device, const BucketView& bucket, Collective& /*group*/) {
  const int64_t n = bucket.numel;
  const int64_t k = target_count(density_, n);
  OnePass pass(device, bucket, bound_, k);
  const Moments& m = pass.moments();
  start_step();
  if (n == 0) return method_util::nothing(device, bucket, m.nonfinite);
  const double z = normal_quantile(1.0 - density_ / 2.0);
  // Default mode: the fit is the density control's estimate, which must be a positive number to be
  // steered. Where it is not (one element: no variance, NaN, so nothing would ever be selected;
  // spardl's μ + z σ below zero where the values lie mostly far below zero, so everything would
  // be), the control starts from the mean magnitude. A zero vector still selects nothing.
  auto steered = [&](double estimate) {
    if (!(estimate > 0.0 && std::isfinite(estimate)) && m.sum_abs > 0.0) estimate = m.sum_abs / static_cast<double>(n);
    return finish(pass, control_.threshold(pass, estimate, k), m.nonfinite);
  };

  if (variant_ == Variant::kSparDL) {
    const double mean = m.sum / static_cast<double>(n);
    const double start = mean + z * std::sqrt(unbiased_variance(static_cast<double>(n), m.sum, m.sum_sq));
    if (!reference_) return steered(start);
    // thresholds[0] = start, [1..20] = start / 1.02^i, [21..40] = start * 1.02^i (repeated steps).
    std::vector<double> thresholds{start};
    for (double t = start, i = 0; i < 20; ++i) thresholds.push_back(t /= 1.02);
    for (double t = start, i = 0; i < 20; ++i) thresholds.push_back(t *= 1.02);
    OnePass::Counts counts = pass.counts(thresholds, true);
    const int64_t low = 3 * k / 4, high = 5 * k / 4;
    size_t at = 0;
    if (counts[0] < low) {
      for (size_t i = 1; i <= 20 && counts[at] < low; ++i) at = i;
    } else if (counts[0] > high) {
      for (size_t i = 21; i <= 40 && counts[at] > high; ++i) at = i;
    }
    threshold_ = thresholds[at];
  } else {
    const double norm = std::sqrt(m.sum_sq);
    if (!(norm > 0.0)) return method_util::nothing(device, bucket, m.nonfinite);
    const double dn = static_cast<double>(n);
    const double mean = m.sum_abs / (dn * norm);
    const double var = unbiased_variance(dn, m.sum_abs / norm, m.sum_sq / (norm * norm));
    const double start = mean + z * std::sqrt(var);
    if (!reference_) return steered(start * norm);
    // The at most three evaluations form a binary tree of rescalings (x0.5 down, x1.5 up).
    std::vector<double> rho{start};
    for (size_t i = 0; i < 3; ++i) {
      rho.push_back(rho[i] * 0.5);
      rho.push_back(rho[i] * 1.5);
    }
    std::vector<double> thresholds(rho.size());
    for (size_t i = 0; i < rho.size(); ++i) thresholds[i] = rho[i] * norm;
    OnePass::Counts counts = pass.counts(thresholds, true);
    size_t node = 0;
    for (int evaluation = 0; evaluation < 3; ++evaluation) {
      const double c = static_cast<double>(counts[node]);
      size_t next;
      if (c < 2.0 * k / 3.0) {
        next = 2 * node + 1;
      } else if (c > 4.0 * k / 3.0) {
        next = 2 * node + 2;
      } else {
        break;
      }
      if (evaluation == 2) break;  // the third rescale is never used
      node = next;
    }
    threshold_ = thresholds[node];
  }
  return finish(pass, threshold_, m.nonfinite);
}

}  // namespace gradsparse
