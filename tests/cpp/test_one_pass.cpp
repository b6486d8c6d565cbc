// One pass per step (gradsparse/one_pass.h): Device::scan against the passes it fuses, OnePass's
// answers against plain passes at every kind of bound (none, below, near, above the answer, too
// many candidates), and the methods built on it: their results never depend on the bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/methods.h"
#include "gradsparse/one_pass.h"
#include "gradsparse/parallel.h"
#include "gradsparse/reduce_bucket.h"
#include "gradsparse/rng.h"
#include "reference.h"
#include "threads.h"

using namespace gradsparse;
namespace ref = gradsparse::reference;

namespace {

/// The smallest magnitude of a selection's values: the k-th largest for a top-k selection.
double smallest_magnitude(Device& device, const Selection& s, const BucketView& bucket) {
  double m = std::numeric_limits<double>::infinity();
  for (float v : HostMessage(device, s, bucket).value_list()) m = std::min(m, std::fabs(double{v}));
  return m;
}

template <typename T>
DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<T, Half>) return DType::kFloat16;
  return DType::kBFloat16;
}

constexpr int64_t kN = 3 * kCpuBlock + 77;

/// ref::random_vector<float>(n, seed, scale) as T, drawn once per process: the tests below build
/// the same buckets and streams hundreds of times, and drawing them again was most of their time.
template <typename T = float>
const std::vector<T>& drawn_once(int64_t n, uint64_t seed, float scale = 1.0f) {
  static std::mutex mutex;
  static std::map<std::tuple<int64_t, uint64_t, float>, std::vector<T>> drawn;
  const std::lock_guard<std::mutex> lock(mutex);
  auto [at, fresh] = drawn.try_emplace({n, seed, scale});
  if (fresh)
    for (float v : ref::random_vector<float>(n, seed, scale)) at->second.push_back(Num<T>::from_float(v));
  return at->second;
}

/// A bucket of dtype T with a residual (or none).
template <typename T>
struct Bucket {
  std::vector<T> grad, residual;
  bool with_residual;
  explicit Bucket(bool with_residual_, uint64_t seed = 1)
      : grad(drawn_once<T>(kN, seed)), residual(drawn_once<T>(kN, seed + 1, 0.5f)), with_residual(with_residual_) {}
  BucketView view() { return BucketView{dtype_of<T>(), kN, grad.data(), with_residual ? residual.data() : nullptr}; }
};

std::vector<unsigned char> bytes(const Selection& s) {
  const auto* p = s.message.as<unsigned char>();
  return std::vector<unsigned char>(p, p + s.bytes);
}

void expect_same_moments(const Moments& a, const Moments& b) {
  EXPECT_EQ(a.sum, b.sum);
  EXPECT_EQ(a.sum_abs, b.sum_abs);
  EXPECT_EQ(a.sum_sq, b.sum_sq);
  EXPECT_EQ(a.max_abs, b.max_abs);
  EXPECT_EQ(a.nonfinite, b.nonfinite);
}

/// Device::scan against moments and collect, for every thread count (the threads' lists are
/// joined in index order), bounds that list every element, many, few or none of each 32, and
/// capacities that hold all candidates or overflow; without the sums, the same but for them. Asked
/// to zero from a threshold, the scan zeroes exactly the listed candidates that reach it (from one
/// above the bound: some of them; from one below: all), and nothing when they overflowed.
template <typename T>
void scan_matches_the_passes_it_fuses() {
  for (int threads : {1, 3}) {  // 2, the default here, runs in every other test
    set_cpu_threads(threads);
    for (double lower : {0.0, 1.5, 2.5, double{INFINITY}}) {
      for (bool with_residual : {true, false}) {
        for (Range range : {Range{0, kN}, Range{kCpuBlock - 5, 2 * kCpuBlock + 9}}) {
          for (int64_t capacity : {int64_t{-1}, int64_t{0}, int64_t{100}, int64_t{1} << 20}) {
            for (bool sums : {true, false}) {
              for (double zero_from : {double{INFINITY}, 2.0}) {
                SCOPED_TRACE(::testing::Message()
                             << "threads " << threads << ", lower " << lower << ", residual " << with_residual
                             << ", range " << range.begin << ".." << range.end << ", capacity " << capacity << ", sums "
                             << sums << ", zero from " << zero_from);
                Bucket<T> fused(with_residual), plain(with_residual);
                plain.grad[7] = fused.grad[7] = Num<T>::from_float(INFINITY);  // a non-finite sum keeps its residual
                CpuDevice device;
                const Scan s = device.scan(fused.view(), true, range, lower, capacity, sums, zero_from);
                Moments m = device.moments(plain.view(), true);
                EXPECT_EQ(m.nonfinite, 1);  // grad[7]: what the scans without sums are compared on
                if (!sums) {                // only the non-finite count
                  Moments only;
                  only.nonfinite = m.nonfinite;
                  m = only;
                }
                const Candidates c = device.collect(plain.view(), range, lower, false);
                expect_same_moments(s.moments, m);
                if (capacity == 0) {  // nothing listed, nothing counted
                  EXPECT_EQ(s.above, Scan::kNotCounted);
                } else {
                  EXPECT_EQ(s.above, static_cast<int64_t>(c.size()));
                  if (std::isfinite(lower)) EXPECT_GT(s.above, 100);
                }
                if (capacity < 0 || (capacity > 0 && s.above <= capacity)) {
                  EXPECT_TRUE(s.complete());
                  EXPECT_EQ(s.candidates.index, c.index);
                  EXPECT_EQ(s.candidates.value, c.value);
                } else {
                  EXPECT_FALSE(s.complete());
                  EXPECT_EQ(s.candidates.size(), 0u);
                }
                const uint32_t zero_key = with_residual && s.complete() ? key_at_least<T>(zero_from) : kNoKey;
                EXPECT_EQ(s.candidates.zeroed, zero_key);
                int64_t zeroed = 0;
                for (size_t j = 0; j < c.size(); ++j) {
                  if (Num<T>::key(Num<T>::from_float(c.value[j])) < zero_key) continue;
                  plain.residual[static_cast<size_t>(c.index[j])] = Num<T>::zero();
                  ++zeroed;
                }
                if (zero_key != kNoKey && std::isfinite(lower)) EXPECT_GT(zeroed, 100);
                if (lower == 1.5 && zero_key != kNoKey) EXPECT_LT(zeroed, s.above);
                EXPECT_EQ(0, std::memcmp(fused.residual.data(), plain.residual.data(), kN * sizeof(T)));
                // The unfused default that other devices inherit gives the same, zeroing nothing.
                Bucket<T> composed(with_residual);
                composed.grad[7] = Num<T>::from_float(INFINITY);
                const Scan d = device.Device::scan(composed.view(), true, range, lower, capacity, sums, zero_from);
                expect_same_moments(d.moments, m);
                EXPECT_EQ(d.above, s.above);
                EXPECT_EQ(d.candidates.index, s.candidates.index);
                EXPECT_EQ(d.candidates.zeroed, kNoKey);
              }
            }
          }
        }
      }
    }
  }
  set_cpu_threads(0);
}

TEST(OnePass, ScanMatchesThePassesItFusesFloat32) { scan_matches_the_passes_it_fuses<float>(); }
TEST(OnePass, ScanMatchesThePassesItFusesFloat16) { scan_matches_the_passes_it_fuses<Half>(); }
TEST(OnePass, ScanMatchesThePassesItFusesBFloat16) { scan_matches_the_passes_it_fuses<BFloat16>(); }

/// The same with momentum correction (with and without masking): the scan's update of residual and
/// velocity, its non-finite count and candidates against the plain passes', and the update against
/// the element-by-element one. Some residual entries are +-0 (masking restarts their velocity), one
/// velocity overflows.
template <typename T>
void scan_with_momentum_matches_the_passes() {
  for (bool masking : {false, true}) {
    for (bool sums : {true, false}) {
      SCOPED_TRACE(::testing::Message() << "masking " << masking << ", sums " << sums);
      Bucket<T> fused(true), plain(true);
      std::vector<T> fused_velocity, plain_velocity;
      for (float v : ref::random_vector<float>(kN, 9)) fused_velocity.push_back(Num<T>::from_float(v));
      for (int64_t i = 0; i < kN; i += 5) fused.residual[i] = Num<T>::from_float(i % 2 ? -0.0f : 0.0f);
      fused.grad[7] = Num<T>::from_float(INFINITY);
      fused_velocity[40] = Num<T>::from_float(std::numeric_limits<float>::max());
      fused.grad[40] = Num<T>::from_float(std::numeric_limits<float>::max());
      plain = fused;
      plain_velocity = fused_velocity;
      // The update element by element, as Source::update_element defines it: the SIMD paths that
      // both passes share must match it too.
      std::vector<T> one_residual = fused.residual, one_velocity = fused_velocity;
      const Source<T> one{one_residual.data(), fused.grad.data(), true, one_velocity.data(), 0.9f, masking};
      for (int64_t i = 0; i < kN; ++i) {
        bool finite;
        one.update_element(i, finite);
      }
      auto with_velocity = [&](Bucket<T>& b, std::vector<T>& velocity) {
        BucketView view = b.view();
        view.velocity = velocity.data();
        view.momentum = 0.9f;
        view.momentum_masking = masking;
        return view;
      };
      CpuDevice device;
      const Scan s = device.scan(with_velocity(fused, fused_velocity), true, Range{0, kN}, 1.5, -1, sums);
      Moments m = device.moments(with_velocity(plain, plain_velocity), true);
      EXPECT_GE(m.nonfinite, 1);
      if (!sums) {
        Moments only;
        only.nonfinite = m.nonfinite;
        m = only;
      }
      expect_same_moments(s.moments, m);
      const Candidates c = device.collect(plain.view(), Range{0, kN}, 1.5, false);
      EXPECT_GT(c.size(), 100u);
      EXPECT_EQ(s.candidates.index, c.index);
      EXPECT_EQ(s.candidates.value, c.value);
      EXPECT_EQ(0, std::memcmp(fused.residual.data(), plain.residual.data(), kN * sizeof(T)));
      EXPECT_EQ(0, std::memcmp(fused_velocity.data(), plain_velocity.data(), kN * sizeof(T)));
      EXPECT_EQ(0, std::memcmp(fused.residual.data(), one_residual.data(), kN * sizeof(T)));
      EXPECT_EQ(0, std::memcmp(fused_velocity.data(), one_velocity.data(), kN * sizeof(T)));
    }
  }
}

TEST(OnePass, ScanWithMomentumMatchesThePassesFloat32) { scan_with_momentum_matches_the_passes<float>(); }
TEST(OnePass, ScanWithMomentumMatchesThePassesBFloat16) { scan_with_momentum_matches_the_passes<BFloat16>(); }

/// A bound at `lower` for the next pass, learned from a first step (which has no candidates, so
/// its bound widens from 0.85 to 0.68 of the lowest question).
CandidateBound bound_at(double lower) {
  CandidateBound bound;
  if (!std::isfinite(lower)) return bound;
  Bucket<float> b(true);
  CpuDevice device;
  OnePass pass(device, b.view(), bound, 1000);
  pass.counts({lower / 0.68}, false)[0];  // an answer within the capacity
  bound.learn(pass);
  EXPECT_DOUBLE_EQ(bound.lower(), lower);
  return bound;
}

TEST(OnePass, AnswersEqualPlainPasses) {
  // Values ~ N(0, 1.12^2), 98 thousand of them; k = 500 lists at most 5024 candidates, so the
  // answers at 2.5 and above fit (about 2.5%) and a bound at 2.0 finds too many (about 7%).
  const int64_t k = 500;
  struct Case {
    double lower;
    bool overflowed, missed;
  };
  // No bound, above every question, above some, below all of them, too low.
  for (const Case& c : {Case{INFINITY, false, true}, Case{3.2, false, true}, Case{2.55, false, true},
                        Case{2.45, false, false}, Case{2.0, true, true}}) {
    SCOPED_TRACE(c.lower);
    const CandidateBound bound = bound_at(c.lower);
    Bucket<float> one(true), plain(true);
    CpuDevice device;
    OnePass pass(device, one.view(), bound, k);
    expect_same_moments(pass.moments(), device.moments(plain.view(), true));
    const std::vector<double> thresholds{2.6, 2.5, 3.0, 2.8};
    for (bool strict : {false, true}) {
      OnePass::Counts counts = pass.counts(thresholds, strict);
      const std::vector<int64_t> want = device.count(plain.view(), Range{0, kN}, thresholds, strict);
      for (size_t j : {size_t{2}, size_t{0}, size_t{1}, size_t{3}}) EXPECT_EQ(counts[j], want[j]) << thresholds[j];
    }
    for (const auto& [t, every] : {std::pair{2.6, 1}, std::pair{2.5, 1}, std::pair{2.5, 2}}) {
      const BlockSample sample{every};  // a sample of the candidates, or of the bucket
      const Exceedance e = pass.exceedance(t, true, 0.5, sample);
      const Exceedance f = device.exceedance(plain.view(), t, true, 0.5, sample);
      EXPECT_EQ(e.count, f.count);
      EXPECT_EQ(e.sum, f.sum);  // the CPU kernel's order, to the bit
      EXPECT_EQ(e.sum_sq, f.sum_sq);
      EXPECT_EQ(e.min, f.min);
    }
    // The 12th largest of a 2% sample (3.11): from the candidates at the bounds below it, by
    // gathering the sample at the others (at 3.2 only 11 sampled elements are candidates).
    std::vector<uint64_t> sampled;
    sample_distinct_bits(9, kN / 50, kN, sampled);
    std::vector<float> sample;
    for (int64_t i : sample_distinct(9, kN / 50, kN)) sample.push_back(std::fabs(plain.residual[i]));
    std::sort(sample.begin(), sample.end(), std::greater<float>());
    EXPECT_EQ(pass.kth_sampled(sampled, kN / 50, 12), sample[11]);
    EXPECT_GT(sample[11], 2.6);
    // The 5th largest of the hashed 1% sample (about 980 elements): from the candidates where
    // they hold 5 sampled elements, else by hashing every position; nothing where s exceeds it.
    std::vector<float> hashed;
    for (int64_t i = 0; i < kN; ++i) {
      if (in_percent_sample(9, static_cast<uint64_t>(i))) hashed.push_back(std::fabs(plain.residual[i]));
    }
    std::sort(hashed.begin(), hashed.end(), std::greater<float>());
    EXPECT_GT(hashed.size(), 900u);
    EXPECT_LT(hashed.size(), 1080u);
    EXPECT_EQ(pass.kth_hashed(9, 5), hashed[4]);
    EXPECT_EQ(pass.kth_hashed(9, static_cast<int64_t>(hashed.size())), hashed.back());
    EXPECT_FALSE(pass.kth_hashed(9, static_cast<int64_t>(hashed.size()) + 1).has_value());
    // Largest first (it zeroes what it takes), then a threshold selection of what is left: a pass
    // over the bucket, since the candidates no longer match the residual.
    const Selection top = pass.largest(k);
    const Selection want_top = device.select_topk(plain.view(), k, false);
    EXPECT_EQ(bytes(top), bytes(want_top));
    EXPECT_GT(smallest_magnitude(device, top, plain.view()), 2.6);
    EXPECT_EQ(pass.missed(), c.missed);
    const Selection s = pass.select(2.5, false, true);
    const Selection want = device.select(plain.view(), SelectRule{2.5, false, Range{0, kN}, false, true});
    EXPECT_EQ(bytes(s), bytes(want));
    EXPECT_GT(s.count, 100);
    EXPECT_EQ(one.residual, plain.residual);
    EXPECT_EQ(pass.overflowed(), c.overflowed);
    EXPECT_TRUE(pass.missed());
  }
}

// holds() says what a count would say, from the candidates where they hold k or more (above the
// bound and below it), by a pass where they do not, and never as a question for the bound.
TEST(OnePass, HoldsAnswersAsACountAndAsksNothingOfTheCandidates) {
  CpuDevice device;
  Bucket<float> one(true), plain(true);
  OnePass pass(device, one.view(), bound_at(2.45), 500);
  device.moments(plain.view(), true);  // the update the pass made
  const int64_t candidates = pass.candidates();
  int answers[2] = {0, 0};
  for (double t : {0.5, 2.0, 2.45, 2.5, 2.6, 3.0, 3.3, 4.0}) {
    for (int64_t m : {int64_t{1}, int64_t{300}, int64_t{500}, candidates}) {
      const bool want = device.count(plain.view(), Range{0, kN}, {t}, false)[0] >= m;
      EXPECT_EQ(pass.holds(t, m), want) << t << ", " << m;
      ++answers[want ? 1 : 0];
    }
  }
  EXPECT_GT(answers[0], 0);
  EXPECT_GT(answers[1], 0);
  EXPECT_EQ(pass.lowest_asked(), INFINITY);
  EXPECT_FALSE(pass.missed());
  // More than the candidates: a pass over the bucket (about 3,900 reach 2.3, 2,800 2.6), still
  // no question for the bound.
  EXPECT_TRUE(pass.holds(2.3, candidates + 1));
  EXPECT_FALSE(pass.holds(2.6, candidates + 1));
  EXPECT_EQ(pass.lowest_asked(), INFINITY);
  EXPECT_FALSE(pass.missed());
}

TEST(OnePass, TheBoundSettlesOnAStationaryStream) {
  CandidateBound bound;
  const int64_t k = 300;
  bool settled = false;
  for (int step = 0; step < 6; ++step) {
    Bucket<float> b(true, 10 + step);
    CpuDevice device;
    OnePass pass(device, b.view(), bound, k);
    const double kth = smallest_magnitude(device, pass.largest(k), b.view());
    if (step >= 3) settled = !pass.missed() && !pass.overflowed();
    EXPECT_FALSE(step == 0 && !pass.missed()) << "the first step has no candidates";
    bound.learn(pass);
    EXPECT_LT(bound.lower(), kth);
  }
  EXPECT_TRUE(settled);
}

/// A stream whose threshold moves by 8% from step to step, up and down: the bound stays below
/// every step's threshold once it has learned the moves (it never tightens to within 2.5 standard
/// deviations of them), so no step after the first dozen misses its candidates or lists too many
/// (either costs a pass).
TEST(OnePass, TheBoundStaysBelowAThresholdThatMoves) {
  CandidateBound bound;
  const int64_t k = 300;
  int missed = 0;
  for (int step = 0; step < 40; ++step) {
    Bucket<float> b(true, 10 + step);
    const float scale = step % 2 == 0 ? 1.04f : 1.0f / 1.04f;
    for (float& g : b.grad) g *= scale;
    for (float& r : b.residual) r *= scale;
    CpuDevice device;
    OnePass pass(device, b.view(), bound, k);
    pass.largest(k);
    if (step >= 12) missed += pass.missed() || pass.overflowed() ? 1 : 0;
    bound.learn(pass);
  }
  EXPECT_EQ(missed, 0);
}

/// A bound through a bucket of n elements (70 blocks) whose gradient grows by `growth` (5%) every
/// other step (k = 1% of it): `ask(step, pass)` asks a step's questions before its top k,
/// `look(step, pass)` sees the finished step before the bound learns from it.
constexpr int64_t kMovingN = 70 * kCpuBlock + 5, kMovingK = kMovingN / 100;
template <typename Ask, typename Look>
void moving_stream(int steps, const Ask& ask, const Look& look, float growth = 1.05f, int64_t n = kMovingN,
                   int64_t k = kMovingK) {
  const std::vector<float> grad = ref::random_vector<float>(n, 31), start = ref::random_vector<float>(n, 32, 0.5f);
  CpuDevice device;
  CandidateBound bound;
  for (int step = 0; step < steps; ++step) {
    const float scale = step % 2 == 1 ? growth : 1.0f;
    std::vector<float> g(grad), r(start);
    for (float& v : g) v *= scale;
    BucketView view{DType::kFloat32, n, g.data(), r.data()};
    OnePass pass(device, view, bound, k);
    ask(step, pass);
    pass.largest(k);
    look(step, pass);
    bound.learn(pass);
  }
}

/// Where the threshold moves and a method asks, every fourth step, about a threshold 6% below
/// its k-th largest (as RedSync's first count does when the largest magnitude moves), the bound
/// stands below that question's usual place relative to the step's estimate: no step misses, and
/// none lists from as far below as a bound placed below the last lowest question would (which,
/// after such a step, put it there and then lower by the spread of the moves). Whether the
/// questions start with the first step that estimates or after several ordinary ones, no step
/// misses once twenty have estimated. (Where the spread of their place started at 0 and grew by a
/// twentieth a step, questions that started late missed every time for more than 30 steps.)
TEST(OnePass, TheBoundStandsBelowQuestionsAwayFromTheEstimate) {
  for (int first : {2, 10}) {
    int missed = 0;
    int64_t most = 0;
    moving_stream(
        40 + first,
        [&](int step, OnePass& pass) {
          if (step >= first && step % 4 == 2 && std::isfinite(pass.estimate()))
            pass.counts({0.94 * pass.estimate()}, true)[0];
        },
        [&](int step, const OnePass& pass) {
          if (step < first + 20) return;
          missed += pass.missed() || pass.overflowed() ? 1 : 0;
          most = std::max(most, pass.candidates());
        });
    EXPECT_EQ(missed, 0) << "questions from step " << first;
    EXPECT_LT(most, 23 * kMovingK / 10) << most;  // 2.6 k with the bound below the last lowest question
  }
}

/// A bucket that starts with an outlying layer (its first 8,192 elements 14 times the others'
/// magnitudes, as a classifier's weights at the start of DDP's first bucket), which moves by up
/// to 40% a step while the rest grows by 5% every other step. The estimate's blocks always hold
/// the first, so the estimate is a quantile of that layer and moves with it, while the k-th
/// largest moves with the rest: the bound learns not to follow the estimate, and after twenty
/// steps no step misses or lists too many. (Moved by the estimate, 26 of the 40 did, each
/// costing the exact passes: one bucket of 16.8M elements, a 4x2048 MLP's, selected in 20 ms a
/// step instead of 9.)
TEST(OnePass, AnOutlyingLayerInTheEstimatesBlocksDoesNotMoveTheBound) {
  constexpr int64_t n = kMovingN, k = kMovingK, outlying = 8192;
  const std::vector<float> grad = ref::random_vector<float>(n, 41), start = ref::random_vector<float>(n, 42, 0.5f);
  std::mt19937_64 rng(43);
  std::uniform_real_distribution<float> jitter(0.6f, 1.4f);
  CpuDevice device;
  CandidateBound bound;
  int costly = 0;
  for (int step = 0; step < 60; ++step) {
    const float scale = step % 2 == 1 ? 1.05f : 1.0f, layer = 14.0f * jitter(rng);
    std::vector<float> g(grad), r(start);
    for (int64_t i = 0; i < n; ++i) g[i] *= i < outlying ? layer : scale;
    BucketView view{DType::kFloat32, n, g.data(), r.data()};
    OnePass pass(device, view, bound, k);
    pass.largest(k);
    if (step >= 20) costly += pass.missed() || pass.overflowed() ? 1 : 0;
    bound.learn(pass);
  }
  EXPECT_LE(costly, 1);
}

/// At a density so low that 16 blocks hold fewer than 64 of the k largest (k = 300 of 128 blocks:
/// about 37), the estimate reads as many blocks as hold 64 (28): every step estimates, so the
/// bound follows the moves and no step misses or lists too many. (Without it no step estimated;
/// at 25M elements and density 0.0001 the bound missed or overflowed every few steps, and DGC's
/// step took 9 adds.)
TEST(OnePass, EstimatesAtLowDensitiesFromMoreBlocks) {
  constexpr int64_t n = 128 * kCpuBlock, k = 300;
  int estimated = 0, missed = 0;
  int64_t most = 0;
  double worst = 0.0;  // the estimate's largest relative error against the k-th largest taken
  moving_stream(
      40, [](int, OnePass&) {},
      [&](int step, const OnePass& pass) {
        if (step < 20) return;
        estimated += std::isfinite(pass.estimate()) ? 1 : 0;
        missed += pass.missed() || pass.overflowed() ? 1 : 0;
        most = std::max(most, pass.candidates());
        worst = std::max(worst, std::fabs(pass.estimate() / pass.lowest_asked() - 1.0));
      },
      1.05f, n, k);
  EXPECT_EQ(estimated, 20);
  EXPECT_EQ(missed, 0);
  EXPECT_LT(most, 3 * k) << most;
  EXPECT_LT(worst, 0.05) << worst;
}

/// One question far below the estimate (30%, once) widens the bound for a few steps, not for
/// dozens: the spread of the questions' place is a mean absolute deviation, which one far
/// question moves in proportion to its distance. (With a standard deviation the bound listed
/// 3.5k candidates three steps later and 1.7k forty steps later.)
TEST(OnePass, OneFarQuestionWidensTheBoundForAFewStepsOnly) {
  int missed = 0;
  int64_t before = 0, most = 0;
  moving_stream(
      36,
      [](int step, OnePass& pass) {
        if (step != 20) return;
        ASSERT_TRUE(std::isfinite(pass.estimate()));
        pass.counts({0.7 * pass.estimate()}, true)[0];
      },
      [&](int step, const OnePass& pass) {
        if (step >= 12 && step < 20) before = std::max(before, pass.candidates());
        if (step > 21) missed += pass.missed() || pass.overflowed() ? 1 : 0;
        if (step >= 23) most = std::max(most, pass.candidates());
      });
  EXPECT_EQ(missed, 0);
  EXPECT_LT(before, 12 * kMovingK / 10) << before;
  EXPECT_LT(most, 18 * kMovingK / 10) << most;
}

/// Where the threshold stands still, one question far below it (30%, once) makes the steps
/// estimate their k-th largest (a sample read before the scan, for a threshold that moves) for
/// about twenty steps, not fifty: the spread of the question's moves is a mean absolute one.
TEST(OnePass, OneFarQuestionOnAStillThresholdIsForgottenInAFewSteps) {
  double last = 0.0;
  int estimated = 0, missed = 0;
  int64_t most = 0;
  moving_stream(
      80,
      [&](int step, OnePass& pass) {
        if (step == 20) pass.counts({0.7 * last}, true)[0];
      },
      [&](int step, const OnePass& pass) {
        last = pass.lowest_asked();
        if (step > 21) missed += pass.missed() || pass.overflowed() ? 1 : 0;
        if (step > 21) estimated += std::isfinite(pass.estimate()) ? 1 : 0;
        if (step >= 30) most = std::max(most, pass.candidates());
      },
      1.0f);
  EXPECT_EQ(missed, 0);
  EXPECT_LE(estimated, 25) << estimated;  // 53 with the moves' standard deviation
  EXPECT_LT(most, 12 * kMovingK / 10) << most;
}

/// Over a bucket of 64 blocks and more whose threshold has been moving (`moving`: by 10% a step),
/// the scan zeroes from this step's k-th largest magnitude, estimated from a sample of its blocks
/// before the scan, and not from the last step's threshold: a step whose gradient grew by 15%
/// zeroes about k candidates, not the twice k and more above the last threshold, and its bound
/// moves up with the estimate. Where it has not been moving, from the last threshold. The sample
/// reads the update without writing it (the velocity too), and the step then leaves the residual
/// and the velocity as the plain update and its top k do.
template <typename T>
void zeroes_from_an_estimate_of_this_steps_threshold(bool momentum, bool moving) {
  const int64_t n = 70 * kCpuBlock + 5, k = n / 100;
  const std::vector<float> grad = ref::random_vector<float>(n, 31), start = ref::random_vector<float>(n, 32, 0.5f);
  const std::vector<float> velocity_start = ref::random_vector<float>(n, 33, 0.2f);
  struct Step {
    std::vector<T> grad, residual, velocity;
    Step(const std::vector<float>& g, const std::vector<float>& r, const std::vector<float>& u, float scale) {
      for (float v : g) grad.push_back(Num<T>::from_float(v * scale));
      for (float v : r) residual.push_back(Num<T>::from_float(v));
      for (float v : u) velocity.push_back(Num<T>::from_float(v));
    }
  };
  auto view = [&](Step& s) {
    BucketView v{dtype_of<T>(), n, s.grad.data(), s.residual.data()};
    if (momentum) {
      v.velocity = s.velocity.data();
      v.momentum = 0.9f;
      v.momentum_masking = true;
    }
    return v;
  };
  CpuDevice device;
  CandidateBound bound;
  // The first step lists nothing, the next too many; then they zero their top k.
  float scale = 1.0f;
  for (int step = 0; step < 12 && !(step > 6 && std::isfinite(bound.zero_from())); ++step) {
    scale = moving && step % 2 == 1 ? 1.1f : 1.0f;
    Step s(grad, start, velocity_start, scale);
    OnePass pass(device, view(s), bound, k);
    pass.largest(k);
    bound.learn(pass);
  }
  const double last = bound.zero_from();
  ASSERT_TRUE(std::isfinite(last));
  if (moving) {
    ASSERT_GT(bound.moves(), 0.01);
  } else {
    ASSERT_EQ(bound.moves(), 0.0);
  }
  Step one(grad, start, velocity_start, 1.15f * scale), plain = one;
  device.moments(view(plain), true);  // the plain update
  int64_t above_last = 0;
  for (const T& v : plain.residual) above_last += std::fabs(Num<T>::to_float(v)) >= last ? 1 : 0;
  ASSERT_GT(above_last, 2 * k) << "the gradient's growth moves the threshold";
  {
    OnePass pass(device, view(one), bound, k);
    int64_t zeroed = 0;
    for (int64_t i = 0; i < n; ++i)
      zeroed += Num<T>::to_float(one.residual[i]) == 0.0f && Num<T>::to_float(plain.residual[i]) != 0.0f ? 1 : 0;
    if (moving) {
      EXPECT_GT(zeroed, k * 9 / 10);
      EXPECT_LT(zeroed, k * 11 / 10);
      EXPECT_LT(pass.candidates(), 3 * k);
    } else {
      EXPECT_EQ(zeroed, above_last);
      EXPECT_EQ(pass.rescale(), 1.0);
    }
    const Selection s = pass.largest(k);
    if (moving) {  // the bound moved as the threshold did, estimated from the same blocks both steps
      EXPECT_NEAR(pass.rescale(), smallest_magnitude(device, s, view(one)) / last, 0.01);
    }
    EXPECT_EQ(bytes(s), bytes(device.select_topk(view(plain), k, /*update=*/false, /*zero=*/true)));
  }
  EXPECT_EQ(0, std::memcmp(one.residual.data(), plain.residual.data(), n * sizeof(T)));
  EXPECT_EQ(0, std::memcmp(one.velocity.data(), plain.velocity.data(), n * sizeof(T)));
}

TEST(OnePass, ZeroesFromAnEstimateOfThisStepsThreshold) {
  zeroes_from_an_estimate_of_this_steps_threshold<float>(false, true);
  zeroes_from_an_estimate_of_this_steps_threshold<float>(true, true);
  zeroes_from_an_estimate_of_this_steps_threshold<BFloat16>(true, true);
  zeroes_from_an_estimate_of_this_steps_threshold<float>(false, false);
}

/// The hashed sample's s-th largest from more candidates than one block of them (their hashes are
/// taken block by block on the pool's threads, then joined).
TEST(OnePass, KthHashedFromManyCandidates) {
  CpuDevice device;
  CandidateBound bound;  // at 0.3: about 80% of the elements are candidates
  {
    Bucket<float> b(true);
    OnePass pass(device, b.view(), bound, kN);
    pass.counts({0.3 / 0.68}, false)[0];
    bound.learn(pass);
  }
  ASSERT_DOUBLE_EQ(bound.lower(), 0.3);
  Bucket<float> one(true), plain(true);
  OnePass pass(device, one.view(), bound, kN);
  device.moments(plain.view(), true);  // the plain update
  EXPECT_GT(pass.candidates(), 2 * kCpuBlock);
  std::vector<float> hashed;
  for (int64_t i = 0; i < kN; ++i) {
    if (in_percent_sample(9, static_cast<uint64_t>(i))) hashed.push_back(std::fabs(plain.residual[i]));
  }
  std::sort(hashed.begin(), hashed.end(), std::greater<float>());
  for (int64_t s : {1, 5, 200}) EXPECT_EQ(pass.kth_hashed(9, s), hashed[static_cast<size_t>(s - 1)]) << s;
  EXPECT_FALSE(pass.missed());
}

/// A bound learned from a step whose zeroing selection (the k largest) its candidates answered:
/// the next scan zeroes from that step's threshold.
template <typename T>
CandidateBound zeroing_bound(int64_t k) {
  CandidateBound bound = bound_at(2.45);
  CpuDevice device;
  Bucket<T> b(true, 20);
  OnePass pass(device, b.view(), bound, k);
  pass.largest(k);
  EXPECT_FALSE(pass.missed());
  bound.learn(pass);
  return bound;
}

/// A step whose zeroing selection its candidates answered teaches the bound to zero from its
/// threshold in the next scan; a step that then makes no zeroing selection (it ends without one,
/// selects without zeroing, or reads the bucket again) leaves the residual as a plain update does,
/// and a step that read the bucket again teaches no zeroing.
TEST(OnePass, ZeroesFromTheLastSelectionAndLosesNothing) {
  const int64_t k = 500;
  const CandidateBound bound = zeroing_bound<float>(k);
  CpuDevice device;
  ASSERT_GT(bound.zero_from(), 2.6);
  ASSERT_TRUE(std::isfinite(bound.zero_from()));
  const double t = bound.zero_from() * 1.01;  // above the bound: the candidates answer it
  for (int ending = 0; ending < 3; ++ending) {
    SCOPED_TRACE(ending);
    Bucket<float> one(true, 21), plain(true, 21);
    device.moments(plain.view(), true);  // the plain update
    {
      OnePass pass(device, one.view(), bound, k);
      EXPECT_NE(one.residual, plain.residual) << "the scan zeroed nothing";
      if (ending == 1) {  // then zeroed by the method through the device, as DGC's reference mode does
        const Selection s = pass.select(t, false, /*zero=*/false);
        const Selection want = device.select(plain.view(), SelectRule{t, false, Range{0, kN}, false, false});
        EXPECT_EQ(bytes(s), bytes(want));
        EXPECT_FALSE(pass.missed());
        device.zero_at(one.view(), s.view(one.view()));
        device.zero_at(plain.view(), want.view(plain.view()));
      } else if (ending == 2) {  // a count below the bound (a pass over the bucket), then the selection
        EXPECT_EQ(pass.counts({1.0}, false)[0], device.count(plain.view(), Range{0, kN}, {1.0}, false)[0]);
        const Selection s = pass.select(t, false, /*zero=*/true);
        EXPECT_EQ(bytes(s), bytes(device.select(plain.view(), SelectRule{t, false, Range{0, kN}, false, true})));
        EXPECT_GT(s.count, 100);
        CandidateBound after = bound;
        after.learn(pass);
        EXPECT_EQ(after.zero_from(), INFINITY);
      }
    }
    EXPECT_EQ(one.residual, plain.residual);
  }
}

/// A question that reads only a sample of the blocks (SIDCo's exceedances and sum of logs) writes
/// back what the scan zeroed there alone, answers as a read after the plain update does, and
/// keeps the zeroing for the next step; the step's zeroing selection then leaves the residual as
/// the plain update and that selection do.
template <typename T>
void reads_a_sample_of_blocks_without_undoing_the_zeroing() {
  const int64_t k = 500;
  const CandidateBound bound = zeroing_bound<T>(k);
  CpuDevice device;
  ASSERT_TRUE(std::isfinite(bound.zero_from()));
  const BlockSample sample{2};  // blocks 0 and 2 of 4
  Bucket<T> one(true, 21), plain(true, 21);
  device.moments(plain.view(), true);  // the plain update
  {
    OnePass pass(device, one.view(), bound, k);
    const std::vector<T> scanned = one.residual;
    int64_t zeroed_in_sample = 0;
    for (int64_t i = 0; i < kN; ++i)
      zeroed_in_sample += sample.holds(i) && Num<T>::to_float(scanned[i]) != Num<T>::to_float(plain.residual[i]);
    ASSERT_GT(zeroed_in_sample, 50) << "the scan zeroed nothing in the sampled blocks";
    for (double t : {1.0, 3.0}) {  // below every candidate, and among them
      const Exceedance e = pass.exceedance(t, true, 0.5, sample);
      const Exceedance want = device.exceedance(plain.view(), t, true, 0.5, sample);
      EXPECT_EQ(e.count, want.count) << t;
      EXPECT_EQ(e.sum, want.sum) << t;
      EXPECT_EQ(e.sum_sq, want.sum_sq) << t;
      EXPECT_EQ(e.min, want.min) << t;
    }
    EXPECT_EQ(pass.log_sum(0.5, 1e-9, sample), device.log_sum(plain.view(), 0.5, 1e-9, sample));
    int64_t differ = 0;  // the sampled blocks as the plain update left them, the rest as the scan did
    for (int64_t i = 0; i < kN; ++i) {
      const T want = sample.holds(i) ? plain.residual[i] : scanned[i];
      differ += std::memcmp(&one.residual[i], &want, sizeof(T)) != 0;
    }
    EXPECT_EQ(differ, 0);
    const double t = bound.zero_from() * 1.01;
    EXPECT_EQ(bytes(pass.select(t, false, /*zero=*/true)),
              bytes(device.select(plain.view(), SelectRule{t, false, Range{0, kN}, false, true})));
    CandidateBound after = bound;
    after.learn(pass);
    EXPECT_EQ(after.zero_from(), t) << "the next scan does not zero";
  }
  EXPECT_EQ(0, std::memcmp(one.residual.data(), plain.residual.data(), kN * sizeof(T)));
}
TEST(OnePass, ReadsASampleOfBlocksWithoutUndoingTheZeroing) {
  reads_a_sample_of_blocks_without_undoing_the_zeroing<float>();
}
TEST(OnePass, ReadsASampleOfBlocksWithoutUndoingTheZeroingBFloat16) {
  reads_a_sample_of_blocks_without_undoing_the_zeroing<BFloat16>();
}

/// From estimates off by a factor of up to 10 either way, the density control's threshold holds
/// k elements within its 2% (random normal values: no ties); the next step starts where this one
/// ended, so the same estimate needs no further count.
TEST(DensityControl, SteersAnEstimateToKElements) {
  const int64_t k = 300;
  for (double off : {1.0, 0.5, 2.0, 0.1, 10.0}) {
    Bucket<float> b(true, 40);
    CpuDevice device;
    OnePass pass(device, b.view(), CandidateBound{}, k);
    Bucket<float> copy(true, 40);
    OnePass exact(device, copy.view(), CandidateBound{}, k);
    const double kth = smallest_magnitude(device, exact.largest(k), copy.view());
    DensityControl control;
    const double t = control.threshold(pass, kth * off, k);
    const int64_t c = pass.counts({t}, true)[0];
    EXPECT_LE(std::abs(c - k), DensityControl::kTolerance * k) << "estimate x" << off << ": " << c;
    control.commit();  // the step completed (the method's observe())
    Bucket<float> again(true, 40);
    OnePass next(device, again.view(), CandidateBound{}, k);
    EXPECT_EQ(control.threshold(next, kth * off, k), t) << "estimate x" << off;
  }
}

/// A scale learned far off (here 10^4 too high, as a step of only residuals left it before the
/// fix; checkpoints keep it) puts every count of the next step at 0, where the counts say nothing
/// of the slope: the control must widen its steps until it finds the data, not creep down at the
/// last slope (64, 1/64 of the log ratio a step), and be within its 2% of k a step later.
TEST(DensityControl, LeavesACountOfZeroFarFromTheData) {
  const int64_t k = 300;
  DensityControl control;
  control.load({{"control.scale", 17240.5}, {"control.slope", 64.0}});
  CpuDevice device;
  Bucket<float> copy(true, 40);
  OnePass exact(device, copy.view(), CandidateBound{}, k);
  const double kth = smallest_magnitude(device, exact.largest(k), copy.view());
  int64_t c = 0;
  for (int step = 0; step < 2; ++step) {
    Bucket<float> b(true, 40);
    OnePass pass(device, b.view(), CandidateBound{}, k);
    c = pass.counts({control.threshold(pass, kth, k)}, true)[0];
    control.commit();  // the step completed (the method's observe())
  }
  EXPECT_LE(std::abs(c - k), DensityControl::kTolerance * k) << c;
}

/// k = 1 and the three largest magnitudes tied (a plain sum's identical gradients, which error
/// feedback keeps tied): every count is 0 or at least 3, and 0 is nearer 1. The control chose it
/// at every step, from every estimate, and the bucket sent nothing for good. It sends the group,
/// at every step.
TEST(DensityControl, SendsTiedLargestMagnitudesRatherThanNothing) {
  CpuDevice device;
  for (double estimate : {50.0, 25.0, 100.0, 1e-3, 1e4}) {
    DensityControl control;
    for (int step = 0; step < 8; ++step) {
      Bucket<float> b(true, 40);
      for (int64_t i : {int64_t{5}, int64_t{777}, kN - 1}) {
        b.grad[i] = 50.0f;  // above every other |v| (normal values of deviation about 1.1)
        b.residual[i] = 0.0f;
      }
      OnePass pass(device, b.view(), CandidateBound{}, 1);
      const double t = control.threshold(pass, estimate, 1);
      control.commit();  // the step completed (the method's observe())
      EXPECT_EQ(pass.counts({t}, true)[0], 3) << "estimate " << estimate << ", step " << step;
    }
  }
}

/// A scale (here a loaded one) whose product with the estimate passes the largest double: the
/// threshold was Inf, no step moved from it and Inf was kept as the scale, so nothing was sent
/// from then on and the saved state was refused. The control starts from the estimate instead.
TEST(DensityControl, StartsFromTheEstimateWhereTheScaleOverflows) {
  const int64_t k = 300;
  CpuDevice device;
  Bucket<float> copy(true, 40);
  OnePass exact(device, copy.view(), CandidateBound{}, k);
  const double kth = smallest_magnitude(device, exact.largest(k), copy.view());
  DensityControl control;
  control.load({{"control.scale", 1e308}});
  Bucket<float> b(true, 40);
  OnePass pass(device, b.view(), CandidateBound{}, k);
  const int64_t c = pass.counts({control.threshold(pass, kth * 2.0, k)}, true)[0];
  EXPECT_LE(std::abs(c - k), DensityControl::kTolerance * k) << c;
  control.commit();
  std::map<std::string, double> state;
  control.save(state);
  EXPECT_TRUE(std::isfinite(state["control.scale"])) << state["control.scale"];
}

/// An estimate among the smallest doubles (a subnormal), steered to the data: the ratio of the
/// threshold to it passed the largest double, and Inf was kept as the scale. The scale stays a
/// positive finite number, which a saved state loads.
TEST(DensityControl, KeepsAFiniteScaleFromASubnormalEstimate) {
  const int64_t k = 300;
  CpuDevice device;
  DensityControl control;
  control.load({{"control.scale", 1e300}});
  Bucket<float> b(true, 40);
  OnePass pass(device, b.view(), CandidateBound{}, k);
  const double t = control.threshold(pass, std::numeric_limits<double>::denorm_min(), k);
  EXPECT_GT(t, 1e-3);  // the data reached, so that the ratio to the estimate overflows
  control.commit();
  std::map<std::string, double> state;
  control.save(state);
  EXPECT_TRUE(std::isfinite(state["control.scale"]) && state["control.scale"] > 0.0) << state["control.scale"];
  EXPECT_NO_THROW(DensityControl().load(state));
}

using Factory = std::function<std::unique_ptr<Method>()>;

/// The scale of each step's gradients: a drift, a jump up, a jump down.
const std::vector<float> kDriftScales{1.0f, 1.02f, 1.05f, 1.03f, 20.0f, 19.0f, 0.01f, 0.011f, 0.012f};

/// Step t's gradient of n elements at kDriftScales[t], every 97th element eight times larger (a
/// heavier tail).
std::vector<float> drift_gradient(int64_t n, uint64_t seed, size_t t) {
  std::vector<float> grad = drawn_once(n, seed, kDriftScales[t]);
  for (int64_t i = 0; i < n; i += 97) grad[i] *= 8.0f;
  return grad;
}

template <typename T>
void same_with_and_without_bound_in(const Factory& make, bool ties) {
  const int64_t n = kN;
  std::vector<T> residual_kept(n, Num<T>::zero()), residual_fresh(n, Num<T>::zero());
  std::unique_ptr<Method> kept = make();
  for (size_t t = 0; t < kDriftScales.size(); ++t) {
    std::vector<float> grad = drift_gradient(n, 100 + t, t);
    if (ties)
      for (float& g : grad) g = std::round(g / kDriftScales[t] * 2.0f) * kDriftScales[t] / 2.0f;
    std::vector<T> out_kept, out_fresh;
    for (float g : grad) out_kept.push_back(Num<T>::from_float(g));
    out_fresh = out_kept;
    std::unique_ptr<Method> fresh = make();
    fresh->load_state(kept->state());
    gradsparse::testing::rethrow_first(gradsparse::testing::run_ranks(1, [&](int, Transport& transport) {
      CpuDevice device;
      BucketView a{dtype_of<T>(), n, out_kept.data(), residual_kept.data()};
      BucketView b{dtype_of<T>(), n, out_fresh.data(), residual_fresh.data()};
      reduce_bucket(kept.get(), transport, device, a, ReduceOptions{});
      reduce_bucket(fresh.get(), transport, device, b, ReduceOptions{});
    }));
    ASSERT_EQ(0, std::memcmp(out_kept.data(), out_fresh.data(), n * sizeof(T))) << "step " << t;
    ASSERT_EQ(0, std::memcmp(residual_kept.data(), residual_fresh.data(), n * sizeof(T))) << "step " << t;
  }
}

/// Steps of one method on one rank: the method kept across steps (its bound learned) against a
/// fresh method with the same state each step (no bound: every answer from passes over the
/// bucket). The averaged gradient and the residual agree to the bit every step, through a drift,
/// a jump up (answers below the bound) and a jump down (too many candidates). With `ties`, the
/// gradients take a few values only, so many elements tie at any threshold. In float32 and again
/// in bfloat16 (whose candidates' keys are written out, not read in place).
void same_with_and_without_bound(const Factory& make, bool ties = false) {
  same_with_and_without_bound_in<float>(make, ties);
  same_with_and_without_bound_in<BFloat16>(make, ties);
}

TEST(OnePass, TopKDoesNotDependOnTheBound) {
  same_with_and_without_bound([] { return std::make_unique<TopK>(0.01); });
}
// Ties at the k-th largest, in several blocks: the kept method takes the lowest positions among
// the candidates' ties, the fresh one the kernel's (lowest indices).
TEST(OnePass, TopKTakesTheSameTiesWithAndWithoutTheBound) {
  same_with_and_without_bound([] { return std::make_unique<TopK>(0.01); }, /*ties=*/true);
}

// Against a plain filter: across block edges, for several thread counts, keeping none, some or all.
TEST(Parallel, PositionsWhereMatchesAFilter) {
  for (int threads : {1, 2, 3}) {
    set_cpu_threads(threads);
    for (int64_t n : {int64_t{0}, int64_t{1}, kCpuBlock, 3 * kCpuBlock + 5}) {
      const std::vector<float> v = ref::random_vector<float>(n, 7);
      for (float cut : {-1e30f, 1.0f, 1e30f}) {
        const auto keep = [&](size_t j) { return v[j] > cut; };
        std::vector<size_t> want;
        for (size_t j = 0; j < v.size(); ++j)
          if (keep(j)) want.push_back(j);
        EXPECT_EQ(positions_where(v.size(), keep), want) << threads << " threads, n " << n << ", cut " << cut;
      }
    }
  }
  set_cpu_threads(0);
}
// Both modes of the estimators; in the default mode the fresh method also gets the density
// control's state from the checkpoint (state()), so this checks that nothing else carries over.
TEST(OnePass, GaussianKDoesNotDependOnTheBound) {
  for (bool reference : {false, true})
    for (const char* variant : {"spardl", "sidco"})
      same_with_and_without_bound([=] { return std::make_unique<GaussianK>(0.01, variant, "gather", reference); });
}
TEST(OnePass, DGCDoesNotDependOnTheBound) {
  for (bool reference : {false, true})
    same_with_and_without_bound([=] { return std::make_unique<DGC>(0.01, 3, "gather", reference); });
}
TEST(OnePass, RedSyncDoesNotDependOnTheBound) {
  for (bool reference : {false, true})
    same_with_and_without_bound([=] { return std::make_unique<RedSync>(0.01, "gather", reference); });
}
TEST(OnePass, SIDCoDoesNotDependOnTheBound) {
  for (bool reference : {false, true})
    for (const char* fit : {"exp", "gpareto", "gamma_gpareto"})
      for (int stages : {1, 2, 0, -1})
        same_with_and_without_bound(
            [=] { return std::make_unique<SIDCo>(0.01, fit, stages, 0.25, std::nullopt, "gather", reference); });
}

// SAGE's default mode lists its band's top k from the bound's candidates: with its default
// exchange (union, which zeroes nothing at the selection) and with gather (which does).
TEST(OnePass, SAGEDoesNotDependOnTheBound) {
  for (const char* exchange : {"union", "gather"}) {
    for (bool ties : {false, true}) {
      same_with_and_without_bound(
          [=] {
            return std::make_unique<SAGE>(0.01, "flat", std::vector<int64_t>{}, false, 3, std::nullopt,
                                          std::string(exchange));
          },
          ties);
    }
  }
}

/// A banded method's default mode (MiCRO, ExDyna, SAGE) on `ranks` ranks, twice side by side: the
/// band listed for the host (the CPU's path) and the band counted and selected by passes
/// (Listing::kNowhere, the path a GPU takes). Every rank's averaged gradient and residual agree to the bit every step,
/// through a drift, a jump up and a jump down, and so do the methods' checkpointed states.
template <typename T>
void same_listed_and_by_passes(const std::function<std::unique_ptr<Method>(Listing)>& make, int ranks) {
  const int64_t n = kN;
  std::vector<std::unique_ptr<Method>> listed, passes;
  for (int r = 0; r < ranks; ++r) {
    listed.push_back(make(Listing::kHostMemory));
    passes.push_back(make(Listing::kNowhere));
  }
  std::vector<std::vector<T>> residual_listed(ranks, std::vector<T>(n, Num<T>::from_float(0.0f)));
  std::vector<std::vector<T>> residual_passes = residual_listed;
  for (size_t t = 0; t < kDriftScales.size(); ++t) {
    std::vector<std::vector<T>> out_listed(ranks), out_passes(ranks);
    for (int r = 0; r < ranks; ++r) {
      for (float g : drift_gradient(n, 100 + 10 * t + r, t)) out_listed[r].push_back(Num<T>::from_float(g));
      out_passes[r] = out_listed[r];
    }
    gradsparse::testing::rethrow_first(gradsparse::testing::run_ranks(ranks, [&](int r, Transport& transport) {
      CpuDevice device;
      BucketView a{dtype_of<T>(), n, out_listed[r].data(), residual_listed[r].data()};
      BucketView b{dtype_of<T>(), n, out_passes[r].data(), residual_passes[r].data()};
      reduce_bucket(listed[r].get(), transport, device, a, ReduceOptions{});
      reduce_bucket(passes[r].get(), transport, device, b, ReduceOptions{});
    }));
    for (int r = 0; r < ranks; ++r) {
      ASSERT_EQ(0, std::memcmp(out_listed[r].data(), out_passes[r].data(), n * sizeof(T)))
          << "step " << t << " rank " << r;
      ASSERT_EQ(0, std::memcmp(residual_listed[r].data(), residual_passes[r].data(), n * sizeof(T)))
          << "step " << t << " rank " << r;
      const MethodState a = listed[r]->state(), b = passes[r]->state();
      ASSERT_EQ(a.size(), b.size());
      for (const auto& [key, value] : a)  // NaN (no estimate yet) equals NaN here
        ASSERT_TRUE(value == b.at(key) || (std::isnan(value) && std::isnan(b.at(key))))
            << key << " " << value << " " << b.at(key) << ", step " << t << " rank " << r;
    }
  }
}

TEST(PartitionedBand, ListedOrByPassesTheSame) {
  for (const bool micro : {true, false})
    for (const char* exchange : {"union", "gather"})
      for (int ranks : {1, 3}) {
        SCOPED_TRACE(::testing::Message()
                     << (micro ? "MiCRO" : "ExDyna") << ", " << exchange << ", " << ranks << " ranks");
        const auto make = [&](Listing l) -> std::unique_ptr<Method> {
          if (micro) return std::make_unique<MiCRO>(0.01, exchange, false, 5, l);
          return std::make_unique<ExDyna>(0.01, exchange, false, 5, l);
        };
        same_listed_and_by_passes<float>(make, ranks);
        same_listed_and_by_passes<BFloat16>(make, ranks);
        same_listed_and_by_passes<Half>(make, ranks);
      }
}

// SAGE's band: its top k where the band holds k or more (by passes: a device top-k that zeroes the
// residual only where the exchange does not zero later), all of it where it holds fewer (from an
// initial threshold far above the k-th magnitude, about 3 on this stream).
TEST(SageBand, ListedOrByPassesTheSame) {
  for (const std::optional<double> initial : {std::optional<double>{}, std::optional<double>{40.0}})
    for (const char* exchange : {"union", "gather"})
      for (int ranks : {1, 3}) {
        SCOPED_TRACE(::testing::Message()
                     << "SAGE, " << exchange << ", " << ranks << " ranks, initial threshold " << initial.value_or(0.0));
        const auto make = [&](Listing l) -> std::unique_ptr<Method> {
          return std::make_unique<SAGE>(0.01, "flat", std::vector<int64_t>{}, false, 5, initial, exchange, l);
        };
        same_listed_and_by_passes<float>(make, ranks);
        if (initial) continue;  // bfloat16 and float16 from the default start only
        same_listed_and_by_passes<BFloat16>(make, ranks);
        same_listed_and_by_passes<Half>(make, ranks);
      }
}

}  // namespace
