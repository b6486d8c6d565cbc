// Runs one function per rank on its own thread over a ThreadGroup and collects each rank's
// exception, so tests can assert what every rank saw.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gradsparse/transport.h"

namespace gradsparse::testing {

/// What the other ranks do when one rank's body throws: wait for it until the group's timeout, as
/// real peers do (the default), or fail at once (for tests that look only at the throwing rank).
enum class OnError { kPeersWait, kPeersFail };

/// One rank's part of a run: `body` over rank r's transport of `group`, what it throws kept in `error`.
inline void run_rank(ThreadGroup& group, int r, const std::function<void(int rank, Transport& transport)>& body,
                     std::exception_ptr& error) {
  auto transport = group.transport(r);
  try {
    body(r, *transport);
  } catch (...) {
    error = std::current_exception();
  }
}

inline std::vector<std::exception_ptr> run_ranks(int world_size,
                                                 const std::function<void(int rank, Transport& transport)>& body,
                                                 std::chrono::milliseconds timeout = std::chrono::seconds(30),
                                                 OnError on_error = OnError::kPeersWait) {
  auto group = ThreadGroup::create(world_size, timeout);
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      run_rank(*group, r, body, errors[r]);
      if (errors[r] && on_error == OnError::kPeersFail) group->abort("rank " + std::to_string(r) + " failed");
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

/// run_ranks on threads kept from one call to the next, for tests that run ranks thousands of
/// times (Methods.DegenerateBucketsOfEveryDtype, RoundTrip). A new thread for every rank at every
/// call cost most of their time under AddressSanitizer (75 s against 29 s for the first), and
/// qemu-user keeps the memory of every thread it has run (6.4 GB against 67 MB for RoundTrip at 4
/// ranks, which then took 138 s against 84 s). Rank r runs on the same thread at every call, as a
/// rank's engine thread does in training, so the kernels' thread_local workspaces are reused.
/// Not reentrant: a body must not call run() on the same object.
class RankThreads {
 public:
  RankThreads() = default;
  RankThreads(const RankThreads&) = delete;
  RankThreads& operator=(const RankThreads&) = delete;
  ~RankThreads() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    start_.notify_all();
    for (auto& t : threads_) t.join();
  }

  /// As run_ranks (with OnError::kPeersWait): each rank's exception, null where it returned.
  std::vector<std::exception_ptr> run(int world_size, const std::function<void(int rank, Transport& transport)>& body,
                                      std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    auto group = ThreadGroup::create(world_size, timeout);
    std::vector<std::exception_ptr> errors(world_size);
    std::unique_lock<std::mutex> lock(mutex_);
    for (int r = static_cast<int>(threads_.size()); r < world_size; ++r)
      threads_.emplace_back([this, r, seen = generation_] { serve(r, seen); });
    task_ = [&](int r) { run_rank(*group, r, body, errors[r]); };
    ranks_ = busy_ = world_size;
    ++generation_;
    start_.notify_all();
    done_.wait(lock, [&] { return busy_ == 0; });
    task_ = nullptr;
    return errors;
  }

 private:
  void serve(int rank, uint64_t seen) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      start_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      if (stopping_) return;
      seen = generation_;
      if (rank >= ranks_) continue;
      lock.unlock();
      task_(rank);  // task_ changes only once every rank of the run is done
      lock.lock();
      if (--busy_ == 0) done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable start_, done_;
  std::vector<std::thread> threads_;
  std::function<void(int)> task_;
  int ranks_ = 0, busy_ = 0;
  uint64_t generation_ = 0;
  bool stopping_ = false;
};

/// Forwards every collective to `inner` (a rank of run_ranks' group); tests derive from it to
/// watch or alter one kind of collective. allgatherv is not forwarded: it takes the base class's
/// path through allgather, which the derived class sees.
class Forwarding : public Transport {
 public:
  explicit Forwarding(Transport& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void allgather(const Device& device, const void* send, void* recv, size_t bytes) override {
    inner_.allgather(device, send, recv, bytes);
  }
  void allreduce_sum(const Device& device, void* data, size_t count, DType dtype) override {
    inner_.allreduce_sum(device, data, count, dtype);
  }
  void sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes,
                int src) override {
    inner_.sendrecv(device, send, send_bytes, dst, recv, recv_bytes, src);
  }

 private:
  Transport& inner_;
};

inline void rethrow_first(const std::vector<std::exception_ptr>& errors) {
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace gradsparse::testing
