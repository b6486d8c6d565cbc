// The engine (csrc/torch/engine.cpp) over ThreadTransport: one engine thread per rank reducing
// queued buckets while the submitting threads wait on the futures, as DDP's hook does. Built with
// GRADSPARSE_TORCH_TESTS=ON (links libtorch); scripts/sanitize.sh runs it under ThreadSanitizer.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <memory>
#include <new>
#include <string>
#include <vector>

#include "../threads.h"
#include "engine.h"
#include "gradsparse/methods.h"

using namespace gradsparse;
using gradsparse::testing::Forwarding;
using gradsparse::testing::rethrow_first;
using gradsparse::testing::run_ranks;
using gradsparse::torch_adapter::Engine;

namespace {

/// Forwards to a transport this test keeps alive, and fails every collective from `fail_from` on:
/// with a CommError, or with std::bad_alloc (an allocation failing inside the exchange).
class Failing final : public Forwarding {
 public:
  Failing(Transport& inner, int fail_from, bool bad_alloc)
      : Forwarding(inner), fail_from_(fail_from), bad_alloc_(bad_alloc) {}
  void allgather(const Device& device, const void* send, void* recv, size_t bytes) override {
    check();
    Forwarding::allgather(device, send, recv, bytes);
  }
  void allreduce_sum(const Device& device, void* data, size_t count, DType dtype) override {
    check();
    Forwarding::allreduce_sum(device, data, count, dtype);
  }
  void sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes,
                int src) override {
    check();
    Forwarding::sendrecv(device, send, send_bytes, dst, recv, recv_bytes, src);
  }

 private:
  void check() {
    if (fail_from_ < 0 || calls_++ < fail_from_) return;
    if (bad_alloc_) throw std::bad_alloc();
    throw CommError("injected failure");
  }
  int fail_from_;
  bool bad_alloc_;
  int calls_ = 0;
};

at::Tensor bucket_of(int rank, int bucket, int64_t n) {
  return at::arange(1, n + 1, at::kFloat).sin() * (rank + 1) + bucket;  // no zero
}

constexpr int kBuckets = 6;
constexpr int64_t kN = 3000;

// Every rank queues several buckets at once; the engine threads reduce them in order and every
// rank ends with the same averaged buckets (the hook's contract), with residuals kept per rank.
TEST(Engine, ReducesQueuedBucketsIdenticallyOnEveryRank) {
  constexpr int kRanks = 3;
  std::vector<std::vector<at::Tensor>> results(kRanks);
  auto group = ThreadGroup::create(kRanks, std::chrono::seconds(30));
  rethrow_first(run_ranks(kRanks, [&](int rank, Transport&) {
    Engine engine(group->transport(rank));
    auto method = std::shared_ptr<Method>(std::make_unique<TopK>(0.05));
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    std::vector<at::Tensor> residuals;
    std::vector<std::shared_ptr<ReduceReport>> reports;
    for (int b = 0; b < kBuckets; ++b) {
      residuals.push_back(at::zeros({kN}));
      results[rank].push_back(bucket_of(rank, b, kN));
      reports.push_back(std::make_shared<ReduceReport>());
      ReduceOptions options;
      options.bucket_name = "bucket " + std::to_string(b);
      futures.push_back(
          engine.submit(results[rank].back(), residuals.back(), std::nullopt, method, options, reports.back()));
    }
    for (auto& f : futures) {
      f->wait();
      ASSERT_FALSE(f->hasError()) << f->tryRetrieveErrorMessage();
    }
    for (int b = 0; b < kBuckets; ++b) {  // error feedback: what was not sent stayed in the residual
      EXPECT_EQ(reports[b]->selected, 150);
      EXPECT_EQ(residuals[b].ne(0).sum().item<int64_t>(), kN - 150);
    }
  }));
  for (int r = 1; r < kRanks; ++r)
    for (int b = 0; b < kBuckets; ++b) EXPECT_TRUE(at::equal(results[r][b], results[0][b])) << r << " " << b;
}

class EngineFailure : public ::testing::TestWithParam<bool> {};

// A failed collective, or an allocation failing inside an exchange, stops the engine: the
// failing bucket's future carries the cause, and every later bucket fails at once naming the
// earlier failure instead of entering a collective its peers may never issue.
TEST_P(EngineFailure, FailsEveryLaterBucket) {
  const bool bad_alloc = GetParam();
  // Rank 1 waits out the timeout; rank 0's first collective, before its failure, needs rank 1
  // within it too, also under the sanitizers on busy cores.
  auto group = ThreadGroup::create(2, std::chrono::seconds(3));
  std::vector<std::vector<std::string>> errors(2);
  run_ranks(2, [&](int rank, Transport&) {
    auto inner = group->transport(rank);
    Engine engine(std::make_unique<Failing>(*inner, rank == 0 ? 1 : -1, bad_alloc));
    auto method = std::shared_ptr<Method>(std::make_unique<Threshold>(1.0));
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (int b = 0; b < kBuckets; ++b)
      futures.push_back(
          engine.submit(bucket_of(rank, b, kN), std::nullopt, std::nullopt, method, ReduceOptions{}, nullptr));
    for (auto& f : futures) {
      f->wait();
      errors[rank].push_back(f->hasError() ? f->tryRetrieveErrorMessage() : "");
    }
    engine.shutdown();  // `inner` outlives the engine thread
  });
  ASSERT_EQ(errors[0].size(), static_cast<size_t>(kBuckets));
  EXPECT_NE(errors[0][0].find(bad_alloc ? "an allocation failed" : "injected failure"), std::string::npos)
      << errors[0][0];
  for (int b = 1; b < kBuckets; ++b)
    EXPECT_NE(errors[0][b].find("an earlier exchange failed"), std::string::npos) << errors[0][b];
  EXPECT_NE(errors[1][0], "") << "rank 1 must fail (timeout) rather than hang";
}

INSTANTIATE_TEST_SUITE_P(CommErrorOrBadAlloc, EngineFailure, ::testing::Bool());

// Engines shut down from other threads while buckets are still queued finish them first.
TEST(Engine, ShutdownDrainsTheQueue) {
  auto group = ThreadGroup::create(2, std::chrono::seconds(30));
  rethrow_first(run_ranks(2, [&](int rank, Transport&) {
    auto engine = std::make_unique<Engine>(group->transport(rank));
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (int b = 0; b < kBuckets; ++b)
      futures.push_back(
          engine->submit(bucket_of(rank, b, kN), std::nullopt, std::nullopt, nullptr, ReduceOptions{}, nullptr));
    engine.reset();
    for (auto& f : futures) {
      ASSERT_TRUE(f->completed());
      ASSERT_FALSE(f->hasError()) << f->tryRetrieveErrorMessage();
    }
  }));
}

}  // namespace
