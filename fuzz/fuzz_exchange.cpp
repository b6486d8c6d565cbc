// libFuzzer target: whole exchanges of every method through reduce_bucket, on rank 0 of a group
// whose peers are untrusted. Peers are simulated in-process (FuzzedPeers): each collective hands
// rank 0 what honest peers with rank 0's own data would send (its control word, its message, its
// SparDL blocks and list sizes; its values in an all-reduce), then applies the input's edits to
// what arrived from the peers. A simulated group never waits, so every input runs in
// microseconds and the same input always takes the same path (threads with timeouts would not).
//
// Input: method, world size (2 to 4), dtype, bucket size, seed, then edits (call, offset, byte):
// byte `offset` of what call number `call` received from the peers is replaced.
// Properties: no out-of-bounds, misaligned or undefined access (ASan, UBSan), no allocation
// beyond the bucket's layout (libFuzzer's -rss_limit_mb and -malloc_limit_mb), and the only
// errors are CorruptMessageError (the engine stops) and NonFiniteError (an agreed abort); any
// other exception escapes and is reported as a crash. Without edits the peers are honest, and
// the exchange must succeed.
#include <cstdio>
#include <cstring>
#include <memory>
#include <vector>

#include "fuzz_input.h"
#include "gradsparse/cpu_device.h"
#include "gradsparse/methods.h"
#include "gradsparse/reduce_bucket.h"
#include "gradsparse/spardl.h"

using namespace gradsparse;

namespace {

struct Edit {
  int call;
  size_t offset;
  uint8_t value;
};

class FuzzedPeers final : public Transport {
 public:
  FuzzedPeers(int size, std::vector<Edit> edits) : size_(size), edits_(std::move(edits)) {}
  int rank() const override { return 0; }
  int size() const override { return size_; }

  void allgather(const Device&, const void* send, void* recv, size_t bytes) override {
    count_allgather(bytes);
    auto* out = static_cast<unsigned char*>(recv);
    for (int r = 0; r < size_; ++r) std::memcpy(out + r * bytes, send, bytes);
    received(out + bytes, bytes * (size_ - 1));  // the peers' slots
  }
  void allreduce_sum(const Device&, void* data, size_t count, DType dtype) override {
    count_allreduce(count * dtype_size(dtype));
    scale(data, count, dtype);
    received(static_cast<unsigned char*>(data), count * dtype_size(dtype));
  }
  void sendrecv(const Device&, const void* send, size_t send_bytes, int, void* recv, size_t recv_bytes, int) override {
    count_sendrecv(send_bytes, recv_bytes);
    std::memset(recv, 0, recv_bytes);
    std::memcpy(recv, send, std::min(send_bytes, recv_bytes));
    received(static_cast<unsigned char*>(recv), recv_bytes);
  }

 private:
  /// The sum over ranks that all hold rank 0's values.
  void scale(void* data, size_t count, DType dtype) const {
    if (dtype == DType::kInt64) {
      for (size_t i = 0; i < count; ++i) static_cast<int64_t*>(data)[i] *= size_;
      return;
    }
    if (dtype == DType::kFloat64) {
      for (size_t i = 0; i < count; ++i) static_cast<double*>(data)[i] *= size_;
      return;
    }
    dispatch_dtype(dtype, [&](auto t) {
      using T = decltype(t);
      auto* v = static_cast<T*>(data);
      for (size_t i = 0; i < count; ++i) v[i] = Num<T>::from_float(Num<T>::to_float(v[i]) * size_);
    });
  }
  void received(unsigned char* data, size_t bytes) {
    for (const Edit& e : edits_)
      if (e.call == calls_ && bytes > 0) data[e.offset % bytes] = e.value;
    ++calls_;
  }
  int size_;
  std::vector<Edit> edits_;
  int calls_ = 0;
};

constexpr int kMethods = 17;

std::unique_ptr<Method> make_method(int id, int world_size) {
  constexpr double d = 0.05;
  switch (id) {
    case 0:
      return std::make_unique<TopK>(d);
    case 1:
      return std::make_unique<Threshold>(4.0);
    case 2:
      return std::make_unique<RandomK>(d, 1);
    case 3:
      return std::make_unique<GaussianK>(d, "spardl");
    case 4:
      return std::make_unique<GaussianK>(d, "sidco");
    case 5:
      return std::make_unique<DGC>(d, 1);
    case 6:
      return std::make_unique<RedSync>(d);
    case 7:
      return std::make_unique<SAGE>(d, "flat", std::vector<int64_t>{}, false, 1, std::nullopt, std::nullopt);
    case 8:
      return std::make_unique<MiCRO>(d, "union", false, 1);
    case 9:
      return std::make_unique<MiCRO>(d, "gather", true, 1);
    case 10:
      return std::make_unique<ExDyna>(d, "gather", true, 1);
    case 11:
      return std::make_unique<ExDyna>(d, "union", false, 1);
    case 12:
      return std::make_unique<SIDCo>(d, "exp", 1, 0.25, std::nullopt);
    case 13:
      return std::make_unique<SIDCo>(d, "gamma_gpareto", 0, 0.25, std::nullopt);
    case 14:
      return std::make_unique<SparDL>(d, 1);
    case 15:
      return std::make_unique<RandomBlock>(d, 1);
    default:
      return std::make_unique<SparDL>(d, world_size % 2 == 0 ? 2 : 1);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const int id = in.u8() % kMethods;
  const int p = 2 + in.u8() % 3;
  const DType dtype = static_cast<DType>(in.u8() % 3);
  int64_t n = 1 + in.u16() % 3000;
  std::unique_ptr<Method> method = make_method(id, p);
  // SparDL's simulated peers send rank 0's lists for their blocks: blocks of one length keep
  // them honest (12 is a multiple of every team size here). Every other method sees every size.
  if (dynamic_cast<const SparDL*>(method.get()) != nullptr) n = (n + 11) / 12 * 12;
  const uint8_t seed = in.u8();
  std::vector<Edit> edits;
  while (!in.done()) {
    const int call = in.u8() % 32;
    const size_t offset = in.u16();
    edits.push_back(Edit{call, offset, in.u8()});
  }

  const bool honest = edits.empty();
  FuzzedPeers transport(p, std::move(edits));
  CpuDevice device;
  std::vector<unsigned char> residual = fuzz::random_bucket(dtype, n, seed);
  for (int step = 0; step < 2; ++step) {
    std::vector<unsigned char> grad = fuzz::random_bucket(dtype, n, seed + 1 + step);
    try {
      reduce_bucket(method.get(), transport, device, BucketView{dtype, n, grad.data(), residual.data()},
                    ReduceOptions{});
    } catch (const CorruptMessageError& e) {
      if (honest) {
        std::fprintf(stderr, "honest peers were rejected: %s\n", e.what());
        __builtin_trap();
      }
      return 0;  // the engine stops here
    } catch (const NonFiniteError&) {
      if (honest) __builtin_trap();  // the data are finite
      // every rank aborted this step; the next goes on
    }
  }
  return 0;
}
