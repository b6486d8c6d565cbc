// Random-k (docs/method-spec.md 4.3): the same k random indices on every rank.
#include "gradsparse/methods.h"
#include "gradsparse/rng.h"
#include "method_util.h"

namespace gradsparse {

RandomK::RandomK(double density, uint64_t seed) : density_(density), seed_(seed) {
  method_util::check_density("RandomK", density);
}

Selection RandomK::select(Device& device, const BucketView& bucket, Collective& /*group*/) {
  const int64_t nonfinite = method_util::update_pass(device, bucket);
  const uint64_t stream = rng_stream(seed_, RngTag::kRandomK, static_cast<uint64_t>(step_), kSharedLane);
  Selection s = device.gather(bucket, sample_distinct(stream, target_count(density_, bucket.numel), bucket.numel));
  device.zero_at(bucket, s.message.data(), s.bytes);
  s.nonfinite = nonfinite;
  return s;
}

void RandomK::observe(const BucketView& /*bucket*/, const ExchangeResult& /*result*/) { ++step_; }

void RandomK::load_state(const MethodState& state) {
  if (auto it = state.find("step"); it != state.end()) step_ = static_cast<int64_t>(it->second);
}

}  // namespace gradsparse
