// SIDCo (docs/method-spec.md 4.10): thresholds from statistical fits of x = |v| / ||v||, refined
// over stages on the exceedances of the previous stage; optionally an adaptive stage count.
#include <algorithm>
#include <cmath>

#include "gradsparse/methods.h"
#include "method_util.h"

namespace gradsparse {

namespace {
/// The default mode's statistics beyond the fused pass's moments (the exceedances of every later
/// stage, gamma's sum of logs) read at least this many blocks of kCpuBlock elements, spread over
/// the bucket (BlockSample), instead of the whole bucket: 0.5M elements estimate a mean, variance
/// or mean log well enough for the density control that follows, and a bucket of 25M elements is
/// then read once, not two or three times. 64 blocks (2.3M elements at 25M, read twice for
/// gamma_gpareto) cost 1.1 ms a step there, 16 blocks 0.2 ms (docs/benchmarks.md, 2026-12-03).
/// The reference mode reads everything.
constexpr int64_t kSampleBlocks = 16;

SidcoFit parse_fit(const std::string& fit) {
  if (fit == "exp") return SidcoFit::kExp;
  if (fit == "gpareto") return SidcoFit::kGPareto;
  if (fit == "gamma_gpareto") return SidcoFit::kGammaGPareto;
  throw ValueError(str("SIDCo: fit must be \"exp\", \"gpareto\" or \"gamma_gpareto\", got \"", fit, "\""));
}
}  // namespace

SIDCo::SIDCo(double density, const std::string& fit, int stages, double first_ratio, std::optional<double> iratio,
             const std::string& exchange, bool reference)
    : EstimatingMethod("SIDCo", exchange, reference),
      density_(density),
      fit_(parse_fit(fit)),
      stages_(stages),
      first_ratio_(first_ratio) {
  method_util::check_density("SIDCo", density);
  GS_CHECK(stages >= -3, ValueError, "SIDCo: stages must be >= 1 (fixed), 0 (fixed per-stage ratio) or -1, -2, -3 ",
           "(adaptive), got ", stages);
  GS_CHECK(first_ratio > 0.0 && first_ratio < 1.0, ValueError, "SIDCo: first_ratio must be in (0, 1), got ",
           first_ratio);
  iratio_ = iratio ? *iratio : (fit_ == SidcoFit::kExp ? 0.2 : 0.075);
  GS_CHECK(iratio_ > 0.0 && iratio_ < 1.0, ValueError, "SIDCo: iratio must be in (0, 1), got ", iratio_);
  if (stages < 0) adaptive_.emplace(stages, density);
}

double SIDCo::stage_threshold(double mean, double variance, double mean_log, double ratio, bool first) const {
  if (fit_ == SidcoFit::kExp) return exp_threshold(mean, ratio);
  if (fit_ == SidcoFit::kGammaGPareto && first) return gamma_threshold(mean, mean_log, ratio);
  return gpareto_threshold(mean, variance, ratio);
}

Selection SIDCo::select(Device& device, const BucketView& bucket, Collective& /*group*/) {
  const int64_t n = bucket.numel;
  const int64_t k = target_count(density_, n);
  OnePass pass(device, bucket, bound_, k);
  const Moments& m = pass.moments();
  const double norm = std::sqrt(m.sum_sq);
  numel_ = n;
  selected_ = 0;
  start_step();
  if (n == 0 || !(norm > 0.0)) return method_util::nothing(device, bucket, m.nonfinite);
  const double dn = static_cast<double>(n);
  const int stages = this->stages();
  const BlockSample sample = reference_ ? BlockSample{} : BlockSample::at_least(n, kSampleBlocks);

  // Stage 1 on the whole vector.
  const double first = (stages == 1 || density_ >= first_ratio_) ? density_ : first_ratio_;
  const double mean = m.sum_abs / (dn * norm);
  const double variance = unbiased_variance(dn, m.sum_abs / norm, m.sum_sq / (norm * norm));
  const double mean_log = fit_ == SidcoFit::kGammaGPareto ? pass.log_sum(1.0 / norm, std::ldexp(1.0, -52), sample) /
                                                                static_cast<double>(sample.size(n))
                                                          : std::numeric_limits<double>::quiet_NaN();
  double eta = stage_threshold(mean, variance, mean_log, first, true);

  // Further stages on the exceedances (x above every threshold so far).
  if (stages > 1 || stages == 0) {
    const double remaining = density_ / first_ratio_;
    double ratio;
    int loops;
    if (stages > 1) {
      ratio = std::pow(remaining, 1.0 / (stages - 1));
      loops = stages - 1;
    } else {
      ratio = iratio_;
      loops = static_cast<int>(std::ceil(std::log(remaining) / std::log(ratio)));
    }
    double floor_eta = eta;
    for (int i = loops; i > 0; --i) {
      const double stage_ratio = (i == 1 && stages == 0) ? remaining / std::pow(ratio, loops - 1) : ratio;
      const Exceedance e = pass.exceedance(floor_eta * norm, /*strict=*/true, 1.0 / norm, sample);
      if (e.count == 0) break;
      const double c = static_cast<double>(e.count);
      const double shifted_mean = e.sum / c - e.min;
      eta = e.min + (fit_ == SidcoFit::kExp
                         ? -shifted_mean * std::log(stage_ratio)
                         : gpareto_threshold(shifted_mean, unbiased_variance(c, e.sum, e.sum_sq), stage_ratio));
      floor_eta = std::max(floor_eta, eta);
    }
  }
  if (reference_) {
    Selection s = finish(pass, eta * norm, m.nonfinite);
    selected_ = s.count;
    return s;
  }
  // The density control steers a positive estimate. Above the first ratio the later stages lower
  // the threshold (their ratio exceeds 1), at densities near 1 below zero, where the control would
  // take it as the threshold and select every element at every step: the estimate is then the
  // mean magnitude, as for Gaussian-k's fits.
  double estimate = eta * norm;
  if (!(estimate > 0.0 && std::isfinite(estimate))) estimate = m.sum_abs / dn;
  Selection s = finish(pass, control_.threshold(pass, estimate, k), m.nonfinite);
  selected_ = s.count;
  return s;
}

void SIDCo::observe(const BucketView& bucket, const ExchangeResult& result) {
  EstimatingMethod::observe(bucket, result);
  if (adaptive_ && numel_ > 0)
    adaptive_->record(static_cast<double>(selected_) / (density_ * static_cast<double>(numel_)));
}

MethodState SIDCo::state() const {
  MethodState state = EstimatingMethod::state();
  if (adaptive_) {
    state["stages"] = adaptive_->stages_;
    state["direction"] = adaptive_->direction_;
    state["sum"] = adaptive_->sum_;
    state["calls"] = adaptive_->calls_;
    state["last_estimate"] = adaptive_->last_estimate_;
  }
  return state;
}

void SIDCo::load_state(const MethodState& state) {
  if (!adaptive_) {
    EstimatingMethod::load_state(state);
    return;
  }
  // Checked before anything loads. The direction is +1 or -1 (0 froze the stage count for good:
  // every later change was 0 x the direction); the calls since the last change are 0 to 4 (the
  // fifth applies the rule and starts again).
  const int64_t stages = std::min<int64_t>(saved_count(state, "stages", 1), adaptive_->max_stages());
  const auto direction = state.find("direction");
  GS_CHECK(direction != state.end(), ValueError, "method state: no 'direction' entry; load a state the method saved");
  GS_CHECK(direction->second == 1.0 || direction->second == -1.0, ValueError, "method state: 'direction' is ",
           direction->second, ", not 1 or -1; load a state the method saved");
  const int64_t calls = saved_count(state, "calls");
  GS_CHECK(calls <= 4, ValueError, "method state: 'calls' is ", calls, ", not a whole number from 0 to 4; load a ",
           "state the method saved");
  const double sum = saved_value(state, "sum"), last_estimate = saved_value(state, "last_estimate");
  EstimatingMethod::load_state(state);
  adaptive_->stages_ = static_cast<int>(stages);
  adaptive_->direction_ = static_cast<int>(direction->second);
  adaptive_->sum_ = sum;
  adaptive_->calls_ = static_cast<int>(calls);
  adaptive_->last_estimate_ = last_estimate;
}

}  // namespace gradsparse
