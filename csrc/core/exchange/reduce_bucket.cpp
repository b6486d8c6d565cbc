#include "gradsparse/reduce_bucket.h"

#include <chrono>
#include <cmath>
#include <new>
#include <stdexcept>

namespace gradsparse {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::vector<int64_t> counts_of(const ExchangeResult& result) {
  std::vector<int64_t> counts;
  for (const ControlWord& w : result.control) counts.push_back(w.count);
  return counts;
}

std::string join(const std::vector<int>& v) {
  std::string s;
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s;
}

/// A method's all-reduces, through the transport, on float64 buffers of the bucket's device.
class TransportCollective final : public Collective {
 public:
  TransportCollective(Transport& transport, Device& device, const Exchange& exchange)
      : transport_(transport), device_(device), exchange_(exchange) {}
  int rank() const override { return transport_.rank(); }
  int size() const override { return transport_.size(); }
  void sum(std::vector<double>& values) override { allreduce_host(transport_, device_, values); }
  void allgather(const void* mine, void* all, size_t bytes) override {
    allgather_host(transport_, device_, mine, all, bytes);
  }
  bool exchange_takes_agreed_words() const override { return exchange_.takes_agreed_words(); }

 private:
  Transport& transport_;
  Device& device_;
  const Exchange& exchange_;
};

/// Applies the non-finite policy after an aborted exchange (the residual is already restored).
/// Every abort comes before the exchange writes the output, so "raise" leaves the bucket's
/// gradient as it was and "skip" zeroes it.
ReduceReport abort_step(const ExchangeResult& result, const ReduceOptions& options, const BucketView& bucket,
                        Device& device, ReduceReport report) {
  if (options.nonfinite == NonFinitePolicy::kRaise) {
    const std::string fix =
        " Use float32 buckets or a lower loss scale (a GradScaler with nonfinite=\"propagate\" lowers it by itself), "
        "or";
    std::string what;
    if (result.overflowed > 0) {  // the same sums on every rank
      what =
          str(": the float16 sum of every rank's residual + gradient / P (all finite) overflowed: the transport's "
              "all-reduce, rounding each partial sum to float16, carried ",
              result.overflowed,
              " sum(s) past float16's largest value (65504), so no rank applied this step. The residuals keep "
              "residual + gradient.",
              fix);
    } else {
      // Each rank's count: NaN/Inf in residual + gradient, or (SparDL in float16) partial sums its
      // residual cannot hold.
      const bool unheld = !result.unheld.empty();
      std::vector<int> ranks;
      int64_t total = 0;
      for (size_t r = 0; r < result.control.size(); ++r) {
        const int64_t count = unheld ? result.unheld[r] : result.control[r].nonfinite;
        if (count > 0) ranks.push_back(static_cast<int>(r));
        total += count;
      }
      what = str(": rank(s) ", join(ranks),
                 unheld ? str(" would keep ", total,
                              " partial sum(s) of several ranks' gradients past float16's largest value (65504) in "
                              "their residuals, so no rank applied this step. The residuals keep residual + gradient.",
                              fix)
                        : str(" saw ", total,
                              " NaN/Inf values in residual + gradient, so no rank applied this step. The residuals "
                              "keep every finite value. Fix the source (lower the learning rate, clip gradients, "
                              "check the loss and the loss scale), or"));
    }
    throw NonFiniteError(str(options.bucket_name, " (", bucket.numel, " elements of ", dtype_name(bucket.dtype), ")",
                             what, " construct the state with nonfinite=\"skip\" to skip such steps."));
  }
  clear_output(device, bucket);
  report.skipped = true;
  return report;
}

/// Runs an exchange. An allocation that fails inside it (a size no buffer can hold, or memory
/// running out) leaves this rank out of step with the others, like a corrupt message: it is
/// reported as one, so that the engine stops instead of going on to the next bucket.
template <typename Run>
ExchangeResult guarded(const ReduceOptions& options, const BucketView& bucket, Run&& run) {
  auto failed = [&](const std::exception& e) {
    return CorruptMessageError(str(options.bucket_name, " (", bucket.numel,
                                   " elements): an allocation failed during the exchange (", e.what(),
                                   "), so this rank can no longer follow the other ranks' collectives. Check that "
                                   "every rank runs the same gradsparse version and that the device has free memory."));
  };
  try {
    return run();
  } catch (const std::bad_alloc& e) {
    throw failed(e);
  } catch (const std::length_error& e) {
    throw failed(e);
  }
}

}  // namespace

ReduceReport reduce_bucket(Method* method, Transport& transport, Device& device, const BucketView& given,
                           const ReduceOptions& options) {
  GS_CHECK(given.numel >= 0, ValueError, options.bucket_name, ": numel must be >= 0, got ", given.numel);
  GS_CHECK(given.grad != nullptr || given.numel == 0, ValueError, options.bucket_name, ": gradient is null");
  BucketView bucket = given;
  bucket.momentum = options.momentum;
  bucket.momentum_masking = options.momentum_masking;
  ReduceReport report;
  report.numel = bucket.numel;
  const Traffic before = transport.traffic();
  auto t0 = std::chrono::steady_clock::now();

  if (options.dense || method == nullptr) {
    report.dense = true;
    report.exchange = "dense all-reduce";
    if (method != nullptr) {
      // A warm-up step of a sparse method applies the state's non-finite policy, as its sparse
      // steps do (a bucket without a method passes NaN on, as DDP does): every rank's count of
      // NaN/Inf in its gradient, before the velocity moves or anything is sent.
      BucketView gradient = bucket;
      gradient.residual = gradient.velocity = nullptr;
      // A scan without sums, range or list: the count alone.
      report.nonfinite =
          gradient.numel > 0 ? device.scan(gradient, false, Range{}, HUGE_VAL, 0, false).moments.nonfinite : 0;
      ExchangeResult counts;
      for (int64_t count :
           allgather_counts(transport, device, {report.nonfinite}, count_bytes(static_cast<uint64_t>(bucket.numel)))) {
        counts.control.emplace_back().nonfinite = count;
      }
      if (!counts.nonfinite_ranks().empty()) {
        report.traffic = transport.traffic() - before;
        return abort_step(counts, options, bucket, device, report);
      }
    }
    if (bucket.velocity != nullptr) device.momentum(bucket);
    t0 = std::chrono::steady_clock::now();
    dense_allreduce(transport, device, bucket);
    report.exchange_seconds = seconds_since(t0);
    report.selected = report.selected_all = report.union_size = bucket.numel;
    report.traffic = transport.traffic() - before;
    return report;
  }

  // A sparse step fuses momentum correction into the method's first pass (the update), which
  // needs the residual.
  GS_CHECK(bucket.velocity == nullptr || bucket.residual != nullptr, ValueError, options.bucket_name,
           ": momentum correction needs the error-feedback residual on sparse steps; pass a residual or no velocity");
  const Exchange& exchange = options.shard_only ? method->exchange().for_shard() : method->exchange();
  exchange.check(bucket, transport.size());
  TransportCollective group(transport, device, exchange);
  report.exchange = exchange.name();
  Selection selection = method->select(device, bucket, group);
  report.select_seconds = seconds_since(t0);
  report.nonfinite = selection.nonfinite;
  // Where the step does not complete, this rank's residual gets back what its selection zeroed
  // (exactly: the values are added to zeros); the other exchanges left the residual alone.
  auto restore_residual = [&] {
    if (bucket.residual != nullptr && selection.count > 0 && exchange.selection_zeroes())
      device.scatter_add(selection.view(bucket), bucket.residual, 1.0f);
  };

  // What the step takes from the residual: the selection where it zeroed it (the exchanges that
  // take back what no owner kept write back the selection's own values), else what the exchange
  // records before it rewrites the residual.
  const bool keep_taken = options.keep_taken && bucket.residual != nullptr;
  Selection taken;
  BucketView view = bucket;
  if (keep_taken && !exchange.selection_zeroes()) view.taken = &taken;

  t0 = std::chrono::steady_clock::now();
  const ExchangeResult result = [&] {
    try {
      return guarded(options, bucket, [&] { return exchange.run(transport, device, view, selection); });
    } catch (...) {  // a refusal or a failure: the selection reached no one this rank can count on
      restore_residual();
      throw;
    }
  }();
  report.exchange_seconds = seconds_since(t0);
  report.traffic = transport.traffic() - before;
  report.selected = result.control[static_cast<size_t>(transport.rank())].count;
  report.selected_all = result.total_count();
  report.counts = counts_of(result);
  report.union_size = result.union_size;

  if (result.aborted) {
    restore_residual();
    return abort_step(result, options, bucket, device, report);
  }
  if (keep_taken)
    report.taken =
        std::make_shared<const Selection>(exchange.selection_zeroes() ? std::move(selection) : std::move(taken));
  method->observe(bucket, result);
  const MethodReport figures = method->report();
  report.threshold = figures.threshold;
  report.imbalance = figures.imbalance;
  return report;
}

}  // namespace gradsparse
