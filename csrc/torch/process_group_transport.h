// ProcessGroupTransport: the core's Transport over a torch.distributed ProcessGroup, so that
// every exchange runs on Gloo (CPU), NCCL (CUDA) or MPI unchanged. Buffers are wrapped as
// tensors without copies; collectives are issued from the calling thread and waited for.
//
// On CUDA, collectives are enqueued after the calling thread's current stream (the engine sets
// its own stream current) and Work::wait() makes that stream wait for them, so later work on the
// stream, including the release of buffers back to the caching allocator, is ordered after them.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <functional>
#include <string>

#include "gradsparse/transport.h"

namespace gradsparse::torch_adapter {

class ProcessGroupTransport final : public Transport {
 public:
  ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void allgather(const Device& device, const void* send, void* recv, size_t bytes) override;
  void allgatherv(Device& device, const void* send, void* recv, const std::vector<size_t>& sizes) override;
  void allreduce_sum(const Device& device, void* data, size_t count, DType dtype) override;
  void sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv, size_t recv_bytes,
                int src) override;

  const c10::intrusive_ptr<c10d::ProcessGroup>& group() const { return group_; }

  /// Posts the send of `out` to `dst` and the receive into `in` from `src` (an empty tensor posts
  /// nothing), then waits for both; `coalesced` posts them as one NCCL group. Counts no bytes
  /// (public for the tests of its failures).
  void send_and_receive(const at::Tensor& out, int dst, const at::Tensor& in, int src, bool coalesced,
                        const char* what);

 private:
  /// Posts one operation (`post` returns its Work) and waits for it. A failure in either is a
  /// CommError, which stops the engine: a backend may raise while posting (Gloo's send to a
  /// closed connection), and this rank is then out of step with the others just the same.
  void complete(const std::function<c10::intrusive_ptr<c10d::Work>()>& post, const std::string& what, size_t bytes);
  void wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what, size_t bytes,
            std::chrono::milliseconds timeout);
  [[noreturn]] void failed(const std::exception& e, const std::string& what, size_t bytes) const;
  /// Refuses (ValueError) buffers on a CUDA device when the group has no backend for CUDA (a
  /// group created with backend="cpu:gloo"), before anything is posted.
  void check_device(const Device& device) const;
  /// Whether buffers on `device` travel through NCCL (CUDA buffers on a group whose CUDA backend is
  /// NCCL); refuses `device` as check_device does.
  bool nccl(const Device& device) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  std::chrono::milliseconds timeout_;
  int rank_;
  int size_;
};

}  // namespace gradsparse::torch_adapter
