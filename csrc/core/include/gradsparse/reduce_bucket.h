// reduce_bucket: one bucket's whole step on one rank, the unit of work the engine runs.
//   0. with a velocity (momentum correction) the gradient becomes the rank's velocity: fused into the
//      method's first pass on sparse steps (kernels.h Source), a pass of its own on dense steps;
//   1. the method selects (its first pass fuses the error-feedback update), possibly agreeing on
//      a threshold with the other ranks through small all-reduces;
//   2. the exchange the method names (exchange.h) moves every rank's selection and writes the
//      average into the bucket;
//   3. if any rank saw NaN/Inf, or a float16 exchange summed finite values past 65504 (every rank
//      learns it alike), every rank applies the same policy (docs/method-spec.md ruling 5): each
//      rank restores its residual (nothing of the finite gradient is lost; non-finite elements
//      kept their old residual), then either throws NonFiniteError (kRaise; the bucket's gradient
//      as it was) or writes zeros into the bucket and reports the step as skipped (kSkip);
//   4. otherwise the method commits the step's state (Method::observe).
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/method.h"
#include "gradsparse/transport.h"

namespace gradsparse {

enum class NonFinitePolicy { kRaise, kSkip };

struct ReduceOptions {
  /// Dense average instead of sparse (warm-up steps); the residual is not touched.
  bool dense = false;
  NonFinitePolicy nonfinite = NonFinitePolicy::kRaise;
  /// How error messages name the bucket, e.g. "bucket 3".
  std::string bucket_name = "bucket";
  /// Only this rank's shard of the result is wanted (FSDP's reduce-scatter): the bucket is P equal
  /// shards in rank order, and the method's exchange is replaced by its Exchange::for_shard() (the
  /// gather exchanges route their pairs to the shards' owners; the others run whole).
  bool shard_only = false;
  /// Momentum correction's factor (used when the bucket has a velocity).
  float momentum = 0.0f;
  /// Momentum factor masking: the velocity restarts from zero where the residual is zero, which is
  /// where the previous step emptied it (set when the previous step was sparse).
  bool momentum_masking = false;
  /// Keep what a completed sparse step took from the residual (ReduceReport::taken), so that the
  /// step can be taken back if its result is not applied (nonfinite="propagate": another bucket
  /// of the step overflowed, so the loss scaler skips the whole step).
  bool keep_taken = false;
};

struct ReduceReport {
  bool dense = false;
  bool skipped = false;  ///< a rank saw non-finite values and the policy is kSkip
  int64_t numel = 0;
  int64_t selected = 0;      ///< pairs this rank sent
  int64_t selected_all = 0;  ///< pairs all ranks sent together
  /// Pairs each rank sent (SparDL: the final list of each block, owner by owner).
  std::vector<int64_t> counts;
  int64_t union_size = 0;  ///< elements the exchange wrote (the union for union exchanges)
  int64_t nonfinite = 0;   ///< non-finite elements this rank saw
  double threshold = std::numeric_limits<double>::quiet_NaN();
  double imbalance = std::numeric_limits<double>::quiet_NaN();  ///< max count * P / total - 1
  Traffic traffic;                                              ///< bytes this rank moved in this step
  std::string exchange;  ///< the exchange that ran (exchange_name), or "dense all-reduce"
  double select_seconds = 0.0;
  double exchange_seconds = 0.0;
  /// With ReduceOptions::keep_taken, after a completed sparse step with a residual: the residual's
  /// values (residual + gradient) at every position the step rewrote, as a message for the bucket.
  /// Writing them back (out[index] = value) leaves the residual as if nothing had been sent.
  std::shared_ptr<const Selection> taken;
};

ReduceReport reduce_bucket(Method* method, Transport& transport, Device& device, const BucketView& bucket,
                           const ReduceOptions& options);

}  // namespace gradsparse
