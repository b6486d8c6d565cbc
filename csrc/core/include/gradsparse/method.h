// Selection methods: small per-bucket state machines that pick which elements of the
// error-feedback-corrected gradient a rank sends (docs/method-spec.md). One instance per bucket.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/estimators.h"
#include "gradsparse/exchange.h"

namespace gradsparse {

/// Named numbers that make up a method's state in a checkpoint.
using MethodState = std::map<std::string, double>;

/// What a method may ask of the group while it selects: every rank calls the same sequence.
class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// In-place sum over all ranks; every rank passes the same number of values.
  virtual void sum(std::vector<double>& values) = 0;
};

/// The outcome of one step, as reported in statistics.
struct MethodReport {
  double threshold = std::numeric_limits<double>::quiet_NaN();  ///< NaN for methods without one
  double imbalance = std::numeric_limits<double>::quiet_NaN();  ///< partitioned methods only
};

class Method {
 public:
  virtual ~Method() = default;
  virtual std::string name() const = 0;

  /// This rank's selection for one step of the bucket. The first pass over the bucket applies
  /// the error-feedback update (device passes with `update`); the residual entries are zeroed as
  /// the exchange requires (not at all for the union exchange, which zeroes the union).
  virtual Selection select(Device& device, const BucketView& bucket, Collective& group) = 0;

  /// The exchange this method's selections go through.
  virtual ExchangeKind exchange() const { return ExchangeKind::kGather; }

  /// When every rank always selects the same known number of pairs for a bucket of `numel`
  /// elements (Top-k), the gather exchange skips its control words: one fixed-size all-gather,
  /// with no count to wait for (no device-to-host synchronisation before the data moves).
  virtual std::optional<int64_t> fixed_count(int64_t /*numel*/) const { return std::nullopt; }

  /// Methods whose selection is part of their own communication schedule (SparDL) run the whole
  /// step in run(): error feedback, selection, exchange, the averaged bucket and the residual.
  /// Before any data moves they agree on aborting, like exchange() does; an aborted step leaves
  /// the residual holding residual + gradient wherever that is finite.
  virtual bool runs_exchange() const { return false; }
  virtual ExchangeResult run(Transport& /*transport*/, Device& /*device*/, const BucketView& /*bucket*/) {
    throw std::logic_error(str(name(), " does not run its own exchange"));
  }

  /// Called after a completed exchange with every rank's control word: adaptive methods commit
  /// the state of the step here, so that an aborted step leaves no trace.
  virtual void observe(const BucketView& /*bucket*/, const ExchangeResult& /*result*/) {}

  /// Figures of the last step.
  virtual MethodReport report() const { return {}; }

  /// Checkpointable state; load_state() accepts what state() returned.
  virtual MethodState state() const { return {}; }
  virtual void load_state(const MethodState& /*state*/) {}
};

}  // namespace gradsparse
