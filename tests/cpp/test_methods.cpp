// Every selection method over ThreadTransport, 1 to 4 ranks: gradient mass is conserved every step
// (docs/method-spec.md ruling 6), every rank issues the same collectives, and degenerate inputs
// (ruling 4) neither crash nor desynchronise the ranks. The exact behaviour of each method is
// compared with a re-statement in tests/python/test_methods.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/methods.h"
#include "gradsparse/reduce_bucket.h"
#include "gradsparse/spardl.h"
#include "reference.h"
#include "threads.h"

using namespace gradsparse;
namespace ref = gradsparse::reference;
using gradsparse::testing::RankThreads;
using gradsparse::testing::rethrow_first;
using gradsparse::testing::run_ranks;

namespace {
/// The rank threads that the tests stepping ranks thousands of times share (RoundTrip's step_all,
/// DegenerateBucketsOfEveryDtype); neither runs inside the other.
RankThreads& rank_threads() {
  static RankThreads threads;
  return threads;
}
}  // namespace

namespace {

using Factory = std::function<std::unique_ptr<Method>()>;

struct Case {
  const char* name;
  Factory make;
};

std::vector<Case> all_methods(double d = 0.02) {
  return {
      {"topk", [=] { return std::make_unique<TopK>(d); }},
      {"threshold", [=] { return std::make_unique<Threshold>(std::nullopt, d); }},
      {"randomk", [=] { return std::make_unique<RandomK>(d, 3); }},
      {"randomblock", [=] { return std::make_unique<RandomBlock>(d, 3); }},
      {"gaussiank_spardl", [=] { return std::make_unique<GaussianK>(d, "spardl"); }},
      {"gaussiank_sidco", [=] { return std::make_unique<GaussianK>(d, "sidco"); }},
      {"dgc", [=] { return std::make_unique<DGC>(d, 3); }},
      {"redsync", [=] { return std::make_unique<RedSync>(d); }},
      {"sage",
       [=] { return std::make_unique<SAGE>(d, "flat", std::vector<int64_t>{}, false, 3, std::nullopt, std::nullopt); }},
      {"sage_reference_per_tensor",
       [=] {
         return std::make_unique<SAGE>(d, "per_tensor", std::vector<int64_t>{}, true, 3, std::nullopt, std::nullopt);
       }},
      {"micro", [=] { return std::make_unique<MiCRO>(d, "union", false, 3); }},
      {"micro_reference_gather", [=] { return std::make_unique<MiCRO>(d, "gather", true, 3); }},
      {"exdyna", [=] { return std::make_unique<ExDyna>(d, "union", false, 3); }},
      {"exdyna_reference", [=] { return std::make_unique<ExDyna>(d, "union", true, 3); }},
      {"exdyna_gather", [=] { return std::make_unique<ExDyna>(d, "gather", false, 3); }},
      {"sidco_exp", [=] { return std::make_unique<SIDCo>(d, "exp", 1, 0.25, std::nullopt); }},
      {"sidco_gpareto_2", [=] { return std::make_unique<SIDCo>(d, "gpareto", 2, 0.25, std::nullopt); }},
      {"sidco_gamma_0", [=] { return std::make_unique<SIDCo>(d, "gamma_gpareto", 0, 0.25, std::nullopt); }},
      {"sidco_adaptive", [=] { return std::make_unique<SIDCo>(d, "exp", -2, 0.25, std::nullopt); }},
  };
}

using Value = std::function<float(int, int, int64_t)>;

/// Runs `steps` steps of every rank's method (methods[r] on rank r) over a bucket of n elements
/// and checks conservation and collective counts each step.
void run_steps(const Case& c, const std::vector<std::unique_ptr<Method>>& methods, int64_t n, int steps,
               const Value& value) {
  const int p = static_cast<int>(methods.size());
  std::vector<std::vector<float>> residual(p, std::vector<float>(n, 0.0f));
  for (int t = 0; t < steps; ++t) {
    std::vector<std::vector<float>> grads(p), out(p);
    std::vector<double> before(n, 0.0);
    for (int r = 0; r < p; ++r) {
      grads[r].resize(n);
      for (int64_t i = 0; i < n; ++i) grads[r][i] = value(t, r, i);
      out[r] = grads[r];
      for (int64_t i = 0; i < n; ++i) before[i] += double(grads[r][i]) + residual[r][i];
    }
    std::vector<ReduceReport> reports(p);
    rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
      CpuDevice device;
      BucketView bucket{DType::kFloat32, n, out[rank].data(), residual[rank].data()};
      reports[rank] = reduce_bucket(methods[rank].get(), transport, device, bucket, ReduceOptions{});
    }));
    for (int r = 0; r < p; ++r) {
      ASSERT_EQ(reports[r].traffic.collectives, reports[0].traffic.collectives) << c.name << " rank " << r;
      ASSERT_EQ(out[r], out[0]) << c.name << ": ranks disagree on the update";
    }
    for (int64_t i = 0; i < n; ++i) {
      double after = double(p) * out[0][i];
      for (int r = 0; r < p; ++r) after += residual[r][i];
      ASSERT_NEAR(after, before[i], 1e-4 * (1.0 + std::fabs(before[i]))) << c.name << " step " << t << " i " << i;
    }
  }
}

std::vector<std::unique_ptr<Method>> make_ranks(const Case& c, int p) {
  std::vector<std::unique_ptr<Method>> methods;
  for (int r = 0; r < p; ++r) methods.push_back(c.make());
  return methods;
}

/// run_steps with a new method object on every rank.
void run_and_check(const Case& c, int p, int64_t n, int steps, const Value& value) {
  run_steps(c, make_ranks(c, p), n, steps, value);
}

float wave(int t, int r, int64_t i) {
  const float base = std::sin(0.37f * i + 1.3f * r + 0.11f * t);
  return base * base * base * (1.0f + 0.1f * t) * ((i % 97 == 0) ? 8.0f : 1.0f);
}

class Methods : public ::testing::TestWithParam<int> {};

TEST_P(Methods, ConserveMassAndKeepRanksInStep) {
  const int p = GetParam();
  for (const Case& c : all_methods()) {
    SCOPED_TRACE(c.name);
    run_and_check(c, p, 40000, 6, wave);
  }
}

// A method object is not tied to one bucket size: one that served a bucket of one size selects
// within the next, smaller or larger (MiCRO's and ExDyna's partitions were laid out once, for the
// first size, and reached past a smaller bucket's end).
TEST_P(Methods, OneObjectServesBucketsOfAnySize) {
  const int p = GetParam();
  for (const Case& c : all_methods()) {
    SCOPED_TRACE(c.name);
    const auto methods = make_ranks(c, p);
    for (const int64_t n : {int64_t{100000}, int64_t{40000}, int64_t{70001}, int64_t{5}})
      run_steps(c, methods, n, 3, wave);
  }
}

TEST_P(Methods, DegenerateInputsNeverCrash) {
  const int p = GetParam();
  for (const Case& c : all_methods()) {
    SCOPED_TRACE(c.name);
    run_and_check(c, p, 1, 3, [](int, int r, int64_t) { return 0.5f + r; });              // n = 1
    run_and_check(c, p, 3, 3, [](int t, int r, int64_t i) { return float(t + r + i); });  // n < P for P = 4
    run_and_check(c, p, 1000, 3, [](int, int, int64_t) { return 0.0f; });                 // all zeros
    run_and_check(c, p, 700, 3, [](int, int, int64_t) { return 1.0f; });                  // all equal
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, Methods, ::testing::Values(1, 2, 3, 4));

TEST(Methods, RejectBadOptions) {
  EXPECT_THROW(TopK(0.0), ValueError);
  EXPECT_THROW(Threshold(std::nullopt, std::nullopt), ValueError);
  EXPECT_THROW(Threshold(1.0, 0.1), ValueError);
  EXPECT_THROW(GaussianK(0.1, "median"), ValueError);
  EXPECT_THROW(SAGE(0.1, "rows", {}, false, 0, std::nullopt, std::nullopt), ValueError);
  EXPECT_THROW(MiCRO(0.1, "shared", false, 0), ValueError);
  EXPECT_THROW(SIDCo(0.1, "exp", -4, 0.25, std::nullopt), ValueError);
  EXPECT_THROW(SIDCo(0.1, "weibull", 1, 0.25, std::nullopt), ValueError);
  EXPECT_THROW(SIDCo(0.1, "exp", 1, 1.5, std::nullopt), ValueError);
}

// Loss scaling (Method::rescale): a factor that is no positive finite number is refused naming
// the method, for every method; Threshold's magnitude follows the factor and its state keeps it
// (as "loss_scale").
// (tests/python/test_methods.py checks that every rescaled method selects what it selects
// without loss scaling.)
TEST(Methods, RescaleRefusesBadFactorsAndMovesThresholdsMagnitude) {
  for (const Case& c : all_methods()) {
    std::unique_ptr<Method> method = c.make();
    for (double bad : {0.0, -2.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
      try {
        method->rescale(bad);
        ADD_FAILURE() << c.name << ": rescale(" << bad << ") was taken";
      } catch (const ValueError& e) {
        EXPECT_NE(std::string(e.what()).find("rescale factor must be a positive finite number"), std::string::npos)
            << e.what();
      }
    }
  }
  std::vector<float> g{0.5f, 3.0f, -5.0f, 1.0f};
  const auto selected = [&](Threshold& method, float times) {
    std::vector<float> scaled(g), residual(g.size(), 0.0f);
    for (float& v : scaled) v *= times;
    auto group = ThreadGroup::create(1);
    CpuDevice device;
    const BucketView bucket{DType::kFloat32, static_cast<int64_t>(g.size()), scaled.data(), residual.data()};
    return reduce_bucket(&method, *group->transport(0), device, bucket, ReduceOptions{}).selected;
  };
  Threshold method(2.0, std::nullopt);
  EXPECT_EQ(selected(method, 1.0f), 2);
  method.rescale(4.0);
  EXPECT_EQ(selected(method, 4.0f), 2);  // |v| >= 8 of the values times 4: the same two
  EXPECT_EQ(method.state().at("loss_scale"), 4.0);
  Threshold loaded(2.0, std::nullopt);
  loaded.load_state(method.state());
  EXPECT_EQ(selected(loaded, 4.0f), 2);
  EXPECT_THROW(loaded.load_state({{"loss_scale", -1.0}}), ValueError);
}

/// SAGE's sampled means of steps 0..steps-1 on one rank, per-tensor sampling over `segments`, on
/// a bucket of `n` elements holding 1, 2, ..., n (whose element [n], past the bucket, is huge, so
/// that a sample read there would show).
std::vector<double> sage_sample_means(std::vector<int64_t> segments, int64_t n, bool reference, int steps) {
  SAGE sage(0.1, "per_tensor", std::move(segments), reference, 3, std::nullopt, std::nullopt);
  std::vector<double> means;
  for (int step = 0; step < steps; ++step) {
    std::vector<float> g(n + 1, 1e6f), residual(n + 1, 0.0f);
    for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(i + 1);
    auto group = ThreadGroup::create(1);
    auto transport = group->transport(0);
    CpuDevice device;
    const BucketView bucket{DType::kFloat32, n, g.data(), residual.data()};
    reduce_bucket(&sage, *transport, device, bucket, ReduceOptions{});
    means.push_back(sage.state().at("sample_mean"));
  }
  return means;
}

// A parameter of no elements has no position to sample, so per-tensor sampling leaves it out of
// the draw of a tensor: the samples are those of the same bucket without it. (Drawn as a tensor of
// one element, a trailing empty one sampled the element past the bucket, and one in the middle
// the next tensor's first element.)
TEST(Methods, SagePerTensorSamplingSkipsEmptyParameters) {
  for (bool reference : {false, true}) {
    SCOPED_TRACE(reference ? "reference" : "default");
    const std::vector<double> trailing = sage_sample_means({100, 0}, 100, reference, 3);
    EXPECT_EQ(trailing, sage_sample_means({100}, 100, reference, 3));
    const std::vector<double> middle = sage_sample_means({30, 0, 0, 70}, 100, reference, 3);
    EXPECT_EQ(middle, sage_sample_means({30, 70}, 100, reference, 3));
    for (double mean : trailing) EXPECT_LE(mean, 100.0);
  }
}

// Sizes that cannot be a bucket's parameters are refused by name: a negative one when the method
// is made, and sizes that do not add up to the bucket at its first step.
TEST(Methods, SageRefusesSegmentsThatDoNotFitTheBucket) {
  try {
    SAGE(0.1, "per_tensor", {10, -1}, false, 3, std::nullopt, std::nullopt);
    FAIL() << "a negative segment was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("segments[1] is -1"), std::string::npos) << e.what();
  }
  try {
    sage_sample_means({60, 0, 30}, 100, false, 1);
    FAIL() << "segments adding up to 90 were accepted for a bucket of 100";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("segments add up to 90 elements but the bucket has 100"), std::string::npos)
        << e.what();
  }
}

/// The pairs all ranks sent at each step of MiCRO's or ExDyna's default mode on two ranks, for
/// normal gradients of n = 10000 elements at `scales[t]` (0: a step of zeros), density 0.01.
std::vector<int64_t> banded_counts(bool micro, const std::vector<float>& scales) {
  const int p = 2;
  const int64_t n = 10000;
  std::vector<std::unique_ptr<Method>> methods;
  for (int r = 0; r < p; ++r) {
    if (micro) {
      methods.push_back(std::make_unique<MiCRO>(0.01, "union", false, 3));
    } else {
      methods.push_back(std::make_unique<ExDyna>(0.01, "gather", false, 3));
    }
  }
  std::vector<std::vector<float>> residual(p, std::vector<float>(n, 0.0f));
  std::vector<int64_t> sent;
  for (size_t t = 0; t < scales.size(); ++t) {
    std::vector<ReduceReport> reports(p);
    rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
      std::vector<float> g = ref::random_vector<float>(n, 10 * t + rank, scales[t] > 0.0f ? scales[t] : 1.0f);
      if (scales[t] == 0.0f) std::fill(g.begin(), g.end(), 0.0f);
      CpuDevice device;
      BucketView bucket{DType::kFloat32, n, g.data(), residual[rank].data()};
      reports[rank] = reduce_bucket(methods[rank].get(), transport, device, bucket, ReduceOptions{});
    }));
    sent.push_back(reports[0].selected_all);
  }
  return sent;
}

// After a step whose counts put the threshold far off the band (a step of zeros: nothing to
// count; a x1000 rise in scale: everything above the band), the next step predicts from a sample
// again, so the count is back near the target k = 100 at once. (The estimate used to move one
// band width a step: after a step of zeros every element passed for about 35 steps, and after the
// rise most of them for about 10. Then the step after the sampled one sent up to 2.6 k, its band
// too narrow for the residual's growth; and after a step of zeros every element passed at the next
// step where a zero sample's prediction rounded the band's lowest edge to 0.)
TEST(Methods, BandedMethodsRecoverFromAFarOffStep) {
  struct Stream {
    std::vector<float> scales;
    size_t far_off;  // the step of zeros, or of the rise
  };
  const std::vector<Stream> streams = {{{0.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f}, 0},
                                       {{1.0f, 1.0f, 0.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f}, 2},
                                       {{1e-3f, 1e-3f, 1e-3f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f}, 3}};
  for (bool micro : {true, false}) {
    for (const Stream& stream : streams) {
      const std::vector<int64_t> sent = banded_counts(micro, stream.scales);
      for (size_t t = stream.far_off + 1; t < sent.size(); ++t)
        EXPECT_TRUE(sent[t] >= 50 && sent[t] <= 200)
            << (micro ? "MiCRO" : "ExDyna") << ": " << sent[t] << " pairs at step " << t << ", " << t - stream.far_off
            << " after the far-off step";
    }
  }
}

/// Rank 0 of two, whose peer sent rank 0's own band counts as `forge` altered them (the sums of
/// the sampling histogram are rank 0's doubled).
class ForgedPeer final : public Collective {
 public:
  explicit ForgedPeer(std::function<void(unsigned char*)> forge) : forge_(std::move(forge)) {}
  int rank() const override { return 0; }
  int size() const override { return 2; }
  void sum(std::vector<double>& values) override {
    for (double& v : values) v *= 2.0;
  }
  void allgather(const void* mine, void* all, size_t bytes) override {
    auto* out = static_cast<unsigned char*>(all);
    std::memcpy(out, mine, bytes);
    std::memcpy(out + bytes, mine, bytes);
    forge_(out + bytes);
  }
  bool exchange_takes_agreed_words() const override { return true; }

 private:
  std::function<void(unsigned char*)> forge_;
};

// MiCRO's band counts from a peer carry its control word (two ranks): a count no bucket of this
// size can hold is a CorruptMessageError naming the rank; an honest copy gives both ranks the
// same word.
TEST(Methods, BandCountsFromPeersAreChecked) {
  const int64_t n = 1000;
  for (int forged : {0, 1}) {
    std::vector<float> g = ref::random_vector<float>(n, 3), residual(n, 0.0f);
    BucketView bucket{DType::kFloat32, n, g.data(), residual.data()};
    CpuDevice device;
    MiCRO method(0.05, "union", false, 0);
    ForgedPeer group([&](unsigned char* row) {
      const uint32_t huge = 5000;  // 4-byte counts; position 2 is the first band bin
      if (forged) std::memcpy(row + 2 * 4, &huge, 4);
    });
    if (forged) {
      try {
        method.select(device, bucket, group);
        FAIL() << "forged band counts were accepted";
      } catch (const CorruptMessageError& e) {
        EXPECT_NE(std::string(e.what()).find("band counts from rank 1 hold 5000"), std::string::npos) << e.what();
      }
    } else {
      const Selection s = method.select(device, bucket, group);
      ASSERT_EQ(s.agreed.size(), 2u);
      EXPECT_EQ(s.agreed[0].count, s.count);
      EXPECT_EQ(s.agreed[1].count, s.count);
    }
  }
}

// Random-k and Random-block keep the digest of the indices they drew (the shared exchange then
// reads no message back to hash them): it equals the digest of their message's indices, which a
// rank whose selection kept none computes.
TEST(Methods, SharedDrawsKeepTheirMessagesDigest) {
  const int64_t n = 5000;
  CpuDevice device;
  ForgedPeer group([](unsigned char*) {});  // unused: the draws ask no collective
  const std::vector<std::function<std::unique_ptr<Method>()>> makers = {
      [] { return std::make_unique<RandomK>(0.01, 3); }, [] { return std::make_unique<RandomBlock>(0.01, 3); }};
  for (const auto& make : makers) {
    const std::unique_ptr<Method> method = make();
    std::vector<float> g = ref::random_vector<float>(n, 8), residual(n, 0.0f);
    const BucketView bucket{DType::kFloat32, n, g.data(), residual.data()};
    const Selection s = method->select(device, bucket, group);
    const std::vector<int64_t> read = HostMessage(device, s, bucket).index_list();
    ASSERT_TRUE(s.index_digest.has_value()) << method->name();
    ASSERT_EQ(read.size(), 50u) << method->name();
    EXPECT_EQ(*s.index_digest, index_digest(read.data(), read.size())) << method->name();
  }
}

// A candidate can sit below the band: the band's lower edge is rounded to the bucket's dtype where
// candidates are listed, and compared in float64 where they are chosen. Every |v| of this bfloat16
// bucket is 1, the band starts at 1.001 (1 in bfloat16) and density 0.6 makes its lowest edge the
// threshold: nothing reaches it, and the agreed words say so (each rank's count at the threshold
// leaves out its candidates below the band).
TEST(Methods, AgreedCountsLeaveOutCandidatesBelowTheBand) {
  const int64_t n = 1000;
  std::vector<uint16_t> g(n), residual(n, 0);
  for (int64_t i = 0; i < n; ++i) g[i] = i % 3 ? 0x3F80 : 0xBF80;  // +1 and -1
  BucketView bucket{DType::kBFloat16, n, g.data(), residual.data()};
  CpuDevice device;
  MiCRO method(0.6, "union", false, 0);
  const double estimate = 1.25 * 1.001;  // a steady trend: the prediction, so the band is [1.001, 1.5645)
  method.load_state(
      {{"step", 5.0}, {"threshold", estimate}, {"estimate", estimate}, {"before_last", estimate}, {"k_prev", 600.0}});
  ForgedPeer group([](unsigned char*) {});
  const Selection s = method.select(device, bucket, group);
  EXPECT_EQ(s.count, 0);
  ASSERT_EQ(s.agreed.size(), 2u);
  EXPECT_EQ(s.agreed[0].count, 0);
  EXPECT_EQ(s.agreed[1].count, 0);
}

// The methods that start from a prediction of the threshold (a sample's, not a fit of this step's
// values) select about their target from the first step at any scale of the gradient. SAGE's
// default started at 1 / (2 sqrt(k)) and could lower it only by its band's width a step: it sent
// nothing for about 60 steps of gradients near 1e-13, 20 near 1e-3. MiCRO's and ExDyna's first
// sample was binned on 2^-40 to 2^10: near 1e5 their first step sent 98% of the bucket.
TEST(Methods, SampledStartsSelectAboutTheTargetAtAnyScale) {
  const double d = 0.01;
  const int p = 2;
  const int64_t n = 50000, k = 500;  // per rank (SAGE) or in all (MiCRO, ExDyna)
  const std::vector<std::pair<Case, int64_t>> cases = {
      {{"micro", [=] { return std::make_unique<MiCRO>(d, "union", false, 3); }}, k},
      {{"exdyna", [=] { return std::make_unique<ExDyna>(d, "union", false, 3); }}, k},
      {{"sage",
        [=] {
          return std::make_unique<SAGE>(d, "flat", std::vector<int64_t>{}, false, 3, std::nullopt, std::nullopt);
        }},
       p * k},
  };
  for (const double scale : {1e-13, 1e-3, 1.0, 1e5, 1e30}) {
    for (const auto& [c, expected] : cases) {
      SCOPED_TRACE(std::string(c.name) + " at scale " + std::to_string(scale));
      const auto methods = make_ranks(c, p);
      std::vector<std::vector<float>> residual(p, std::vector<float>(n, 0.0f));
      for (int t = 0; t < 3; ++t) {
        std::vector<int64_t> sent(p);
        rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
          std::mt19937 random(static_cast<unsigned>(100 * t + rank));
          std::normal_distribution<float> normal(0.0f, 1.0f);
          std::vector<float> grad(n);
          for (float& g : grad) g = static_cast<float>(scale * normal(random));
          CpuDevice device;
          BucketView bucket{DType::kFloat32, n, grad.data(), residual[rank].data()};
          sent[rank] = reduce_bucket(methods[rank].get(), transport, device, bucket, ReduceOptions{}).selected_all;
        }));
        EXPECT_NEAR(static_cast<double>(sent[0]), static_cast<double>(expected), 0.1 * expected) << "step " << t;
      }
    }
  }
}

// SAGE's sampled start in a bucket mostly of zeros (an embedding's gradient: 1.2% of the elements
// nonzero, density 0.01): its share of k counts the zeros drawn too, so the band reaches the
// nonzero elements' lower part and holds k. Counting only the positive draws, the share was 1
// (the largest), and every step sent about half of k.
TEST(Methods, SageStartsWithinAMostlyZeroBucket) {
  const int p = 2;
  const int64_t n = 50000, k = 500;
  const auto methods = make_ranks({"sage",
                                   [] {
                                     return std::make_unique<SAGE>(0.01, "flat", std::vector<int64_t>{}, false, 3,
                                                                   std::nullopt, std::nullopt);
                                   }},
                                  p);
  std::vector<std::vector<float>> residual(p, std::vector<float>(n, 0.0f));
  for (int t = 0; t < 4; ++t) {
    std::vector<int64_t> sent(p);
    rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
      std::mt19937 random(static_cast<unsigned>(100 * t + rank));
      std::normal_distribution<float> normal(0.0f, 1.0f);
      std::uniform_int_distribution<int64_t> position(0, n - 1);
      std::vector<float> grad(n, 0.0f);
      for (int i = 0; i < 600; ++i) grad[position(random)] = normal(random);
      CpuDevice device;
      BucketView bucket{DType::kFloat32, n, grad.data(), residual[rank].data()};
      sent[rank] = reduce_bucket(methods[rank].get(), transport, device, bucket, ReduceOptions{}).selected_all;
    }));
    EXPECT_NEAR(static_cast<double>(sent[0]), static_cast<double>(p * k), 0.1 * p * k) << "step " << t;
  }
}

// A step whose gradient is zero leaves only the residual, whose magnitudes end in a cliff (at the
// last steps' thresholds). The density control's first secant step from there overshot to a
// threshold 10^4 times too high that held nothing, and kept it as the best of the step (the first
// of equal counts): its scale was 10^4 too high, and at the next steps every count far above the
// data was 0, which steps of 1/64 in log space could not leave. Gaussian-k (spardl) and SIDCo
// (gpareto) then sent nothing at any later step. Every estimator must be sending again (the cliff
// is steep: 8 counts do not always reach 2% of k there, so the bound is loose).
TEST(Methods, EstimatorsRecoverFromAStepOfOnlyResiduals) {
  const double d = 0.01;
  const std::vector<Case> cases = {
      {"gaussiank_spardl", [=] { return std::make_unique<GaussianK>(d, "spardl"); }},
      {"gaussiank_sidco", [=] { return std::make_unique<GaussianK>(d, "sidco"); }},
      {"dgc", [=] { return std::make_unique<DGC>(d, 3); }},
      {"redsync", [=] { return std::make_unique<RedSync>(d); }},
      {"sidco_exp", [=] { return std::make_unique<SIDCo>(d, "exp", -1, 0.25, std::nullopt); }},
      {"sidco_gpareto", [=] { return std::make_unique<SIDCo>(d, "gpareto", -1, 0.25, std::nullopt); }},
      {"sidco_gamma_gpareto", [=] { return std::make_unique<SIDCo>(d, "gamma_gpareto", -1, 0.25, std::nullopt); }},
  };
  const int64_t n = 20000, k = 200;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::unique_ptr<Method> method = c.make();
    std::vector<float> residual(n, 0.0f);
    int64_t sent = 0;  // at the four steps after the step of zeros
    for (int t = 0; t < 7; ++t) {
      std::vector<float> g(n, 0.0f);
      if (t != 2) {
        for (int64_t i = 0; i < n; ++i) {
          const float s = std::sin(0.37f * i + 0.11f * t);
          g[i] = s * s * s * (i % 97 == 0 ? 8.0f : 1.0f);
        }
      }
      ReduceReport report;
      rethrow_first(run_ranks(1, [&](int, Transport& transport) {
        CpuDevice device;
        const BucketView bucket{DType::kFloat32, n, g.data(), residual.data()};
        report = reduce_bucket(method.get(), transport, device, bucket, ReduceOptions{});
      }));
      if (t > 2) sent += report.selected;
    }
    EXPECT_GT(sent, k);
  }
}

// Gaussian-k's default mode steers its normal fit with the density control, which takes a fit that
// is not a positive number as the threshold itself. A fit is not one where the bucket holds one
// element (no variance: NaN, which selected nothing at every step, so the element never left the
// residual) or, for the spardl variant, where the values lie mostly far below zero (μ + z σ < 0:
// every element was selected). Both must select about k, as every other estimator does.
TEST(Methods, GaussianKSelectsAboutKWhereItsFitIsNoThreshold) {
  for (const char* variant : {"spardl", "sidco"}) {
    SCOPED_TRACE(variant);
    GaussianK one(0.01, variant);
    float g = 3.0f, residual = 0.0f;
    int64_t sent = 0;
    for (int t = 0; t < 3; ++t) {
      float out = g;
      ReduceReport report;
      rethrow_first(run_ranks(1, [&](int, Transport& transport) {
        CpuDevice device;
        report =
            reduce_bucket(&one, transport, device, BucketView{DType::kFloat32, 1, &out, &residual}, ReduceOptions{});
      }));
      sent += report.selected;
    }
    EXPECT_GE(sent, 2) << "n = 1: the element stays in the residual";
  }
  const int64_t n = 20000, k = 200;
  GaussianK negative(0.01, "spardl");
  std::vector<float> g = ref::random_vector<float>(n, 5, 0.2f), residual(n, 0.0f);
  for (float& v : g) v -= 1.0f;  // μ = -1, σ = 0.2: μ + z σ = -0.48
  ReduceReport report;
  rethrow_first(run_ranks(1, [&](int, Transport& transport) {
    CpuDevice device;
    report = reduce_bucket(&negative, transport, device, BucketView{DType::kFloat32, n, g.data(), residual.data()},
                           ReduceOptions{});
  }));
  EXPECT_NEAR(report.selected, k, DensityControl::kTolerance * k);
}

}  // namespace

// A damaged or hand-made method state (a negative or fractional step, a missing entry, a stage
// count of 0, a negative block count, a band factor outside its rule's range) is refused naming
// the entry: the step picks a partition by index, and a negative one read outside the layout's
// tables; a band of NaN or 0 would put every later band off.
TEST(Methods, DamagedStatesAreRefusedNamingTheEntry) {
  const MethodState banded = {
      {"step", 3.0}, {"threshold", 0.1}, {"estimate", 0.1}, {"before_last", 0.1}, {"k_prev", 10.0}};
  auto with = [](MethodState s, const std::string& key, double v) {
    s[key] = v;
    return s;
  };
  auto without = [](MethodState s, const std::string& key) {
    s.erase(key);
    return s;
  };
  auto expect_refused = [](Method& method, const MethodState& state, const std::string& entry) {
    try {
      method.load_state(state);
      ADD_FAILURE() << method.name() << ": accepted a state with a bad '" << entry << "'";
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + entry + "'"), std::string::npos) << e.what();
    }
  };
  MiCRO micro(0.01, "union", false, 0);
  expect_refused(micro, with(banded, "step", -1.0), "step");
  expect_refused(micro, with(banded, "step", 2.5), "step");
  expect_refused(micro, with(banded, "step", std::nan("")), "step");
  expect_refused(micro, with(banded, "k_prev", -4.0), "k_prev");
  expect_refused(micro, without(banded, "step"), "step");
  for (double band : {1.0, 2.5, 0.0, std::nan("")}) expect_refused(micro, with(banded, "band", band), "band");
  for (const char* miss : {"trend_miss", "mean_miss"})
    for (double v : {-0.5, std::nan(""), HUGE_VAL}) expect_refused(micro, with(banded, miss, v), miss);
  micro.load_state(with(banded, "band", 2.0));  // as the sampled step leaves it
  EXPECT_EQ(micro.state().at("band"), 2.0);
  micro.load_state(banded);  // before the adaptive band
  EXPECT_EQ(micro.state().at("band"), 1.25);
  ExDyna exdyna(0.01, "union", false, 0);
  expect_refused(exdyna, with(banded, "blocks.0", -3.0), "blocks.0");
  expect_refused(exdyna, with(banded, "band", 1.01), "band");
  expect_refused(exdyna, with(banded, "trend_miss", std::nan("")), "trend_miss");
  exdyna.load_state(with(with(banded, "trend_miss", 0.25), "mean_miss", 0.0));
  EXPECT_EQ(exdyna.state().at("trend_miss"), 0.25);
  SAGE sage(0.01, "flat", {}, false, 3, std::nullopt, std::nullopt);
  expect_refused(sage, {{"step", -2.0}, {"threshold", 0.1}, {"sample_mean", 0.1}}, "step");
  for (double band : {1.0, 1.3, std::nan("")})
    expect_refused(sage, {{"step", 2.0}, {"threshold", 0.1}, {"sample_mean", 0.1}, {"band", band}}, "band");
  sage.load_state({{"step", 2.0}, {"threshold", 0.1}, {"sample_mean", 0.1}, {"band", 1.1}});
  EXPECT_EQ(sage.state().at("band"), 1.1);
  sage.load_state({{"step", 2.0}, {"threshold", 0.1}, {"sample_mean", 0.1}});  // before the adaptive band
  EXPECT_EQ(sage.state().at("band"), 1.25);
  SIDCo sidco(0.01, "exp", -1, 0.25, std::nullopt);  // adaptive stages
  MethodState saved = sidco.state();
  ASSERT_TRUE(saved.count("stages"));
  expect_refused(sidco, with(saved, "stages", 0.0), "stages");
  sidco.load_state(with(saved, "stages", 1.0e9));  // more than it may use: its largest count,
  EXPECT_EQ(sidco.stages(), 7);                    // ceil(log2(1 / 0.01))
  micro.load_state(banded);                        // the undamaged state loads
}

// The density control's scale and slope (the estimators' default mode) from a damaged or hand-made
// state are refused naming the entry, and the refused state changes nothing. A scale of NaN or Inf
// made every later step select nothing, 0 or a negative one every element, and a slope of NaN or 0
// stopped the control from ever moving.
TEST(Methods, DamagedControlStatesAreRefusedNamingTheEntry) {
  const std::vector<std::function<std::unique_ptr<Method>()>> makers = {
      [] { return std::make_unique<GaussianK>(0.01, "sidco"); },
      [] { return std::make_unique<GaussianK>(0.01, "spardl"); }, [] { return std::make_unique<DGC>(0.01, 3); },
      [] { return std::make_unique<RedSync>(0.01); },
      [] { return std::make_unique<SIDCo>(0.01, "exp", 1, 0.25, std::nullopt); }};
  const std::vector<std::pair<std::string, double>> damaged = {
      {"control.scale", std::nan("")}, {"control.scale", HUGE_VAL}, {"control.scale", 0.0},  {"control.scale", -2.0},
      {"control.slope", std::nan("")}, {"control.slope", 0.0},      {"control.slope", 1.0e9}};
  const int64_t n = 10000, k = 100;
  for (const auto& make : makers) {
    const std::unique_ptr<Method> method = make();
    SCOPED_TRACE(method->name());
    std::vector<float> residual(n, 0.0f);
    auto step = [&](int t) {
      std::vector<float> g = ref::random_vector<float>(n, 40 + t);
      ReduceReport report;
      rethrow_first(run_ranks(1, [&](int, Transport& transport) {
        CpuDevice device;
        report = reduce_bucket(method.get(), transport, device,
                               BucketView{DType::kFloat32, n, g.data(), residual.data()}, ReduceOptions{});
      }));
      return report.selected;
    };
    for (int t = 0; t < 2; ++t) step(t);
    const MethodState saved = method->state();
    ASSERT_TRUE(saved.count("control.scale") && saved.count("control.slope"));
    for (const auto& [key, value] : damaged) {
      MethodState state = saved;
      state[key] = value;
      try {
        method->load_state(state);
        ADD_FAILURE() << "accepted " << key << " = " << value;
      } catch (const ValueError& e) {
        EXPECT_NE(std::string(e.what()).find("'" + key + "'"), std::string::npos) << e.what();
      }
      EXPECT_EQ(method->state(), saved) << "a refused " << key << " = " << value << " was loaded";
    }
    method->load_state(saved);  // the undamaged state loads, and the control goes on steering
    for (int t = 2; t < 5; ++t) EXPECT_NEAR(step(t), k, 0.2 * k) << "step " << t;
  }
}

// The step of the methods that draw from a stream per step (Random-k, Random-block, DGC) and the
// adaptive SIDCo's direction and call count are checked as the other entries of a method state
// are: a damaged or hand-made value is refused naming the entry, and loads nothing. They were cast
// unchecked (a NaN step drew from whatever stream the cast gave), and a direction of 0 froze the
// stage count for good.
TEST(Methods, DamagedStepsAndStageCountersAreRefusedNamingTheEntry) {
  auto expect_refused = [](Method& method, const std::string& key, double value) {
    const MethodState saved = method.state();
    MethodState state = saved;
    state[key] = value;
    try {
      method.load_state(state);
      ADD_FAILURE() << method.name() << ": accepted " << key << " = " << value;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("'" + key + "'"), std::string::npos) << e.what();
    }
    EXPECT_EQ(method.state(), saved) << method.name() << ": a refused " << key << " = " << value << " was loaded";
  };
  RandomK randomk(0.01, 3);
  RandomBlock randomblock(0.01, 3);
  DGC dgc(0.01, 3);
  for (Method* method : std::vector<Method*>{&randomk, &randomblock, &dgc}) {
    for (double step : {std::nan(""), -1.0, 2.5, 1e300}) expect_refused(*method, "step", step);
    MethodState state = method->state();
    state["step"] = 7.0;
    method->load_state(state);  // a whole step loads
    EXPECT_EQ(method->state().at("step"), 7.0) << method->name();
  }
  SIDCo sidco(0.01, "exp", -2, 0.25, std::nullopt);
  for (double direction : {0.0, std::nan(""), 2.0, -0.5}) expect_refused(sidco, "direction", direction);
  for (double calls : {5.0, -1.0, std::nan("")}) expect_refused(sidco, "calls", calls);
  MethodState state = sidco.state();
  state["direction"] = -1.0;
  state["calls"] = 4.0;
  sidco.load_state(state);  // the undamaged state loads
  EXPECT_EQ(sidco.state(), state);
}

// MiCRO's and ExDyna's reference mode scales the last threshold by a factor near 1 at every step
// after the first, so a loaded threshold that is not a positive finite number stayed so for good:
// NaN or Inf sent only the dummy element of every rank at every step, 0 or a negative one every
// element. A state past its first step with such a threshold is refused naming it, and loads
// nothing; a fresh method's state (no threshold yet) loads.
TEST(Methods, ReferencePartitionsRefuseADamagedThreshold) {
  const MethodState saved = {
      {"step", 3.0}, {"threshold", 0.1}, {"estimate", 0.1}, {"before_last", 0.1}, {"k_prev", 10.0}};
  MiCRO micro(0.01, "union", true, 0);
  ExDyna exdyna(0.01, "union", true, 0);
  for (PartitionedMethod* method : std::vector<PartitionedMethod*>{&micro, &exdyna}) {
    const MethodState fresh = method->state();
    EXPECT_TRUE(std::isnan(fresh.at("threshold"))) << method->name();
    method->load_state(fresh);
    method->load_state(saved);
    const MethodState loaded = method->state();
    for (double threshold : {std::nan(""), HUGE_VAL, 0.0, -0.1}) {
      MethodState state = saved;
      state["threshold"] = threshold;
      state["step"] = 4.0;
      try {
        method->load_state(state);
        ADD_FAILURE() << method->name() << ": accepted threshold = " << threshold;
      } catch (const ValueError& e) {
        EXPECT_NE(std::string(e.what()).find("'threshold'"), std::string::npos) << e.what();
      }
      EXPECT_EQ(method->state(), loaded) << method->name() << ": a refused state was loaded";
    }
  }
}

// ExDyna's block layout is per world size. One loaded from a run of 4 ranks into a run of 2 is a
// ValueError at the first step naming the entries, both world sizes and the way out, and stays one
// at every later try (the first try used to lay out even partitions before it failed, and the
// next step then ran on them, the loaded layout silently dropped). Blocks that do not add up to
// 1024 are refused when the state is loaded, naming the entries.
TEST(Methods, ExDynaRefusesALayoutOfAnotherWorldSizeNamingIt) {
  const int p = 2;
  const int64_t n = 100000;
  MethodState saved = {{"step", 3.0}, {"threshold", 0.1}, {"estimate", 0.1}, {"before_last", 0.1}, {"k_prev", 10.0}};
  for (int b = 0; b < 4; ++b) saved["blocks." + std::to_string(b)] = 256.0;
  std::vector<std::unique_ptr<Method>> methods;
  for (int r = 0; r < p; ++r) {
    methods.push_back(std::make_unique<ExDyna>(0.01, "union", false, 3));
    methods[r]->load_state(saved);
  }
  std::vector<std::vector<float>> residual(p, std::vector<float>(n, 0.0f));
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      rethrow_first(run_ranks(p, [&](int rank, Transport& transport) {
        std::vector<float> g = ref::random_vector<float>(n, rank);
        CpuDevice device;
        reduce_bucket(methods[rank].get(), transport, device,
                      BucketView{DType::kFloat32, n, g.data(), residual[rank].data()}, ReduceOptions{});
      }));
      ADD_FAILURE() << "attempt " << attempt << ": a layout of 4 partitions ran at 2 ranks";
    } catch (const ValueError& e) {
      const std::string what = e.what();
      for (const char* part : {"'blocks.0' to 'blocks.3'", "4 partitions", "this run has 2", "saved at 2 ranks"})
        EXPECT_NE(what.find(part), std::string::npos) << "attempt " << attempt << ": " << what;
    }
  }
  ExDyna exdyna(0.01, "union", false, 3);
  MethodState short_of = saved;
  short_of["blocks.3"] = 200.0;
  try {
    exdyna.load_state(short_of);
    ADD_FAILURE() << "blocks adding up to 968 were accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("'blocks.0' to 'blocks.3' hold 968 blocks"), std::string::npos) << e.what();
  }
}

// Above SIDCo's first ratio (0.25) the later stages' ratios exceed 1 and lower the threshold, at
// densities near 1 below zero. The default mode's density control took that estimate as the
// threshold, so every step selected every element (10000 for a target of 7000 or 9000); it now
// starts from the mean magnitude there, as Gaussian-k does, and selects about k.
TEST(Methods, SidcoHoldsItsDensityWhereItsLaterStagesFallBelowZero) {
  const int64_t n = 10000;
  for (const char* fit : {"exp", "gpareto", "gamma_gpareto"}) {
    for (int stages : {2, 3}) {
      for (double density : {0.7, 0.9}) {
        SCOPED_TRACE(::testing::Message() << fit << " stages=" << stages << " density=" << density);
        SIDCo sidco(density, fit, stages, 0.25, std::nullopt);
        const double k = density * n;
        std::vector<float> residual(n, 0.0f);
        for (int t = 0; t < 4; ++t) {
          std::vector<float> g = ref::random_vector<float>(n, 60 + t);
          ReduceReport report;
          rethrow_first(run_ranks(1, [&](int, Transport& transport) {
            CpuDevice device;
            report = reduce_bucket(&sidco, transport, device, BucketView{DType::kFloat32, n, g.data(), residual.data()},
                                   ReduceOptions{});
          }));
          EXPECT_NEAR(static_cast<double>(report.selected), k, 0.05 * k) << "step " << t;
        }
      }
    }
  }
}

// A step of an empty bucket has nothing to sample: SAGE reports no threshold (NaN) for it and keeps
// its last one for the next step. It dropped it, and the reference mode, which scales the last
// threshold (NaN times anything), then selected nothing at every later step.
// SAGE's default mode where its prediction misses by more than the band: at step 0 the top k of
// 100,000 elements lie at 2 (the others at 1), at step 1 at 1.4. The sampled scale ratio (the top
// is a hundredth of the sample) predicts about 2, so the band after the sampled step, from 2 / 1.25,
// holds nothing; the second, from 2 / 1.25^2, holds the k at 1.4. The step sends exactly them,
// does not restart and widens the band to its widest (the miss was about 35%).
TEST(Methods, SageTakesTheTopKFromASecondBandWhereTheFirstMissed) {
  const int64_t n = 100000, k = 1000;
  for (Listing listing : {Listing::kHostMemory, Listing::kNowhere}) {
    SCOPED_TRACE(listing == Listing::kNowhere ? "passes on the device" : "candidates listed");
    SAGE sage(0.01, "flat", {}, false, 3, std::nullopt, std::nullopt, listing);
    std::vector<float> residual(n);
    auto step = [&](float top) {
      std::vector<float> g(n);
      for (int64_t i = 0; i < n; ++i) g[i] = (i % 100 == 7 ? top : 1.0f) * (i % 2 == 0 ? 1.0f : -1.0f);
      std::fill(residual.begin(), residual.end(), 0.0f);  // each step sees exactly g
      ReduceReport report;
      rethrow_first(run_ranks(1, [&](int, Transport& transport) {
        CpuDevice device;
        report = reduce_bucket(&sage, transport, device, BucketView{DType::kFloat32, n, g.data(), residual.data()},
                               ReduceOptions{});
      }));
      int64_t wrong = 0;  // what was sent is gone from the residual: exactly the top
      for (int64_t i = 0; i < n; ++i) wrong += (residual[i] == 0.0f) != (i % 100 == 7) ? 1 : 0;
      EXPECT_EQ(wrong, 0);
      return report.selected;
    };
    EXPECT_EQ(step(2.0f), k);
    EXPECT_EQ(sage.report().threshold, 2.0);
    EXPECT_EQ(step(1.4f), k);
    EXPECT_EQ(sage.report().threshold, 1.4f);
    EXPECT_EQ(sage.state().at("restart"), 0.0);
    EXPECT_EQ(sage.state().at("band"), 1.25);
  }
}

TEST(Methods, SageKeepsItsThresholdOverAnEmptyBucket) {
  const int64_t n = 10000;
  for (bool reference : {true, false}) {
    SCOPED_TRACE(reference ? "reference" : "default");
    SAGE sage(0.01, "flat", {}, reference, 3, std::nullopt, std::nullopt);
    std::vector<float> residual(n, 0.0f);
    auto step = [&](int64_t size, int t) {
      std::vector<float> g = ref::random_vector<float>(n, 80 + t, 0.01f);
      ReduceReport report;
      rethrow_first(run_ranks(1, [&](int, Transport& transport) {
        CpuDevice device;
        report = reduce_bucket(&sage, transport, device, BucketView{DType::kFloat32, size, g.data(), residual.data()},
                               ReduceOptions{});
      }));
      return report.selected;
    };
    for (int t = 0; t < 3; ++t) step(n, t);
    const double threshold = sage.state().at("threshold");
    ASSERT_TRUE(std::isfinite(threshold) && threshold > 0.0);
    EXPECT_EQ(step(0, 3), 0);
    EXPECT_TRUE(std::isnan(sage.report().threshold));
    EXPECT_EQ(sage.state().at("threshold"), threshold);
    for (int t = 4; t < 8; ++t) {
      EXPECT_GT(step(n, t), 0) << "step " << t;
      EXPECT_TRUE(std::isfinite(sage.report().threshold)) << "step " << t;
    }
  }
}

// ---- state() / load_state() round trips ---------------------------------------------------------

namespace {

/// all_methods() and the variants it leaves out: the reference modes, the other exchanges and
/// listings, a fixed threshold, the adaptive SIDCo's stage counts, SparDL with one and two teams.
std::vector<Case> every_variant(double d = 0.02) {
  std::vector<Case> cases = all_methods(d);
  std::vector<Case> more = {
      {"topk_reduce_scatter", [=] { return std::make_unique<TopK>(d, "reduce_scatter"); }},
      {"threshold_fixed", [=] { return std::make_unique<Threshold>(0.5, std::nullopt); }},
      {"gaussiank_spardl_ref", [=] { return std::make_unique<GaussianK>(d, "spardl", "gather", true); }},
      {"gaussiank_sidco_ref", [=] { return std::make_unique<GaussianK>(d, "sidco", "gather", true); }},
      {"dgc_ref", [=] { return std::make_unique<DGC>(d, 3, "gather", true); }},
      {"redsync_ref", [=] { return std::make_unique<RedSync>(d, "gather", true); }},
      {"sage_reference_flat",
       [=] { return std::make_unique<SAGE>(d, "flat", std::vector<int64_t>{}, true, 3, std::nullopt, std::nullopt); }},
      {"sage_initial",
       [=] { return std::make_unique<SAGE>(d, "flat", std::vector<int64_t>{}, false, 3, 0.3, std::nullopt); }},
      {"sage_nowhere",
       [=] {
         return std::make_unique<SAGE>(d, "flat", std::vector<int64_t>{}, false, 3, std::nullopt, std::nullopt,
                                       Listing::kNowhere);
       }},
      {"micro_reference", [=] { return std::make_unique<MiCRO>(d, "union", true, 3); }},
      {"micro_gather", [=] { return std::make_unique<MiCRO>(d, "gather", false, 3); }},
      {"micro_nowhere", [=] { return std::make_unique<MiCRO>(d, "union", false, 3, Listing::kNowhere); }},
      {"exdyna_reference_gather", [=] { return std::make_unique<ExDyna>(d, "gather", true, 3); }},
      {"sidco_adaptive_1", [=] { return std::make_unique<SIDCo>(d, "exp", -1, 0.25, std::nullopt); }},
      {"sidco_adaptive_3", [=] { return std::make_unique<SIDCo>(d, "gpareto", -3, 0.25, std::nullopt); }},
      {"sidco_adaptive_ref", [=] { return std::make_unique<SIDCo>(d, "exp", -2, 0.25, std::nullopt, "gather", true); }},
      {"sidco_gamma_ref",
       [=] { return std::make_unique<SIDCo>(d, "gamma_gpareto", 3, 0.25, std::nullopt, "gather", true); }},
      {"spardl_1", [=] { return std::make_unique<SparDL>(d, 1); }},
      {"spardl_2", [=] { return std::make_unique<SparDL>(d, 2); }},
  };
  cases.insert(cases.end(), more.begin(), more.end());
  return cases;
}

/// Whether `c` runs on p ranks (SparDL's two teams need an even number of them).
bool runs_on(const Case& c, int p) { return std::string(c.name) != "spardl_2" || p % 2 == 0; }

/// Two states alike, NaN entries equal to NaN.
::testing::AssertionResult same_state(const MethodState& a, const MethodState& b) {
  bool same = a.size() == b.size();
  for (auto x = a.begin(), y = b.begin(); same && x != a.end(); ++x, ++y)
    same = x->first == y->first && (x->second == y->second || (std::isnan(x->second) && std::isnan(y->second)));
  if (same) return ::testing::AssertionSuccess();
  auto text = [](const MethodState& s) {
    std::string out;
    for (const auto& [key, value] : s) out += key + "=" + std::to_string(value) + " ";
    return out;
  };
  return ::testing::AssertionFailure() << "{ " << text(a) << "} vs { " << text(b) << "}";
}

struct RankRun {
  std::vector<float> residual;
  std::vector<float> out;
  double threshold = 0.0;
};

/// One step of every rank: gradients value(t, r, i) (times `scale`), residuals in `runs`.
void step_all(const std::vector<std::unique_ptr<Method>>& methods, std::vector<RankRun>& runs, int64_t n, int t,
              const Value& value, float scale) {
  const int p = static_cast<int>(methods.size());
  rethrow_first(rank_threads().run(p, [&](int rank, Transport& transport) {
    RankRun& run = runs[rank];
    run.out.resize(n);
    for (int64_t i = 0; i < n; ++i) run.out[i] = value(t, rank, i) * scale;
    CpuDevice device;
    BucketView bucket{DType::kFloat32, n, run.out.data(), run.residual.data()};
    const ReduceReport report = reduce_bucket(methods[rank].get(), transport, device, bucket, ReduceOptions{});
    run.threshold = report.threshold;
  }));
}

float drifting(int t, int r, int64_t i) {
  // a scale that moves from step to step, so the adaptive parts of every method have work to do
  const float level = 1.0f + 0.6f * std::sin(0.9f * t);
  const float base = std::sin(0.37f * i + 1.3f * r + 0.71f * t * t + 0.05f * i * r);
  return level * base * base * base * ((i % 97 == 0) ? 8.0f : 1.0f) * (i < 20000 ? 3.0f : 1.0f);
}

/// Runs `before` steps (rescaled by `rescale_by` after the first half of them), saves every rank's
/// state, loads it into a new method, saves that one's state before any step and loads it into a
/// third (a checkpoint loaded and saved again, unstepped), and checks that the third goes on for
/// `after` steps exactly as the method that saved the state.
void expect_round_trip(const Case& c, int p, int64_t n, int before, int after, double rescale_by, bool used = false) {
  SCOPED_TRACE(::testing::Message() << c.name << " p=" << p << " n=" << n << " before=" << before
                                    << " rescale=" << rescale_by << (used ? " into a used method" : ""));
  auto going = make_ranks(c, p);
  std::vector<RankRun> runs(p);
  for (auto& r : runs) r.residual.assign(n, 0.0f);
  const float scale = static_cast<float>(rescale_by);
  for (int t = 0; t < before; ++t) {
    if (t == before / 2 && rescale_by != 1.0)
      for (auto& m : going) m->rescale(rescale_by);
    step_all(going, runs, n, t, drifting, t < before / 2 ? 1.0f : scale);
  }
  if (before == 0 && rescale_by != 1.0)
    for (auto& m : going) m->rescale(rescale_by);
  std::vector<MethodState> saved;
  for (auto& m : going) saved.push_back(m->state());
  auto middle = make_ranks(c, p);
  for (int r = 0; r < p; ++r) middle[r]->load_state(saved[r]);
  for (int r = 0; r < p; ++r)
    EXPECT_TRUE(same_state(middle[r]->state(), saved[r])) << "rank " << r << ": state() after load";
  auto loaded = make_ranks(c, p);
  if (used) {  // the state goes into methods that ran steps of their own (a checkpoint loaded mid-run)
    std::vector<RankRun> other(p);
    for (auto& r : other) r.residual.assign(n, 0.0f);
    for (int t = 0; t < 5; ++t) step_all(loaded, other, n, t + 11, drifting, 2.0f);
  }
  for (int r = 0; r < p; ++r) loaded[r]->load_state(middle[r]->state());
  std::vector<RankRun> runs2 = runs;
  for (int t = before; t < before + after; ++t) {
    step_all(going, runs, n, t, drifting, scale);
    step_all(loaded, runs2, n, t, drifting, scale);
    for (int r = 0; r < p; ++r) {
      ASSERT_EQ(runs[r].residual, runs2[r].residual) << "step " << t << " rank " << r << ": residuals differ";
      ASSERT_EQ(runs[r].out, runs2[r].out) << "step " << t << " rank " << r << ": updates differ";
      if (!(std::isnan(runs[r].threshold) && std::isnan(runs2[r].threshold)))
        ASSERT_EQ(runs[r].threshold, runs2[r].threshold) << "step " << t << " rank " << r;
    }
  }
}

}  // namespace

// Every method (both modes, every exchange, SparDL too): a state saved after some steps (rescaled
// or not), loaded, saved again before a step and loaded into a new method (or one that ran steps of
// its own) goes on exactly as the method that saved it.
class RoundTrip : public ::testing::TestWithParam<int> {};

TEST_P(RoundTrip, LoadedStateGoesOnAsTheMethodWouldHave) {
  const int p = GetParam();
  for (const Case& c : every_variant()) {
    if (!runs_on(c, p)) continue;
    for (int before : {0, 2, 7}) expect_round_trip(c, p, 40000, before, 4, 1.0);
    expect_round_trip(c, p, 40000, 4, 3, 4.0);
    for (int before : {0, 4}) expect_round_trip(c, p, 40000, before, 3, 1.0, /*used=*/true);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, RoundTrip, ::testing::Values(3, 4));

// ExDyna's block layout, loaded, lives only in saved_blocks_ until the next step lays it out. A
// state saved before that step (a checkpoint loaded and saved again, as a resumed run that saves
// before its first step does) left out the 'blocks.' entries, and a run resumed from it started
// from even partitions: its selections differed from the run that saved the layout.
TEST(Methods, ExDynaKeepsALoadedLayoutInAStateSavedBeforeItsNextStep) {
  const Case c{"exdyna", [] { return std::make_unique<ExDyna>(0.02, "union", false, 3); }};
  const int p = 2;
  const int64_t n = 40000;
  auto going = make_ranks(c, p);
  std::vector<RankRun> runs(p);
  for (auto& r : runs) r.residual.assign(n, 0.0f);
  for (int t = 0; t < 4; ++t) step_all(going, runs, n, t, drifting, 1.0f);
  ASSERT_NE(going[0]->state().at("blocks.0"), 512.0) << "the test needs a rebalanced layout";
  auto middle = make_ranks(c, p), loaded = make_ranks(c, p);
  for (int r = 0; r < p; ++r) {
    middle[r]->load_state(going[r]->state());
    EXPECT_TRUE(same_state(middle[r]->state(), going[r]->state())) << "rank " << r;
    loaded[r]->load_state(middle[r]->state());
  }
  std::vector<RankRun> runs2 = runs;
  for (int t = 4; t < 6; ++t) {
    step_all(going, runs, n, t, drifting, 1.0f);
    step_all(loaded, runs2, n, t, drifting, 1.0f);
    for (int r = 0; r < p; ++r) ASSERT_EQ(runs[r].residual, runs2[r].residual) << "step " << t << " rank " << r;
  }
}

// A state without a layout (saved before ExDyna's first step) loaded into an ExDyna that ran steps
// lays out even partitions at the next step, as a new method that loads it does: the method kept
// its own rebalanced layout, and went on differently from the run that saved the state.
TEST(Methods, ExDynaLoadsAStateWithoutALayoutIntoAMethodThatRan) {
  const Case c{"exdyna", [] { return std::make_unique<ExDyna>(0.02, "union", false, 3); }};
  const int p = 2;
  const int64_t n = 40000;
  auto used = make_ranks(c, p), fresh = make_ranks(c, p);
  std::vector<RankRun> runs(p);
  for (auto& r : runs) r.residual.assign(n, 0.0f);
  for (int t = 0; t < 4; ++t) step_all(used, runs, n, t, drifting, 1.0f);
  ASSERT_NE(used[0]->state().at("blocks.0"), 512.0) << "the test needs a rebalanced layout";
  for (int r = 0; r < p; ++r) used[r]->load_state(fresh[r]->state());
  for (auto& r : runs) r.residual.assign(n, 0.0f);
  std::vector<RankRun> runs2 = runs;
  for (int t = 0; t < 3; ++t) {
    step_all(fresh, runs, n, t, drifting, 1.0f);
    step_all(used, runs2, n, t, drifting, 1.0f);
    for (int r = 0; r < p; ++r) ASSERT_EQ(runs[r].residual, runs2[r].residual) << "step " << t << " rank " << r;
  }
}

// ---- rescale() ----------------------------------------------------------------------------------

namespace {

/// A method rescaled by `first` before its first step and by `second` before step `at`, fed the
/// gradients times the product so far, against one fed the plain gradients: with power-of-two
/// factors every step selects the same elements (updates and residuals exactly times the scale).
void expect_rescale_invariant(const Case& c, int p, int64_t n, double first, double second, int at, int steps) {
  SCOPED_TRACE(::testing::Message() << c.name << " p=" << p << " first=" << first << " second=" << second);
  auto plain = make_ranks(c, p), scaled = make_ranks(c, p);
  std::vector<RankRun> a(p), b(p);
  for (auto& r : a) r.residual.assign(n, 0.0f);
  for (auto& r : b) r.residual.assign(n, 0.0f);
  double scale = first;
  for (auto& m : scaled) m->rescale(first);
  for (int t = 0; t < steps; ++t) {
    if (t == at) {
      for (auto& m : scaled) m->rescale(second);
      scale *= second;
      for (auto& r : b)
        for (float& v : r.residual) v = static_cast<float>(v * second);  // as GradScaler's unscale would leave it
    }
    step_all(plain, a, n, t, drifting, 1.0f);
    step_all(scaled, b, n, t, drifting, static_cast<float>(scale));
    for (int r = 0; r < p; ++r) {
      int64_t wrong_residual = 0, wrong_out = 0;
      for (int64_t i = 0; i < n; ++i) {
        wrong_residual += b[r].residual[i] != static_cast<float>(a[r].residual[i] * scale) ? 1 : 0;
        wrong_out += b[r].out[i] != static_cast<float>(a[r].out[i] * scale) ? 1 : 0;
      }
      ASSERT_EQ(wrong_residual, 0) << "step " << t << " rank " << r << ": residual elements not times the scale";
      ASSERT_EQ(wrong_out, 0) << "step " << t << " rank " << r << ": update elements not times the scale";
    }
  }
}

}  // namespace

TEST(Methods, RescaledMethodsSelectWhatTheyWouldWithoutLossScaling) {
  for (const Case& c : every_variant()) {
    expect_rescale_invariant(c, 2, 40000, 4.0, 0.125, 2, 4);
    expect_rescale_invariant(c, 2, 40000, 1.0 / (1024.0 * 1024.0), 1024.0 * 1024.0 * 8.0, 2, 4);
  }
}

// ---- degenerate selections ----------------------------------------------------------------------

namespace {

template <typename T>
DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<T, Half>) return DType::kFloat16;
  return DType::kBFloat16;
}

template <typename T>
void degenerate_run(const Case& c, int p, int64_t n, int steps, const Value& value, NonFinitePolicy policy,
                    std::vector<int64_t>* selected = nullptr) {
  auto methods = make_ranks(c, p);
  std::vector<std::vector<T>> residual(p, std::vector<T>(n, Num<T>::zero()));
  for (int t = 0; t < steps; ++t) {
    std::vector<std::vector<T>> out(p, std::vector<T>(n));
    for (int r = 0; r < p; ++r)
      for (int64_t i = 0; i < n; ++i) out[r][i] = Num<T>::from_float(value(t, r, i));
    std::vector<ReduceReport> reports(p);
    std::vector<std::exception_ptr> errors = rank_threads().run(p, [&](int rank, Transport& transport) {
      CpuDevice device;
      BucketView bucket{dtype_of<T>(), n, out[rank].data(), residual[rank].data()};
      ReduceOptions options;
      options.nonfinite = policy;
      reports[rank] = reduce_bucket(methods[rank].get(), transport, device, bucket, options);
    });
    bool raised = false;
    int raising = 0;
    for (auto& e : errors) {
      if (!e) continue;
      try {
        std::rethrow_exception(e);
      } catch (const NonFiniteError& x) {
        raised = true;  // expected under kRaise only
        ++raising;
        if (policy != NonFinitePolicy::kRaise) {
          ADD_FAILURE() << "step " << t << ": raised under nonfinite=skip: " << x.what();
          return;
        }
      } catch (const std::exception& x) {
        ADD_FAILURE() << "step " << t << ": " << x.what();
        return;
      }
    }
    bool nonfinite_input = false;  // a gradient value that is NaN or Inf in T (the residuals stay finite)
    for (int r = 0; r < p; ++r)
      for (int64_t i = 0; i < n; ++i)
        nonfinite_input = nonfinite_input || !std::isfinite(Num<T>::to_float(Num<T>::from_float(value(t, r, i))));
    if (policy == NonFinitePolicy::kRaise && nonfinite_input) {
      ASSERT_TRUE(raised) << "step " << t << ": a NaN/Inf gradient raised no NonFiniteError under nonfinite=raise";
    }
    if (raised) {
      EXPECT_EQ(raising, p) << "step " << t << ": not every rank raised (each must know that none applied the step)";
      continue;
    }
    for (int r = 0; r < p; ++r) {
      for (int64_t i = 0; i < n; ++i) {
        const float a = Num<T>::to_float(out[r][i]), b = Num<T>::to_float(out[0][i]);
        ASSERT_TRUE(a == b || (std::isnan(a) && std::isnan(b))) << "step " << t << " rank " << r << " i " << i;
      }
      for (int64_t i = 0; i < n; ++i)
        ASSERT_TRUE(std::isfinite(Num<T>::to_float(residual[r][i]))) << "step " << t << " rank " << r << " i " << i;
    }
    if (selected) selected->push_back(reports[0].selected);
  }
}

}  // namespace

TEST(Methods, DegenerateBucketsOfEveryDtype) {
  const float nan = std::nanf(""), inf = std::numeric_limits<float>::infinity();
  const std::vector<std::pair<const char*, Value>> values = {
      {"zeros", [](int, int, int64_t) { return 0.0f; }},
      {"equal", [](int, int, int64_t) { return 1.0f; }},
      {"wave", wave},
      {"nan at step 1", [=](int t, int r, int64_t i) { return t == 1 && i == 0 && r == 0 ? nan : wave(t, r, i); }},
      {"inf at step 1", [=](int t, int r, int64_t i) { return t == 1 && i % 3 == 0 ? inf : wave(t, r, i); }},
      {"huge", [](int t, int r, int64_t i) { return (i % 2 ? 1.0f : -1.0f) * 60000.0f * (1 + r + t % 2); }},
      {"tiny", [](int t, int r, int64_t i) { return float(i % 5) * 1e-7f * (1 + r + t); }},
  };
  for (double d : {0.02, 1.0}) {
    for (const Case& c : every_variant(d)) {
      for (int p : {1, 4}) {
        if (!runs_on(c, p)) continue;
        for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{5}, int64_t{300}}) {
          for (const auto& [what, value] : values) {
            for (NonFinitePolicy policy : {NonFinitePolicy::kSkip, NonFinitePolicy::kRaise}) {
              SCOPED_TRACE(::testing::Message() << c.name << " d=" << d << " p=" << p << " n=" << n << " " << what
                                                << (policy == NonFinitePolicy::kSkip ? " skip" : " raise"));
              {
                SCOPED_TRACE("float32");
                degenerate_run<float>(c, p, n, 3, value, policy);
              }
              {
                SCOPED_TRACE("float16");
                degenerate_run<Half>(c, p, n, 3, value, policy);
              }
              {
                SCOPED_TRACE("bfloat16");
                degenerate_run<BFloat16>(c, p, n, 3, value, policy);
              }
            }
          }
        }
      }
    }
  }
}

// SAGE over an empty bucket at its first step (no threshold found, NaN): the next steps start as a
// first step does, with about the threshold of a SAGE without the empty step (the default mode
// selecting its top k).
// The reference mode scaled the NaN threshold at every later step and selected nothing for good;
// the default mode selected nothing at the next step.
TEST(Methods, SageStartsAfterAnEmptyFirstBucket) {
  const int64_t n = 10000;
  for (bool reference : {true, false}) {
    SCOPED_TRACE(reference ? "reference" : "default");
    SAGE sage(0.01, "flat", {}, reference, 3, std::nullopt, std::nullopt);
    SAGE plain(0.01, "flat", {}, reference, 3, std::nullopt, std::nullopt);
    std::vector<float> residual(n, 0.0f), plain_residual(n, 0.0f);
    auto step = [&](SAGE& method, std::vector<float>& r, int64_t size, int t) {
      std::vector<float> g = ref::random_vector<float>(n, 80 + t, 0.01f);
      ReduceReport report;
      rethrow_first(run_ranks(1, [&](int, Transport& transport) {
        CpuDevice device;
        report = reduce_bucket(&method, transport, device, BucketView{DType::kFloat32, size, g.data(), r.data()},
                               ReduceOptions{});
      }));
      return report.selected;
    };
    EXPECT_EQ(step(sage, residual, 0, 0), 0);
    for (int t = 1; t < 12; ++t) {
      const int64_t selected = step(sage, residual, n, t);
      if (!reference) EXPECT_EQ(selected, 100) << "step " << t;  // the default mode's top k
      step(plain, plain_residual, n, t);
      const double threshold = sage.report().threshold, expected = plain.report().threshold;
      EXPECT_TRUE(threshold > expected / 1.5 && threshold < expected * 1.5)
          << "step " << t << ": " << threshold << " against " << expected;
    }
  }
}

// ---- damaged states -----------------------------------------------------------------------------

// A state short of an entry the method reads (a truncated checkpoint, or another method's state) is
// a ValueError naming the entry. SAGE, MiCRO, ExDyna and the adaptive SIDCo read theirs with
// std::map::at, whose std::out_of_range said only "map::at".
TEST(Methods, StatesShortOfAnEntryAreRefusedNamingIt) {
  const std::vector<Case> cases = {
      {"sage",
       [] {
         return std::make_unique<SAGE>(0.02, "flat", std::vector<int64_t>{}, false, 3, std::nullopt, std::nullopt);
       }},
      {"micro", [] { return std::make_unique<MiCRO>(0.02, "union", false, 3); }},
      {"exdyna", [] { return std::make_unique<ExDyna>(0.02, "union", true, 3); }},
      {"sidco_adaptive", [] { return std::make_unique<SIDCo>(0.02, "exp", -2, 0.25, std::nullopt); }},
  };
  const int64_t n = 40000;
  for (const Case& c : cases) {
    auto methods = make_ranks(c, 1);
    std::vector<RankRun> runs(1);
    runs[0].residual.assign(n, 0.0f);
    for (int t = 0; t < 3; ++t) step_all(methods, runs, n, t, drifting, 1.0f);
    const MethodState saved = methods[0]->state();
    int entries = 0;  // of the listed entries, those the method's state has
    for (const char* key : {"threshold", "sample_mean", "estimate", "before_last", "sum", "last_estimate"}) {
      if (!saved.count(key)) continue;
      ++entries;
      SCOPED_TRACE(::testing::Message() << c.name << " without '" << key << "'");
      MethodState state = saved;
      state.erase(key);
      auto fresh = c.make();
      try {
        fresh->load_state(state);
        ADD_FAILURE() << "accepted";
      } catch (const ValueError& e) {
        EXPECT_NE(std::string(e.what()).find("no '" + std::string(key) + "' entry"), std::string::npos) << e.what();
      } catch (const std::exception& e) {
        ADD_FAILURE() << "refused with " << typeid(e).name() << ": " << e.what();
      }
    }
    EXPECT_GT(entries, 0) << c.name << "'s state has none of the entries listed: nothing was tried";
  }
}

// SAGE's reference mode scales its last threshold by α β γ at every step, as MiCRO's and ExDyna's
// reference mode scale theirs: a loaded threshold of 0, below 0 or infinite stays so for good
// (every element selected at every step, or none), so a state past its first step with one is
// refused naming it, as theirs is (ReferencePartitionsRefuseADamagedThreshold). NaN (no threshold
// yet: only empty buckets so far) loads, and the next step starts as the first.
TEST(Methods, SageReferenceRefusesADamagedThreshold) {
  const MethodState saved = {{"step", 3.0}, {"threshold", 0.1}, {"sample_mean", 0.1}};
  SAGE sage(0.01, "flat", {}, /*reference=*/true, 3, std::nullopt, std::nullopt);
  sage.load_state(saved);
  for (double threshold : {HUGE_VAL, 0.0, -0.1, -HUGE_VAL}) {
    MethodState state = saved;
    state["threshold"] = threshold;
    state["step"] = 4.0;
    try {
      sage.load_state(state);
      ADD_FAILURE() << "accepted threshold = " << threshold;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("'threshold'"), std::string::npos) << e.what();
    }
    EXPECT_EQ(sage.state().at("threshold"), 0.1) << "a refused state was loaded";
  }
  MethodState none = saved;
  none["threshold"] = std::nan("");
  sage.load_state(none);
  SAGE plain(0.01, "flat", {}, /*reference=*/false, 3, std::nullopt, std::nullopt);
  MethodState damaged = saved;
  damaged["threshold"] = -1.0;
  plain.load_state(damaged);  // the default mode predicts its band afresh from it: no lasting harm
}

// Two positive finite factors whose product is no positive finite number (1e200 twice, 1e-200
// twice): the method's loss scale became Inf or 0, which its own state then held, and load_state
// refused that state ('loss_scale' is inf): a checkpoint the method saved that it cannot load. The
// second rescale is refused instead, and changes nothing.
TEST(Methods, RescaleRefusesAFactorThatTakesTheLossScaleOutOfRange) {
  for (const Case& c : every_variant()) {
    for (double factor : {1e200, 1e-200}) {
      SCOPED_TRACE(::testing::Message() << c.name << " factor " << factor);
      std::unique_ptr<Method> method = c.make();
      method->rescale(factor);
      const MethodState before = method->state();
      try {
        method->rescale(factor);
        ADD_FAILURE() << "accepted a rescale by " << factor << " to a loss scale of " << factor * factor;
      } catch (const ValueError&) {
        EXPECT_TRUE(same_state(method->state(), before)) << "a refused rescale changed the state";
      }
      std::unique_ptr<Method> fresh = c.make();
      EXPECT_NO_THROW(fresh->load_state(method->state())) << "the method's own state is refused";
    }
  }
}
