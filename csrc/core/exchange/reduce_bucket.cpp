#include "gradsparse/reduce_bucket.h"

#include <chrono>

namespace gradsparse {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

}  // namespace

ReduceReport reduce_bucket(Method* method, Transport& transport, Device& device, const BucketView& bucket,
                           const ReduceOptions& options) {
  GS_CHECK(bucket.numel >= 0, ValueError, options.bucket_name, ": numel must be >= 0, got ", bucket.numel);
  GS_CHECK(bucket.grad != nullptr || bucket.numel == 0, ValueError, options.bucket_name, ": gradient is null");
  ReduceReport report;
  report.numel = bucket.numel;
  const Traffic before = transport.traffic();

  if (options.dense || method == nullptr) {
    report.dense = true;
    const auto t0 = std::chrono::steady_clock::now();
    dense_allreduce(transport, device, bucket);
    report.exchange_seconds = seconds_since(t0);
    report.selected = report.selected_all = bucket.numel;
    report.traffic = transport.traffic() - before;
    return report;
  }

  auto t0 = std::chrono::steady_clock::now();
  Selection selection = method->select(device, bucket);
  report.select_seconds = seconds_since(t0);
  report.selected = selection.count;
  report.nonfinite = selection.nonfinite;
  report.threshold = method->threshold();

  t0 = std::chrono::steady_clock::now();
  const ExchangeResult result = gather_add(transport, device, bucket, selection);
  report.exchange_seconds = seconds_since(t0);
  report.traffic = transport.traffic() - before;
  report.selected_all = result.total_count();

  if (result.aborted) {
    // Put this rank's selection back: selected residual entries were zeroed, so adding the sent
    // values restores them exactly.
    if (bucket.residual != nullptr && selection.count > 0) {
      device.scatter_add_message(bucket.dtype, bucket.residual, bucket.numel, selection.message.data(), selection.bytes,
                                 1.0f, transport.rank());
    }
    if (options.nonfinite == NonFinitePolicy::kRaise) {
      int64_t total = 0;
      for (const ControlWord& w : result.control) total += w.nonfinite;
      throw NonFiniteError(
          str(options.bucket_name, " (", bucket.numel, " elements of ", dtype_name(bucket.dtype), "): rank(s) ",
              join(result.nonfinite_ranks()), " saw ", total,
              " NaN/Inf values in residual + gradient, so no rank applied this step. The residuals keep every finite "
              "value. Fix the source (lower the learning rate, clip gradients, check the loss and the loss scale), or "
              "construct the state with nonfinite=\"skip\" to skip such steps."));
    }
    device.fill_zero(bucket.grad, static_cast<size_t>(bucket.numel) * dtype_size(bucket.dtype));
    report.skipped = true;
    return report;
  }
  method->observe(bucket, result.control);
  return report;
}

}  // namespace gradsparse
