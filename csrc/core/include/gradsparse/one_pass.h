// One pass per step for the threshold estimators (docs/architecture.md, "One pass").
//
// An estimating method needs statistics of the whole bucket (moments), then counts or exceedance
// moments at thresholds it computes from them, then the selection. Made one after another these
// read the bucket two or three times. OnePass reads it once: Device::scan updates the residual,
// adds the moments and lists the candidates, the elements at or above a lower bound that the
// method's CandidateBound learned from its earlier steps. Every later question about a threshold
// at or above that bound is answered from the candidates, exactly as a pass over the bucket would
// answer it; a question below the bound (or after too many candidates) makes that pass, read-only.
// So the results never depend on the bound: only the time does.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gradsparse/device.h"

namespace gradsparse {

class OnePass;

/// Where a step lists its candidates for the host (CandidateBound::capacity).
enum class Listing {
  kHostMemory,   ///< only on a device whose memory the host reads in place (the CPU)
  kEveryDevice,  ///< on every device: for a method whose questions read many elements on the host anyway
  kNowhere,      ///< on no device: every question is a pass, as on a GPU (the CPU tests run that path with it)
};

/// Whether a step on `device` lists candidates for the host.
inline bool lists_candidates(const Device& device, Listing listing) {
  return listing == Listing::kEveryDevice || (listing == Listing::kHostMemory && device.kind() == DeviceKind::kCPU);
}

/// Where a method's next step starts listing candidates: a factor below the lowest threshold its
/// last step asked about, widened when a question fell below the candidates and otherwise
/// tightened halfway, but never within 2.5 standard deviations of that question's log moves from
/// step to step (a bound closer than the moves is missed every few steps, and each miss costs a
/// pass). Where the threshold moves (by 1% a step or more) and the estimate places the lowest
/// question better than the last one does (follows()), OnePass moves the bound by the change
/// of an estimate of the k-th largest magnitude made before its scan, and the bound stands below
/// the lowest question's usual place relative to that estimate, by 2.5 times the spread of their
/// log ratio (a mean absolute deviation scaled to a standard deviation, which one far question
/// moves less). Not part of a checkpoint (it changes the time of a step, never its result).
class CandidateBound {
 public:
  /// The lower bound of the next step's candidates (+inf before the first step: no candidates).
  double lower() const { return lower_; }
  /// From where the next step's scan zeroes its candidates (Device::scan): the threshold of the
  /// last step's zeroing selection, when the candidates answered it and every question before it;
  /// +inf otherwise (a step that reads the whole bucket again would first write back what was
  /// zeroed). Where the threshold moves, OnePass zeroes from its estimate instead.
  double zero_from() const { return zero_from_; }
  /// The spread of the lowest question's log moves from step to step, lately: a moving mean of
  /// their absolute values over about ten steps, times sqrt(pi / 2) (a standard deviation where
  /// the moves are normal; one far move raises it in proportion to its distance, not its square,
  /// and is forgotten in about twenty steps); 0 before two steps asked one.
  double moves() const { return kDeviationToSpread * moves_; }
  /// The last step's estimate of its k-th largest magnitude (OnePass::estimate; NaN: none).
  double estimate() const { return estimate_; }
  /// Whether the next step moves the bound, and the scan's zeroing, by its estimate: where the
  /// threshold moves and the estimate placed the lowest question more closely than the last
  /// question did (a spread of their log ratio below that of the moves), or where no estimate
  /// was made yet. A sample whose blocks one outlying layer dominates (a classifier's weights at
  /// the start of DDP's first bucket, 14 times the magnitudes of the rest) moved with that layer,
  /// by 30% to 40% a step while the bucket's k-th largest moved by 2% to 6%: the bound, moved by
  /// it, listed too many candidates on most steps, each costing the exact passes.
  bool follows() const { return follows_; }
  /// How many candidates are listed at most for a target of k elements. With Listing::kHostMemory
  /// none on a device whose memory the host does not read in place (a GPU): there a listed
  /// candidate costs a copy to the host and host work, while a question answered by a pass is one
  /// read of the bucket at the device's bandwidth (on an H200 at 25M elements and density 0.01,
  /// Top-k's whole one-rank step took 6.7 ms with candidates listed, 1.0 ms without). DGC lists
  /// them everywhere (Listing::kEveryDevice): its sampled quantile, when the candidates cannot
  /// answer it, gathers the whole 1% sample to the host (11 ms a step there, against 4 to 9 ms).
  static int64_t capacity(const Device& device, int64_t k, Listing listing) {
    return lists_candidates(device, listing) ? 8 * k + 1024 : 0;
  }
  /// Learns from a finished step.
  void learn(const OnePass& pass);

 private:
  /// sqrt(pi / 2): a mean absolute deviation from the mean, as a normal's standard deviation.
  static constexpr double kDeviationToSpread = 1.2533141373155003;
  double factor_ = 0.85;
  double lower_ = std::numeric_limits<double>::infinity();
  double last_ = std::numeric_limits<double>::infinity();  ///< the last step's lowest question
  double moves_ = 0.0;  ///< a moving mean of the absolute log moves of the lowest question, step to step
  /// Means of r = ln(lowest question / the step's estimate) and of |r - that mean| over the steps
  /// with an estimate: plain over the first 20 (`ratios_` counts them), then moving (weight 1/20).
  double ratio_mean_ = 0.0;
  double ratio_deviation_ = 0.0;
  int ratios_ = 0;
  double estimate_ = std::numeric_limits<double>::quiet_NaN();
  double zero_from_ = std::numeric_limits<double>::infinity();
  bool follows_ = true;
};

/// The statistical estimators' default mode (docs/method-spec.md ruling 9): a method's estimate
/// of the threshold, times a factor learned from its earlier steps, then moved by secant steps in
/// log space on the exact counts (from the step's candidates) until the count is within 2% of k,
/// at most eight more counts. Its two numbers are part of a checkpoint: they change the result.
class DensityControl {
 public:
  static constexpr double kTolerance = 0.02;   ///< |count - k| <= kTolerance * k stops the steps
  static constexpr int kSteps = 8;             ///< at most this many counts after the first
  static constexpr double kMargin = 1e-9;      ///< thresholds closer than this (relative) are one
  static constexpr double kLeastSlope = 0.25;  ///< the slope stays from kLeastSlope to kMostSlope
  static constexpr double kMostSlope = 64.0;
  /// Where every count is 0 or more than 2k (ties at the top), the bisection for the largest
  /// magnitudes' group stops at thresholds this close (relative).
  static constexpr double kTieSpread = 1e-3;
  /// The threshold to select at (|v| > threshold) for k elements; the estimate itself when it is
  /// not a positive finite number.
  double threshold(OnePass& pass, double estimate, int64_t k);
  /// Keeps what the last threshold() learned: the method's observe(), so that a step aborted
  /// after its selection (a non-finite value under nonfinite="skip") leaves the control as it was.
  void commit() { committed_ = pending_; }
  /// Forgets what threshold() learned since the last commit(): at the start of every step, so
  /// that a step which asks no threshold (a zero vector) commits nothing of an aborted one.
  void discard() { pending_ = committed_; }
  void save(std::map<std::string, double>& state) const;
  /// Reads what save() wrote; keeps the initial values when the keys are absent. A scale that is
  /// not a positive finite number, or a slope outside [kLeastSlope, kMostSlope], is a ValueError
  /// naming the entry (and loads nothing).
  void load(const std::map<std::string, double>& state);

 private:
  struct Learned {
    double scale = 1.0;  ///< the chosen threshold / its estimate
    double slope = 2.0;  ///< -d log(count) / d log(threshold)
  };
  Learned committed_;  ///< of the last completed step
  Learned pending_;    ///< of this step's threshold(), until commit()
};

/// One step's pass over a bucket and the questions a threshold estimator asks about it. The
/// constructor makes the pass (with the error-feedback update); every answer is exact. Where the
/// bound says so, the pass also zeroes the candidates at or above the last step's selection (on
/// the CPU, in cache), and the step's zeroing selection settles the difference; any question that
/// reads the bucket again first writes them back (one that reads a sample of its blocks, those in
/// the sample), as does the end of a step that made no zeroing selection. So a method reads the
/// bucket only through its OnePass while one is alive.
class OnePass {
 public:
  /// Without `sums` the pass does not compute the moments' sums (moments() holds only nonfinite):
  /// for a method that reads none of them. Without `update` it reads the residual as it is (no
  /// error-feedback update): for a selection from values accumulated elsewhere (SparDL's blocks).
  OnePass(Device& device, const BucketView& bucket, const CandidateBound& bound, int64_t k,
          Listing listing = Listing::kHostMemory, Range range = {0, -1}, bool sums = true, bool update = true);
  /// Writes back what the scan zeroed and no selection settled: a step that ends early (a zero
  /// vector, no selection) or throws loses nothing.
  ~OnePass();
  OnePass(const OnePass&) = delete;
  OnePass& operator=(const OnePass&) = delete;

  const Moments& moments() const { return scan_.moments; }

  /// Counts at several thresholds (|v| >= t, or > t when strict) asked one at a time: those the
  /// candidates cover come from them; the first one they do not cover counts all the uncovered
  /// ones in one read-only pass.
  class Counts {
   public:
    int64_t operator[](size_t j);

   private:
    friend class OnePass;
    Counts(OnePass& pass, std::vector<double> thresholds, bool strict);
    OnePass& pass_;
    std::vector<double> thresholds_;
    std::vector<uint32_t> keys_;
    bool strict_;
    std::vector<int64_t> value_;
    std::vector<bool> known_;
  };
  Counts counts(std::vector<double> thresholds, bool strict) { return Counts(*this, std::move(thresholds), strict); }

  /// Moments of y = |v| * scale over the elements of `sample` with |v| >= threshold (> when
  /// strict).
  Exceedance exceedance(double threshold, bool strict, double scale, BlockSample sample = {});
  /// The elements of the range with |v| >= threshold (> when strict), as a message; zeroes their
  /// residual when `zero`. A selection that zeroes is a step's last question: the candidates no
  /// longer match the residual, so any question after it passes over the bucket (and counts as
  /// one the candidates missed).
  Selection select(double threshold, bool strict, bool zero);
  /// The exact k largest magnitudes of the range (ties: lowest index), zeroed in the residual
  /// where `zero` (as select()); the selection's kth_key is the k-th largest's key.
  Selection largest(int64_t k, bool zero = true);
  /// Whether at least k elements of the range have |v| >= threshold: from the candidates where
  /// they hold k or more (a band's edge below them holds them all), otherwise by a read-only pass.
  /// Not a question the bound learns from: it asks whether the k-th largest reaches the
  /// threshold, which a bound at the k-th largest answers.
  bool holds(double threshold, int64_t k);
  /// The s-th largest magnitude |v| among a sample of the range: the elements whose bit is set
  /// in `sampled` (a bitmap over the bucket's positions, as sample_distinct_bits writes it; `count`
  /// bits set, all inside the range, 1 <= s <= count). From the candidates when at least s sampled
  /// elements are among them (those left out lie below every candidate), else by gathering every
  /// sampled element.
  double kth_sampled(const std::vector<uint64_t>& sampled, int64_t count, int64_t s);
  /// The same over the hashed 1% sample of the range (in_percent_sample(stream, p), rng.h), which
  /// holds about a hundredth of the range: from the candidates when at least s sampled elements
  /// are among them, else by hashing every position (in_percent_sample_positions) and gathering the
  /// sampled ones. nullopt when the whole sample holds fewer than s elements.
  std::optional<double> kth_hashed(uint64_t stream, int64_t s);
  /// Device::log_sum over the bucket.
  double log_sum(double scale, double eps, BlockSample sample);

  /// The lowest threshold of a question whose answer held at most the capacity of elements (the
  /// others cannot be answered from candidates at any bound); +inf when none did.
  double lowest_asked() const { return lowest_asked_; }
  /// Whether such a question fell below the candidates and needed a pass over the bucket.
  bool missed() const { return missed_; }
  /// This step's k-th largest magnitude, estimated from a sample of blocks before the scan where
  /// the threshold moves (NaN where not), and the factor by which the bound was moved for it: the
  /// estimate over the last step's (1 where either is missing).
  double estimate() const { return estimate_; }
  double rescale() const { return rescale_; }
  /// How many candidates the scan found.
  int64_t candidates() const { return scan_.above; }
  /// Whether the candidates were too many to list.
  bool overflowed() const { return !scan_.complete(); }
  /// The threshold of the zeroing selection, when the candidates answered it and nothing read the
  /// whole bucket after the scan (a sample of its blocks may have been); +inf otherwise.
  double zeroed_from() const { return passed_ ? std::numeric_limits<double>::infinity() : zeroed_from_; }

 private:
  /// The key a question's elements reach (|v| >= t, or > t when strict; t rounded to the dtype, as
  /// every pass compares, kernels.h).
  uint32_t key_of(double threshold, bool strict) const;
  /// True when the candidates hold every element of the range whose key reaches `key`.
  bool covers(uint32_t key) const { return scan_.complete() && !stale_ && key >= lower_key_; }
  /// Notes a question at `threshold` whose answer holds `elements` elements.
  void asked(double threshold, int64_t elements, bool covered);
  /// The s-th largest of `magnitude` (reordered), noted as a question that about s / count of
  /// the range reaches.
  double kth_of(std::vector<float>& magnitude, int64_t s, int64_t count, bool covered);
  /// The magnitudes |v| at `positions` (of the bucket), gathered from the device.
  std::vector<float> magnitudes_at(const std::vector<int64_t>& positions);
  /// The candidates' keys in the bucket's dtype (computed on first use).
  const HostBuffer<uint32_t>& keys();
  /// f(keys) with the candidates' keys: of a float32 bucket read from their values in place
  /// (method_util::FloatKeys), of the others keys().
  template <typename F>
  decltype(auto) with_keys(const F& f);
  /// The candidates whose key reaches `key`, as positions in the candidate lists.
  Positions reaching(uint32_t key);
  /// The device, for a question that reads the bucket: first writes back what the scan zeroed.
  Device& reading();
  /// `read(device)` for a question that reads only the blocks of `sample`: first writes back what
  /// the scan zeroed in those blocks alone (once for every question on the same sample), which
  /// the step's zeroing selection zeroes again before it settles the difference, so the next scan
  /// still zeroes (reading() where the sample is the whole bucket).
  template <typename Read>
  auto reading(BlockSample sample, const Read& read);
  /// Zeroes again what reading(sample, ...) wrote back.
  void zero_written_back();
  /// Writes back (or zeroes) the candidates the scan zeroed in every `every`-th block.
  void write_sample(int64_t every, bool zero);
  /// The message of the candidates at `chosen` (a selection at `threshold`), zeroed in the
  /// residual when `zero`: then the residual is zero at exactly those, whatever the scan zeroed.
  /// `chosen_from`: the key that every chosen candidate and no other reaches, where there is one
  /// (kNoKey where not: the k largest with some of the ties at the k-th left out).
  Selection emit(const Positions& chosen, uint32_t chosen_from, bool zero, double threshold);

  Device& device_;
  BucketView bucket_;
  Range range_;
  int64_t capacity_;
  Scan scan_;
  uint32_t lower_key_;
  HostBuffer<uint32_t> keys_;
  double lowest_asked_ = std::numeric_limits<double>::infinity();
  bool missed_ = false;
  bool stale_ = false;        ///< after a selection that zeroed residual entries: the candidates are out of date
  bool passed_ = false;       ///< a question read the whole bucket after the scan
  int64_t written_back_ = 0;  ///< the BlockSample::every whose zeroed candidates are written back (0: none)
  double zeroed_from_ = std::numeric_limits<double>::infinity();  ///< the zeroing selection's threshold, if any
  double estimate_ = std::numeric_limits<double>::quiet_NaN();
  double rescale_ = 1.0;
};

}  // namespace gradsparse
