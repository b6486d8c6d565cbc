// Top-k: the exact k largest magnitudes of the error-feedback-corrected gradient.
#include <cmath>

#include "gradsparse/method.h"

namespace gradsparse {

int64_t target_count(double density, int64_t n) {
  if (n <= 0) return 0;
  const double k = std::floor(density * static_cast<double>(n));
  if (!(k >= 1.0)) return 1;
  return k >= static_cast<double>(n) ? n : static_cast<int64_t>(k);
}

TopK::TopK(double density) : density_(density) {
  GS_CHECK(std::isfinite(density) && density > 0.0 && density <= 1.0, ValueError,
           "TopK: density must be in (0, 1], got ", density, "; for example density=0.01 sends 1% of each bucket");
}

Selection TopK::select(Device& device, const BucketView& bucket) {
  return device.select_topk(bucket, target_count(density_, bucket.numel));
}

}  // namespace gradsparse
