// reduce_bucket: one bucket's whole step on one rank, the unit of work the engine runs.
//   1. the method selects (fused error feedback + selection, one pass over memory);
//   2. the exchange moves every rank's pairs and writes the average into the bucket;
//   3. if any rank saw NaN/Inf, every rank applies the same policy (ALGORITHMS.md decision 5):
//      each rank puts its own selection back into its residual (so nothing of the finite gradient
//      is lost; non-finite elements kept their old residual), then either throws NonFiniteError
//      (kRaise) or writes zeros into the bucket and reports the step as skipped (kSkip).
#pragma once

#include <cstdint>
#include <limits>
#include <string>

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
};

struct ReduceReport {
  bool dense = false;
  bool skipped = false;  ///< a rank saw non-finite values and the policy is kSkip
  int64_t numel = 0;
  int64_t selected = 0;      ///< pairs this rank sent
  int64_t selected_all = 0;  ///< pairs all ranks sent together
  int64_t nonfinite = 0;     ///< non-finite elements this rank saw
  double threshold = std::numeric_limits<double>::quiet_NaN();
  Traffic traffic;  ///< bytes this rank moved in this step
  double select_seconds = 0.0;
  double exchange_seconds = 0.0;
};

ReduceReport reduce_bucket(Method* method, Transport& transport, Device& device, const BucketView& bucket,
                           const ReduceOptions& options);

}  // namespace gradsparse
