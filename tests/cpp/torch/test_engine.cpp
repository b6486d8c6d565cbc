// The engine (csrc/torch/engine.cpp) over ThreadTransport: one engine thread per rank reducing
// queued buckets while the submitting threads wait on the futures, as DDP's hook does; and
// ProcessGroupTransport (csrc/torch/process_group_transport.cpp) over a fake process group whose
// Works fail as the test says. Built with GRADSPARSE_TORCH_TESTS=ON (links libtorch);
// scripts/sanitize.sh runs it under ThreadSanitizer.
#include <gtest/gtest.h>

#include <ATen/ATen.h>

#include <functional>
#include <future>
#include <limits>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "../threads.h"
#include "engine.h"
#include "gradsparse/cpu_device.h"
#include "gradsparse/methods.h"
#include "process_group_transport.h"

using namespace gradsparse;
using gradsparse::testing::Forwarding;
using gradsparse::testing::rethrow_first;
using gradsparse::testing::run_ranks;
using gradsparse::torch_adapter::Engine;
using gradsparse::torch_adapter::ProcessGroupTransport;

namespace {

/// Where a rank's bucket fails, and with what.
enum class Fault {
  kCommError,           // a collective fails (CommError)
  kBadAlloc,            // an allocation inside the exchange fails (std::bad_alloc)
  kTorchOutOfMemory,    // one of PyTorch's allocators fails inside the exchange (c10::OutOfMemoryError, as
                        // the CUDA caching allocator raises for the exchange's buffers and the transport's
                        // own copies)
  kBadAllocInSelection  // an allocation of the selection fails, before the exchange
};

/// Forwards to a transport this test keeps alive, and fails every collective from `fail_from` on
/// (for the faults of a collective).
class Failing final : public Forwarding {
 public:
  Failing(Transport& inner, int fail_from, Fault fault) : Forwarding(inner), fail_from_(fail_from), fault_(fault) {}
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
    if (fail_from_ < 0 || fault_ == Fault::kBadAllocInSelection || calls_++ < fail_from_) return;
    if (fault_ == Fault::kBadAlloc) throw std::bad_alloc();
    TORCH_CHECK_WITH(OutOfMemoryError, fault_ != Fault::kTorchOutOfMemory,
                     "CUDA out of memory. Tried to allocate 2.00 GiB (injected)");
    throw CommError("injected failure");
  }
  int fail_from_;
  Fault fault_;
  int calls_ = 0;
};

/// A method whose first selection fails as an allocation does (std::bad_alloc).
class FailingSelection final : public Method {
 public:
  explicit FailingSelection(std::unique_ptr<Method> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  Selection select(Device& device, const BucketView& bucket, Collective& group) override {
    if (!failed_) {
      failed_ = true;
      throw std::bad_alloc();
    }
    return inner_->select(device, bucket, group);
  }
  const Exchange& exchange() const override { return inner_->exchange(); }
  void observe(const BucketView& bucket, const ExchangeResult& result) override { inner_->observe(bucket, result); }
  MethodReport report() const override { return inner_->report(); }

 private:
  std::unique_ptr<Method> inner_;
  bool failed_ = false;
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

class EngineFailure : public ::testing::TestWithParam<Fault> {};

// A failed collective, or an allocation failing inside an exchange or its selection, stops the
// engine: the failing bucket's future carries the cause, naming the bucket once, and every later
// bucket fails at once naming the earlier bucket and its failure instead of entering a collective
// its peers may never issue. An allocation failing in the exchange named the bucket twice, and a
// later bucket blamed "an earlier exchange" without naming it, also after a failed selection. An
// allocation of PyTorch's (c10::OutOfMemoryError, not std::bad_alloc) and one in the selection,
// outside the exchange, let the next bucket's collectives meet the peers' collectives of the
// failed one: every later bucket of rank 0 was reduced with rank 1's bucket before it.
TEST_P(EngineFailure, FailsEveryLaterBucket) {
  const Fault fault = GetParam();
  // Rank 1 waits out the timeout; rank 0's first collective, before its failure, needs rank 1
  // within it too, also under the sanitizers on busy cores.
  auto group = ThreadGroup::create(2, std::chrono::seconds(3));
  std::vector<std::vector<std::string>> errors(2);
  run_ranks(2, [&](int rank, Transport&) {
    auto inner = group->transport(rank);
    Engine engine(std::make_unique<Failing>(*inner, rank == 0 ? 1 : -1, fault));
    std::shared_ptr<Method> method = std::make_unique<Threshold>(1.0);
    if (rank == 0 && fault == Fault::kBadAllocInSelection)
      method = std::make_unique<FailingSelection>(std::make_unique<Threshold>(1.0));
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (int b = 0; b < kBuckets; ++b) {
      ReduceOptions options;
      options.bucket_name = "bucket " + std::to_string(b);
      futures.push_back(engine.submit(bucket_of(rank, b, kN), std::nullopt, std::nullopt, method, options, nullptr));
    }
    for (auto& f : futures) {
      f->wait();
      errors[rank].push_back(f->hasError() ? f->tryRetrieveErrorMessage() : "");
    }
    engine.shutdown();  // `inner` outlives the engine thread
  });
  ASSERT_EQ(errors[0].size(), static_cast<size_t>(kBuckets));
  const char* cause = fault == Fault::kCommError          ? "injected failure"
                      : fault == Fault::kBadAlloc         ? "an allocation failed"
                      : fault == Fault::kTorchOutOfMemory ? "CUDA out of memory"
                                                          : "bad_alloc";
  EXPECT_NE(errors[0][0].find(cause), std::string::npos) << errors[0][0];
  // The failed bucket named once, and by every later bucket.
  EXPECT_EQ(errors[0][0].find("bucket 0", errors[0][0].find("bucket 0") + 1), std::string::npos) << errors[0][0];
  for (int b = 1; b < kBuckets; ++b)
    EXPECT_NE(errors[0][b].find("gradsparse: bucket " + std::to_string(b) +
                                " was not reduced because an earlier bucket failed: bucket 0"),
              std::string::npos)
        << b << ": " << errors[0][b];
  for (const std::string& error : errors[0])  // PyTorch's errors without their C++ stack trace
    EXPECT_EQ(error.find("Exception raised from"), std::string::npos) << error;
  EXPECT_NE(errors[1][0], "") << "rank 1 must fail (timeout) rather than hang";
}

INSTANTIATE_TEST_SUITE_P(Faults, EngineFailure,
                         ::testing::Values(Fault::kCommError, Fault::kBadAlloc, Fault::kTorchOutOfMemory,
                                           Fault::kBadAllocInSelection),
                         [](const ::testing::TestParamInfo<Fault>& info) {
                           switch (info.param) {
                             case Fault::kCommError:
                               return std::string("CommError");
                             case Fault::kBadAlloc:
                               return std::string("BadAlloc");
                             case Fault::kTorchOutOfMemory:
                               return std::string("TorchOutOfMemory");
                             case Fault::kBadAllocInSelection:
                               return std::string("BadAllocInSelection");
                           }
                           return std::string();
                         });

using Submit = std::function<c10::intrusive_ptr<c10::ivalue::Future>(Engine&, int rank, int bucket)>;

/// Each rank's error message ("" for none) of the two buckets `submit` hands to that rank's engine,
/// with a callback that raises attached to rank 0's bucket 0 before rank 1 submits anything (so
/// that bucket completes, or fails, only once the callback is there).
std::vector<std::vector<std::string>> errors_under_a_raising_callback(const Submit& submit) {
  auto group = ThreadGroup::create(2, std::chrono::seconds(30));
  std::promise<void> attached;
  std::shared_future<void> ready = attached.get_future().share();
  std::vector<std::vector<std::string>> errors(2);
  rethrow_first(run_ranks(2, [&](int rank, Transport&) {
    Engine engine(group->transport(rank));
    if (rank == 1) ready.wait();
    std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
    for (int b = 0; b < 2; ++b) {
      futures.push_back(submit(engine, rank, b));
      if (rank == 0 && b == 0) {
        futures[0]->addCallback([](c10::ivalue::Future&) { throw std::runtime_error("a callback raised"); });
        attached.set_value();
      }
    }
    for (auto& f : futures) {
      f->wait();
      errors[rank].push_back(f->hasError() ? f->tryRetrieveErrorMessage() : "");
    }
  }));
  return errors;
}

// A callback of a bucket's future that raises once the bucket is reduced says nothing about the
// exchanges: the engine goes on with the next bucket.
TEST(Engine, ACallbackThatRaisesLeavesTheEngineRunning) {
  const auto errors = errors_under_a_raising_callback([](Engine& engine, int rank, int b) {
    return engine.submit(bucket_of(rank, b, kN), std::nullopt, std::nullopt, nullptr, ReduceOptions{}, nullptr);
  });
  for (int r = 0; r < 2; ++r)
    for (int b = 0; b < 2; ++b) EXPECT_EQ(errors[r][b], "") << r << " " << b;
}

// A callback that raises on a bucket's future that failed (here NaN/Inf in rank 0's bucket 0,
// refused alike on both ranks) is as little concern of the exchanges as one on a reduced bucket:
// the failed future carries the error and the engine goes on with the next bucket. The callback's
// exception escaped the engine thread from the failure path (setErrorIfNeeded inside the catch
// block) and ended the process (std::terminate).
TEST(Engine, ACallbackThatRaisesOnAFailedBucketLeavesTheEngineRunning) {
  const std::vector<std::shared_ptr<Method>> methods = {std::make_shared<TopK>(0.05), std::make_shared<TopK>(0.05)};
  const auto errors = errors_under_a_raising_callback([&](Engine& engine, int rank, int b) {
    at::Tensor grad = bucket_of(rank, b, kN);
    if (b == 0 && rank == 0) grad[7] = std::numeric_limits<float>::quiet_NaN();
    ReduceOptions options;
    options.bucket_name = "bucket " + std::to_string(b);
    return engine.submit(grad, at::zeros({kN}), std::nullopt, methods[rank], options, nullptr);
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(errors[r][0].find("NaN/Inf"), std::string::npos) << r << ": " << errors[r][0];
    EXPECT_EQ(errors[r][1], "") << r;
  }
}

/// Fails every collective with a CommError once `gate` is open (for a test that must act before
/// the engine's first collective fails).
class GatedFailure final : public Forwarding {
 public:
  GatedFailure(Transport& inner, std::shared_future<void> gate) : Forwarding(inner), gate_(std::move(gate)) {}
  void allgather(const Device&, const void*, void*, size_t) override { fail(); }
  void allreduce_sum(const Device&, void*, size_t, DType) override { fail(); }
  void sendrecv(const Device&, const void*, size_t, int, void*, size_t, int) override { fail(); }

 private:
  void fail() {
    gate_.wait();
    throw CommError("injected failure");
  }
  std::shared_future<void> gate_;
};

// The same on an engine that stops: a collective of bucket 0 fails, and callbacks that raise on
// its future and on bucket 1's (failed at once for the earlier failure) leave both futures failed
// with their errors, and the process running.
TEST(Engine, ACallbackThatRaisesOnABucketOfAStoppedEngineEndsNothing) {
  auto group = ThreadGroup::create(2, std::chrono::seconds(30));
  auto inner = group->transport(0);
  std::promise<void> attached;
  Engine engine(std::make_unique<GatedFailure>(*inner, attached.get_future().share()));
  std::vector<c10::intrusive_ptr<c10::ivalue::Future>> futures;
  for (int b = 0; b < 2; ++b) {
    ReduceOptions options;
    options.bucket_name = "bucket " + std::to_string(b);
    futures.push_back(engine.submit(bucket_of(0, b, kN), std::nullopt, std::nullopt, nullptr, options, nullptr));
    futures.back()->addCallback([](c10::ivalue::Future&) { throw std::runtime_error("a callback raised"); });
  }
  attached.set_value();
  std::vector<std::string> errors;
  for (auto& f : futures) {
    f->wait();
    errors.push_back(f->hasError() ? f->tryRetrieveErrorMessage() : "");
  }
  engine.shutdown();  // `inner` outlives the engine thread
  EXPECT_NE(errors[0].find("bucket 0: injected failure"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("bucket 1 was not reduced because an earlier bucket failed: bucket 0"), std::string::npos)
      << errors[1];
}

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

// shutdown() from two threads at once while a bucket is in flight (State.close() releases the
// GIL while it waits, so two Python threads, or atexit's close and a user's, can be in it
// together): both wait for the thread and return. Both joined the same std::thread at once, and
// the second join never returned.
TEST(Engine, ShutdownFromTwoThreadsAtOnceWaitsInBoth) {
  auto group = ThreadGroup::create(2, std::chrono::seconds(30));
  auto inner = group->transport(0);
  std::promise<void> release;
  Engine engine(std::make_unique<GatedFailure>(*inner, release.get_future().share()));
  auto future = engine.submit(bucket_of(0, 0, kN), std::nullopt, std::nullopt, nullptr, ReduceOptions{}, nullptr);
  std::vector<std::string> errors(2);
  std::vector<std::thread> closers;
  for (int t = 0; t < 2; ++t) {
    closers.emplace_back([&, t] {
      try {
        engine.shutdown();
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // both are waiting in shutdown()
  release.set_value();
  for (auto& closer : closers) closer.join();
  EXPECT_TRUE(future->completed());
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

/// A Work that records whether it was waited for, and with which timeout; its wait takes `delay`,
/// then raises `error` when one is given, and returns `result` otherwise (false: c10d's "aborted").
class FakeWork final : public c10d::Work {
 public:
  explicit FakeWork(std::string error = "", bool result = true,
                    std::chrono::milliseconds delay = std::chrono::milliseconds(0))
      : error_(std::move(error)), result_(result), delay_(delay) {}
  bool wait(std::chrono::milliseconds timeout) override {
    waited = true;
    given = timeout;
    std::this_thread::sleep_for(delay_);
    if (!error_.empty()) throw std::runtime_error(error_);
    return result_;
  }
  bool waited = false;
  std::chrono::milliseconds given{-1};

 private:
  std::string error_;
  bool result_;
  std::chrono::milliseconds delay_;
};

/// Rank 0 of a process group of two, with no backend for any device, whose send, receive and
/// all-reduce return the Works the test set, or raise while posting where it set none.
class FakeGroup final : public c10d::ProcessGroup {
 public:
  FakeGroup() : ProcessGroup(0, 2) {}
  const std::string getBackendName() const override { return "fake"; }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>&, int, int) override { return post(send_work); }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>&, int, int) override { return post(recv_work); }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>&, const c10d::AllreduceOptions&) override {
    return post(allreduce_work);
  }
  void startCoalescing(c10::DeviceType) override { ++coalescing; }
  c10::intrusive_ptr<c10d::Work> endCoalescing(c10::DeviceType) override {
    --coalescing;
    return coalesced_work;
  }
  c10::intrusive_ptr<FakeWork> send_work, recv_work, allreduce_work, coalesced_work;
  int posted = 0;
  int coalescing = 0;  // groups started and not ended

 private:
  c10::intrusive_ptr<c10d::Work> post(const c10::intrusive_ptr<FakeWork>& work) {
    ++posted;
    if (!work) throw std::runtime_error("the connection to rank 1 is closed");
    return work;
  }
};

/// A CUDA device in name only: the transport must refuse it before touching its memory.
class NamedCudaDevice final : public Device {
 public:
  DeviceKind kind() const override { return DeviceKind::kCUDA; }
  Buffer allocate(size_t) override { unused(); }
  void copy_to_host(void*, const void*, size_t) override { unused(); }
  void copy_from_host(void*, const void*, size_t) override { unused(); }
  void copy(void*, const void*, size_t) override { unused(); }
  void fill_zero(void*, size_t) override { unused(); }
  void synchronize() override { unused(); }
  SelectStats select_pairs(const BucketView&, const SelectRule&, int, const PairSink&) override { unused(); }
  SelectStats topk_pairs(const BucketView&, int64_t, bool, bool, int, const PairSink&) override { unused(); }
  Moments moments(const BucketView&, bool) override { unused(); }
  std::vector<int64_t> count(const BucketView&, Range, const std::vector<double>&, bool) override { unused(); }
  Exceedance exceedance(const BucketView&, double, bool, double, BlockSample) override { unused(); }
  double log_sum(const BucketView&, double, double, BlockSample) override { unused(); }
  Candidates collect(const BucketView&, Range, double, bool) override { unused(); }
  double sample_abs_sum(const BucketView&, const std::vector<int64_t>&) override { unused(); }
  void gather_values(const BucketView&, const MessageView&, void*) override { unused(); }
  void zero_at(const BucketView&, const MessageView&) override { unused(); }
  void assign(const MessageView&, void*) override { unused(); }
  void scatter_add(const MessageView&, void*, float) override { unused(); }
  void scatter_add_float32(const MessageView&, float*, float) override { unused(); }
  void divide(DType, void*, int64_t, float) override { unused(); }
  void round_to(DType, const float*, void*, int64_t) override { unused(); }
  void momentum(const BucketView&) override { unused(); }

 private:
  [[noreturn]] static void unused() { throw std::logic_error("NamedCudaDevice: not a real device"); }
};

std::string comm_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const CommError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no CommError";
  return "";
}

/// What one sendrecv of 8 bytes to rank 1 and 16 bytes from it raised (a CommError's text).
std::string sendrecv_error(ProcessGroupTransport& transport) {
  CpuDevice device;
  std::vector<uint8_t> out(8), in(16);
  return comm_error([&] { transport.sendrecv(device, out.data(), 8, 1, in.data(), 16, 1); });
}

// A send whose wait fails (the peer closed the connection) leaves the receive posted: the
// backend may still write into the receive buffer, which the caller frees once sendrecv returns.
// The receive is waited for too, and the send's failure is raised. The receive was never waited for.
TEST(ProcessGroupTransport, WaitsForTheReceiveWhenTheSendFails) {
  auto group = c10::make_intrusive<FakeGroup>();
  group->send_work = c10::make_intrusive<FakeWork>("the connection to rank 1 is closed");
  group->recv_work = c10::make_intrusive<FakeWork>();
  ProcessGroupTransport transport(group, std::chrono::seconds(5));
  const std::string error = sendrecv_error(transport);
  EXPECT_NE(error.find("sendrecv (send) of 8 bytes on rank 0 of 2 (fake process group) failed: the connection to "
                       "rank 1 is closed"),
            std::string::npos)
      << error;
  EXPECT_TRUE(group->recv_work->waited);
}

// The waits of one sendrecv share the timeout: the receive, waited for after a send that failed
// late (here after 400 of 1000 ms), gets what is left, so that a stalled peer is reported within
// the timeout. It got the whole timeout again.
TEST(ProcessGroupTransport, TheWaitsOfASendrecvShareTheTimeout) {
  auto group = c10::make_intrusive<FakeGroup>();
  group->send_work = c10::make_intrusive<FakeWork>("Timed out waiting 1000ms for send operation to complete", true,
                                                   std::chrono::milliseconds(400));
  group->recv_work = c10::make_intrusive<FakeWork>();
  ProcessGroupTransport transport(group, std::chrono::milliseconds(1000));
  sendrecv_error(transport);
  EXPECT_GT(group->send_work->given.count(), 500);  // nearly all of it (a margin for a paused thread)
  EXPECT_GE(group->recv_work->given.count(), 1);
  EXPECT_LE(group->recv_work->given.count(), 600);
}

// The receive's failure is raised when only it fails, after both waits.
TEST(ProcessGroupTransport, RaisesTheReceivesFailureAfterWaitingForBoth) {
  auto group = c10::make_intrusive<FakeGroup>();
  group->send_work = c10::make_intrusive<FakeWork>();
  group->recv_work = c10::make_intrusive<FakeWork>("the connection to rank 1 is closed");
  ProcessGroupTransport transport(group, std::chrono::seconds(5));
  const std::string error = sendrecv_error(transport);
  EXPECT_NE(error.find("sendrecv (receive) of 16 bytes on rank 0 of 2"), std::string::npos) << error;
  EXPECT_TRUE(group->send_work->waited);
}

// A receive that fails while being posted, after the send was posted: the send is waited for
// before the failure is raised (the backend may read the send buffer until then). The send was
// never waited for.
TEST(ProcessGroupTransport, WaitsForTheSendWhenPostingTheReceiveFails) {
  auto group = c10::make_intrusive<FakeGroup>();
  group->send_work = c10::make_intrusive<FakeWork>();
  ProcessGroupTransport transport(group, std::chrono::seconds(5));
  const std::string error = sendrecv_error(transport);
  EXPECT_NE(error.find("sendrecv of 24 bytes on rank 0 of 2 (fake process group) failed: the connection to rank 1 "
                       "is closed"),
            std::string::npos)
      << error;
  EXPECT_TRUE(group->send_work->waited);
}

// A post that fails inside an NCCL group (here the receive's, after the send's) still ends the
// group, and the group's Work is waited for: NCCL's group stayed open on the thread, holding back
// every later NCCL operation of the process.
TEST(ProcessGroupTransport, EndsTheCoalescedGroupWhenAPostFails) {
  auto group = c10::make_intrusive<FakeGroup>();
  group->send_work = c10::make_intrusive<FakeWork>();
  group->coalesced_work = c10::make_intrusive<FakeWork>();
  ProcessGroupTransport transport(group, std::chrono::seconds(5));
  const at::Tensor out = at::zeros({8}, at::kByte), in = at::zeros({16}, at::kByte);
  const std::string error =
      comm_error([&] { transport.send_and_receive(out, 1, in, 1, /*coalesced=*/true, "sendrecv"); });
  EXPECT_NE(error.find("sendrecv of 24 bytes on rank 0 of 2 (fake process group) failed: the connection to rank 1 "
                       "is closed"),
            std::string::npos)
      << error;
  EXPECT_EQ(group->coalescing, 0);
  EXPECT_TRUE(group->coalesced_work->waited);
  // and a group whose posts all succeed is ended once
  group->recv_work = c10::make_intrusive<FakeWork>();
  group->coalesced_work = c10::make_intrusive<FakeWork>();
  transport.send_and_receive(out, 1, in, 1, /*coalesced=*/true, "sendrecv");
  EXPECT_EQ(group->coalescing, 0);
  EXPECT_TRUE(group->coalesced_work->waited);
}

// c10d's Work::wait returns false for an operation that was aborted before it completed: its
// buffers hold no result, so it is a failed collective. It passed as a completed one.
TEST(ProcessGroupTransport, AWaitThatReturnsFalseFails) {
  auto group = c10::make_intrusive<FakeGroup>();
  group->allreduce_work = c10::make_intrusive<FakeWork>("", /*result=*/false);
  group->send_work = c10::make_intrusive<FakeWork>();
  group->recv_work = c10::make_intrusive<FakeWork>("", /*result=*/false);
  ProcessGroupTransport transport(group, std::chrono::milliseconds(1500));
  CpuDevice device;
  std::vector<float> data(4, 1.0f);
  std::string error = comm_error([&] { transport.allreduce_sum(device, data.data(), 4, DType::kFloat32); });
  EXPECT_NE(error.find("allreduce of 16 bytes on rank 0 of 2 (fake process group) failed: it did not complete: the "
                       "backend's wait (timeout 1500 ms) returned false, which means the operation was aborted"),
            std::string::npos)
      << error;
  error = sendrecv_error(transport);
  EXPECT_NE(error.find("sendrecv (receive) of 16 bytes"), std::string::npos) << error;
  EXPECT_NE(error.find("returned false"), std::string::npos) << error;
}

// Buckets on a CUDA device over a group without a backend for CUDA (backend="cpu:gloo") are
// refused by name, with the fix, before anything is posted. The sendrecv raised c10's "No backend
// type associated with device type cuda" without saying where, and the all-reduce posted.
TEST(ProcessGroupTransport, RefusesCudaBuffersOnAGroupWithoutACudaBackend) {
  auto group = c10::make_intrusive<FakeGroup>();
  group->allreduce_work = c10::make_intrusive<FakeWork>();
  group->send_work = c10::make_intrusive<FakeWork>();
  group->recv_work = c10::make_intrusive<FakeWork>();
  ProcessGroupTransport transport(group, std::chrono::seconds(5));
  NamedCudaDevice device;
  const std::vector<std::function<void()>> collectives{
      [&] { transport.sendrecv(device, nullptr, 8, 1, nullptr, 8, 1); },
      [&] { transport.allreduce_sum(device, nullptr, 4, DType::kFloat32); },
      [&] { transport.allgather(device, nullptr, nullptr, 8); },
      [&] { transport.allgatherv(device, nullptr, nullptr, {8, 8}); }};
  for (const auto& collective : collectives) {
    try {
      collective();
      ADD_FAILURE() << "not refused";
    } catch (const ValueError& e) {
      const std::string error = e.what();
      EXPECT_NE(error.find("the bucket is on cuda:0, but the fake process group of rank 0 has no backend for CUDA "
                           "devices (its backends serve: none)"),
                std::string::npos)
          << error;
      EXPECT_NE(error.find("backend=\"cpu:gloo,cuda:nccl\""), std::string::npos) << error;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "not a ValueError: " << e.what();
    }
  }
  EXPECT_EQ(group->posted, 0);
}

}  // namespace
