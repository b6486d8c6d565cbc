// The fused error-feedback + selection kernels against the naive reference (reference.h).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/kernels.h"
#include "gradsparse/parallel.h"
#include "reference.h"

using namespace gradsparse;
namespace ref = gradsparse::reference;

namespace {

template <typename T, typename I = uint32_t>
struct Output {
  std::vector<I> indices;
  std::vector<T> values;
  SelectStats stats;

  PairSink sink() {
    return [this](int64_t count) {
      indices.resize(count);
      values.resize(count);
      return PairSpan{indices.data(), values.data()};
    };
  }
};

template <typename T, typename I>
void expect_same(const Output<T, I>& got, const ref::Pairs<T>& want) {
  ASSERT_EQ(got.stats.count, static_cast<int64_t>(want.indices.size()));
  ASSERT_EQ(got.indices.size(), want.indices.size());
  EXPECT_EQ(got.stats.nonfinite, want.nonfinite);
  for (size_t i = 0; i < want.indices.size(); ++i) {
    ASSERT_EQ(static_cast<int64_t>(got.indices[i]), want.indices[i]) << "pair " << i;
    ASSERT_TRUE(ref::same_bits(got.values[i], want.values[i])) << "pair " << i;
  }
}

template <typename T>
void expect_same_vector(const std::vector<T>& a, const std::vector<T>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(ref::same_bits(a[i], b[i])) << "element " << i;
}

/// Top-k with error feedback from the residual `start` against the reference: the same pairs,
/// non-finite count and k-th key, and the residual after; then without zeroing, the same pairs
/// and the residual updated but kept where they were taken, which it returns.
template <typename T>
std::vector<T> expect_topk_as_reference(const std::vector<T>& start, const std::vector<T>& grad, int64_t k) {
  const auto n = static_cast<int64_t>(grad.size());
  std::vector<T> residual = start, want_residual = start, kept = start;
  const auto want = ref::topk(&want_residual, grad, k);
  Output<T> got;
  got.stats = cpu::select_topk<T, uint32_t>(residual.data(), grad.data(), n, k, got.sink());
  expect_same(got, want);
  expect_same_vector(residual, want_residual);
  if (!want.values.empty()) {  // the k-th largest key: the least among the values taken
    uint32_t least = Num<T>::key(want.values[0]);
    for (const T& v : want.values) least = std::min(least, Num<T>::key(v));
    EXPECT_EQ(got.stats.kth_key, least);
  }
  Output<T> unzeroed;
  unzeroed.stats =
      cpu::select_topk<T, uint32_t>(Source<T>{kept.data(), grad.data(), true}, n, k, /*zero=*/false, unzeroed.sink());
  expect_same(unzeroed, want);
  for (size_t j = 0; j < want.indices.size(); ++j) want_residual[want.indices[j]] = want.values[j];
  expect_same_vector(kept, want_residual);
  return kept;
}

/// Top-k without a residual against the reference: the same pairs (a non-finite gradient read as
/// zero) and non-finite count, and the gradient left alone.
template <typename T>
void expect_topk_without_residual_as_reference(const std::vector<T>& grad, int64_t k) {
  const std::vector<T> copy = grad;
  const auto want = ref::topk<T>(nullptr, grad, k);
  Output<T> got;
  got.stats = cpu::select_topk<T, uint32_t>(nullptr, grad.data(), static_cast<int64_t>(grad.size()), k, got.sink());
  expect_same(got, want);
  expect_same_vector(grad, copy);
}

const std::vector<int64_t> kSizes = {0, 1, 2, 7, kCpuBlock - 1, kCpuBlock, kCpuBlock + 3, 3 * kCpuBlock + 17};

template <typename T>
class SelectTest : public ::testing::Test {};
using Types = ::testing::Types<float, Half, BFloat16>;
TYPED_TEST_SUITE(SelectTest, Types);

TYPED_TEST(SelectTest, ThresholdWithErrorFeedbackMatchesReference) {
  using T = TypeParam;
  for (int64_t n : kSizes) {
    for (double thr : {0.0, 0.5, 1.5, 2.5, 100.0}) {
      std::vector<T> residual = ref::random_vector<T>(n, 11 + n, 0.7f);
      const std::vector<T> grad = ref::random_vector<T>(n, 12 + n);
      std::vector<T> want_residual = residual;
      const auto want = ref::threshold(&want_residual, grad, thr);
      Output<T> got;
      got.stats = cpu::select_threshold<T, uint32_t>(residual.data(), grad.data(), n, thr, got.sink());
      expect_same(got, want);
      expect_same_vector(residual, want_residual);
    }
  }
}

/// Without a residual the gradient is read, never written: a non-finite value is counted and read
/// as zero (selected only by a threshold of 0), in the whole bucket and within a range.
TYPED_TEST(SelectTest, ThresholdWithoutErrorFeedbackLeavesInputAlone) {
  using T = TypeParam;
  const float nonfinite[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity()};
  for (int64_t n : kSizes) {
    std::vector<T> grad = ref::random_vector<T>(n, 5 + n);
    const int64_t at[] = {0, n / 2, n - 1};
    for (int j = 0; j < 3; ++j)
      if (at[j] >= 0 && at[j] < n) grad[at[j]] = ref::from_float<T>(nonfinite[j]);
    const std::vector<T> copy = grad;
    for (double thr : {0.0, 1.0, 2.5, std::numeric_limits<double>::infinity()}) {
      const auto want = ref::threshold<T>(nullptr, grad, thr);
      Output<T, uint64_t> got;
      got.stats = cpu::select_threshold<T, uint64_t>(nullptr, grad.data(), n, thr, got.sink());
      expect_same(got, want);
      expect_same_vector(grad, copy);
      const Range range{n / 4, n - n / 4};  // the middle half
      ref::Pairs<T> within;
      within.nonfinite = want.nonfinite;  // of the whole bucket
      for (size_t i = 0; i < want.indices.size(); ++i) {
        if (want.indices[i] < range.begin || want.indices[i] >= range.end) continue;
        within.indices.push_back(want.indices[i]);
        within.values.push_back(want.values[i]);
      }
      Output<T, uint64_t> part;
      part.stats = cpu::select<T, uint64_t>(Source<T>{nullptr, grad.data(), false}, n, key_at_least<T>(thr), range,
                                            /*zero=*/true, part.sink());
      expect_same(part, within);
      expect_same_vector(grad, copy);
    }
  }
}

TYPED_TEST(SelectTest, TopKMatchesReference) {
  using T = TypeParam;
  for (int64_t n : kSizes) {
    for (int64_t k : {int64_t{0}, int64_t{1}, int64_t{3}, n / 100, n / 2, n - 1, n, n + 5}) {
      if (k < 0) continue;
      SCOPED_TRACE(::testing::Message() << "n = " << n << ", k = " << k);
      expect_topk_as_reference(ref::random_vector<T>(n, 21 + n, 0.5f), ref::random_vector<T>(n, 22 + n), k);
    }
  }
}

/// Without a residual Top-k reads the gradient, never writes it, and reads a non-finite value as
/// zero: taken only where k reaches the zeros.
TYPED_TEST(SelectTest, TopKWithoutErrorFeedbackReadsNonFiniteAsZero) {
  using T = TypeParam;
  const int64_t n = 3 * kCpuBlock + 17;
  std::vector<T> grad = ref::random_vector<T>(n, 23);
  grad[5] = ref::from_float<T>(std::numeric_limits<float>::quiet_NaN());
  grad[kCpuBlock + 1] = ref::from_float<T>(std::numeric_limits<float>::infinity());
  grad[n - 1] = ref::from_float<T>(-std::numeric_limits<float>::infinity());
  for (int64_t k : {int64_t{1}, n / 100, n - 2, n}) {
    SCOPED_TRACE(::testing::Message() << "k = " << k);
    expect_topk_without_residual_as_reference(grad, k);
  }
}

TYPED_TEST(SelectTest, TopKBreaksTiesByLowestIndex) {
  using T = TypeParam;
  for (float value : {0.0f, 1.0f}) {  // all zeros, all equal
    const int64_t n = 2 * kCpuBlock + 9;
    const std::vector<T> grad(n, ref::from_float<T>(value));
    for (int64_t k : {int64_t{1}, int64_t{1000}, kCpuBlock + 1, n}) {
      std::vector<T> residual(n, Num<T>::zero());
      std::vector<T> want_residual = residual;
      const auto want = ref::topk(&want_residual, grad, k);
      Output<T, uint64_t> got;
      got.stats = cpu::select_topk<T, uint64_t>(residual.data(), grad.data(), n, k, got.sink());
      expect_same(got, want);
      for (int64_t i = 0; i < k; ++i) ASSERT_EQ(got.indices[i], static_cast<uint64_t>(i));
      EXPECT_EQ(got.stats.kth_key, Num<T>::key(ref::from_float<T>(value)));
      expect_same_vector(residual, want_residual);
    }
  }
}

TYPED_TEST(SelectTest, NonFiniteElementsKeepTheirResidualAndAreCounted) {
  using T = TypeParam;
  const int64_t n = kCpuBlock + 100;
  std::vector<T> grad = ref::random_vector<T>(n, 31);
  grad[3] = ref::from_float<T>(std::numeric_limits<float>::quiet_NaN());
  grad[kCpuBlock + 7] = ref::from_float<T>(-std::numeric_limits<float>::infinity());
  const std::vector<T> start = ref::random_vector<T>(n, 32, 0.1f);
  for (bool use_topk : {false, true}) {
    std::vector<T> residual = start, want_residual = start;
    const auto want = use_topk ? ref::topk(&want_residual, grad, 50) : ref::threshold(&want_residual, grad, 2.0);
    Output<T> got;
    got.stats = use_topk ? cpu::select_topk<T, uint32_t>(residual.data(), grad.data(), n, 50, got.sink())
                         : cpu::select_threshold<T, uint32_t>(residual.data(), grad.data(), n, 2.0, got.sink());
    EXPECT_EQ(got.stats.nonfinite, 2);
    expect_same(got, want);
    expect_same_vector(residual, want_residual);
    EXPECT_TRUE(ref::same_bits(residual[3], start[3]));
  }
}

TYPED_TEST(SelectTest, OutputDoesNotDependOnThreadCount) {
  using T = TypeParam;
  const int64_t n = 9 * kCpuBlock + 123;
  const std::vector<T> grad = ref::random_vector<T>(n, 41);
  Output<T> one, two;
  std::vector<T> r1(n, Num<T>::zero()), r2(n, Num<T>::zero());
  set_cpu_threads(1);
  one.stats = cpu::select_topk<T, uint32_t>(r1.data(), grad.data(), n, n / 100, one.sink());
  set_cpu_threads(2);
  two.stats = cpu::select_topk<T, uint32_t>(r2.data(), grad.data(), n, n / 100, two.sink());
  set_cpu_threads(0);
  ASSERT_EQ(one.indices, two.indices);
  expect_same_vector(one.values, two.values);
  expect_same_vector(r1, r2);
}

// float32 Top-k over at least 64 blocks (on the AVX2 paths) lists its candidates in one pass from
// a floor that a sample of its blocks places (select.cpp, select_topk_listed); where the floor
// misses, it counts as the smaller buckets above do. Either way the result is the reference's.
constexpr int64_t kListed = 64 * kCpuBlock + 5;  // 65 blocks: the sample is every 4th

TEST(SelectTopKListed, MatchesReference) {
  const std::vector<float> start = ref::random_vector<float>(kListed, 51, 0.5f);
  std::vector<float> grad = ref::random_vector<float>(kListed, 52);
  grad[7] = std::numeric_limits<float>::quiet_NaN();  // in a sampled block (0) and another (1)
  grad[kCpuBlock + 9] = -std::numeric_limits<float>::infinity();
  for (int64_t k : {int64_t{1}, int64_t{300}, kListed / 100, kListed / 10}) {
    SCOPED_TRACE(::testing::Message() << "k = " << k);
    std::vector<float> updated = expect_topk_as_reference(start, grad, k);
    // Read-only, as OnePass::largest reads a residual already updated: its k largest.
    const std::vector<float> before = updated;
    const auto want = ref::topk<float>(nullptr, updated, k);
    Output<float> read;
    read.stats = cpu::select_topk<float, uint32_t>(Source<float>{updated.data(), grad.data(), false}, kListed, k,
                                                   /*zero=*/false, read.sink());
    expect_same(read, want);
    expect_same_vector(updated, before);
  }
}

TEST(SelectTopKListed, WithoutErrorFeedbackReadsNonFiniteAsZero) {
  std::vector<float> grad = ref::random_vector<float>(kListed, 54);
  grad[5] = std::numeric_limits<float>::quiet_NaN();  // in a sampled block (0) and others
  grad[kCpuBlock + 1] = std::numeric_limits<float>::infinity();
  grad[kListed - 1] = -std::numeric_limits<float>::infinity();
  for (int64_t k : {int64_t{1}, kListed / 100, kListed - 2}) {
    SCOPED_TRACE(::testing::Message() << "k = " << k);
    expect_topk_without_residual_as_reference(grad, k);
  }
}

TEST(SelectTopKListed, MatchesReferenceWhereTheSampleMisplacesTheFloor) {
  // Large values only in the sampled blocks put the floor too high (too few candidates); only
  // outside them, too low (past the cap); all equal, every element ties at the floor; an outlying
  // layer in the first block (half of it 14 times the rest, as a classifier's weights at the start
  // of DDP's first bucket) too high, and a floor from the other sampled blocks lists again.
  const int64_t every = BlockSample::at_least(kListed, 16).every;
  ASSERT_EQ(every, 4);
  for (int layout = 0; layout < 4; ++layout) {
    std::vector<float> grad = ref::random_vector<float>(kListed, 53 + layout);
    for (int64_t i = 0; i < kListed; ++i) {
      const bool sampled = (i / kCpuBlock) % every == 0;
      if (layout == 3) {
        grad[i] *= i < kCpuBlock / 2 ? 14.0f : 1.0f;
      } else {
        grad[i] = layout == 2 ? 0.25f : sampled == (layout == 0) ? 100.0f * grad[i] : grad[i];
      }
    }
    grad[kCpuBlock + 3] = std::numeric_limits<float>::quiet_NaN();  // counted on every path
    for (int64_t k : {kListed / 100, kListed / 3}) {
      SCOPED_TRACE(::testing::Message() << "layout " << layout << ", k = " << k);
      expect_topk_as_reference(std::vector<float>(kListed, 0.0f), grad, k);
      expect_topk_without_residual_as_reference(grad, k);
    }
  }
}

TEST(SelectTopKListed, UpdatesWithMomentumCorrectionAsTheScalarUpdate) {
  const std::vector<float> grad = ref::random_vector<float>(kListed, 57);
  const std::vector<float> start = ref::random_vector<float>(kListed, 58, 0.5f);
  const std::vector<float> start_velocity = ref::random_vector<float>(kListed, 59, 0.2f);
  for (bool masking : {false, true}) {
    std::vector<float> want_residual = start, want_velocity = start_velocity;
    const Source<float> scalar{want_residual.data(), grad.data(), true, want_velocity.data(), 0.9f, masking};
    for (int64_t i = 0; i < kListed; ++i) {
      bool finite;
      scalar.update_element(i, finite);
    }
    const int64_t k = kListed / 100;
    const auto want = ref::topk<float>(nullptr, want_residual, k);  // the updated residual's k largest
    for (int64_t i : want.indices) want_residual[i] = 0.0f;
    std::vector<float> residual = start, velocity = start_velocity;
    Output<float> got;
    got.stats = cpu::select_topk<float, uint32_t>(
        Source<float>{residual.data(), grad.data(), true, velocity.data(), 0.9f, masking}, kListed, k, true,
        got.sink());
    expect_same(got, want);
    expect_same_vector(residual, want_residual);
    expect_same_vector(velocity, want_velocity);
  }
}

TEST(ScatterAdd, AccumulatesDuplicatesAndDivides) {
  std::vector<float> out(6, 1.0f);
  const std::vector<int64_t> idx = {0, 5, 0, 2, 5, 5};
  const std::vector<float> val = {2, 4, 6, 8, 10, 12};
  cpu::scatter_add<float, int64_t>(out.data(), 6, idx.data(), val.data(), 6, 2.0f);
  EXPECT_EQ(out, (std::vector<float>{5, 1, 5, 1, 1, 14}));
}

TEST(ScatterAdd, RejectsOutOfRangeIndicesWithoutWriting) {
  std::vector<float> out(4, 0.0f);
  for (std::vector<int64_t> idx : {std::vector<int64_t>{0, 4}, std::vector<int64_t>{-1, 1}}) {
    const std::vector<float> val = {1, 1};
    EXPECT_THROW((cpu::scatter_add<float, int64_t>(out.data(), 4, idx.data(), val.data(), 2, 1.0f)),
                 CorruptMessageError);
    EXPECT_EQ(out, std::vector<float>(4, 0.0f));
  }
  const std::vector<uint32_t> big = {3, 0xffffffffu};
  const std::vector<float> val = {1, 1};
  EXPECT_THROW((cpu::scatter_add<float, uint32_t>(out.data(), 4, big.data(), val.data(), 2, 1.0f)),
               CorruptMessageError);
  EXPECT_EQ(out, std::vector<float>(4, 0.0f));
}

TEST(SelectArguments, RejectNegativeThresholdAndK) {
  std::vector<float> g(4, 1.0f);
  Output<float> o;
  EXPECT_THROW((cpu::select_threshold<float, uint32_t>(nullptr, g.data(), 4, -1.0, o.sink())), ValueError);
  EXPECT_THROW((cpu::select_topk<float, uint32_t>(nullptr, g.data(), 4, -1, o.sink())), ValueError);
}

// What a C++ caller can get wrong is a ValueError, as in Python: a NaN threshold selected nothing
// while the gradient went into the residual, an infinite divisor wrote NaN into `out`, null data
// crashed the process, a sink without room was called gradsparse's internal error, and a negative
// thread count was taken as the default.
TEST(SelectArguments, RejectWhatTheKernelsCannotUse) {
  std::vector<float> g(4, 1.0f), r(4, 0.0f), out(4, 0.0f);
  const std::vector<int64_t> idx = {0, 1};
  Output<float> o;
  for (double threshold : {std::nan(""), -1.0}) {  // +infinity selects nothing (above)
    EXPECT_THROW((cpu::select_threshold<float, uint32_t>(r.data(), g.data(), 4, threshold, o.sink())), ValueError);
    CpuDevice device;
    EXPECT_THROW(device.select_threshold(BucketView{DType::kFloat32, 4, g.data(), r.data()}, threshold), ValueError);
    EXPECT_EQ(r, std::vector<float>(4, 0.0f));
  }
  for (float divisor : {0.0f, std::nanf(""), HUGE_VALF}) {
    EXPECT_THROW((cpu::scatter_add<float, int64_t>(out.data(), 4, idx.data(), g.data(), 2, divisor)), ValueError);
    EXPECT_THROW(cpu::divide<float>(out.data(), 4, divisor), ValueError);
  }
  EXPECT_EQ(out, std::vector<float>(4, 0.0f));
  EXPECT_THROW((cpu::select_threshold<float, uint32_t>(r.data(), nullptr, 4, 0.5, o.sink())), ValueError);
  EXPECT_THROW((cpu::select_topk<float, uint32_t>(r.data(), nullptr, 4, 2, o.sink())), ValueError);
  EXPECT_THROW((cpu::scatter_add<float, int64_t>(out.data(), 4, nullptr, g.data(), 2, 1.0f)), ValueError);
  EXPECT_THROW((cpu::scatter_add<float, int64_t>(out.data(), 4, idx.data(), nullptr, 2, 1.0f)), ValueError);
  const PairSink no_room = [](int64_t) { return PairSpan{}; };
  EXPECT_THROW((cpu::select_threshold<float, uint32_t>(nullptr, g.data(), 4, 0.5, no_room)), ValueError);
  EXPECT_THROW(set_cpu_threads(-4), ValueError);
  // Nothing to read is no error: n = 0 with null data, or a sink without room for no pairs.
  EXPECT_EQ((cpu::select_threshold<float, uint32_t>(nullptr, nullptr, 0, 0.5, no_room).count), 0);
  EXPECT_EQ((cpu::select_threshold<float, uint32_t>(nullptr, g.data(), 4, 2.0, no_room).count), 0);
}

}  // namespace
