// The CUDA kernels against the CPU kernels on the same inputs. Every test skips when no GPU is
// present; CI compiles and links this file with nvcc, users with a GPU run it.
#include <gtest/gtest.h>

#include <vector>

#include "gradsparse/cuda_device.h"
#include "gradsparse/cpu_device.h"
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

template <typename T>
class CudaSelect : public ::testing::Test {};
using Types = ::testing::Types<float, Half, BFloat16>;
TYPED_TEST_SUITE(CudaSelect, Types);

TYPED_TEST(CudaSelect, MessagesAndResidualsMatchTheCpu) {
  GS_REQUIRE_GPU();
  using T = TypeParam;
  const DType dtype = std::is_same_v<T, float>  ? DType::kFloat32
                      : std::is_same_v<T, Half> ? DType::kFloat16
                                                : DType::kBFloat16;
  CudaDevice gpu(0, nullptr);
  CpuDevice cpu;
  for (int64_t n : {int64_t{1}, int64_t{1000}, int64_t{100003}}) {
    for (bool use_topk : {false, true}) {
      std::vector<T> grad = ref::random_vector<T>(n, 5 + n), residual = ref::random_vector<T>(n, 6 + n, 0.5f);
      DeviceVector<T> g(gpu, grad), r(gpu, residual);
      BucketView on_gpu{dtype, n, g.data(), r.data()};
      BucketView on_cpu{dtype, n, grad.data(), residual.data()};
      const Selection a = use_topk ? gpu.select_topk(on_gpu, n / 50 + 1) : gpu.select_threshold(on_gpu, 1.5);
      const Selection b = use_topk ? cpu.select_topk(on_cpu, n / 50 + 1) : cpu.select_threshold(on_cpu, 1.5);
      EXPECT_EQ(a.count, b.count);
      EXPECT_EQ(to_host(gpu, a), to_host(cpu, b));
      const std::vector<T> rr = r.host();
      for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(ref::same_bits(rr[i], residual[i])) << i;

      std::vector<T> zeros(n, Num<T>::zero());
      DeviceVector<T> out(gpu, zeros);
      gpu.scatter_add_message(dtype, out.data(), n, a.message.data(), a.bytes, 2.0f, 0);
      cpu.scatter_add_message(dtype, zeros.data(), n, b.message.data(), b.bytes, 2.0f, 0);
      const std::vector<T> o = out.host();
      for (int64_t i = 0; i < n; ++i) ASSERT_TRUE(ref::same_bits(o[i], zeros[i])) << i;
    }
  }
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
  EXPECT_THROW(gpu.scatter_add_message(DType::kFloat32, out.data(), 4, bad.data(), bytes.size(), 1.0f, 1),
               CorruptMessageError);
  EXPECT_EQ(out.host(), std::vector<float>(4, 7.0f));
}

}  // namespace
