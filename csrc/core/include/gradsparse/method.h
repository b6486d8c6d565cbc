// Selection methods: small per-bucket state machines that pick which elements of the
// error-feedback-corrected gradient a rank sends (ALGORITHMS.md). One instance per bucket.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/exchange.h"

namespace gradsparse {

/// Named numbers that make up a method's state in a checkpoint.
using MethodState = std::map<std::string, double>;

class Method {
 public:
  virtual ~Method() = default;
  virtual std::string name() const = 0;

  /// Fused error feedback + selection for one bucket (kernels.h semantics).
  virtual Selection select(Device& device, const BucketView& bucket) = 0;

  /// Called after a completed exchange with every rank's control word (counts), so that adaptive
  /// methods can steer their next threshold from global information. Default: nothing.
  virtual void observe(const BucketView& /*bucket*/, const std::vector<ControlWord>& /*control*/) {}

  /// The threshold used by the last selection, or NaN for methods without one.
  virtual double threshold() const { return std::numeric_limits<double>::quiet_NaN(); }

  /// Checkpointable state; load_state() accepts what state() returned.
  virtual MethodState state() const { return {}; }
  virtual void load_state(const MethodState& /*state*/) {}
};

/// Number of elements a density asks for: floor(density * n), at least 1 when n > 0
/// (ALGORITHMS.md, project decision 4), at most n.
int64_t target_count(double density, int64_t n);

/// Exact top-k by magnitude, k = target_count(density, n) (ALGORITHMS.md section 6, "Top-k").
class TopK final : public Method {
 public:
  explicit TopK(double density);
  std::string name() const override { return "topk"; }
  Selection select(Device& device, const BucketView& bucket) override;
  double density() const { return density_; }

 private:
  double density_;
};

/// Hard threshold: every element with |a| >= threshold (ALGORITHMS.md section 6, "Hard threshold").
class Threshold final : public Method {
 public:
  explicit Threshold(double threshold);
  std::string name() const override { return "threshold"; }
  Selection select(Device& device, const BucketView& bucket) override;
  double threshold() const override { return threshold_; }
  MethodState state() const override { return {{"threshold", threshold_}}; }
  void load_state(const MethodState& state) override;

 private:
  double threshold_;
};

}  // namespace gradsparse
