// Threshold estimators and scaling rules: the host-side math of the selection methods, as small
// units with their own tests (docs/method-spec.md section 4 gives every formula).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace gradsparse {

// ---- special functions ------------------------------------------------------------------------

/// Φ⁻¹(p), the standard normal quantile, for p in (0, 1); relative error about 1e-15.
double normal_quantile(double p);
/// P(a, x), the regularised lower incomplete gamma function, a > 0, x >= 0.
double gamma_p(double a, double x);
/// x with P(a, x) = p, for a > 0 and p in [0, 1).
double gamma_p_inverse(double a, double p);

// ---- shared helpers ---------------------------------------------------------------------------

/// max(1, floor(density * n)) capped at n (0 for n = 0): docs/method-spec.md ruling 4.
int64_t target_count(double density, int64_t n);
/// The kljp initial threshold 1 / (2 sqrt(k)) (docs/method-spec.md 4.2, 4.8).
double initial_threshold(int64_t k);
/// SAGE's sample size, Slovin's formula with e = 0.05: floor(n / (1 + 0.0025 n)), at least 1.
int64_t slovin_sample_size(int64_t n);
/// Unbiased variance from a count and float64 sums of x and x².
double unbiased_variance(double count, double sum, double sum_sq);

// ---- MiCRO / ExDyna ---------------------------------------------------------------------------

/// The original online threshold scaling of MiCRO and ExDyna (reference mode, §1.2 step 4): the
/// factor for ratio = previous total count / target.
double online_scaling_factor(double ratio);

/// The default controller of MiCRO and ExDyna (method-spec 4.8): a predicted threshold, a band
/// around it in which candidates are counted in fine bins, and the agreed threshold chosen from
/// the global bin counts.
class BandController {
 public:
  static constexpr int kBandBins = 256;  ///< band bins (plus one overflow bin)

  /// The sampling histogram of a sampled prediction (4.8): edges 2^(-40 + 50 b / 512) for
  /// b = -1117..1721, from below the least float32 magnitude (2^-149) to above the largest.
  static constexpr int kFirstSampleEdge = -1117;
  static constexpr int kSampleBins = 1721 - kFirstSampleEdge;

  /// The edges of the sampling histogram, indexed from 0.
  static const std::vector<double>& sample_edges();
  /// The bin of a magnitude in the sampling histogram (clamped to 0..kSampleBins - 1).
  static int sample_bin(double magnitude);
  /// The prediction from the summed sampling histogram: the lower edge of the highest bin at
  /// which the weight from the top reaches `target`.
  static double predict_from_samples(const std::vector<double>& weights, double target);

  /// The prediction for step t (t >= 1) from the agreed thresholds of the last two steps.
  static double predict_from_trend(double last, double before_last, int64_t t);
  /// The other prediction for step t (t >= 1): the geometric mean of the last two estimates (the
  /// last alone at t = 1 or without two positive ones). Steadier than the trend where a step's
  /// threshold scatters around a level, as one mini-batch's gradients do.
  static double predict_from_mean(double last, double before_last, int64_t t);
  /// How far a prediction missed: |ln(estimate / prediction)|, NaN unless both are finite and
  /// positive.
  static double miss(double prediction, double estimate);
  static constexpr double kMissDecay = 0.8;  ///< each step's weight on the misses before it
  /// The band factor w: 2 at t = 0, 1.25 afterwards (SAGE; MiCRO's and ExDyna's first two steps).
  static double band_factor(int64_t t);
  static constexpr double kNarrowestBand = 1.05;  ///< the adaptive band's least factor
  /// MiCRO's and ExDyna's band factor for the next step, from this step's factor `w`, its
  /// prediction and the estimate λ̃ that followed: with m = miss(prediction, estimate),
  /// w' = clamp(exp(max(2 m, 0.9 ln w)), 1.05, 1.25), or 1.25 where m is NaN. A miss widens the
  /// band at once; a run of close predictions narrows it slowly, so fewer candidates are listed
  /// and counted.
  static double next_band_factor(double w, double prediction, double estimate);
  /// The band factor a checkpoint saved as "band", or `absent` where it holds none (saved before
  /// the adaptive band). One outside [kNarrowestBand, widest] (NaN, 0, a damaged or hand-made
  /// state), which would put every later band off, is a ValueError naming the entry.
  static double saved_band(const std::map<std::string, double>& state, double widest, double absent);
  /// Edges e_b = (prediction / w) w^(2b/256), b = 0..256.
  static std::vector<double> band_edges(double prediction, double w);
  /// The band bin of a candidate magnitude: b with e_b <= m < e_{b+1}, 256 above the last edge,
  /// 0 below the first.
  static int band_bin(const std::vector<double>& edges, double magnitude);
  /// The bin of the agreed threshold e_{b*} from the global band counts (257 bins): b* minimising
  /// |G(b) - target| (ties: the larger b), G(b) the count in bins b..256.
  static int choose(const std::vector<double>& counts, double target);
  /// The estimate of the threshold that would have hit `target`, for the next prediction: the
  /// chosen threshold when it is inside the band; outside, an extrapolation along the slope of
  /// the counts in log-log scale (method-spec 4.8).
  static double estimate(const std::vector<double>& edges, const std::vector<double>& counts, double target,
                         double chosen);
  /// The least slope -d ln G / d ln threshold the extrapolation assumes.
  static constexpr double kLeastSlope = 0.5;
  /// The estimate the next step predicts from: estimate(), or NaN where the counts say the
  /// prediction was far off: nothing counted (G(0) = 0: a step of zeros, or a fall in scale below
  /// the band), or more than `target` above the band while the counts fall across the band by less
  /// than the least slope (the band lies in the body of the distribution, far below its tail: a
  /// rise in scale). The next step then predicts from a sample (method-spec 4.8, "Far off"), where
  /// the estimate would climb one band width a step.
  static double next_estimate(const std::vector<double>& edges, const std::vector<double>& counts, double target,
                              double chosen);
};

// ---- SAGE -------------------------------------------------------------------------------------

/// SAGE's reference update (§3.2): λ α β γ, each product rounded to float32 as the original's
/// float32 tensor is.
double sage_reference_update(double lambda, double alpha, double density_exam, double density);

// ---- SIDCo ------------------------------------------------------------------------------------

enum class SidcoFit { kExp, kGPareto, kGammaGPareto };

/// Generalised Pareto threshold by the method of moments: mean μ, variance s², ratio δ:
/// σ (1 - δ^κ) / κ with κ = (μ²/s² - 1)/2, σ = μ (μ²/s² + 1)/2 (limit -σ ln δ when κ -> 0).
double gpareto_threshold(double mean, double variance, double ratio);
/// Gamma threshold: shape from Minka's approximation with L = ln μ - mean(ln x); b P⁻¹(a, 1 - δ).
double gamma_threshold(double mean, double mean_log, double ratio);
/// Exponential threshold: -mean ln δ.
double exp_threshold(double mean, double ratio);

/// SIDCo's adaptive stage count (§5.2 step 7), per bucket.
class SidcoStages {
 public:
  SidcoStages(int mode, double density);
  int stages() const { return stages_; }
  int max_stages() const { return max_stages_; }
  /// Adds one step's achieved / target ratio; every 5 steps applies the mode's rule.
  void record(double ratio);

  // State, for checkpoints.
  int stages_ = 1;
  int direction_ = 1;
  double sum_ = 0.0;
  int calls_ = 0;
  double last_estimate_ = 0.0;

 private:
  int mode_;
  int max_stages_;
};

}  // namespace gradsparse
