// Top-k (docs/method-spec.md 4.1): the exact k largest magnitudes of the selection values.
#include "gradsparse/methods.h"
#include "method_util.h"

namespace gradsparse {

TopK::TopK(double density, const std::string& exchange)
    : PerRankMethod("TopK", exchange, fixed_gather()), density_(density) {
  method_util::check_density("TopK", density);
}

Selection TopK::select(Device& device, const BucketView& bucket, Collective& /*group*/) {
  OnePass pass(device, bucket, bound_, target_count(density_, bucket.numel), Listing::kHostMemory, {0, -1},
               /*sums=*/false);
  Selection s = pass.largest(target_count(density_, bucket.numel));
  s.nonfinite = pass.moments().nonfinite;
  bound_.learn(pass);
  return s;
}

}  // namespace gradsparse
