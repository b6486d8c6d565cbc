// Runs one function per rank on its own thread over a ThreadGroup and collects each rank's
// exception, so tests can assert what every rank saw.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gradsparse/transport.h"

namespace gradsparse::testing {

/// What the other ranks do when one rank's body throws: wait for it until the group's timeout, as
/// real peers do (the default), or fail at once (for tests that look only at the throwing rank).
enum class OnError { kPeersWait, kPeersFail };

inline std::vector<std::exception_ptr> run_ranks(int world_size,
                                                 const std::function<void(int rank, Transport& transport)>& body,
                                                 std::chrono::milliseconds timeout = std::chrono::seconds(30),
                                                 OnError on_error = OnError::kPeersWait) {
  auto group = ThreadGroup::create(world_size, timeout);
  std::vector<std::exception_ptr> errors(world_size);
  std::vector<std::thread> threads;
  for (int r = 0; r < world_size; ++r) {
    threads.emplace_back([&, r] {
      auto transport = group->transport(r);
      try {
        body(r, *transport);
      } catch (...) {
        errors[r] = std::current_exception();
        if (on_error == OnError::kPeersFail) group->abort("rank " + std::to_string(r) + " failed");
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

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
