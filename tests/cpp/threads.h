// Runs one function per rank on its own thread over a ThreadGroup and collects each rank's
// exception, so tests can assert what every rank saw.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "gradsparse/transport.h"

namespace gradsparse::testing {

inline std::vector<std::exception_ptr> run_ranks(int world_size,
                                                 const std::function<void(int rank, Transport& transport)>& body,
                                                 std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
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
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

inline void rethrow_first(const std::vector<std::exception_ptr>& errors) {
  for (const auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace gradsparse::testing
