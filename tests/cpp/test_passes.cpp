// The passes methods build on (Device API on the CPU) against naive loops: selection over a range
// with or without the fused update and zeroing, moments, counts, exceedances, log sums,
// candidates, samples, gather and zeroing at indices, large fills and copies.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/parallel.h"
#include "reference.h"

using namespace gradsparse;
namespace ref = gradsparse::reference;

namespace {

constexpr int64_t kN = 3 * kCpuBlock + 77;

struct Bucket {
  std::vector<float> grad = ref::random_vector<float>(kN, 1);
  std::vector<float> residual = ref::random_vector<float>(kN, 2, 0.5f);
  BucketView view() { return BucketView{DType::kFloat32, kN, grad.data(), residual.data()}; }
  /// The selection values after the error-feedback update (all finite here).
  std::vector<float> values() const {
    std::vector<float> v(kN);
    for (int64_t i = 0; i < kN; ++i) v[i] = residual[i] + grad[i];
    return v;
  }
};

std::vector<int64_t> message_indices(const Selection& s) {
  const auto* base = s.message.as<unsigned char>();
  MessageHeader h;
  std::memcpy(&h, base, sizeof(h));
  std::vector<int64_t> out;
  for (uint64_t j = 0; j < h.count; ++j) {
    uint32_t v;
    std::memcpy(&v, base + kMessageHeaderBytes + 4 * j, 4);
    out.push_back(v);
  }
  return out;
}

TEST(Passes, SelectOverARangeUpdatesTheWholeBucket) {
  for (bool zero : {true, false}) {
    Bucket b;
    const std::vector<float> v = b.values();
    CpuDevice device;
    const Range range{kCpuBlock - 5, 2 * kCpuBlock + 9};
    const Selection s = device.select(b.view(), SelectRule{1.5, false, range, true, zero});
    std::vector<int64_t> want;
    for (int64_t i = range.begin; i < range.end; ++i)
      if (std::fabs(v[i]) >= 1.5f) want.push_back(i);
    EXPECT_EQ(message_indices(s), want);
    for (int64_t i = 0; i < kN; ++i) {
      const bool selected = std::binary_search(want.begin(), want.end(), i);
      ASSERT_EQ(b.residual[i], (selected && zero) ? 0.0f : v[i]) << i;
    }
  }
}

TEST(Passes, StrictAndReadOnlySelection) {
  Bucket b;
  CpuDevice device;
  device.moments(b.view(), true);  // applies the update
  const std::vector<float> v = b.residual;
  const float t = std::fabs(v[123]);  // an exact value: strict excludes it, >= includes it
  const Selection strict = device.select(b.view(), SelectRule{t, true, Range{0, -1}, false, false});
  const Selection loose = device.select(b.view(), SelectRule{t, false, Range{0, -1}, false, false});
  const auto si = message_indices(strict), li = message_indices(loose);
  EXPECT_FALSE(std::binary_search(si.begin(), si.end(), 123));
  EXPECT_TRUE(std::binary_search(li.begin(), li.end(), 123));
  EXPECT_EQ(b.residual, v);  // read-only, not zeroed
}

TEST(Passes, MomentsCountsExceedancesAndLogSums) {
  Bucket b;
  CpuDevice device;
  const std::vector<float> v = b.values();
  const Moments m = device.moments(b.view(), true);
  double sa = 0, s = 0, ss = 0, mx = 0;
  for (float x : v) {
    sa += std::fabs(x);
    s += x;
    ss += double(x) * x;
    mx = std::max(mx, double(std::fabs(x)));
  }
  EXPECT_NEAR(m.sum_abs, sa, 1e-9 * sa);
  EXPECT_NEAR(m.sum, s, 1e-9 * sa);
  EXPECT_NEAR(m.sum_sq, ss, 1e-9 * ss);
  EXPECT_EQ(m.max_abs, mx);
  EXPECT_EQ(m.nonfinite, 0);

  const std::vector<double> thresholds{2.0, 0.5, 3.0, 0.5};
  const auto counts = device.count(b.view(), Range{10, kN - 10}, thresholds, true);
  for (size_t j = 0; j < thresholds.size(); ++j) {
    int64_t want = 0;
    for (int64_t i = 10; i < kN - 10; ++i) want += std::fabs(v[i]) > static_cast<float>(thresholds[j]);
    EXPECT_EQ(counts[j], want) << j;
  }

  const Exceedance e = device.exceedance(b.view(), 1.0, false, 0.5, BlockSample{});
  int64_t c = 0;
  double es = 0, ess = 0, emin = 1e300;
  for (float x : v) {
    if (std::fabs(x) < 1.0f) continue;
    const double y = std::fabs(double(x)) * 0.5;
    ++c;
    es += y;
    ess += y * y;
    emin = std::min(emin, y);
  }
  EXPECT_EQ(e.count, c);
  EXPECT_NEAR(e.sum, es, 1e-9 * es);
  EXPECT_NEAR(e.sum_sq, ess, 1e-9 * ess);
  EXPECT_EQ(e.min, emin);

  // Logs of products per block, or one by one where a product would leave the normal numbers:
  // a huge scale (overflow), a tiny one without eps (underflow), a zero without eps (-inf).
  for (const auto& [scale, eps] : {std::pair{0.25, 1e-3}, std::pair{1e300, 0.0}, std::pair{1e-300, 0.0}}) {
    double ls = 0;
    for (float x : v) ls += std::log(std::fabs(double(x)) * scale + eps);
    EXPECT_NEAR(device.log_sum(b.view(), scale, eps, BlockSample{}), ls, 1e-12 * std::fabs(ls)) << scale;
  }
  b.residual[kN - 3] = 0.0f;  // in the last block's tail
  EXPECT_EQ(device.log_sum(b.view(), 1.0, 0.0, BlockSample{}), -INFINITY);
  b.residual[kN - 3] = 1.0f;
  b.residual[5] = NAN;  // a NaN in the first block
  EXPECT_TRUE(std::isnan(device.log_sum(b.view(), 1.0, 1e-3, BlockSample{})));
  b.residual[5] = INFINITY;
  EXPECT_EQ(device.log_sum(b.view(), 1.0, 1e-3, BlockSample{}), INFINITY);
}

// log_sum's order restated (kernels/cpu/statistics.cpp): per block, 8 running products, each
// multiplied by 8 factors |v| * scale + eps (a product, then a sum) and then brought back into
// [1, 2) with its exponent counted; one log per product; the block's tail one log at a time.
double restated_log_sum(const std::vector<float>& v, double scale, double eps) {
  double total = 0.0;
  for (int64_t begin = 0; begin < static_cast<int64_t>(v.size()); begin += kCpuBlock) {
    const int64_t end = std::min<int64_t>(static_cast<int64_t>(v.size()), begin + kCpuBlock);
    auto y = [&](int64_t i) { return std::fabs(static_cast<double>(v[static_cast<size_t>(i)])) * scale + eps; };
    std::vector<double> product(8, 1.0);
    int64_t exponent = 0, i = begin;
    for (; i + 64 <= end; i += 64)
      for (int64_t l = 0; l < 8; ++l) {
        for (int64_t r = 0; r < 8; ++r) product[l] *= y(i + r * 8 + l);
        int e = 0;
        product[l] = 2.0 * std::frexp(product[l], &e);  // all normal here: [1, 2) and the exponent
        exponent += e - 1;
      }
    double s = static_cast<double>(exponent) * std::log(2.0);
    for (double p : product) s += std::log(p);
    for (; i < end; ++i) s += std::log(y(i));
    total += s;
  }
  return total;
}

// Every SIMD path (this test runs on each, GRADSPARSE_SIMD) multiplies the same factors in the
// same order, so the sums are the same to the bit.
TEST(Passes, LogSumsAreTheSameToTheBitOnEveryPath) {
  Bucket b;
  CpuDevice device;
  device.moments(b.view(), true);  // applies the update
  for (const auto& [scale, eps] : {std::pair{0.25, 1e-3}, std::pair{1.0 / 3.0, std::ldexp(1.0, -52)}})
    EXPECT_EQ(device.log_sum(b.view(), scale, eps, BlockSample{}), restated_log_sum(b.residual, scale, eps)) << scale;
  // Without a residual the gradient's values are read (non-finite ones as zeros).
  b.grad[7] = NAN;
  std::vector<float> read = b.grad;
  read[7] = 0.0f;
  const BucketView grad_only{DType::kFloat32, kN, b.grad.data(), nullptr};
  EXPECT_EQ(device.log_sum(grad_only, 0.5, 1e-3, BlockSample{}), restated_log_sum(read, 0.5, 1e-3));
}

// A sample of every few blocks: which elements it reads, how many, and the statistics over them.
TEST(Passes, BlockSamplesReadEveryFewBlocks) {
  EXPECT_EQ(BlockSample::at_least(kN, 2).every, 2);  // 4 blocks
  EXPECT_EQ(BlockSample::at_least(kN, 3).every, 1);
  EXPECT_EQ(BlockSample::at_least(0, 64).every, 1);
  EXPECT_EQ(BlockSample::at_least(763 * kCpuBlock, 64).every, 11);  // 70 blocks read
  for (const int64_t every : {1, 2, 3, 5}) {
    const BlockSample sample{every};
    for (const int64_t n : {int64_t{0}, int64_t{1}, kCpuBlock, kCpuBlock + 1, 2 * kCpuBlock, kN}) {
      std::vector<int64_t> read;
      for (int64_t i = 0; i < n; ++i)
        if (sample.holds(i)) read.push_back(i);
      ASSERT_EQ(sample.size(n), static_cast<int64_t>(read.size())) << every << " " << n;
      for (size_t j = 0; j < read.size(); ++j) ASSERT_EQ(sample.element(static_cast<int64_t>(j)), read[j]);
    }
  }
  Bucket b;
  CpuDevice device;
  const BucketView view{DType::kFloat32, kN, b.grad.data(), b.residual.data()};
  const BlockSample sample{3};  // blocks 0 and 3 (the short last one)
  double ls = 0, es = 0;
  int64_t count = 0;
  for (int64_t i = 0; i < kN; ++i) {
    if (!sample.holds(i)) continue;
    const double y = std::fabs(double(b.residual[i]));
    ls += std::log(y * 0.5 + 1e-3);
    if (y >= 1.0) ++count, es += y * 0.5;
  }
  EXPECT_NEAR(device.log_sum(view, 0.5, 1e-3, sample), ls, 1e-12 * std::fabs(ls));
  const Exceedance e = device.exceedance(view, 1.0, false, 0.5, sample);
  EXPECT_EQ(e.count, count);
  EXPECT_NEAR(e.sum, es, 1e-12 * es);
  EXPECT_LT(count, device.exceedance(view, 1.0, false, 0.5, BlockSample{}).count);
}

// The moments of one block in MomentLanes' order (kernels/cpu/statistics.cpp), restated: the
// body, the first len / 16 * 16 elements, in 16 lanes (element i in lane (i - begin) % 16), each
// lane adding v, |v| and v * v in float32 over runs of 8 of its elements and each run's sums to
// its float64 sums; the last len % 16 elements to lane 0 in float64; the lanes in lane order. A
// block whose largest |v| is outside [2^-40, 2^60] adds every element in float64 in the same lanes.
Moments block_moments_restated(const float* r, int64_t begin, int64_t end) {
  const int64_t body = begin + (end - begin) / 16 * 16;
  float largest = 0.0f;
  for (int64_t i = begin; i < end; ++i) largest = std::max(largest, std::fabs(r[i]));
  const bool wide = largest != 0.0f && !(largest >= 0x1p-40f && largest <= 0x1p60f);
  double lane[3][16] = {};
  for (int l = 0; l < 16; ++l) {
    float run[3] = {};
    int rows = 0;
    for (int64_t i = begin + l; i < body; i += 16) {
      if (wide) {
        const double x = r[i];
        lane[0][l] += x;
        lane[1][l] += std::fabs(x);
        lane[2][l] += x * x;
        continue;
      }
      run[0] += r[i];
      run[1] += std::fabs(r[i]);
      run[2] += r[i] * r[i];
      if (++rows == 8 || i + 16 >= body) {
        for (int q = 0; q < 3; ++q) lane[q][l] += static_cast<double>(run[q]), run[q] = 0.0f;
        rows = 0;
      }
    }
  }
  for (int64_t i = body; i < end; ++i) {
    const double x = r[i];
    lane[0][0] += x;
    lane[1][0] += std::fabs(x);
    lane[2][0] += x * x;
  }
  Moments m;
  for (int l = 0; l < 16; ++l) {
    m.sum += lane[0][l];
    m.sum_abs += lane[1][l];
    m.sum_sq += lane[2][l];
  }
  m.max_abs = largest;
  return m;
}

// float32 sums are defined to the bit (so that the AVX-512, AVX2 and portable paths, and any
// thread count, agree): per block of kCpuBlock elements, moments add in MomentLanes' order
// (block_moments_restated), exceedances in four lanes (the t-th element taken in lane t % 4, lanes
// in order); the blocks' sums are added in block order. The lengths cut the 16 lanes and the
// runs of 8 anywhere; a block of huge and one of tiny magnitudes take the float64 order.
TEST(Passes, Float32SumsFollowTheirDocumentedOrder) {
  for (const int64_t n : {kN, 2 * kCpuBlock + 6, int64_t{3}, int64_t{6}, int64_t{7}, int64_t{13}, int64_t{301},
                          int64_t{16 * 8 * 3 + 16 * 5 + 9}}) {
    Bucket b;
    CpuDevice device;
    if (n == kN) {  // block 1 huge, block 2 tiny (its largest just below 2^-40), in both directions
      for (int64_t i = kCpuBlock; i < 2 * kCpuBlock; ++i) b.residual[i] *= 0x1p62f;
      for (int64_t i = 2 * kCpuBlock; i < 3 * kCpuBlock; ++i) b.residual[i] *= 0x1p-44f;
      for (int64_t i = kCpuBlock; i < 3 * kCpuBlock; ++i) b.grad[i] = 0.0f;
    }
    const BucketView view{DType::kFloat32, n, b.grad.data(), b.residual.data()};
    const Moments m = device.moments(view, true);
    Moments want;
    for (int64_t begin = 0; begin < n; begin += kCpuBlock) {
      const Moments block = block_moments_restated(b.residual.data(), begin, std::min(n, begin + kCpuBlock));
      want.sum += block.sum;
      want.sum_abs += block.sum_abs;
      want.sum_sq += block.sum_sq;
      want.max_abs = std::max(want.max_abs, block.max_abs);
    }
    EXPECT_EQ(m.sum, want.sum) << n;
    EXPECT_EQ(m.sum_abs, want.sum_abs) << n;
    EXPECT_EQ(m.sum_sq, want.sum_sq) << n;
    EXPECT_EQ(m.max_abs, want.max_abs) << n;
    if (n == kN) {  // the huge block's squares overflow float32: only the float64 order holds them
      EXPECT_TRUE(std::isfinite(m.sum_sq));
      EXPECT_GT(m.sum_sq, 1e30);
    }

    for (const double threshold : {0.0, 0.3, 1.2, 1e30}) {
      const int64_t every = threshold == 0.3 ? 2 : 1;  // a sample reads whole blocks, in the same order
      const Exceedance e = device.exceedance(view, threshold, false, 0.7, BlockSample{every});
      double sum = 0, sum_sq = 0;
      int64_t count = 0;
      for (int64_t begin = 0; begin < n; begin += every * kCpuBlock) {
        double bs[4] = {}, bss[4] = {};
        int64_t taken = 0;
        for (int64_t i = begin; i < std::min(n, begin + kCpuBlock); ++i) {
          if (std::fabs(b.residual[i]) < static_cast<float>(threshold)) continue;
          const double y = std::fabs(double(b.residual[i])) * 0.7;
          bs[taken % 4] += y;
          bss[taken % 4] += y * y;
          ++taken;
        }
        count += taken;
        sum += ((bs[0] + bs[1]) + bs[2]) + bs[3];
        sum_sq += ((bss[0] + bss[1]) + bss[2]) + bss[3];
      }
      EXPECT_EQ(e.count, count) << n << " " << threshold;
      EXPECT_EQ(e.sum, sum) << n << " " << threshold;
      EXPECT_EQ(e.sum_sq, sum_sq) << n << " " << threshold;
    }

    // Few thresholds (compared with every element: 1, 2, 4 or 8 comparisons), repeated ones, and
    // many (found by a table).
    for (const std::vector<double>& thresholds :
         {std::vector<double>{0.4}, std::vector<double>{1.1, 0.3}, std::vector<double>{0.1, 0.1, 2.0, 1e30},
          std::vector<double>{1.5, 0.2, 0.9}, std::vector<double>{0.05, 0.1, 0.2, 0.4, 0.8, 1.6},
          std::vector<double>{0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4},
          std::vector<double>{0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8}}) {
      const auto counts = device.count(view, Range{n / 5, n - n / 7}, thresholds, false);
      for (size_t j = 0; j < thresholds.size(); ++j) {
        int64_t expected = 0;
        for (int64_t i = n / 5; i < n - n / 7; ++i)
          expected += std::fabs(b.residual[i]) >= static_cast<float>(thresholds[j]);
        EXPECT_EQ(counts[j], expected) << n << " " << thresholds[j];
      }
    }
  }
}

// The scan lists a block's candidates from its mask with as many unconditional writes per mask
// word as the block before suggests (simd.h, unmarked_writes: 2 below 1.25 marks per word, 3
// below 2, else 4) and passes over groups of 256 elements without one: blocks at 0%, 0.1%, 0.5%,
// 2.5%, 4% and 30% candidates, in one thread so that each block follows the one before, list
// exactly the elements at or above the bound.
TEST(Passes, ScanListsCandidatesAfterBlocksOfEveryDensity) {
  const std::vector<double> fractions{0.005, 0.025, 0.0, 0.04, 0.3, 0.001, 0.005, 0.04, 0.025, 0.3};
  const int64_t n = static_cast<int64_t>(fractions.size()) * kCpuBlock + 77;
  std::vector<float> grad(static_cast<size_t>(n), 0.0f), residual(static_cast<size_t>(n), 0.25f);
  std::mt19937 rng(9);
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  for (int64_t i = 0; i < n; ++i) {
    const double fraction =
        fractions[static_cast<size_t>(std::min<int64_t>(i / kCpuBlock, static_cast<int64_t>(fractions.size()) - 1))];
    if (uniform(rng) < fraction) residual[static_cast<size_t>(i)] = i % 2 == 0 ? 3.0f : -3.0f;
  }
  std::vector<int64_t> want;
  for (int64_t i = 3; i < n - 3; ++i)
    if (std::fabs(residual[static_cast<size_t>(i)]) >= 2.0f) want.push_back(i);
  set_cpu_threads(1);
  CpuDevice device;
  const Scan s =
      device.scan(BucketView{DType::kFloat32, n, grad.data(), residual.data()}, true, Range{3, n - 3}, 2.0, -1, false);
  set_cpu_threads(0);
  EXPECT_EQ(s.above, static_cast<int64_t>(want.size()));
  EXPECT_EQ(s.candidates.index, want);
  for (size_t j = 0; j < s.candidates.size(); ++j)
    ASSERT_EQ(s.candidates.value[j], residual[static_cast<size_t>(s.candidates.index[j])]);
}

// The scan's fused update where residual + gradient is not finite (the AVX-512 path branches to
// its blend only then; ctest runs this on every SIMD path): such an element keeps its residual
// and is counted, a finite neighbour in the same vector is updated, with sums or without, and the
// candidates are those of the updated values.
TEST(Passes, ScanKeepsTheResidualWhereTheSumIsNotFinite) {
  for (const bool sums : {true, false}) {
    Bucket b;
    const int64_t bad[] = {0, 5, 17, 31, kCpuBlock + 8, 2 * kCpuBlock + 3, kN - 2};  // vectors, tail
    b.grad[0] = NAN;
    b.grad[5] = INFINITY;
    b.grad[17] = -INFINITY;
    b.residual[31] = 3.0e38f, b.grad[31] = 3.0e38f;  // a finite residual and gradient whose sum overflows
    b.grad[kCpuBlock + 8] = NAN;
    b.grad[2 * kCpuBlock + 3] = -NAN;
    b.grad[kN - 2] = INFINITY;
    std::vector<float> want = b.residual;
    for (int64_t i = 0; i < kN; ++i)
      if (std::isfinite(b.residual[i] + b.grad[i])) want[i] = b.residual[i] + b.grad[i];
    std::vector<int64_t> candidates;
    for (int64_t i = 0; i < kN; ++i)
      if (std::fabs(want[i]) >= 1.5f) candidates.push_back(i);
    CpuDevice device;
    const Scan s = device.scan(b.view(), true, Range{0, kN}, 1.5, -1, sums);
    EXPECT_EQ(s.moments.nonfinite, static_cast<int64_t>(std::size(bad))) << sums;
    for (int64_t i = 0; i < kN; ++i) ASSERT_TRUE(ref::same_bits(b.residual[i], want[i])) << i << " " << sums;
    EXPECT_EQ(s.candidates.index, candidates) << sums;
    if (sums) {
      EXPECT_TRUE(std::isfinite(s.moments.sum) && std::isfinite(s.moments.sum_sq));
      EXPECT_EQ(s.moments.max_abs, 3.0e38f);  // the kept residual of element 31
    }
  }
}

/// The scan's update of float16 and bfloat16 values (a vector path on AVX2 CPUs, ctest runs every
/// SIMD path) gives each element numeric.h's formula to the bit, without momentum correction and
/// with it (masked or not): every finite 16-bit pattern as the residual, against gradients of
/// every kind (subnormal, largest finite, ties of the rounding, NaN, infinities) and velocities at
/// zero, finite and at the largest, and zero residuals (which the masking reads), over a bucket
/// that ends inside a vector. The non-finite sums
/// are counted and keep the residual, a velocity changes only where its new value is finite, and
/// the moments, the candidates and later counts are those of the updated values.
template <typename T>
void scan_updates_sixteen_bit_values() {
  const int64_t n = 2 * 65536 + 13;  // the second half's residuals zero (where the masking restarts velocities)
  std::vector<T> residual(n), grad(n), velocity(n);
  std::mt19937 rng(5);
  const uint16_t specials[] = {0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x7bff, 0xfbff, 0x7f7f,
                               0xff7f, 0x7c00, 0xfc00, 0x7f80, 0xff80, 0x7e00, 0x7fc0, 0x3c00};
  auto finite_bits = [](uint16_t bits) {
    T v{bits};
    return is_finite(v) ? v : T{static_cast<uint16_t>(bits & 0x803f)};
  };
  for (int64_t i = 0; i < n; ++i) {
    // every finite pattern (a residual is finite), then zeros of both signs
    residual[i] = finite_bits(i < 65536 ? static_cast<uint16_t>(i) : static_cast<uint16_t>((i & 1) << 15));
    const uint32_t pick = rng();
    // a special value, the residual itself or its negation (sums at twice it, ties, zeros), or random bits
    grad[i].bits = pick % 4 == 0   ? specials[(pick >> 8) % std::size(specials)]
                   : pick % 4 == 1 ? static_cast<uint16_t>(residual[i].bits ^ ((pick >> 8) & 0x8000u))
                                   : static_cast<uint16_t>(pick >> 8);
    velocity[i] = finite_bits(pick % 8 == 0 ? static_cast<uint16_t>(0) : static_cast<uint16_t>(pick >> 16));
  }
  const DType dtype = std::is_same_v<T, Half> ? DType::kFloat16 : DType::kBFloat16;
  const float factor = 0.9f;
  for (const int momentum : {0, 1, 2}) {  // none, unmasked, masked
    std::vector<T> want = residual, want_velocity = velocity;
    int64_t nonfinite = 0;
    for (int64_t i = 0; i < n; ++i) {
      const T addend =
          momentum == 0 ? grad[i]
                        : momentum_value(grad[i], want_velocity[i], momentum_emptied(momentum == 2, want[i]), factor);
      bool finite;
      ef_accumulate(want[i], addend, finite);
      nonfinite += !finite;
    }
    for (const bool sums : {true, false}) {
      std::vector<T> r = residual, u = velocity;
      BucketView view{dtype, n, grad.data(), r.data()};
      if (momentum != 0) view.velocity = u.data(), view.momentum = factor, view.momentum_masking = momentum == 2;
      CpuDevice device;
      const double threshold = 1.0;
      const Scan s = device.scan(view, true, Range{0, n}, threshold, -1, sums);
      EXPECT_EQ(s.moments.nonfinite, nonfinite) << momentum << sums;
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(r[i].bits, want[i].bits) << i << " " << momentum << sums;
        ASSERT_EQ(u[i].bits, (momentum == 0 ? velocity : want_velocity)[i].bits) << i << " " << momentum << sums;
      }
      std::vector<int64_t> candidates;
      double sum = 0.0, max_abs = 0.0;
      for (int64_t i = 0; i < n; ++i) {
        const double v = Num<T>::to_float(want[i]);
        if (std::fabs(v) >= threshold) candidates.push_back(i);
        sum += v;
        max_abs = std::max(max_abs, std::fabs(v));
      }
      EXPECT_EQ(s.candidates.index, candidates) << momentum << sums;
      if (sums) {
        EXPECT_EQ(s.moments.max_abs, max_abs) << momentum;
        EXPECT_NEAR(s.moments.sum, sum, 1e-9 * max_abs * n) << momentum;
      }
      // and a count's read-only pass over the updated values (thresholds rounded to T), over a range
      const std::vector<double> thresholds{1e-6, 0.5, 1.0, 3.0, 60000.0};
      const auto counts = device.count(BucketView{dtype, n, grad.data(), r.data()}, Range{7, n - 5}, thresholds, false);
      for (size_t j = 0; j < thresholds.size(); ++j) {
        int64_t expected = 0;
        for (int64_t i = 7; i < n - 5; ++i) expected += Num<T>::key(want[i]) >= threshold_key<T>(thresholds[j]);
        EXPECT_EQ(counts[j], expected) << thresholds[j];
      }
    }
  }
}

TEST(Passes, ScanUpdatesFloat16ValuesAsTheFormula) { scan_updates_sixteen_bit_values<Half>(); }
TEST(Passes, ScanUpdatesBFloat16ValuesAsTheFormula) { scan_updates_sixteen_bit_values<BFloat16>(); }

/// Device::sample_keys looks at the values the update will give, with momentum correction and its
/// masking, without writing the residual or the velocity: the keys at or above the floor of the
/// sampled blocks' elements (a block's last few elements too), in index order, where a sum that is
/// not finite keeps the residual's value and, without a residual, a non-finite gradient reads as 0.
template <typename T>
void sample_keys_look_without_writing() {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, BFloat16>);
  const int64_t n = kN;
  std::vector<T> grad = ref::random_vector<T>(n, 41), residual = ref::random_vector<T>(n, 42, 0.5f);
  std::vector<T> velocity = ref::random_vector<T>(n, 43, 0.5f);
  for (int64_t i : {int64_t{3}, int64_t{40}, kCpuBlock + 9, 3 * kCpuBlock + 70}) residual[i] = Num<T>::zero();
  for (int64_t i : {int64_t{7}, 3 * kCpuBlock + 71}) grad[i] = Num<T>::from_float(NAN);
  grad[11] = Num<T>::from_float(INFINITY);
  const std::vector<T> grad0 = grad, residual0 = residual, velocity0 = velocity;
  const float f = 0.9f;
  const double floor = 1.2;
  auto rounded = [](float x) { return Num<T>::to_float(Num<T>::from_float(x)); };
  for (const bool update : {true, false}) {
    for (const bool momentum : {true, false}) {
      for (const bool with_residual : {true, false}) {
        if ((momentum && !update) || (!with_residual && (update || momentum))) continue;
        for (const int64_t every : {int64_t{1}, int64_t{3}}) {
          BucketView view{std::is_same_v<T, float> ? DType::kFloat32 : DType::kBFloat16, n, grad.data(),
                          with_residual ? residual.data() : nullptr};
          if (momentum) {
            view.velocity = velocity.data();
            view.momentum = f;
            view.momentum_masking = true;
          }
          std::vector<uint32_t> want;
          for (int64_t i = 0; i < n; ++i) {
            if (!BlockSample{every}.holds(i)) continue;
            const float g = Num<T>::to_float(grad[i]), r = Num<T>::to_float(residual[i]);
            float v;
            if (!with_residual) {
              v = std::isfinite(g) ? g : 0.0f;
            } else if (!update) {
              v = r;
            } else {
              float a = g;
              if (momentum) a = rounded(f * (r == 0.0f ? 0.0f : Num<T>::to_float(velocity[i])) + g);
              const float sum = rounded(r + a);
              v = std::isfinite(sum) ? sum : r;
            }
            if (std::fabs(v) >= floor) want.push_back(Num<T>::key(Num<T>::from_float(v)));
          }
          CpuDevice device;
          const std::vector<uint32_t> keys = device.sample_keys(view, update, BlockSample{every}, floor);
          EXPECT_EQ(keys, want) << update << momentum << with_residual << every;
          EXPECT_GT(want.size(), 100u);
          ASSERT_EQ(0, std::memcmp(residual.data(), residual0.data(), n * sizeof(T)));
          ASSERT_EQ(0, std::memcmp(velocity.data(), velocity0.data(), n * sizeof(T)));
          ASSERT_EQ(0, std::memcmp(grad.data(), grad0.data(), n * sizeof(T)));
        }
      }
    }
  }
}

TEST(Passes, SampleKeysLookAtTheUpdateWithoutWritingIt) {
  sample_keys_look_without_writing<float>();
  sample_keys_look_without_writing<BFloat16>();
}

// Large fills and copies run in parallel blocks of 128 KiB (cpu_device.cpp): every byte of an
// odd length is written, none outside it, and an overlapping copy keeps memmove's result.
TEST(Passes, LargeFillsAndCopiesWriteEveryByte) {
  const size_t bytes = (size_t{3} << 20) + 5;
  std::vector<unsigned char> a(bytes + 2), b(bytes + 2);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<unsigned char>(i * 7 + 1);
  CpuDevice device;
  device.copy(b.data() + 1, a.data() + 1, bytes);
  EXPECT_EQ(b[0], 0);
  EXPECT_EQ(b[bytes + 1], 0);
  EXPECT_TRUE(std::equal(a.begin() + 1, a.end() - 1, b.begin() + 1));
  device.fill_zero(a.data() + 1, bytes);
  EXPECT_EQ(a[0], 1);
  EXPECT_EQ(a[bytes + 1], static_cast<unsigned char>((bytes + 1) * 7 + 1));
  EXPECT_TRUE(std::all_of(a.begin() + 1, a.end() - 1, [](unsigned char c) { return c == 0; }));
  for (const int shift : {1000, -1000}) {  // overlapping, either way
    std::vector<unsigned char> want = b, got = b;
    const size_t from = shift > 0 ? 0 : 1000, to = shift > 0 ? 1000 : 0, length = bytes - 1000;
    std::memmove(want.data() + to, want.data() + from, length);
    device.copy(got.data() + to, got.data() + from, length);
    EXPECT_EQ(got, want) << "shift " << shift;
  }
}

TEST(Passes, CandidatesSamplesGatherAndZeroing) {
  Bucket b;
  CpuDevice device;
  device.moments(b.view(), true);
  const std::vector<float> v = b.residual;
  const Candidates c = device.collect(b.view(), Range{5, kN - 5}, 2.5, false);
  std::vector<int64_t> want;
  for (int64_t i = 5; i < kN - 5; ++i)
    if (std::fabs(v[i]) >= 2.5f) want.push_back(i);
  EXPECT_EQ(c.index, want);
  for (size_t j = 0; j < c.size(); ++j) EXPECT_EQ(c.value[j], v[c.index[j]]);

  const std::vector<int64_t> positions{3, 3, 100, kN - 1};
  EXPECT_DOUBLE_EQ(device.sample_abs_sum(b.view(), positions),
                   2.0 * std::fabs(double(v[3])) + std::fabs(double(v[100])) + std::fabs(double(v[kN - 1])));

  const Selection g = device.gather(b.view(), {7, 8, 9000});
  EXPECT_EQ(message_indices(g), (std::vector<int64_t>{7, 8, 9000}));
  std::vector<float> out(kN, 0.0f);
  device.scatter_add(g.view(b.view()), out.data(), 1.0f);
  EXPECT_EQ(out[8], v[8]);
  EXPECT_EQ(out[9000], v[9000]);
  device.zero_at(b.view(), g.view(b.view()));
  EXPECT_EQ(b.residual[7], 0.0f);
  EXPECT_EQ(b.residual[9000], 0.0f);
  EXPECT_EQ(b.residual[6], v[6]);

  const Selection e = device.emit(b.view(), {1, 4}, {2.5f, -1.0f}, true);
  std::vector<float> out2(kN, 0.0f);
  device.scatter_add(e.view(b.view()), out2.data(), 1.0f);
  EXPECT_EQ(out2[1], 2.5f);
  EXPECT_EQ(out2[4], -1.0f);
  EXPECT_EQ(b.residual[4], 0.0f);
  EXPECT_THROW(device.emit(b.view(), {4, 1}, {1.0f, 1.0f}, false), ValueError);  // not ascending
}

}  // namespace
