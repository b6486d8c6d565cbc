// Random-k (docs/method-spec.md 4.3) and the selection shared by the methods that draw their
// indices alike on every rank.
#include "gradsparse/methods.h"
#include "gradsparse/rng.h"
#include "method_util.h"

namespace gradsparse {

SharedDraw::SharedDraw(const char* owner, double density, uint64_t seed) : density_(density), seed_(seed) {
  method_util::check_density(owner, density);
}

Selection SharedDraw::select(Device& device, const BucketView& bucket, Collective& /*group*/) {
  const int64_t nonfinite = method_util::update_pass(device, bucket);
  const std::vector<int64_t> at = positions(bucket.numel);
  Selection s = device.gather(bucket, at);
  s.index_digest = index_digest(at.data(), at.size());
  device.zero_at(bucket, s.view(bucket));
  s.nonfinite = nonfinite;
  return s;
}

std::vector<int64_t> RandomK::positions(int64_t n) const {
  const uint64_t stream = rng_stream(seed_, RngTag::kRandomK, static_cast<uint64_t>(step_), kSharedLane);
  return sample_distinct(stream, target_count(density_, n), n);
}

}  // namespace gradsparse
