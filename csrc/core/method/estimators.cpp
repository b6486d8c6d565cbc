#include "gradsparse/estimators.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "gradsparse/common.h"

namespace gradsparse {

// ---- special functions ------------------------------------------------------------------------

namespace {
constexpr double kSqrt2 = 1.4142135623730951;
constexpr double kInvSqrt2Pi = 0.3989422804014327;

/// Upper tail Q(x) = P(Z > x) of the standard normal.
double normal_upper_tail(double x) { return 0.5 * std::erfc(x / kSqrt2); }

/// ln Γ(a). std::lgamma also writes the sign of Γ(a) to the global `signgam` (POSIX): a data race
/// when ranks or buckets fit SIDCo's gamma on several threads at once (ThreadSanitizer reported it
/// in tests/cpp/test_methods.cpp). lgamma_r hands the sign back instead.
double log_gamma(double a) {
#if defined(__GLIBC__) || defined(__APPLE__)
  int sign = 0;
  return ::lgamma_r(a, &sign);
#else
  return std::lgamma(a);
#endif
}
}  // namespace

double normal_quantile(double p) {
  GS_CHECK(p > 0.0 && p < 1.0, ValueError, "normal_quantile: p must be in (0, 1), got ", p);
  if (p == 0.5) return 0.0;
  // Solve Q(x) = q for x > 0 by Newton's method on the upper tail (Q is convex there, so the
  // iterates approach from one side), then use the symmetry Φ⁻¹(p) = -Φ⁻¹(1 - p).
  const double q = p > 0.5 ? 1.0 - p : p;
  double x = std::sqrt(-2.0 * std::log(q));  // above the root for q < 0.5
  for (int i = 0; i < 100; ++i) {
    const double density = kInvSqrt2Pi * std::exp(-0.5 * x * x);
    const double step = (normal_upper_tail(x) - q) / density;
    x += step;
    if (std::fabs(step) <= 1e-16 * std::max(1.0, std::fabs(x))) break;
  }
  return p > 0.5 ? x : -x;
}

double gamma_p(double a, double x) {
  GS_CHECK(a > 0.0 && x >= 0.0, ValueError, "gamma_p: needs a > 0 and x >= 0, got a=", a, " x=", x);
  if (x == 0.0) return 0.0;
  const double log_prefactor = a * std::log(x) - x - log_gamma(a);
  if (x < a + 1.0) {
    // Series: P = e^-x x^a / Γ(a+1) Σ x^n / ((a+1)...(a+n)).
    double term = 1.0 / a, sum = term;
    for (int n = 1; n < 100000; ++n) {
      term *= x / (a + n);
      sum += term;
      if (std::fabs(term) < std::fabs(sum) * 1e-17) break;
    }
    return std::min(1.0, sum * std::exp(log_prefactor));
  }
  // Continued fraction for Q = 1 - P (modified Lentz).
  const double tiny = 1e-300;
  double b = x + 1.0 - a, c = 1.0 / tiny, d = 1.0 / b, h = d;
  for (int i = 1; i < 100000; ++i) {
    const double an = -i * (i - a);
    b += 2.0;
    d = an * d + b;
    if (std::fabs(d) < tiny) d = tiny;
    c = b + an / c;
    if (std::fabs(c) < tiny) c = tiny;
    d = 1.0 / d;
    const double delta = d * c;
    h *= delta;
    if (std::fabs(delta - 1.0) < 1e-17) break;
  }
  return std::max(0.0, 1.0 - std::exp(log_prefactor) * h);
}

double gamma_p_inverse(double a, double p) {
  GS_CHECK(a > 0.0 && p >= 0.0 && p < 1.0, ValueError, "gamma_p_inverse: needs a > 0 and p in [0, 1), got a=", a,
           " p=", p);
  if (p == 0.0) return 0.0;
  // Start from the Wilson-Hilferty approximation, then Newton's method kept inside a bracket that
  // shrinks with every step (bisection when Newton leaves it).
  const double z = normal_quantile(p);
  const double c = 1.0 - 1.0 / (9.0 * a) + z / (3.0 * std::sqrt(a));
  double x = c > 0.0 ? a * c * c * c : std::pow(p * std::tgamma(a + 1.0), 1.0 / a);
  if (!(x > 0.0) || !std::isfinite(x)) x = a;
  double lo = 0.0, hi = std::max(2.0 * x, a + 10.0);
  while (gamma_p(a, hi) < p) hi *= 2.0;
  const double log_norm = log_gamma(a);
  for (int i = 0; i < 200; ++i) {
    const double f = gamma_p(a, x) - p;
    if (f == 0.0) break;
    if (f < 0.0) {
      lo = x;
    } else {
      hi = x;
    }
    const double derivative = std::exp((a - 1.0) * std::log(x) - x - log_norm);
    double next = x - f / derivative;
    if (!(next > lo && next < hi)) next = 0.5 * (lo + hi);
    if (std::fabs(next - x) <= 1e-15 * x || hi - lo <= 1e-15 * hi) {
      x = next;
      break;
    }
    x = next;
  }
  return x;
}

// ---- shared helpers ---------------------------------------------------------------------------

int64_t target_count(double density, int64_t n) {
  if (n <= 0) return 0;
  const double k = std::floor(density * static_cast<double>(n));
  if (!(k >= 1.0)) return 1;
  return k >= static_cast<double>(n) ? n : static_cast<int64_t>(k);
}

double initial_threshold(int64_t k) { return 1.0 / (2.0 * std::sqrt(static_cast<double>(std::max<int64_t>(k, 1)))); }

int64_t slovin_sample_size(int64_t n) {
  const double s = std::floor(static_cast<double>(n) / (1.0 + 0.0025 * static_cast<double>(n)));
  return std::max<int64_t>(1, static_cast<int64_t>(s));
}

double unbiased_variance(double count, double sum, double sum_sq) {
  if (count < 2.0) return std::numeric_limits<double>::quiet_NaN();
  const double mean = sum / count;
  return std::max(0.0, (sum_sq - count * mean * mean) / (count - 1.0));
}

// ---- MiCRO / ExDyna ---------------------------------------------------------------------------

double online_scaling_factor(double ratio) {
  if (ratio > 1.1) return 1.005;
  if (ratio > 0.909) return 1.00125;  // the original's 0.9987 branch is unreachable (§8 question 1)
  return 0.995;
}

const std::vector<double>& BandController::sample_edges() {
  static const std::vector<double> edges = [] {
    std::vector<double> e(kSampleBins + 1);
    for (int i = 0; i <= kSampleBins; ++i) e[i] = std::pow(2.0, -40.0 + 50.0 * (kFirstSampleEdge + i) / 512.0);
    return e;
  }();
  return edges;
}

int BandController::sample_bin(double magnitude) {
  const auto& e = sample_edges();
  const int b = static_cast<int>(std::upper_bound(e.begin(), e.end(), magnitude) - e.begin()) - 1;
  return std::clamp(b, 0, static_cast<int>(e.size()) - 2);
}

double BandController::predict_from_samples(const std::vector<double>& weights, double target) {
  const auto& e = sample_edges();
  GS_ASSERT(weights.size() + 1 == e.size());
  double from_top = 0.0;
  for (int b = static_cast<int>(weights.size()) - 1; b > 0; --b) {
    from_top += weights[b];
    if (from_top >= target) return e[b];
  }
  return e[0];
}

double BandController::predict_from_trend(double last, double before_last, int64_t t) {
  if (t <= 1 || !(before_last > 0.0) || !(last > 0.0)) return last;
  return last * std::clamp(last / before_last, 1.0 / 1.2, 1.2);
}

double BandController::predict_from_mean(double last, double before_last, int64_t t) {
  if (t <= 1 || !(before_last > 0.0) || !(last > 0.0)) return last;
  return std::sqrt(last * before_last);
}

double BandController::miss(double prediction, double estimate) {
  if (!(prediction > 0.0 && estimate > 0.0 && std::isfinite(prediction) && std::isfinite(estimate))) {
    return std::numeric_limits<double>::quiet_NaN();
  }
  return std::fabs(std::log(estimate / prediction));
}

double BandController::band_factor(int64_t t) { return t == 0 ? 2.0 : 1.25; }

double BandController::next_band_factor(double w, double prediction, double estimate) {
  const double widest = band_factor(1);
  const double m = miss(prediction, estimate);
  if (std::isnan(m)) return widest;
  return std::clamp(std::exp(std::max(2.0 * m, 0.9 * std::log(w))), kNarrowestBand, widest);
}

double BandController::saved_band(const std::map<std::string, double>& state, double widest, double absent) {
  const auto it = state.find("band");
  if (it == state.end()) return absent;
  GS_CHECK(it->second >= kNarrowestBand && it->second <= widest, ValueError, "method state: 'band' is ", it->second,
           ", not a number from ", kNarrowestBand, " to ", widest, "; load a state the method saved");
  return it->second;
}

std::vector<double> BandController::band_edges(double prediction, double w) {
  std::vector<double> e(kBandBins + 1);
  const double lo = prediction / w;
  for (int b = 0; b <= kBandBins; ++b) e[b] = lo * std::pow(w, 2.0 * b / kBandBins);
  return e;
}

int BandController::band_bin(const std::vector<double>& edges, double magnitude) {
  const int b = static_cast<int>(std::upper_bound(edges.begin(), edges.end(), magnitude) - edges.begin()) - 1;
  return std::clamp(b, 0, kBandBins);
}

int BandController::choose(const std::vector<double>& counts, double target) {
  GS_ASSERT(static_cast<int>(counts.size()) == kBandBins + 1);
  double above = 0.0;  // G(b)
  int best = kBandBins;
  double best_error = std::numeric_limits<double>::infinity();
  for (int b = kBandBins; b >= 0; --b) {
    above += counts[b];
    const double error = std::fabs(above - target);
    if (error < best_error) {  // scanning downwards: ties keep the larger b
      best_error = error;
      best = b;
    }
  }
  return best;
}

namespace {
/// BandController::estimate's extrapolation from the band's counts: the estimate, and whether the
/// counts say the prediction was far off (BandController::next_estimate).
std::pair<double, bool> extrapolate(const std::vector<double>& edges, const std::vector<double>& counts, double target,
                                    double chosen) {
  constexpr int kTop = BandController::kBandBins;
  std::vector<double> above(kTop + 2, 0.0);  // G(b)
  for (int b = kTop; b >= 0; --b) above[b] = above[b + 1] + counts[b];
  const int mid = kTop / 2;
  // -d ln G / d ln threshold between two edges (0 where G does not fall; 1 where it is unknown)
  auto raw_slope = [&](int lo, int hi) {
    if (!(above[lo] >= above[hi] && above[hi] > 0.0)) return 1.0;
    return std::log(above[lo] / above[hi]) / std::log(edges[hi] / edges[lo]);
  };
  auto slope = [&](int lo, int hi) {  // at least 0.5
    if (!(above[lo] > above[hi] && above[hi] > 0.0)) return 1.0;
    return std::max(BandController::kLeastSlope, raw_slope(lo, hi));
  };
  // Outside the band the slope of the band is a poor guide far away (tails steepen), so the
  // extrapolation goes at most one band width (e_256 / e_0) beyond the band.
  const double width = edges[kTop] / edges[0];
  if (above[kTop] > target) {  // above the band
    const double jump = std::pow(above[kTop] / target, 1.0 / slope(0, kTop));
    return {edges[kTop] * std::min(jump, width), raw_slope(0, kTop) < BandController::kLeastSlope};
  }
  if (above[0] < target) {  // below the band
    if (above[0] <= 0.0) return {edges[0] / width, true};
    const double jump = std::pow(above[0] / target, 1.0 / slope(0, mid));
    return {edges[0] * std::max(jump, 1.0 / width), false};
  }
  return {chosen, false};
}
}  // namespace

double BandController::estimate(const std::vector<double>& edges, const std::vector<double>& counts, double target,
                                double chosen) {
  return extrapolate(edges, counts, target, chosen).first;
}

double BandController::next_estimate(const std::vector<double>& edges, const std::vector<double>& counts, double target,
                                     double chosen) {
  const auto [value, far_off] = extrapolate(edges, counts, target, chosen);
  return far_off ? std::numeric_limits<double>::quiet_NaN() : value;
}

// ---- SAGE -------------------------------------------------------------------------------------

double sage_reference_update(double lambda, double alpha, double density_exam, double density) {
  const double beta = 2.0 / (1.0 + std::exp(density - density_exam));
  const double ratio = density_exam / density;
  const double gamma = ratio < 0.1 ? 0.95 : (ratio > 10.0 ? 1.05 : 1.0);
  // Rounded to float32 as the original's tensor, but never past its largest finite value: a λ
  // above it (an initial_threshold of 1e300, or near 3.4e38 times α > 1) rounded to Inf, which no
  // step left (Inf times β γ): nothing was selected for good, and the saved state was refused.
  // From the largest float32 the threshold falls by γ β at every step that selects too little.
  auto round = [](double x) { return static_cast<float>(std::min(x, double{std::numeric_limits<float>::max()})); };
  float l = round(lambda * alpha);
  l = round(static_cast<double>(l) * beta);
  l = round(static_cast<double>(l) * gamma);
  return l;
}

// ---- SIDCo ------------------------------------------------------------------------------------

double exp_threshold(double mean, double ratio) { return -mean * std::log(ratio); }

double gpareto_threshold(double mean, double variance, double ratio) {
  if (!(variance > 0.0)) return mean;  // all equal (or a single element): nothing stands out
  const double r = mean * mean / variance;
  const double shape = 0.5 * (r - 1.0);
  const double scale = 0.5 * mean * (r + 1.0);
  if (std::fabs(shape) < 1e-12) return -scale * std::log(ratio);
  return scale * (1.0 - std::pow(ratio, shape)) / shape;
}

double gamma_threshold(double mean, double mean_log, double ratio) {
  const double l = std::log(mean) - mean_log;
  if (!(l > 0.0) || !std::isfinite(l)) return mean;  // all equal: nothing stands out
  const double shape = (3.0 - l + std::sqrt((l - 3.0) * (l - 3.0) + 24.0 * l)) / (12.0 * l);
  const double scale = mean / shape;
  return scale * gamma_p_inverse(shape, 1.0 - ratio);
}

SidcoStages::SidcoStages(int mode, double density)
    : mode_(mode), max_stages_(std::max(1, static_cast<int>(std::ceil(std::log(density) / std::log(0.5))))) {
  GS_CHECK(mode == -1 || mode == -2 || mode == -3, ValueError, "SIDCo: adaptive stages must be -1, -2 or -3, got ",
           mode);
}

void SidcoStages::record(double ratio) {
  sum_ += ratio;
  if (++calls_ < 5) return;
  const double e = sum_ / calls_;
  if (mode_ == -1) {
    if (e > 1.2) {
      stages_ -= 1;
    } else if (e < 0.8) {
      stages_ += 1;
    }
  } else {
    bool flip = false;
    if (last_estimate_ > 0.0) {
      if (mode_ == -2) {
        flip = std::fabs(e - 1.0) > std::fabs(last_estimate_ - 1.0);
      } else {
        flip = !((e > last_estimate_ && last_estimate_ < 0.8) || (e < last_estimate_ && last_estimate_ > 1.2));
      }
    }
    if (flip) direction_ = -direction_;
    if (e > 1.2) stages_ -= direction_;
    if (e < 0.8) stages_ += direction_;
  }
  stages_ = std::clamp(stages_, 1, max_stages_);
  last_estimate_ = e;
  sum_ = 0.0;
  calls_ = 0;
}

}  // namespace gradsparse
