// The selection methods of gradsparse, one implementation file each in csrc/core/method/, each
// reading like its section of docs/method-spec.md.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gradsparse/estimators.h"
#include "gradsparse/method.h"
#include "gradsparse/one_pass.h"
#include "gradsparse/partition.h"

namespace gradsparse {

/// A method that selects about k pairs on every rank. Its selections go through its gather
/// (option "gather": gather-and-add, or Top-k's fixed-size gather) or through reduce-scatter +
/// all-gather ("reduce_scatter"), whose bytes per rank do not grow with the world size. (The
/// Python option "auto" picks one of the two per bucket, and switches them between steps while
/// it times both: set_exchange.)
class PerRankMethod : public Method {
 public:
  const Exchange& exchange() const override { return exchange_.get(); }
  void set_exchange(const std::string& value) override { exchange_.set(value); }

 protected:
  PerRankMethod(const std::string& owner, const std::string& exchange, const Exchange& gather)
      : exchange_(owner, {{"gather", &gather}, {"reduce_scatter", &reduce_scatter_allgather()}}, exchange) {}

 private:
  ExchangeSetting exchange_;
};

/// A per-rank method whose threshold is a statistical estimate (Gaussian-k, DGC, RedSync, SIDCo).
/// Default mode: DensityControl steers the estimate to k elements (ruling 9); `reference`: the
/// original rule, with its own corrections, exactly.
class EstimatingMethod : public PerRankMethod {
 public:
  MethodReport report() const override { return {threshold_, std::numeric_limits<double>::quiet_NaN()}; }
  /// Commits the density control's step (an aborted step leaves it as it was).
  void observe(const BucketView& bucket, const ExchangeResult& result) override;
  MethodState state() const override;
  void load_state(const MethodState& state) override;

 protected:
  EstimatingMethod(const std::string& owner, const std::string& exchange, bool reference)
      : PerRankMethod(owner, exchange, gather_and_add()), reference_(reference) {}

  /// Where each select() starts: no threshold yet, and nothing the density control learned in a
  /// step that was aborted (it commits only in observe()).
  void start_step() {
    threshold_ = std::numeric_limits<double>::quiet_NaN();
    control_.discard();
  }
  /// Selects |v| > threshold (zeroing the residual there), records the threshold and the
  /// non-finite count, and lets the candidate bound learn from the step.
  Selection finish(OnePass& pass, double threshold, int64_t nonfinite);

  CandidateBound bound_;    ///< where the next step's one pass starts listing candidates
  DensityControl control_;  ///< default mode only
  bool reference_;
  double threshold_ = std::numeric_limits<double>::quiet_NaN();
};

/// Top-k (method-spec 4.1). Every rank selects exactly k, so its gather is the fixed-size
/// gather: one all-gather, no count to wait for (no device-to-host synchronisation before the
/// data moves).
class TopK final : public PerRankMethod {
 public:
  explicit TopK(double density, const std::string& exchange = "gather");
  std::string name() const override { return "topk"; }
  Selection select(Device& device, const BucketView& bucket, Collective& group) override;

 private:
  CandidateBound bound_;  ///< where the next step's one pass starts listing candidates
  double density_;
};

/// Hard threshold (4.2): a fixed threshold, or 1/(2 sqrt(k)) from a density.
class Threshold final : public PerRankMethod {
 public:
  Threshold(std::optional<double> threshold, std::optional<double> density, const std::string& exchange = "gather");
  explicit Threshold(double threshold) : Threshold(threshold, std::nullopt) {}
  std::string name() const override { return "threshold"; }
  Selection select(Device& device, const BucketView& bucket, Collective& group) override;
  MethodReport report() const override { return {threshold_, std::numeric_limits<double>::quiet_NaN()}; }
  /// {"loss_scale": s} once rescaled: the threshold in use is the given (or density's) one times s.
  MethodState state() const override;
  void load_state(const MethodState& state) override;

 private:
  std::optional<double> fixed_;
  std::optional<double> density_;
  double threshold_ = std::numeric_limits<double>::quiet_NaN();
};

/// A method whose indices every rank draws alike from the shared stream of its step t, so
/// only values travel (exchange "shared"): Random-k and Random-block.
class SharedDraw : public Method {
 public:
  /// Error feedback, then the values at positions() are sent and zeroed in the residual.
  Selection select(Device& device, const BucketView& bucket, Collective& group) final;
  const Exchange& exchange() const override { return shared_indices(); }
  void observe(const BucketView& /*bucket*/, const ExchangeResult& /*result*/) override { ++step_; }
  MethodState state() const override { return {{"step", static_cast<double>(step_)}}; }
  void load_state(const MethodState& state) override {
    if (state.count("step")) step_ = saved_count(state, "step");
  }

 protected:
  SharedDraw(const char* owner, double density, uint64_t seed);
  /// This step's positions in a bucket of `n` elements, ascending, the same on every rank.
  virtual std::vector<int64_t> positions(int64_t n) const = 0;
  double density_;
  uint64_t seed_;
  int64_t step_ = 0;
};

/// Random-k (4.3): the same k random indices on every rank.
class RandomK final : public SharedDraw {
 public:
  RandomK(double density, uint64_t seed) : SharedDraw("RandomK", density, seed) {}
  std::string name() const override { return "randomk"; }

 private:
  std::vector<int64_t> positions(int64_t n) const override;
};

/// Random-block (4.12): k contiguous indices (wrapping past the end of the bucket) from a random
/// start; the same block on every rank.
class RandomBlock final : public SharedDraw {
 public:
  RandomBlock(double density, uint64_t seed) : SharedDraw("RandomBlock", density, seed) {}
  std::string name() const override { return "randomblock"; }

 private:
  std::vector<int64_t> positions(int64_t n) const override;
};

/// Gaussian-k (4.4), SparDL's or SIDCo's variant.
class GaussianK final : public EstimatingMethod {
 public:
  enum class Variant { kSparDL, kSIDCo };
  GaussianK(double density, const std::string& variant, const std::string& exchange = "gather", bool reference = false);
  std::string name() const override { return "gaussiank"; }
  Selection select(Device& device, const BucketView& bucket, Collective& group) override;

 private:
  double density_;
  Variant variant_;
};

/// DGC's sampled threshold (4.5).
class DGC final : public EstimatingMethod {
 public:
  DGC(double density, uint64_t seed, const std::string& exchange = "gather", bool reference = false);
  std::string name() const override { return "dgc"; }
  Selection select(Device& device, const BucketView& bucket, Collective& group) override;
  void observe(const BucketView& bucket, const ExchangeResult& result) override;
  MethodState state() const override;
  void load_state(const MethodState& state) override;

 private:
  double density_;
  uint64_t seed_;
  int64_t step_ = 0;
  std::vector<uint64_t> sampled_;  ///< the step's sample as a bitmap (kept only to allocate once)
};

/// RedSync's bisection threshold (4.6).
class RedSync final : public EstimatingMethod {
 public:
  explicit RedSync(double density, const std::string& exchange = "gather", bool reference = false);
  std::string name() const override { return "redsync"; }
  Selection select(Device& device, const BucketView& bucket, Collective& group) override;

 private:
  double density_;
};

/// SAGE (4.7): sampled-scale threshold scaling.
class SAGE final : public Method {
 public:
  enum class Sampling { kFlat, kPerTensor };
  /// `segments`: the sizes of the bucket's parameters, in order (for per-tensor sampling).
  /// `listing`: where the default mode's one pass lists candidates for the host (one_pass.h). Where
  /// it does not (a GPU), the band's count, its top k and the selection are passes on the device.
  SAGE(double density, const std::string& sampling, std::vector<int64_t> segments, bool reference, uint64_t seed,
       std::optional<double> initial_threshold, std::optional<std::string> exchange,
       Listing listing = Listing::kHostMemory);
  std::string name() const override { return "sage"; }
  Selection select(Device& device, const BucketView& bucket, Collective& group) override;
  const Exchange& exchange() const override { return exchange_.get(); }
  void set_exchange(const std::string& value) override { exchange_.set(value); }
  void observe(const BucketView& bucket, const ExchangeResult& result) override;
  MethodReport report() const override { return {reported_, std::numeric_limits<double>::quiet_NaN()}; }
  MethodState state() const override;
  void load_state(const MethodState& state) override;

 protected:
  void rescale_state(double factor) override;

 private:
  struct Step {
    int64_t t = 0;
    double threshold = std::numeric_limits<double>::quiet_NaN();  // λ of the last step that selected
    double sample_mean = std::numeric_limits<double>::quiet_NaN();
    bool restart = false;  // its band held fewer than k: the next prediction is sampled (default mode)
    double band = BandController::band_factor(1);  // default mode: w of the next step that does not sample
  };
  std::vector<int64_t> sample_positions(int64_t n, int rank) const;
  /// The default mode's prediction from the sampled magnitudes (method-spec 4.7); `otherwise`
  /// where none of them is a positive finite number.
  static double sampled_prediction(std::vector<double> magnitudes, int64_t k, int64_t n, double otherwise);

  double density_;
  Sampling sampling_;
  std::vector<int64_t> segments_;
  bool reference_;
  uint64_t seed_;
  std::optional<double> initial_;
  ExchangeSetting exchange_;
  Listing listing_;
  CandidateBound bound_;  ///< default mode: where the next step's one pass starts listing candidates
  Step committed_;
  Step pending_;
  double reported_ = std::numeric_limits<double>::quiet_NaN();  // the last step's λ (NaN: an empty bucket)
};

/// MiCRO (4.8) and ExDyna (4.9): exclusive selection in rotating partitions with one global
/// threshold. The two differ only in how the partitions are laid out.
class PartitionedMethod : public Method {
 public:
  /// `listing`: where the default mode lists its band's candidates for the host (one_pass.h). Where
  /// it does not (a GPU), the band's counts and the selection are passes on the device.
  PartitionedMethod(double density, const std::string& exchange, bool reference, uint64_t seed,
                    Listing listing = Listing::kHostMemory);
  Selection select(Device& device, const BucketView& bucket, Collective& group) override;
  const Exchange& exchange() const override { return *exchange_; }
  void observe(const BucketView& bucket, const ExchangeResult& result) override;
  MethodReport report() const override { return {pending_.threshold, imbalance_}; }
  MethodState state() const override;
  void load_state(const MethodState& state) override;

 protected:
  /// The element range of a partition for a bucket of n elements and P ranks (layout created on
  /// first use).
  virtual Range partition_range(int partition, int64_t n, int world_size) = 0;
  /// Called after a completed step t with every rank's count and their total.
  virtual void rebalance(const std::vector<int64_t>& /*counts*/, int64_t /*t*/, int64_t /*total*/) {}
  virtual void save_layout(MethodState& /*state*/) const {}
  virtual void load_layout(const MethodState& /*state*/) {}
  void rescale_state(double factor) override;

 private:
  struct Step {
    int64_t t = 0;
    double threshold = std::numeric_limits<double>::quiet_NaN();    // λ of the last step
    double estimate = std::numeric_limits<double>::quiet_NaN();     // default mode: λ̃ of the last step
    double before_last = std::numeric_limits<double>::quiet_NaN();  // default mode: λ̃ of the one before
    int64_t k_prev = 0;                                             // total count of the last step
    double band = BandController::band_factor(1);                   // default mode: w of the next step
    double trend_miss = 0.0;  // default mode: the trend's misses, each step's before it weighted by 0.8
    double mean_miss = 0.0;   // default mode: the same for the mean of the last two estimates
  };
  Selection select_reference(Device& device, const BucketView& bucket, Range range, int64_t k);
  Selection select_default(Device& device, const BucketView& bucket, Collective& group, Range range, int64_t k);

  double density_;
  const Exchange* exchange_;
  bool reference_;
  uint64_t seed_;
  Listing listing_;
  Step committed_;
  Step pending_;
  double imbalance_ = std::numeric_limits<double>::quiet_NaN();
};

class MiCRO final : public PartitionedMethod {
 public:
  using PartitionedMethod::PartitionedMethod;
  std::string name() const override { return "micro"; }

 protected:
  Range partition_range(int partition, int64_t n, int world_size) override;

 private:
  std::optional<StaticPartition> layout_;
};

class ExDyna final : public PartitionedMethod {
 public:
  using PartitionedMethod::PartitionedMethod;
  std::string name() const override { return "exdyna"; }

 protected:
  Range partition_range(int partition, int64_t n, int world_size) override;
  void rebalance(const std::vector<int64_t>& counts, int64_t t, int64_t total) override;
  void save_layout(MethodState& state) const override;
  void load_layout(const MethodState& state) override;

 private:
  /// A ValueError naming the entries where a loaded layout (`blocks`, none: nothing loaded) is not
  /// one of `world_size` partitions.
  static void check_saved_blocks(const std::vector<int64_t>& blocks, int world_size);
  std::optional<BlockPartition> layout_;
  std::vector<int64_t> saved_blocks_;  // a loaded layout, applied when the layout is created
};

/// SIDCo (4.10): multi-stage statistical fits.
class SIDCo final : public EstimatingMethod {
 public:
  SIDCo(double density, const std::string& fit, int stages, double first_ratio, std::optional<double> iratio,
        const std::string& exchange = "gather", bool reference = false);
  std::string name() const override { return "sidco"; }
  Selection select(Device& device, const BucketView& bucket, Collective& group) override;
  void observe(const BucketView& bucket, const ExchangeResult& result) override;
  MethodState state() const override;
  void load_state(const MethodState& state) override;
  int stages() const { return adaptive_ ? adaptive_->stages() : stages_; }

 private:
  double stage_threshold(double mean, double variance, double mean_log, double ratio, bool first) const;

  double density_;
  SidcoFit fit_;
  int stages_;
  double first_ratio_;
  double iratio_;
  std::optional<SidcoStages> adaptive_;
  int64_t selected_ = 0;
  int64_t numel_ = 0;
};

}  // namespace gradsparse
