// The threshold estimators and scaling rules (estimators.h), each against known values or a
// direct statement of its rule.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "gradsparse/estimators.h"
#include "gradsparse/parallel.h"
#include "gradsparse/rng.h"

using namespace gradsparse;

TEST(Estimators, NormalQuantileMatchesKnownValues) {
  // Reference values of the standard normal quantile.
  EXPECT_NEAR(normal_quantile(0.975), 1.959963984540054, 1e-13);
  EXPECT_NEAR(normal_quantile(0.9995), 3.290526731491926, 1e-12);
  EXPECT_NEAR(normal_quantile(0.5), 0.0, 0.0);
  EXPECT_NEAR(normal_quantile(0.025), -1.959963984540054, 1e-13);
  EXPECT_NEAR(normal_quantile(1e-10), -6.361340902404056, 1e-10);
  for (double p : {0.001, 0.2, 0.6, 0.9, 0.99999}) {
    const double x = normal_quantile(p);
    EXPECT_NEAR(0.5 * std::erfc(-x / std::sqrt(2.0)), p, 1e-14 * std::max(1.0, 1.0 / p)) << p;
  }
  EXPECT_THROW(normal_quantile(0.0), ValueError);
  EXPECT_THROW(normal_quantile(1.0), ValueError);
}

TEST(Estimators, IncompleteGammaAndItsInverse) {
  // P(1, x) = 1 - e^-x; P(0.5, x) = erf(sqrt(x)).
  for (double x : {0.01, 0.5, 1.0, 3.0, 20.0}) {
    EXPECT_NEAR(gamma_p(1.0, x), 1.0 - std::exp(-x), 1e-14) << x;
    EXPECT_NEAR(gamma_p(0.5, x), std::erf(std::sqrt(x)), 1e-14) << x;
  }
  for (double a : {0.3, 0.9, 1.0, 2.5, 17.0, 300.0}) {
    for (double p : {1e-6, 0.01, 0.25, 0.75, 0.999, 0.999999}) {
      const double x = gamma_p_inverse(a, p);
      EXPECT_NEAR(gamma_p(a, x), p, 1e-12 * std::max(1.0, p)) << "a=" << a << " p=" << p;
    }
  }
  EXPECT_NEAR(gamma_p_inverse(1.0, 0.75), std::log(4.0), 1e-13);
}

// Ranks on threads (and buckets fitted side by side) invert the gamma CDF at once: each gets what
// it gets alone. std::lgamma wrote the sign of Γ to the global signgam, a data race that
// ThreadSanitizer reports (CI runs this suite under it, scripts/sanitize.sh).
TEST(Estimators, IncompleteGammaInverseFromSeveralThreadsAtOnce) {
  const std::vector<double> shapes = {0.3, 0.9, 2.5, 17.0};
  std::vector<double> alone, together(shapes.size());
  for (double a : shapes) alone.push_back(gamma_p_inverse(a, 0.99));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < shapes.size(); ++i)
    threads.emplace_back([&, i] {
      for (int repeat = 0; repeat < 50; ++repeat) together[i] = gamma_p_inverse(shapes[i], 0.99);
    });
  for (auto& t : threads) t.join();
  EXPECT_EQ(together, alone);
}

TEST(Estimators, TargetCountAndInitialThreshold) {
  EXPECT_EQ(target_count(0.001, 10), 1);
  EXPECT_EQ(target_count(0.5, 11), 5);
  EXPECT_EQ(target_count(1.0, 11), 11);
  EXPECT_EQ(target_count(0.5, 0), 0);
  // The initial threshold (docs/method-spec.md 4.2): ResNet-18, N = 11,173,962, density 0.001 -> k = 11,173 -> 4.73e-3.
  EXPECT_NEAR(initial_threshold(target_count(0.001, 11173962)), 4.7302e-3, 1e-6);
  EXPECT_EQ(slovin_sample_size(11173962), 399);
  EXPECT_EQ(slovin_sample_size(1), 1);
}

TEST(Estimators, OnlineScalingFollowsTheOriginalBands) {
  EXPECT_EQ(online_scaling_factor(1.2), 1.005);
  EXPECT_EQ(online_scaling_factor(1.1), 1.00125);  // boundaries as coded: (0.909, 1.1]
  EXPECT_EQ(online_scaling_factor(1.0), 1.00125);
  EXPECT_EQ(online_scaling_factor(0.909), 0.995);
  EXPECT_EQ(online_scaling_factor(0.1), 0.995);
}

TEST(Estimators, BandControllerChoosesTheClosestCount) {
  const auto edges = BandController::band_edges(1.0, 1.25);
  ASSERT_EQ(edges.size(), 257u);
  EXPECT_DOUBLE_EQ(edges[0], 0.8);
  EXPECT_NEAR(edges[256], 1.25, 1e-12);
  std::vector<double> counts(257, 0.0);
  for (int b = 0; b < 257; ++b) counts[b] = 10.0;  // G(b) = 10 (257 - b)
  // target 1000: G(157) = 1000 exactly.
  EXPECT_EQ(BandController::choose(counts, 1000.0), 157);
  // Ties go to the larger b (fewer elements): G(b) = 1005 and 995 are equally far from 1000.
  counts.assign(257, 10.0);
  counts[256] = 5.0;  // G(b) = 10 (256 - b) + 5
  EXPECT_EQ(BandController::choose(counts, 1000.0), 157);
  EXPECT_EQ(BandController::band_bin(edges, 0.5), 0);
  EXPECT_EQ(BandController::band_bin(edges, 2.0), 256);
  EXPECT_EQ(BandController::band_bin(edges, edges[10]), 10);
}

TEST(Estimators, BandEstimateExtrapolatesAtMostOneBandWidth) {
  const auto edges = BandController::band_edges(1.0, 1.25);
  std::vector<double> counts(257, 0.0);
  counts[256] = 1e6;  // everything above the band
  const double up = BandController::estimate(edges, counts, 1000.0, edges[256]);
  EXPECT_NEAR(up, edges[256] * edges[256] / edges[0], 1e-9);
  counts.assign(257, 0.0);  // nothing in the band at all
  const double down = BandController::estimate(edges, counts, 1000.0, edges[0]);
  EXPECT_NEAR(down, edges[0] * edges[0] / edges[256], 1e-12);
  counts.assign(257, 10.0);  // inside: the chosen threshold itself
  EXPECT_EQ(BandController::estimate(edges, counts, 1000.0, edges[157]), edges[157]);
}

TEST(Estimators, SampledPredictionFindsTheTopWeight) {
  std::vector<double> weights(BandController::kSampleBins, 0.0);
  weights[300] = 500.0;
  weights[200] = 5000.0;
  EXPECT_EQ(BandController::predict_from_samples(weights, 400.0), BandController::sample_edges()[300]);
  EXPECT_EQ(BandController::predict_from_samples(weights, 600.0), BandController::sample_edges()[200]);
  EXPECT_EQ(BandController::predict_from_samples(weights, 1e9), BandController::sample_edges()[0]);
  EXPECT_EQ(BandController::predict_from_trend(2.0, 1.0, 5), 2.4);  // clamped to x1.2
  EXPECT_EQ(BandController::predict_from_trend(2.0, 1.0, 1), 2.0);  // no trend at t = 1
  EXPECT_EQ(BandController::predict_from_mean(2.0, 8.0, 5), 4.0);   // the geometric mean
  EXPECT_EQ(BandController::predict_from_mean(2.0, 8.0, 1), 2.0);   // one estimate at t = 1
  EXPECT_EQ(BandController::predict_from_mean(2.0, std::nan(""), 5), 2.0);
  EXPECT_DOUBLE_EQ(BandController::miss(2.0, 1.0), std::log(2.0));
  EXPECT_DOUBLE_EQ(BandController::miss(1.0, 2.0), std::log(2.0));
  EXPECT_TRUE(std::isnan(BandController::miss(0.0, 2.0)));
}

// The adaptive band: a miss widens it at once to twice the miss (in log scale), close predictions
// narrow it by a tenth of its log a step, and it stays within [1.05, 1.25].
TEST(Estimators, BandFactorFollowsThePredictionsMisses) {
  using BC = BandController;
  EXPECT_DOUBLE_EQ(BC::next_band_factor(1.25, 1.0, 1.0), std::exp(0.9 * std::log(1.25)));
  EXPECT_DOUBLE_EQ(BC::next_band_factor(1.05, 1.0, 1.0), 1.05);          // stays at the narrowest
  EXPECT_DOUBLE_EQ(BC::next_band_factor(1.05, 1.0, 1.08), 1.08 * 1.08);  // missed by 8%: (1.08)^2
  EXPECT_DOUBLE_EQ(BC::next_band_factor(1.05, 1.08, 1.0), 1.08 * 1.08);  // either way
  EXPECT_DOUBLE_EQ(BC::next_band_factor(1.05, 1.0, 1.2), 1.25);          // at the widest
  EXPECT_DOUBLE_EQ(BC::next_band_factor(1.05, 0.0, 1.0), 1.25);          // nothing to go by
  EXPECT_DOUBLE_EQ(BC::next_band_factor(1.05, 1.0, std::nan("")), 1.25);
  double w = 1.25;  // from the widest to the narrowest in 15 close steps
  int steps = 0;
  for (; w > 1.05; ++steps) w = BC::next_band_factor(w, 1.0, 1.001);
  EXPECT_EQ(steps, 15);
}

TEST(Estimators, SageReferenceUpdateRoundsToFloat32) {
  const double l = sage_reference_update(0.0047302, 1.1, 0.001, 0.001);  // beta = 1, gamma = 1
  EXPECT_EQ(l, static_cast<double>(static_cast<float>(0.0047302 * 1.1)));
  // Far too dense (d / density = 500 > 10): beta > 1 and gamma = 1.05 raise the threshold.
  EXPECT_NEAR(sage_reference_update(1.0, 1.0, 0.5, 0.001), 1.05 * 2.0 / (1.0 + std::exp(0.001 - 0.5)), 1e-6);
  EXPECT_NEAR(sage_reference_update(1.0, 1.0, 0.0, 0.001), 0.95 * 2.0 / (1.0 + std::exp(0.001)), 1e-6);
}

/// A threshold above float32's largest (an initial_threshold of 1e300, or 3e38 times a scale
/// change of 1.2) saturates there instead of becoming Inf, which no later step leaves: from it
/// the threshold falls by gamma beta at each step that selects nothing.
TEST(Estimators, SageReferenceUpdateStaysFinite) {
  const double largest = std::numeric_limits<float>::max();
  const float times_beta = static_cast<float>(largest * (2.0 / (1.0 + std::exp(0.01))));  // nothing selected: d = 0
  const double expected = static_cast<float>(static_cast<double>(times_beta) * 0.95);
  for (double lambda : {1e300, 3e38, largest, double{INFINITY}}) {
    const double l = sage_reference_update(lambda, 1.2, 0.0, 0.01);
    EXPECT_EQ(l, expected) << lambda;  // finite, and below the largest (beta gamma < 1)
  }
  EXPECT_LT(expected, largest);
}

TEST(Estimators, SidcoFits) {
  // Exponential data with mean 1: P(x > -ln d) = d.
  EXPECT_NEAR(exp_threshold(1.0, 0.01), std::log(100.0), 1e-12);
  // Generalised Pareto with shape 0 (mean^2 = variance) is the exponential.
  EXPECT_NEAR(gpareto_threshold(2.0, 4.0, 0.01), 2.0 * std::log(100.0), 1e-9);
  EXPECT_EQ(gpareto_threshold(2.0, 0.0, 0.01), 2.0);  // no spread: nothing stands out
  // Gamma with shape 1 is exponential: L = ln mean - mean ln x = Euler's gamma for Exp(1).
  const double euler = 0.5772156649015329;
  const double g = gamma_threshold(1.0, -euler, 0.01);
  EXPECT_NEAR(g, std::log(100.0), 0.05);  // Minka's approximation of the shape, not exact
}

TEST(Estimators, SidcoAdaptiveStagesModeOne) {
  SidcoStages s(-1, 0.001);
  for (int i = 0; i < 5; ++i) s.record(0.5);  // too few selected -> one more stage
  EXPECT_EQ(s.stages(), 2);
  for (int i = 0; i < 5; ++i) s.record(2.0);  // too many -> one fewer
  EXPECT_EQ(s.stages(), 1);
  for (int i = 0; i < 5; ++i) s.record(2.0);  // clamped at 1
  EXPECT_EQ(s.stages(), 1);
  EXPECT_THROW(SidcoStages(-4, 0.01), ValueError);
}

TEST(Rng, DrawsAreReproducibleAndDistinctSamplingIsDistinct) {
  // docs/method-spec.md: stream(seed, tag, t, lane) = mix(mix(mix(seed ^ tag) ^ t) ^ lane) and
  // draw(s, i) = mix(s + i); the values are those of tests/python/restatements.py (rs.stream, rs.draw).
  EXPECT_EQ(rng_stream(1, RngTag::kDgc, 3, kSharedLane), 0xFAD9CF64683348B7ull);
  EXPECT_EQ(rng_draw(rng_stream(1, RngTag::kDgc, 3, kSharedLane), 7), 0xC78E62D3408C2643ull);
  EXPECT_EQ(rng_stream(1, RngTag::kDgc, 3, 0), 0x7D0A63DE773FD22Dull);
  EXPECT_EQ(rng_stream(1, RngTag::kDgc, 3, 1), 0xA6746ED4B19DB144ull);
  // splitmix64 of 0: its first output for seed 0 is 0xE220A8397B1DCDAF.
  EXPECT_EQ(mix64(0), 0xE220A8397B1DCDAFull);
  for (int64_t count : {0, 1, 10, 60, 99, 100, 150}) {
    const auto s = sample_distinct(42, count, 100);
    ASSERT_EQ(static_cast<int64_t>(s.size()), std::min<int64_t>(count, 100));
    for (size_t i = 1; i < s.size(); ++i) ASSERT_LT(s[i - 1], s[i]);
    for (int64_t v : s) ASSERT_TRUE(v >= 0 && v < 100);
  }
}

TEST(Rng, PercentSamplePositionsAreTheHashedSampleOfARange) {
  // in_percent_sample_positions on every SIMD path against the hash of each position: empty and
  // short ranges, ranges that start and end inside a 64-position word, and ones of several blocks.
  const int64_t far = int64_t{1} << 40;
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, 0},
                            {5, 5},
                            {9, 4},
                            {0, 63},
                            {3, 70},
                            {0, 3 * kCpuBlock},
                            {17, 2 * kCpuBlock + 1001},
                            {far + 31, far + kCpuBlock + 7}}) {
    SCOPED_TRACE(::testing::Message() << begin << ".." << end);
    std::vector<int64_t> want;
    for (int64_t p = begin; p < end; ++p)
      if (in_percent_sample(7, static_cast<uint64_t>(p))) want.push_back(p);
    EXPECT_EQ(in_percent_sample_positions(7, begin, end), want);
    if (end - begin > kCpuBlock)
      EXPECT_NEAR(static_cast<double>(want.size()), (end - begin) / 100.0, (end - begin) / 500.0);
  }
}

TEST(Rng, PercentSampleBitsHashEachPosition) {
  // in_percent_sample_bits on every SIMD path (ctest runs each) against the hash of each position:
  // lengths around the vector step of 64, positions in order and scattered up to 2^40.
  std::vector<int64_t> positions(100003);
  for (size_t j = 0; j < positions.size(); ++j)
    positions[j] = j % 3 == 0 ? static_cast<int64_t>(j) : static_cast<int64_t>(rng_draw(11, j) >> 24);
  for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{63}, int64_t{64}, int64_t{65}, int64_t{1000}, int64_t{100003}}) {
    SCOPED_TRACE(::testing::Message() << "n " << n);
    std::vector<uint64_t> bits(static_cast<size_t>((n + 63) / 64) + 1, ~uint64_t{0});  // stale bits are replaced
    in_percent_sample_bits(7, positions.data(), n, bits.data());
    std::vector<uint64_t> want(bits.size(), 0);
    want.back() = ~uint64_t{0};  // the word past the last is not written
    int64_t sampled = 0;
    for (int64_t j = 0; j < n; ++j) {
      const bool in = in_percent_sample(7, static_cast<uint64_t>(positions[j]));
      want[j / 64] |= uint64_t{in ? 1u : 0u} << (j % 64);
      sampled += in ? 1 : 0;
    }
    EXPECT_EQ(bits, want);
    if (n == 100003) EXPECT_NEAR(static_cast<double>(sampled), 1000.0, 150.0);  // about 1 in 100
  }
}

TEST(Rng, SampleDistinctIsTheFirstDistinctDrawsInEveryForm) {
  // Every path (the walk on a bitmap or a hash set, the positions left out, all of them) and the
  // bitmap form give the first `count` distinct values of draw(stream, i) % n.
  for (int64_t n : {int64_t{1}, int64_t{63}, int64_t{64}, int64_t{1000}, int64_t{100003}}) {
    for (int64_t count : {int64_t{0}, int64_t{1}, n / 3000, n / 7, n / 2, n / 2 + 1, n - 1, n, n + 5}) {
      SCOPED_TRACE(::testing::Message() << "n " << n << ", count " << count);
      std::set<int64_t> want;
      if (count > n / 2) {  // all but the first n - count distinct draws
        std::set<int64_t> left_out;
        for (uint64_t i = 0; static_cast<int64_t>(left_out.size()) < std::max<int64_t>(n - count, 0); ++i)
          left_out.insert(static_cast<int64_t>(rng_draw(5, i) % static_cast<uint64_t>(n)));
        for (int64_t p = 0; p < n; ++p)
          if (left_out.count(p) == 0) want.insert(p);
      } else {
        for (uint64_t i = 0; static_cast<int64_t>(want.size()) < count; ++i)
          want.insert(static_cast<int64_t>(rng_draw(5, i) % static_cast<uint64_t>(n)));
      }
      const std::vector<int64_t> got = sample_distinct(5, count, n);
      EXPECT_EQ(got, std::vector<int64_t>(want.begin(), want.end()));
      std::vector<uint64_t> bits{~uint64_t{0}};  // stale contents are cleared
      sample_distinct_bits(5, count, n, bits);
      EXPECT_EQ(bits.size(), static_cast<size_t>((n + 63) / 64));
      EXPECT_EQ(set_positions(bits), got);
    }
  }
}
