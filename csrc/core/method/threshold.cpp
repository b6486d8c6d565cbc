// Hard threshold: every element with |a| >= threshold, compared in the bucket's dtype.
#include <cmath>

#include "gradsparse/method.h"

namespace gradsparse {

namespace {
void check_threshold(double threshold) {
  GS_CHECK(std::isfinite(threshold) && threshold >= 0.0, ValueError,
           "Threshold: threshold must be a finite number >= 0, got ", threshold,
           "; for example threshold=1e-3 sends every element with |value| >= 1e-3");
}
}  // namespace

Threshold::Threshold(double threshold) : threshold_(threshold) { check_threshold(threshold); }

Selection Threshold::select(Device& device, const BucketView& bucket) {
  return device.select_threshold(bucket, threshold_);
}

void Threshold::load_state(const MethodState& state) {
  const auto it = state.find("threshold");
  GS_CHECK(it != state.end(), ValueError, "Threshold.load_state: the state has no 'threshold' entry");
  check_threshold(it->second);
  threshold_ = it->second;
}

}  // namespace gradsparse
