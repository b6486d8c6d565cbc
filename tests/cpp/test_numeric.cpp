// Conversions between float32 and the 16-bit types: exact widening, round-to-nearest-even
// narrowing, magnitude keys that order like |x|, and the look-up of a key's bin (KeyBins).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gradsparse/key_bins.h"
#include "gradsparse/numeric.h"
#include "gradsparse/parallel.h"

using namespace gradsparse;

namespace {

// The nearest representable 16-bit value by brute force over all finite encodings, ties to even
// (the encoding with an even last bit), overflow to Inf at the rounding boundary.
template <typename Widen>
uint16_t nearest_by_search(float f, Widen widen, uint16_t inf_bits) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double target = std::fabs(static_cast<double>(f));
  double best_err = std::numeric_limits<double>::infinity();
  uint16_t best = 0;
  for (uint32_t b = 0; b < inf_bits; ++b) {
    const double err = std::fabs(static_cast<double>(widen(static_cast<uint16_t>(b))) - target);
    if (err < best_err || (err == best_err && (b & 1u) == 0)) {
      best_err = err;
      best = static_cast<uint16_t>(b);
    }
  }
  // Beyond the largest finite value, round to Inf at the halfway point to the next power.
  const double max_finite = widen(static_cast<uint16_t>(inf_bits - 1));
  const double ulp = max_finite - widen(static_cast<uint16_t>(inf_bits - 2));
  if (target >= max_finite + ulp / 2) best = inf_bits;
  return static_cast<uint16_t>(sign | best);
}

std::vector<float> probe_floats() {
  std::vector<float> v = {
      0.0f,          -0.0f,         1.0f,          -1.0f,   65504.0f, 65519.99f,          65520.0f,          1e-8f,
      2.9802322e-8f, 5.9604645e-8f, 6.1035156e-5f, 6.1e-5f, 3.0e38f,  1.0f + 1.0f / 2048, 1.0f + 3.0f / 2048};
  std::mt19937 rng(7);
  std::uniform_int_distribution<uint32_t> bits(0, 0x7f7fffffu);
  for (int i = 0; i < 3000; ++i) {
    float f = bits_float(bits(rng));
    // Concentrate on the 16-bit types' ranges.
    if (i % 3 == 0) f = std::ldexp(std::fmod(std::fabs(f), 2.0f), static_cast<int>(bits(rng) % 50) - 30);
    v.push_back(i % 2 ? f : -f);
  }
  return v;
}

/// MiCRO's band: 257 geometric edges over a factor of 1.25^2, as float32 keys.
std::vector<uint32_t> band_keys() {
  std::vector<uint32_t> band;
  for (int b = 0; b <= 256; ++b)
    band.push_back(Num<float>::key(static_cast<float>(2.0 / 1.25 * std::pow(1.25, b / 128.0))));
  return band;
}

}  // namespace

TEST(Numeric, HalfWideningIsExactForEveryEncoding) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const uint16_t h = static_cast<uint16_t>(b);
    const float f = half_to_float(h);
    if (std::isnan(f)) {
      EXPECT_TRUE(((h & 0x7c00) == 0x7c00) && (h & 0x3ff)) << b;
      continue;
    }
    EXPECT_EQ(float_to_half(f), h) << "round trip of encoding " << b;
  }
}

TEST(Numeric, HalfNarrowingRoundsToNearestEven) {
  for (float f : probe_floats()) {
    EXPECT_EQ(float_to_half(f), nearest_by_search(f, half_to_float, 0x7c00)) << "f=" << f;
  }
}

TEST(Numeric, BFloat16NarrowingRoundsToNearestEven) {
  for (float f : probe_floats()) {
    EXPECT_EQ(float_to_bfloat16(f), nearest_by_search(f, bfloat16_to_float, 0x7f80)) << "f=" << f;
  }
}

// Every finite float16 divided by P = 2 to 16: the quotient is the nearest one, or one step closer
// to zero where P of the nearest would pass 65504; so P quotients never do (the products below are
// exact in float32), and no quotient is more than one unit in its last place from the exact one.
TEST(Numeric, HalfQuotientsSumToAFiniteValueAndStayWithinOneUnit) {
  int64_t moved = 0;
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const Half v{static_cast<uint16_t>(b)};
    if (!is_finite(v)) continue;
    for (int p = 2; p <= 16; ++p) {
      const Half q = quotient(v, static_cast<float>(p));
      const float exact = half_to_float(v.bits) / static_cast<float>(p), got = half_to_float(q.bits);
      ASSERT_LE(std::fabs(got) * static_cast<float>(p), 65504.0f) << "encoding " << b << " / " << p;
      const Half nearest = Num<Half>::from_float(exact);
      if (q.bits != nearest.bits) {
        ++moved;
        ASSERT_EQ(q.bits, nearest.bits - 1) << "encoding " << b << " / " << p;  // one step toward zero
        ASSERT_GT(std::fabs(half_to_float(nearest.bits)), std::fabs(exact));
      }
    }
  }
  EXPECT_GT(moved, 0);  // 65504 / 3 among them
  EXPECT_EQ(half_to_float(quotient(Num<Half>::from_float(65504.0f), 3.0f).bits), 21824.0f);
  EXPECT_EQ(half_to_float(quotient(Num<Half>::from_float(-65504.0f), 3.0f).bits), -21824.0f);
}

TEST(Numeric, NaNAndInfSurviveNarrowing) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(nan))));
  EXPECT_TRUE(std::isnan(bfloat16_to_float(float_to_bfloat16(nan))));
  EXPECT_EQ(float_to_half(inf), 0x7c00);
  EXPECT_EQ(float_to_half(-inf), 0xfc00);
  EXPECT_EQ(float_to_bfloat16(inf), 0x7f80);
}

TEST(Numeric, MagnitudeKeysOrderLikeAbsoluteValues) {
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 10.0f);
  for (int i = 0; i < 10000; ++i) {
    const float a = normal(rng), b = normal(rng);
    EXPECT_EQ(Num<float>::key(a) < Num<float>::key(b), std::fabs(a) < std::fabs(b));
    const Half ha = Num<Half>::from_float(a), hb = Num<Half>::from_float(b);
    EXPECT_EQ(Num<Half>::key(ha) < Num<Half>::key(hb),
              std::fabs(Num<Half>::to_float(ha)) < std::fabs(Num<Half>::to_float(hb)));
  }
  EXPECT_FALSE(is_finite(std::numeric_limits<float>::quiet_NaN()));
  EXPECT_FALSE(is_finite(Num<BFloat16>::from_float(-std::numeric_limits<float>::infinity())));
  EXPECT_TRUE(is_finite(Num<Half>::from_float(65504.0f)));
}

// KeyBins::bin against a binary search, over every key near a bin's edge, at each table end and
// random keys between, for keys spread far enough apart that no slot needs a second step (the
// band's keys) and for keys that crowd some slots (clusters and repeats).
TEST(Numeric, KeyBinsFindTheLastKeyAtOrBelow) {
  std::mt19937 rng(5);
  auto check = [&](std::vector<uint32_t> keys, bool crowded) {
    std::sort(keys.begin(), keys.end());
    const KeyBins table(keys.data(), static_cast<int>(keys.size()));
    const KeyBins::Lookup bins = table.lookup();
    EXPECT_EQ(bins.crowded, crowded);
    std::vector<uint32_t> probes{0x7fffffffu, keys.back() + 1};  // the largest magnitude key (a NaN's)
    for (uint32_t k : keys)
      for (uint32_t d : {0u, 1u}) probes.insert(probes.end(), {k + d, k > keys[0] ? k - d : k});
    std::uniform_int_distribution<uint32_t> between(keys.front(), keys.back());
    for (int i = 0; i < 20000; ++i) probes.push_back(between(rng));
    for (uint32_t key : probes) {
      const int expected = static_cast<int>(std::upper_bound(keys.begin(), keys.end(), key) - keys.begin()) - 1;
      ASSERT_EQ(bins.bin(key), expected) << "key " << key << ", " << keys.size() << " keys";
    }
  };
  check(band_keys(), false);
  // a cluster: three keys within one slot of a wide table
  std::vector<uint32_t> cluster{100, 5000000, 5000001, 5000002, 9000000};
  check(cluster, true);
  // repeated keys inside a slot: bin() is the last of them
  std::vector<uint32_t> repeats{0, 2000000, 2000000, 2000000, 30000000};
  check(repeats, true);
  // few keys far apart; and one key
  check({7, 1u << 20, 1u << 30}, false);
  check({12345}, false);
}

TEST(Numeric, KeyBinsCountEveryKeyIntoItsBin) {
  // On the AVX-512 path (ctest also runs this with GRADSPARSE_SIMD=avx2 and 0) a table that is not
  // crowded counts 16 keys a step and the last n % 16 one at a time; a crowded one every key alone.
  // Inputs of more than one block are counted in blocks on the kernels' threads.
  std::mt19937 rng(6);
  auto expected_bins = [](const std::vector<uint32_t>& keys, const std::vector<uint32_t>& in) {
    std::vector<int64_t> in_bin(keys.size() + 1, 0);
    for (uint32_t key : in) ++in_bin[std::upper_bound(keys.begin(), keys.end(), key) - keys.begin()];
    return in_bin;
  };
  auto check = [&](std::vector<uint32_t> keys, bool crowded, size_t n = 16 * 125 + 7) {
    std::sort(keys.begin(), keys.end());
    const KeyBins table(keys.data(), static_cast<int>(keys.size()));
    EXPECT_EQ(table.lookup().crowded, crowded);
    // keys below, at, just past and between the table's, and the largest bin() takes: n in all
    std::vector<uint32_t> in{0u, 0xfffffffeu, keys.front() - 1, keys.back() + 1};
    for (uint32_t k : keys) in.insert(in.end(), {k, k + 1, k - 1});
    std::uniform_int_distribution<uint32_t> around(keys.front() / 2, keys.back() + keys.back() / 4);
    while (in.size() < n) in.push_back(around(rng));
    std::vector<int64_t> in_bin(keys.size() + 1, 3);  // count() adds to what is there
    table.count(in.data(), static_cast<int64_t>(in.size()), in_bin.data());
    std::vector<int64_t> expected = expected_bins(keys, in);
    for (int64_t& c : expected) c += 3;
    EXPECT_EQ(in_bin, expected) << keys.size() << " keys";
    // the same as float32 values of either sign, whose keys are their magnitudes' bits
    std::vector<float> values(in.size());
    std::vector<uint32_t> magnitudes(in.size());
    for (size_t i = 0; i < in.size(); ++i) {
      const uint32_t bits = (in[i] & 0x7fffffffu) | (i % 3 == 0 ? 0x80000000u : 0u);
      std::memcpy(&values[i], &bits, sizeof bits);
      magnitudes[i] = Num<float>::key(values[i]);
    }
    std::vector<int64_t> value_bins(keys.size() + 1, 0);
    table.count(values.data(), static_cast<int64_t>(values.size()), value_bins.data());
    EXPECT_EQ(value_bins, expected_bins(keys, magnitudes)) << keys.size() << " keys, float32 values";
  };
  check(band_keys(), false);
  check(band_keys(), false, 2 * kCpuBlock + 16 * 125 + 7);
  check({100, 5000000, 5000001, 5000002, 9000000}, true);
  check({7, 1u << 20, 1u << 30}, false);
  check({12345}, false);
  // no keys: every key is below
  const KeyBins none(nullptr, 0);
  const uint32_t some[3] = {1, 2, 3};
  int64_t below = 0;
  none.count(some, 3, &below);
  EXPECT_EQ(below, 3);
}

TEST(Numeric, ThresholdIsRoundedToTheBucketDtype) {
  // 1e-3 is not representable in float16; the comparison uses the float16 value, as PyTorch does.
  const float rounded = Num<Half>::to_float(Num<Half>::from_float(1e-3f));
  EXPECT_NE(rounded, 1e-3f);
  EXPECT_EQ(threshold_key<Half>(1e-3), Num<Half>::key(Num<Half>::from_float(rounded)));
}

TEST(Numeric, ErrorFeedbackKeepsResidualWhenSumIsNotFinite) {
  float r = 2.0f;
  bool finite = true;
  ef_accumulate(r, std::numeric_limits<float>::quiet_NaN(), finite);
  EXPECT_FALSE(finite);
  EXPECT_EQ(r, 2.0f);
  ef_accumulate(r, 3.0f, finite);
  EXPECT_TRUE(finite);
  EXPECT_EQ(r, 5.0f);
  Half h = Num<Half>::from_float(60000.0f);
  ef_accumulate(h, Num<Half>::from_float(60000.0f), finite);  // overflows float16
  EXPECT_FALSE(finite);
  EXPECT_EQ(Num<Half>::to_float(h), 60000.0f);
}

TEST(Numeric, MomentumStepDecaysTakesTheGradientAndMasksWhereTheResidualIsEmpty) {
  float grad[3] = {1.0f, 2.0f, 4.0f};
  float velocity[3] = {10.0f, 10.0f, 10.0f};
  const float residual[3] = {0.5f, 0.0f, -0.0f};
  for (int64_t i = 0; i < 3; ++i) momentum_step(grad, velocity, residual, i, 0.5f, /*masking=*/true);
  // Element 0 keeps its velocity (residual not empty); 1 and 2 restart from zero (+0 and -0).
  EXPECT_EQ(velocity[0], 6.0f);
  EXPECT_EQ(grad[0], 6.0f);
  EXPECT_EQ(velocity[1], 2.0f);
  EXPECT_EQ(grad[1], 2.0f);
  EXPECT_EQ(velocity[2], 4.0f);
  // Without masking (or without a residual) every velocity decays.
  float g2[2] = {1.0f, 1.0f};
  float u2[2] = {2.0f, 2.0f};
  momentum_step(g2, u2, residual + 1, 0, 0.5f, /*masking=*/false);
  momentum_step(g2, u2, static_cast<const float*>(nullptr), 1, 0.5f, /*masking=*/true);
  EXPECT_EQ(u2[0], 2.0f);
  EXPECT_EQ(u2[1], 2.0f);
}

TEST(Numeric, MomentumStepKeepsTheVelocityWhenTheResultIsNotFinite) {
  float grad[1] = {std::numeric_limits<float>::quiet_NaN()};
  float velocity[1] = {3.0f};
  momentum_step(grad, velocity, static_cast<const float*>(nullptr), 0, 0.9f, false);
  EXPECT_EQ(velocity[0], 3.0f);
  EXPECT_TRUE(std::isnan(grad[0]));  // the step's non-finite policy sees it
  Half hg[1] = {Num<Half>::from_float(60000.0f)};
  Half hu[1] = {Num<Half>::from_float(60000.0f)};
  momentum_step(hg, hu, static_cast<const Half*>(nullptr), 0, 0.9f, false);  // overflows float16
  EXPECT_EQ(Num<Half>::to_float(hu[0]), 60000.0f);
  EXPECT_FALSE(is_finite(hg[0]));
}
