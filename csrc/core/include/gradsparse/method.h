// Selection methods: small per-bucket state machines that pick which elements of the
// error-feedback-corrected gradient a rank sends (docs/method-spec.md), and name the exchange
// their selections go through. One instance per bucket. A step is select(), the exchange's
// run(), then observe() (reduce_bucket.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gradsparse/common.h"
#include "gradsparse/device.h"
#include "gradsparse/estimators.h"
#include "gradsparse/exchange.h"

namespace gradsparse {

/// Named numbers that make up a method's state in a checkpoint.
using MethodState = std::map<std::string, double>;

/// A whole number of `state` (a step, a count, a size) from `least` up: a missing, fractional,
/// out-of-range or NaN entry (a damaged or hand-made checkpoint) is a ValueError naming it, where
/// it would index outside the method's tables.
inline int64_t saved_count(const MethodState& state, const std::string& key, int64_t least = 0) {
  const auto it = state.find(key);
  GS_CHECK(it != state.end(), ValueError, "method state: no '", key, "' entry; load a state the method saved");
  const double v = it->second;
  GS_CHECK(v >= static_cast<double>(least) && v <= 9.0e15 && v == std::floor(v), ValueError, "method state: '", key,
           "' is ", v, ", not a whole number from ", least, "; load a state the method saved");
  return static_cast<int64_t>(v);
}

/// The number `key` of `state`: a missing entry (a truncated checkpoint, or another method's
/// state) is a ValueError naming it, not std::map::at's out_of_range ("map::at", which named
/// nothing).
inline double saved_value(const MethodState& state, const std::string& key) {
  const auto it = state.find(key);
  GS_CHECK(it != state.end(), ValueError, "method state: no '", key, "' entry; load a state the method saved");
  return it->second;
}

/// What a method may ask of the group while it selects: every rank calls the same sequence.
class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  /// In-place sum over all ranks; every rank passes the same number of values.
  virtual void sum(std::vector<double>& values) = 0;
  /// Every rank's `bytes` bytes at `mine`, by rank, into `all` (size() * bytes); every rank
  /// passes the same `bytes`.
  virtual void allgather(const void* mine, void* all, size_t bytes) = 0;
  /// Whether the exchange that follows this selection reads Selection::agreed
  /// (Exchange::takes_agreed_words): only then does a method agree the control words while it
  /// selects. The same on every rank.
  virtual bool exchange_takes_agreed_words() const = 0;
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
  /// the error-feedback update (device passes with `update`); the residual entries are zeroed
  /// when the exchange's selections zero them (Exchange::selection_zeroes).
  virtual Selection select(Device& device, const BucketView& bucket, Collective& group) = 0;

  /// The exchange this method's selections go through (exchange.h).
  virtual const Exchange& exchange() const { return gather_and_add(); }

  /// The exchange of the steps to come, by option value, for the methods whose `exchange` option
  /// offers "auto" (which times two exchanges on the first steps; a switch between two steps
  /// changes nothing else). ValueError for the others, and for a value outside the choices.
  virtual void set_exchange(const std::string& value) {
    throw ValueError(str(name(), ": its exchange is fixed; set_exchange(\"", value,
                         "\") applies to the methods whose "
                         "exchange option offers \"auto\""));
  }

  /// Called after a completed exchange with every rank's control word: adaptive methods commit
  /// the state of the step here, so that an aborted step leaves no trace.
  virtual void observe(const BucketView& /*bucket*/, const ExchangeResult& /*result*/) {}

  /// Figures of the last step.
  virtual MethodReport report() const { return {}; }

  /// Checkpointable state; load_state() accepts what state() returned.
  virtual MethodState state() const { return {}; }
  virtual void load_state(const MethodState& /*state*/) {}

  /// Loss scaling: the gradients of the steps to come are `factor` times those of the steps
  /// before (a torch.amp.GradScaler changed its scale). The numbers the method carries from step
  /// to step in gradient units (thresholds, estimates) and its fixed magnitudes (Threshold's, the
  /// initial threshold 1/(2 sqrt(k)), the edges of MiCRO's and ExDyna's sampling histogram)
  /// follow, so that with power-of-two factors the method selects what it would select without
  /// loss scaling. `factor` is a positive finite number (ValueError otherwise).
  void rescale(double factor) {
    GS_CHECK(factor > 0.0 && std::isfinite(factor), ValueError, name(), ": rescale factor must be a positive finite ",
             "number, got ", factor, "; pass the new loss scale divided by the old one");
    // The loss scale it leaves must be one too: an Inf or 0 (1e200 twice) was held in the state,
    // which load_state() then refused. Refused before anything changes.
    const double scale = loss_scale_ * factor;
    GS_CHECK(scale > 0.0 && std::isfinite(scale), ValueError, name(), ": rescale factor ", factor,
             " takes the loss scale from ", loss_scale_, " to ", scale, ", not a positive finite number; pass the new ",
             "loss scale divided by the old one");
    loss_scale_ = scale;
    rescale_state(factor);
  }

 protected:
  /// What rescale() changes besides loss_scale_: the numbers carried in gradient units.
  virtual void rescale_state(double /*factor*/) {}
  /// "loss_scale" in `state`, where it is not 1 (the methods whose fixed magnitudes follow it).
  void save_loss_scale(MethodState& state) const {
    if (loss_scale_ != 1.0) state["loss_scale"] = loss_scale_;
  }
  /// A state's "loss_scale" (1 where absent), checked; load_state() assigns it with the rest.
  static double saved_loss_scale(const MethodState& state) {
    const auto it = state.find("loss_scale");
    const double scale = it == state.end() ? 1.0 : it->second;
    GS_CHECK(scale > 0.0 && std::isfinite(scale), ValueError, "method state: 'loss_scale' is ", scale,
             ", not a positive finite number; load a state the method saved");
    return scale;
  }

  /// The factor of the loss scale the gradients carry (the product of every rescale() factor):
  /// the fixed magnitudes apply to gradients divided by it.
  double loss_scale_ = 1.0;
};

}  // namespace gradsparse
