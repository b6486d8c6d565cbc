// Hard threshold (docs/method-spec.md 4.2): |v| >= τ, compared in the bucket's dtype.
#include <cmath>

#include "gradsparse/methods.h"
#include "method_util.h"

namespace gradsparse {

Threshold::Threshold(std::optional<double> threshold, std::optional<double> density, const std::string& exchange)
    : PerRankMethod("Threshold", exchange, gather_and_add()), fixed_(threshold), density_(density) {
  GS_CHECK(threshold.has_value() != density.has_value(), ValueError,
           "Threshold: give exactly one of threshold (a magnitude) and density (then threshold = 1/(2 sqrt(k)))");
  if (threshold) {
    GS_CHECK(std::isfinite(*threshold) && *threshold >= 0.0, ValueError,
             "Threshold: threshold must be a finite number >= 0, got ", *threshold,
             "; for example threshold=1e-3 sends every element with |value| >= 1e-3");
  } else {
    method_util::check_density("Threshold", *density);
  }
}

Selection Threshold::select(Device& device, const BucketView& bucket, Collective& /*group*/) {
  threshold_ = (fixed_ ? *fixed_ : initial_threshold(target_count(*density_, bucket.numel))) * loss_scale_;
  return device.select_threshold(bucket, threshold_);
}

MethodState Threshold::state() const {
  MethodState state;
  save_loss_scale(state);
  return state;
}

void Threshold::load_state(const MethodState& state) { loss_scale_ = saved_loss_scale(state); }

}  // namespace gradsparse
