// Every method through a GPU's branches, without a GPU. `GuardedDevice` says it is a CUDA device,
// so the methods take the paths they take on a GPU (no candidates listed, every question a device
// pass, the unfused scan, no sample of keys), and runs the CPU kernels for it, as CudaDevice runs
// its CUDA kernels; but its memory and the buckets are unreadable from the host (PROT_NONE)
// outside its own calls and the transport's, as a GPU's memory is. A step that reads or writes
// device memory on the host (a bucket's value, a message the device wrote) crashes here, where on
// a GPU it would read garbage or fault; every output and residual must equal the CpuDevice's to
// the bit; and no device buffer may be left allocated after the steps. GuardedDevice overrides
// what CudaDevice overrides (kernel_device.h, cuda_device.h): a device operation added to
// CudaDevice belongs here too. With 2 ranks the regions are open while either rank is inside a
// call, so a host read by the other rank in that window goes unseen; the 1-rank runs see all.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/methods.h"
#include "gradsparse/reduce_bucket.h"
#include "gradsparse/spardl.h"
#include "reference.h"
#include "threads.h"

namespace gradsparse {
namespace {

/// The guarded regions (device buffers and buckets), all opened while any rank is inside a call
/// of the device or the transport, and closed (PROT_NONE) when none is.
class Guard {
 public:
  static Guard& get() {
    static Guard guard;
    return guard;
  }
  void* allocate(size_t bytes) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t size = std::max<size_t>(page, (bytes + page - 1) / page * page);
    void* p = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    regions_[p] = size;
    if (closed()) mprotect(p, size, PROT_NONE);
    return p;
  }
  void free(void* p) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    munmap(p, regions_.at(p));
    regions_.erase(p);
  }
  /// The regions allocated and not freed.
  size_t live() {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    return regions_.size();
  }
  /// From here on the regions are closed whenever no call is inside (until `off`).
  void on() { set(true); }
  void off() { set(false); }

  /// Opens every region for the duration of a device or transport call.
  class Open {
   public:
    Open() {
      Guard& g = get();
      std::lock_guard<std::recursive_mutex> lock(g.mutex_);
      if (g.inside_++ == 0 && g.on_) g.protect(PROT_READ | PROT_WRITE);
    }
    ~Open() {
      Guard& g = get();
      std::lock_guard<std::recursive_mutex> lock(g.mutex_);
      if (--g.inside_ == 0 && g.on_) g.protect(PROT_NONE);
    }
    Open(const Open&) = delete;
    Open& operator=(const Open&) = delete;
  };

 private:
  Guard() {
    struct sigaction action{};
    action.sa_handler = [](int) {
      static const char said[] =
          "host access to guarded device memory (a pointer a GPU would hold): see the backtrace in a debugger\n";
      (void)!write(2, said, sizeof(said) - 1);
      _exit(3);
    };
    sigaction(SIGSEGV, &action, nullptr);
  }
  bool closed() const { return on_ && inside_ == 0; }
  void set(bool on) {
    std::lock_guard<std::recursive_mutex> lock(mutex_);
    on_ = on;
    protect(closed() ? PROT_NONE : PROT_READ | PROT_WRITE);
  }
  void protect(int prot) {
    for (const auto& [p, size] : regions_) mprotect(p, size, prot);
  }
  std::recursive_mutex mutex_;
  std::map<void*, size_t> regions_;
  int inside_ = 0;
  bool on_ = false;
};

/// f() with every region open.
template <typename F>
auto in(F&& f) {
  Guard::Open open;
  return f();
}

/// A CUDA device in all but its kernels and memory (see the top of the file).
class GuardedDevice final : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::kCUDA; }
  Buffer allocate(size_t bytes) override {
    return Buffer(Guard::get().allocate(bytes), bytes, [](void* p) { Guard::get().free(p); });
  }
  void copy_to_host(void* d, const void* s, size_t bytes) override {
    in([&] { cpu_.copy_to_host(d, s, bytes); });
  }
  void copy_from_host(void* d, const void* s, size_t bytes) override {
    in([&] { cpu_.copy_from_host(d, s, bytes); });
  }
  void copy(void* d, const void* s, size_t bytes) override {
    in([&] { cpu_.copy(d, s, bytes); });
  }
  void fill_zero(void* d, size_t bytes) override {
    in([&] { cpu_.fill_zero(d, bytes); });
  }
  void synchronize() override {}
  SelectStats select_pairs(const BucketView& b, const SelectRule& rule, int index_bytes,
                           const PairSink& sink) override {
    return in([&] { return cpu_.select_pairs(b, rule, index_bytes, sink); });
  }
  SelectStats topk_pairs(const BucketView& b, int64_t k, bool update, bool zero, int index_bytes,
                         const PairSink& sink) override {
    return in([&] { return cpu_.topk_pairs(b, k, update, zero, index_bytes, sink); });
  }
  Moments moments(const BucketView& b, bool update) override {
    return in([&] { return cpu_.moments(b, update); });
  }
  std::vector<int64_t> count(const BucketView& b, Range range, const std::vector<double>& thresholds,
                             bool strict) override {
    return in([&] { return cpu_.count(b, range, thresholds, strict); });
  }
  Exceedance exceedance(const BucketView& b, double threshold, bool strict, double scale, BlockSample sample) override {
    return in([&] { return cpu_.exceedance(b, threshold, strict, scale, sample); });
  }
  double log_sum(const BucketView& b, double scale, double eps, BlockSample sample) override {
    return in([&] { return cpu_.log_sum(b, scale, eps, sample); });
  }
  Candidates collect(const BucketView& b, Range range, double threshold, bool strict) override {
    return in([&] { return cpu_.collect(b, range, threshold, strict); });
  }
  double sample_abs_sum(const BucketView& b, const std::vector<int64_t>& positions) override {
    return in([&] { return cpu_.sample_abs_sum(b, positions); });
  }
  void gather_values(const BucketView& b, const MessageView& at, void* values) override {
    in([&] { cpu_.gather_values(b, at, values); });
  }
  void zero_at(const BucketView& b, const MessageView& message) override {
    in([&] { cpu_.zero_at(b, message); });
  }
  void assign(const MessageView& message, void* out) override {
    in([&] { cpu_.assign(message, out); });
  }
  void scatter_add(const MessageView& message, void* out, float divisor) override {
    in([&] { cpu_.scatter_add(message, out, divisor); });
  }
  void scatter_add_float32(const MessageView& message, float* out, float divisor) override {
    in([&] { cpu_.scatter_add_float32(message, out, divisor); });
  }
  void divide(DType dtype, void* data, int64_t numel, float divisor) override {
    in([&] { cpu_.divide(dtype, data, numel, divisor); });
  }
  void round_to(DType dtype, const float* data, void* out, int64_t numel) override {
    in([&] { cpu_.round_to(dtype, data, out, numel); });
  }
  void momentum(const BucketView& b) override {
    in([&] { cpu_.momentum(b); });
  }

 private:
  CpuDevice cpu_;
};

/// The group's collectives on device memory, as NCCL reads and writes it: opened for the call.
class GuardedTransport final : public testing::Forwarding {
 public:
  using Forwarding::Forwarding;
  void allgather(const Device&, const void* send, void* recv, size_t bytes) override {
    Guard::Open open;
    Forwarding::allgather(host_, send, recv, bytes);
  }
  void allreduce_sum(const Device&, void* data, size_t count, DType dtype) override {
    Guard::Open open;
    Forwarding::allreduce_sum(host_, data, count, dtype);
  }
  void sendrecv(const Device&, const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes,
                int src) override {
    Guard::Open open;
    Forwarding::sendrecv(host_, send, send_bytes, dst, recv, recv_bytes, src);
  }

 private:
  CpuDevice host_;
};

std::unique_ptr<Method> make(const std::string& name) {
  if (name == "topk") return std::make_unique<TopK>(0.02);
  if (name == "topk_reduce_scatter") return std::make_unique<TopK>(0.02, "reduce_scatter");
  if (name == "threshold") return std::make_unique<Threshold>(std::nullopt, 0.02);
  if (name == "gaussiank") return std::make_unique<GaussianK>(0.02, "spardl");
  if (name == "gaussiank_sidco") return std::make_unique<GaussianK>(0.02, "sidco");
  if (name == "dgc") return std::make_unique<DGC>(0.02, 7);
  if (name == "dgc_reference") return std::make_unique<DGC>(0.02, 7, "gather", true);
  if (name == "redsync") return std::make_unique<RedSync>(0.02);
  if (name == "sidco_exp") return std::make_unique<SIDCo>(0.02, "exp", 1, 0.25, std::nullopt);
  if (name == "sidco_gamma_gpareto") return std::make_unique<SIDCo>(0.02, "gamma_gpareto", 2, 0.25, std::nullopt);
  if (name == "sage")
    return std::make_unique<SAGE>(0.02, "flat", std::vector<int64_t>{}, false, 0, std::nullopt, std::nullopt);
  if (name == "micro") return std::make_unique<MiCRO>(0.02, "union", false, 0);
  if (name == "micro_gather") return std::make_unique<MiCRO>(0.02, "gather", false, 0);
  if (name == "exdyna") return std::make_unique<ExDyna>(0.02, "union", false, 0);
  if (name == "spardl") return std::make_unique<SparDL>(0.02, 1);
  if (name == "randomk") return std::make_unique<RandomK>(0.02, 3);
  if (name == "randomblock") return std::make_unique<RandomBlock>(0.02, 3);
  return nullptr;
}

enum class Mode { kPlain, kMomentum, kKeepTaken, kFloat16, kBFloat16, kShardOnly };
const char* mode_name(Mode m) {
  static const char* names[] = {"plain", "momentum", "keep_taken", "float16", "bfloat16", "shard_only"};
  return names[static_cast<int>(m)];
}

/// The buckets' dtype in `mode`.
DType dtype_of(Mode mode) {
  if (mode == Mode::kFloat16) return DType::kFloat16;
  return mode == Mode::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

/// Writes `values` into `to` in the dtype of `mode`.
void store(const std::vector<float>& values, Mode mode, void* to) {
  dispatch_dtype(dtype_of(mode), [&](auto t) {
    using T = decltype(t);
    for (size_t i = 0; i < values.size(); ++i) static_cast<T*>(to)[i] = Num<T>::from_float(values[i]);
  });
}

/// Each rank's bucket (its last step's output) and residual after `steps` steps, as raw bytes.
struct Ranks {
  std::vector<std::vector<uint8_t>> out, residual;
};

Ranks run(const std::string& name, int world_size, Mode mode, bool guarded) {
  constexpr int64_t n = 100'002;  // several blocks of the CPU kernels and a tail; even, for shard_only's 2 shards
  constexpr int steps = 8;
  constexpr size_t bytes = n * sizeof(float);  // room for any dtype
  Guard& guard = Guard::get();
  auto make_buffer = [&] { return guarded ? guard.allocate(bytes) : std::malloc(bytes); };
  std::vector<void*> grads(world_size), residuals(world_size), velocities(world_size);
  for (int r = 0; r < world_size; ++r) {
    grads[r] = make_buffer();
    residuals[r] = make_buffer();
    velocities[r] = make_buffer();
    std::memset(velocities[r], 0, bytes);
    store(reference::random_vector<float>(n, 200 + r, 0.3f), mode, residuals[r]);
  }
  Ranks ranks{std::vector<std::vector<uint8_t>>(world_size), std::vector<std::vector<uint8_t>>(world_size)};
  if (guarded) guard.on();
  const auto errors = testing::run_ranks(world_size, [&](int rank, Transport& inner) {
    GuardedTransport transport(inner);
    CpuDevice cpu;
    GuardedDevice gpu;
    Device& device = guarded ? static_cast<Device&>(gpu) : static_cast<Device&>(cpu);
    std::unique_ptr<Method> method = make(name);
    GS_CHECK(method != nullptr, ValueError, "no method named ", name);
    const DType dtype = dtype_of(mode);
    for (int step = 0; step < steps; ++step) {
      std::vector<float> g = reference::random_vector<float>(n, 100 + rank + 31 * step);
      for (float& x : g) x *= 1.0f + 0.05f * static_cast<float>(step);  // thresholds move
      {
        Guard::Open open;  // the gradient written as a backward pass would
        store(g, mode, grads[rank]);
      }
      BucketView bucket{dtype, n, grads[rank], residuals[rank]};
      ReduceOptions options;
      if (mode == Mode::kMomentum) {
        bucket.velocity = velocities[rank];
        options.momentum = 0.9f;
        options.momentum_masking = step > 0;
      }
      options.keep_taken = mode == Mode::kKeepTaken;
      options.shard_only = mode == Mode::kShardOnly;
      const ReduceReport report = reduce_bucket(method.get(), transport, device, bucket, options);
      if (report.taken != nullptr) (void)HostMessage(device, *report.taken, bucket).index_list();
    }
    Guard::Open open;
    const size_t size = static_cast<size_t>(n) * dtype_size(dtype);
    ranks.out[rank].assign(static_cast<uint8_t*>(grads[rank]), static_cast<uint8_t*>(grads[rank]) + size);
    ranks.residual[rank].assign(static_cast<uint8_t*>(residuals[rank]), static_cast<uint8_t*>(residuals[rank]) + size);
  });
  guard.off();
  for (const std::vector<void*>* buffers : {&grads, &residuals, &velocities})
    for (void* p : *buffers) guarded ? guard.free(p) : std::free(p);
  testing::rethrow_first(errors);
  // Every device buffer of the steps is gone with its method, report and selections: on a GPU
  // one left over would hold device memory for good.
  EXPECT_EQ(guard.live(), 0u) << "device buffers left allocated";
  return ranks;
}

class GuardedDeviceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(GuardedDeviceTest, TakesTheGpusPathsWithoutReadingItsMemoryAndGivesTheCpusBits) {
  for (int world_size : {1, 2}) {
    for (Mode mode :
         {Mode::kPlain, Mode::kMomentum, Mode::kKeepTaken, Mode::kFloat16, Mode::kBFloat16, Mode::kShardOnly}) {
      SCOPED_TRACE(std::string(mode_name(mode)) + ", " + std::to_string(world_size) + " rank(s)");
      const Ranks cpu = run(GetParam(), world_size, mode, false);
      const Ranks gpu = run(GetParam(), world_size, mode, true);
      for (int r = 0; r < world_size; ++r) {
        EXPECT_TRUE(gpu.out[r] == cpu.out[r]) << "rank " << r << "'s output";
        EXPECT_TRUE(gpu.residual[r] == cpu.residual[r]) << "rank " << r << "'s residual";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryMethod, GuardedDeviceTest,
                         ::testing::Values("topk", "topk_reduce_scatter", "threshold", "gaussiank", "gaussiank_sidco",
                                           "dgc", "dgc_reference", "redsync", "sidco_exp", "sidco_gamma_gpareto",
                                           "sage", "micro", "micro_gather", "exdyna", "spardl", "randomk",
                                           "randomblock"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace gradsparse
