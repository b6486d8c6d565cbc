// The CUDA kernels against the CPU kernels on the same inputs. Every test skips when no GPU is
// present; CI compiles and links this file with nvcc, users with a GPU run it.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/cuda_device.h"
#include "gradsparse/methods.h"
#include "gradsparse/one_pass.h"
#include "reference.h"

using namespace gradsparse;
namespace ref = gradsparse::reference;

namespace {

#define GS_REQUIRE_GPU() \
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device"

template <typename T>
struct DeviceVector {
  CudaDevice& device;
  Buffer buffer;
  int64_t n;
  DeviceVector(CudaDevice& d, const std::vector<T>& host)
      : device(d), buffer(d.allocate(host.size() * sizeof(T))), n(host.size()) {
    d.copy_from_host(buffer.data(), host.data(), host.size() * sizeof(T));
  }
  std::vector<T> host() {
    std::vector<T> out(n);
    device.copy_to_host(out.data(), buffer.data(), n * sizeof(T));
    return out;
  }
  T* data() { return buffer.as<T>(); }
};

std::vector<unsigned char> to_host(Device& device, const Selection& s) {
  std::vector<unsigned char> out(s.bytes);
  device.copy_to_host(out.data(), s.message.data(), s.bytes);
  return out;
}

/// The bucket dtype of a core element type.
template <typename T>
constexpr DType dtype_of() {
  return std::is_same_v<T, float> ? DType::kFloat32 : std::is_same_v<T, Half> ? DType::kFloat16 : DType::kBFloat16;
}

template <typename T>
class CudaSelect : public ::testing::Test {};
using Types = ::testing::Types<float, Half, BFloat16>;
TYPED_TEST_SUITE(CudaSelect, Types);

TYPED_TEST(CudaSelect, MessagesAndResidualsMatchTheCpu) {
  GS_REQUIRE_GPU();
  using T = TypeParam;
  const DType dtype = dtype_of<T>();
  CudaDevice gpu(0, nullptr);
  CpuDevice cpu;
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{100003}}) {
    for (bool use_topk : {false, true}) {
      std::vector<T> grad = ref::random_vector<T>(n, 5 + n), residual = ref::random_vector<T>(n, 6 + n, 0.5f);
      DeviceVector<T> g(gpu, grad), r(gpu, residual);
      BucketView on_gpu{dtype, n, g.data(), r.data()};
      BucketView on_cpu{dtype, n, grad.data(), residual.data()};
      const Selection a = use_topk ? gpu.select_topk(on_gpu, n / 50 + 1, true) : gpu.select_threshold(on_gpu, 1.5);
      const Selection b = use_topk ? cpu.select_topk(on_cpu, n / 50 + 1, true) : cpu.select_threshold(on_cpu, 1.5);
      EXPECT_EQ(a.count, b.count);
      if (use_topk) EXPECT_EQ(a.kth_key, b.kth_key);
      EXPECT_EQ(to_host(gpu, a), to_host(cpu, b));
      const std::vector<T> rr = r.host();
      for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(ref::same_bits(rr[i], residual[i])) << i;

      std::vector<T> zeros(n, Num<T>::zero());
      DeviceVector<T> out(gpu, zeros);
      gpu.scatter_add(read_message(gpu, a.message.data(), a.bytes, dtype, n, 0), out.data(), 2.0f);
      cpu.scatter_add(read_message(cpu, b.message.data(), b.bytes, dtype, n, 0), zeros.data(), 2.0f);
      const std::vector<T> o = out.host();
      for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(ref::same_bits(o[i], zeros[i])) << i;
    }
  }
}

// The selection's mask at its edges: every element selected (full mask words), non-finite
// gradients (counted, their residuals kept; without a residual they read as zero), no residual,
// and a sub-range without the update, over a bucket whose last tile is partial.
TYPED_TEST(CudaSelect, EdgesMatchTheCpu) {
  GS_REQUIRE_GPU();
  using T = TypeParam;
  const DType dtype = dtype_of<T>();
  CudaDevice gpu(0, nullptr);
  CpuDevice cpu;
  const int64_t n = 50001;
  std::vector<T> poisoned = ref::random_vector<T>(n, 11);
  for (int64_t i = 0; i < n; i += 997) poisoned[i] = Num<T>::from_float(std::numeric_limits<float>::quiet_NaN());
  for (int64_t i = 5; i < n; i += 1009) poisoned[i] = Num<T>::from_float(-std::numeric_limits<float>::infinity());
  struct Case {
    const char* name;
    bool with_residual;
    SelectRule rule;
  };
  for (const Case& c : {Case{"everything", true, SelectRule{1e-30, false, Range{0, -1}, true, true}},
                        Case{"non-finite", true, SelectRule{1.0, false, Range{0, -1}, true, true}},
                        Case{"no residual", false, SelectRule{1.0, false, Range{0, -1}, true, false}},
                        Case{"range", true, SelectRule{0.5, true, Range{1000, 40000}, false, false}}}) {
    std::vector<T> grad = poisoned, residual = ref::random_vector<T>(n, 12, 0.5f);
    DeviceVector<T> g(gpu, grad), r(gpu, residual);
    T* r_cpu = c.with_residual ? residual.data() : nullptr;
    const Selection a = gpu.select(BucketView{dtype, n, g.data(), c.with_residual ? r.data() : nullptr}, c.rule);
    const Selection b = cpu.select(BucketView{dtype, n, grad.data(), r_cpu}, c.rule);
    EXPECT_GT(b.count, 0) << c.name;
    if (c.rule.update || !c.with_residual) EXPECT_GT(b.nonfinite, 0) << c.name;
    EXPECT_EQ(a.count, b.count) << c.name;
    EXPECT_EQ(a.nonfinite, b.nonfinite) << c.name;
    EXPECT_EQ(to_host(gpu, a), to_host(cpu, b)) << c.name;
    const std::vector<T> rr = r.host();
    for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(ref::same_bits(rr[i], residual[i])) << c.name << " " << i;
  }
}

// A bucket that starts one element past an aligned address takes the element-wise loads instead
// of 16-byte runs, and selects the same (the selection by key and top-k).
TYPED_TEST(CudaSelect, UnalignedBucketsMatchTheCpu) {
  GS_REQUIRE_GPU();
  using T = TypeParam;
  const DType dtype = dtype_of<T>();
  CudaDevice gpu(0, nullptr);
  CpuDevice cpu;
  const int64_t n = 30011;
  for (bool use_topk : {false, true}) {
    std::vector<T> grad = ref::random_vector<T>(n + 1, 31), residual = ref::random_vector<T>(n + 1, 32, 0.5f);
    DeviceVector<T> g(gpu, grad), r(gpu, residual);
    const BucketView on_gpu{dtype, n, g.data() + 1, r.data() + 1};
    const BucketView on_cpu{dtype, n, grad.data() + 1, residual.data() + 1};
    const Selection a = use_topk ? gpu.select_topk(on_gpu, 999) : gpu.select_threshold(on_gpu, 1.5);
    const Selection b = use_topk ? cpu.select_topk(on_cpu, 999) : cpu.select_threshold(on_cpu, 1.5);
    EXPECT_GT(b.count, 0);
    EXPECT_EQ(a.count, b.count);
    EXPECT_EQ(to_host(gpu, a), to_host(cpu, b));
    const std::vector<T> rr = r.host();
    for (int64_t i = 0; i <= n; ++i) ASSERT_TRUE(ref::same_bits(rr[i], residual[i])) << i;
  }
}

// Top-k's radix select at its edges: many equal magnitudes (the k-th key shared by ties spread
// over several tiles, of which the lowest indices win), k = 0, k = n and k > n, non-finite
// gradients with and without a residual, and a bucket whose last tile is partial.
TYPED_TEST(CudaSelect, TopkEdgesMatchTheCpu) {
  GS_REQUIRE_GPU();
  using T = TypeParam;
  const DType dtype = dtype_of<T>();
  CudaDevice gpu(0, nullptr);
  CpuDevice cpu;
  const int64_t n = 50001;
  std::vector<T> steps(n), poisoned = ref::random_vector<T>(n, 21);
  for (int64_t i = 0; i < n; ++i) steps[i] = Num<T>::from_float(0.25f * static_cast<float>(i * 7919 % 9) - 1.0f);
  for (int64_t i = 3; i < n; i += 1013) poisoned[i] = Num<T>::from_float(std::numeric_limits<float>::quiet_NaN());
  for (int64_t i = 8; i < n; i += 2003) poisoned[i] = Num<T>::from_float(std::numeric_limits<float>::infinity());
  struct Case {
    const char* name;
    const std::vector<T>& grad;
    bool with_residual;
    int64_t k;
  };
  for (const Case& c :
       {Case{"ties", steps, true, 12345}, Case{"ties, no residual", steps, false, 30000}, Case{"k = 0", steps, true, 0},
        Case{"k = n", poisoned, true, n}, Case{"k > n", steps, false, n + 5}, Case{"non-finite", poisoned, true, 777},
        Case{"non-finite, no residual", poisoned, false, 777}}) {
    std::vector<T> grad = c.grad, residual = c.with_residual ? ref::random_vector<T>(n, 22, 0.01f) : std::vector<T>(n);
    DeviceVector<T> g(gpu, grad), r(gpu, residual);
    const Selection a = gpu.select_topk(BucketView{dtype, n, g.data(), c.with_residual ? r.data() : nullptr}, c.k);
    const Selection b =
        cpu.select_topk(BucketView{dtype, n, grad.data(), c.with_residual ? residual.data() : nullptr}, c.k);
    EXPECT_EQ(b.count, std::min(c.k, n)) << c.name;
    EXPECT_EQ(a.count, b.count) << c.name;
    EXPECT_EQ(a.nonfinite, b.nonfinite) << c.name;
    if (b.count > 0) EXPECT_EQ(a.kth_key, b.kth_key) << c.name;
    EXPECT_EQ(to_host(gpu, a), to_host(cpu, b)) << c.name;
    const std::vector<T> rr = r.host();
    for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(ref::same_bits(rr[i], residual[i])) << c.name << " " << i;
  }
}

/// One rank: every all-reduce and all-gather is the identity.
class SoloGroup final : public Collective {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void sum(std::vector<double>&) override {}
  void allgather(const void* mine, void* all, size_t bytes) override { std::memcpy(all, mine, bytes); }
  bool exchange_takes_agreed_words() const override { return true; }
};

// Every method selects the same pairs on the GPU as on the CPU (one rank, three steps), and
// leaves the same residual.
TEST(CudaMethods, SelectLikeTheCpu) {
  GS_REQUIRE_GPU();
  const int64_t n = 70001;
  std::vector<std::function<std::unique_ptr<Method>()>> makers = {
      [] { return std::make_unique<TopK>(0.01); },
      [] { return std::make_unique<Threshold>(std::nullopt, 0.01); },
      [] { return std::make_unique<RandomK>(0.01, 1); },
      [] { return std::make_unique<RandomBlock>(0.01, 1); },
      [] { return std::make_unique<GaussianK>(0.01, "spardl"); },
      [] { return std::make_unique<GaussianK>(0.01, "sidco"); },
      [] { return std::make_unique<DGC>(0.01, 1); },
      [] { return std::make_unique<RedSync>(0.01); },
      // SAGE's band by passes on the GPU: its top k kept in the residual (union) or zeroed (gather).
      [] { return std::make_unique<SAGE>(0.01, "flat", std::vector<int64_t>{}, false, 1, std::nullopt, std::nullopt); },
      [] { return std::make_unique<SAGE>(0.01, "flat", std::vector<int64_t>{}, false, 1, std::nullopt, "gather"); },
      [] { return std::make_unique<MiCRO>(0.01, "gather", false, 1); },
      [] { return std::make_unique<ExDyna>(0.01, "union", true, 1); },
      [] { return std::make_unique<ExDyna>(0.01, "union", false, 1); },  // its band by passes on the GPU
      [] { return std::make_unique<SIDCo>(0.01, "gamma_gpareto", 2, 0.25, std::nullopt); },
  };
  CudaDevice gpu(0, nullptr);
  CpuDevice cpu;
  SoloGroup group;
  for (const bool momentum : {false, true}) {  // with a velocity: momentum correction fused in
    for (auto& make : makers) {
      auto on_gpu = make(), on_cpu = make();
      std::vector<float> residual(n, 0.0f), velocity(n, 0.0f);
      DeviceVector<float> r(gpu, residual), u(gpu, velocity);
      for (int t = 0; t < 3; ++t) {
        std::vector<float> grad = ref::random_vector<float>(n, 40 + t);
        DeviceVector<float> g(gpu, grad);
        BucketView on_device{DType::kFloat32, n, g.data(), r.data(), momentum ? u.data() : nullptr, 0.9f, t > 0};
        BucketView on_host{
            DType::kFloat32, n, grad.data(), residual.data(), momentum ? velocity.data() : nullptr, 0.9f, t > 0};
        const Selection a = on_gpu->select(gpu, on_device, group);
        const Selection b = on_cpu->select(cpu, on_host, group);
        ASSERT_EQ(to_host(gpu, a), to_host(cpu, b)) << on_cpu->name() << " step " << t << " momentum " << momentum;
        ASSERT_EQ(r.host(), residual) << on_cpu->name() << " step " << t << " momentum " << momentum;
        ASSERT_EQ(u.host(), velocity) << on_cpu->name() << " step " << t << " momentum " << momentum;
        ExchangeResult result;
        result.control = {ControlWord{b.count, 0, 0}};
        on_gpu->observe(BucketView{}, result);
        on_cpu->observe(BucketView{}, result);
      }
    }
  }
}

// On the GPU OnePass lists no candidates for the host (CandidateBound::capacity) unless asked to:
// even with a bound below many elements, every question is a pass on the device, answered as on
// the CPU.
TEST(CudaOnePass, AnswersEveryQuestionByAPass) {
  GS_REQUIRE_GPU();
  const int64_t n = 70001, k = 700;
  CudaDevice gpu(0, nullptr);
  CpuDevice cpu;
  std::vector<float> residual(n, 0.0f);
  std::vector<float> grad = ref::random_vector<float>(n, 7);
  DeviceVector<float> r(gpu, residual), g(gpu, grad);
  BucketView on_device{DType::kFloat32, n, g.data(), r.data()};
  BucketView on_host{DType::kFloat32, n, grad.data(), residual.data()};
  CandidateBound bound;
  {
    std::vector<float> scratch(residual);
    OnePass first(cpu, BucketView{DType::kFloat32, n, grad.data(), scratch.data()}, bound, k);
    (void)first.counts({3.0}, true)[0];  // about 190 elements: a question the bound learns from
    bound.learn(first);                  // a finite lower bound: on the CPU the next step lists candidates
  }
  ASSERT_TRUE(std::isfinite(bound.lower()));
  OnePass on_gpu(gpu, on_device, bound, k), on_cpu(cpu, on_host, bound, k);
  EXPECT_FALSE(on_cpu.overflowed());
  EXPECT_TRUE(on_gpu.overflowed()) << "the GPU listed candidates";
  for (double t : {0.5, 1.0, 2.0, 3.0})
    EXPECT_EQ(on_gpu.counts({t}, true)[0], on_cpu.counts({t}, true)[0]) << "threshold " << t;
  EXPECT_EQ(to_host(gpu, on_gpu.largest(k)), to_host(cpu, on_cpu.largest(k)));
  EXPECT_EQ(r.host(), residual);
  // DGC's listing (Listing::kEveryDevice) lists them on the GPU too.
  DeviceVector<float> fresh(gpu, std::vector<float>(n, 0.0f));
  OnePass listed(gpu, BucketView{DType::kFloat32, n, g.data(), fresh.data()}, bound, k, Listing::kEveryDevice);
  EXPECT_FALSE(listed.overflowed());
  EXPECT_EQ(listed.counts({2.0}, true)[0],
            cpu.count(BucketView{DType::kFloat32, n, grad.data()}, Range{0, n}, {2.0}, true)[0]);
}

TEST(CudaMomentum, MatchesTheCpu) {
  GS_REQUIRE_GPU();
  CudaDevice gpu(0, nullptr);
  CpuDevice cpu;
  const int64_t n = 100003;
  std::vector<float> grad(n), velocity(n), residual(n);
  for (int64_t i = 0; i < n; ++i) {
    grad[i] = static_cast<float>((i * 7919) % 2001 - 1000) * 1e-3f;
    velocity[i] = static_cast<float>((i * 104729) % 1999 - 999) * 1e-3f;
    residual[i] = i % 3 == 0 ? 0.0f : 1.0f;  // a third emptied by the last step
  }
  grad[5] = std::numeric_limits<float>::quiet_NaN();
  for (bool masking : {false, true}) {
    DeviceVector<float> g(gpu, grad), u(gpu, velocity), r(gpu, residual);
    gpu.momentum(BucketView{DType::kFloat32, n, g.data(), r.data(), u.data(), 0.9f, masking});
    std::vector<float> cg = grad, cu = velocity, cr = residual;
    cpu.momentum(BucketView{DType::kFloat32, n, cg.data(), cr.data(), cu.data(), 0.9f, masking});
    EXPECT_EQ(u.host(), cu);
    const std::vector<float> gg = g.host();
    EXPECT_TRUE(std::isnan(gg[5]));
    for (int64_t i = 0; i < n; ++i)
      if (i != 5) EXPECT_EQ(gg[i], cg[i]) << i;
  }
}

// The statistics a method asks after its pass, over the whole bucket and over a sample of its
// blocks (SIDCo's default mode).
TEST(CudaStatistics, ExceedancesAndLogSumsMatchTheCpu) {
  GS_REQUIRE_GPU();
  CudaDevice gpu(0, nullptr);
  CpuDevice cpu;
  const int64_t n = 5 * kCpuBlock + 123;
  std::vector<float> values = ref::random_vector<float>(n, 11);
  DeviceVector<float> d(gpu, values);
  const BucketView on_device{DType::kFloat32, n, d.data(), nullptr};
  const BucketView on_host{DType::kFloat32, n, values.data(), nullptr};
  for (const int64_t every : {1, 2, 4}) {
    const BlockSample sample{every};
    const Exceedance a = gpu.exceedance(on_device, 0.8, true, 0.25, sample);
    const Exceedance b = cpu.exceedance(on_host, 0.8, true, 0.25, sample);
    EXPECT_EQ(a.count, b.count) << every;
    EXPECT_NEAR(a.sum, b.sum, 1e-12 * b.sum) << every;
    EXPECT_NEAR(a.sum_sq, b.sum_sq, 1e-12 * b.sum_sq) << every;
    EXPECT_EQ(a.min, b.min) << every;
    const double la = gpu.log_sum(on_device, 0.25, 1e-6, sample), lb = cpu.log_sum(on_host, 0.25, 1e-6, sample);
    EXPECT_NEAR(la, lb, 1e-11 * std::fabs(lb)) << every;
  }
}

// More thresholds than one launch holds bins for in shared memory (6144): counted a chunk at a
// time, as the CPU counts them (the launch failed with "invalid argument").
TEST(CudaStatistics, CountsMoreThresholdsThanOneLaunchHoldsLikeTheCpu) {
  GS_REQUIRE_GPU();
  CudaDevice gpu(0, nullptr);
  CpuDevice cpu;
  const int64_t n = 100003;
  std::vector<float> values = ref::random_vector<float>(n, 13);
  DeviceVector<float> d(gpu, values);
  std::vector<double> thresholds(7001);
  for (size_t j = 0; j < thresholds.size(); ++j) thresholds[j] = 1e-3 * static_cast<double>(j);
  for (bool strict : {false, true})
    EXPECT_EQ(gpu.count(BucketView{DType::kFloat32, n, d.data(), nullptr}, Range{5, n}, thresholds, strict),
              cpu.count(BucketView{DType::kFloat32, n, values.data(), nullptr}, Range{5, n}, thresholds, strict))
        << strict;
}

// The op's scatter-add (indices in any order, duplicates allowed: atomics) rounds each add as the
// CPU does, once: out + value / divisor in float32, rounded to the dtype. A 16-bit atomicAdd
// rounded value / divisor to the dtype first (float16 2.296875 + 869 / 5: 176.0, not 176.125).
TYPED_TEST(CudaSelect, UnorderedScatterAddRoundsOnceLikeTheCpu) {
  GS_REQUIRE_GPU();
  using T = TypeParam;
  CudaDevice gpu(0, nullptr);
  const int64_t n = 30011;
  std::vector<T> out = ref::random_vector<T>(n, 51), values = ref::random_vector<T>(n, 52);
  std::vector<int64_t> indices(n);
  for (int64_t j = 0; j < n; ++j) indices[j] = (j * 7919) % n;  // distinct, not ascending
  out[indices[0]] = Num<T>::from_float(2.296875f);
  values[0] = Num<T>::from_float(869.0f);
  for (const float divisor : {5.0f, 3.0f}) {
    DeviceVector<T> o(gpu, out), v(gpu, values);
    DeviceVector<int64_t> idx(gpu, indices);
    cuda::scatter_add<T, int64_t>(gpu, o.data(), n, idx.data(), v.data(), n, divisor, /*strictly_ascending=*/false);
    std::vector<T> expected = out;
    cpu::scatter_add<T, int64_t>(expected.data(), n, indices.data(), values.data(), n, divisor, false);
    const std::vector<T> got = o.host();
    for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(ref::same_bits(got[i], expected[i])) << divisor << " " << i;
  }
  // Duplicates on neighbouring elements (two to a 32-bit word): no add is lost. Each sum is exact.
  const int64_t count = 3 * 200;
  std::vector<int64_t> at(count);
  for (int64_t j = 0; j < count; ++j) at[j] = 1 + j % 3;
  DeviceVector<T> o(gpu, std::vector<T>(5, Num<T>::zero())), v(gpu, std::vector<T>(count, Num<T>::from_float(1.0f)));
  DeviceVector<int64_t> idx(gpu, at);
  cuda::scatter_add<T, int64_t>(gpu, o.data(), 5, idx.data(), v.data(), count, 1.0f, /*strictly_ascending=*/false);
  const std::vector<T> got = o.host();
  for (int64_t i = 0; i < 5; ++i) EXPECT_EQ(Num<T>::to_float(got[i]), i == 0 || i == 4 ? 0.0f : 200.0f) << i;
}

TEST(CudaScatter, RejectsCorruptMessagesWithoutWriting) {
  GS_REQUIRE_GPU();
  CudaDevice gpu(0, nullptr);
  std::vector<float> grad = {0.0f, 3.0f, -4.0f, 0.5f};
  DeviceVector<float> g(gpu, grad);
  const Selection s = gpu.select_threshold(BucketView{DType::kFloat32, 4, g.data(), nullptr}, 1.0);
  std::vector<unsigned char> bytes = to_host(gpu, s);
  bytes[32] = 9;  // first index out of range
  Buffer bad = gpu.allocate(bytes.size());
  gpu.copy_from_host(bad.data(), bytes.data(), bytes.size());
  DeviceVector<float> out(gpu, std::vector<float>(4, 7.0f));
  EXPECT_THROW(gpu.scatter_add(read_message(gpu, bad.data(), bytes.size(), DType::kFloat32, 4, 1), out.data(), 1.0f),
               CorruptMessageError);
  EXPECT_EQ(out.host(), std::vector<float>(4, 7.0f));
}

}  // namespace
