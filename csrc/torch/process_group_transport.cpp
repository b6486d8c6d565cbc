#include "process_group_transport.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <exception>
#include <stdexcept>

#include "adapter.h"

namespace gradsparse::torch_adapter {
namespace {

at::Device torch_device(const Device& device) {
  return device.kind() == DeviceKind::kCUDA ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(device.index()))
                                            : at::Device(at::kCPU);
}

at::Tensor wrap(const Device& device, const void* data, int64_t count, at::ScalarType type) {
  return at::from_blob(const_cast<void*>(data), {count}, at::TensorOptions().dtype(type).device(torch_device(device)));
}

}  // namespace

ProcessGroupTransport::ProcessGroupTransport(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                             std::chrono::milliseconds timeout)
    : group_(std::move(group)), timeout_(timeout) {
  GS_CHECK(group_, ValueError, "ProcessGroupTransport: the process group is None");
  rank_ = group_->getRank();
  size_ = group_->getSize();
}

void ProcessGroupTransport::failed(const std::exception& e, const std::string& what, size_t bytes) const {
  throw CommError(str(what, " of ", bytes, " bytes on rank ", rank_, " of ", size_, " (", group_->getBackendName(),
                      " process group) failed: ", error_text(e),
                      "\nA peer may have stopped or raised, or the ranks issued different collectives."));
}

void ProcessGroupTransport::wait(const c10::intrusive_ptr<c10d::Work>& work, const std::string& what, size_t bytes,
                                 std::chrono::milliseconds timeout) {
  bool completed = false;
  try {
    completed = work->wait(timeout);
  } catch (const std::exception& e) {
    failed(e, what, bytes);
  }
  // c10d's Work::wait returns false when the operation was aborted before it completed (Gloo's
  // send and receive after Work::abort() or ProcessGroup::abort()): its buffers hold no result.
  if (!completed)
    failed(std::runtime_error(str("it did not complete: the backend's wait (timeout ", timeout.count(),
                                  " ms) returned false, which means the operation was aborted")),
           what, bytes);
}

void ProcessGroupTransport::complete(const std::function<c10::intrusive_ptr<c10d::Work>()>& post,
                                     const std::string& what, size_t bytes) {
  c10::intrusive_ptr<c10d::Work> work;
  try {
    work = post();
  } catch (const std::exception& e) {
    failed(e, what, bytes);
  }
  wait(work, what, bytes, timeout_);
}

void ProcessGroupTransport::send_and_receive(const at::Tensor& out, int dst, const at::Tensor& in, int src,
                                             bool coalesced, const char* what) {
  // Both directions are posted before waiting; NCCL needs them in one coalesced group (a lone
  // send would wait for the peer's receive, queued after the peer's own send), other backends
  // run point-to-point operations asynchronously anyway.
  std::vector<at::Tensor> sending{out}, receiving{in};
  const auto send_bytes = static_cast<size_t>(out.numel()), recv_bytes = static_cast<size_t>(in.numel());
  if (send_bytes == 0 && recv_bytes == 0) return;  // nothing either way (empty parts): no group to open
  c10::intrusive_ptr<c10d::Work> sent, received, work;
  // Every operation posted is waited for, even after a failure: the backend may write into `in`
  // (or read `out`) until its wait returns, and the caller frees them once this returns. The
  // first failure is raised after the last wait.
  std::exception_ptr first;
  const auto keep_first = [&](const std::exception& e) {
    try {
      failed(e, what, send_bytes + recv_bytes);
    } catch (const CommError&) {
      if (!first) first = std::current_exception();
    }
  };
  bool coalescing = false;
  try {
    if (coalesced) {
      group_->startCoalescing(c10::DeviceType::CUDA);
      coalescing = true;
    }
    if (send_bytes > 0) sent = group_->send(sending, dst, /*tag=*/0);
    if (recv_bytes > 0) received = group_->recv(receiving, src, /*tag=*/0);
    if (coalesced) {
      coalescing = false;
      work = group_->endCoalescing(c10::DeviceType::CUDA);
    }
  } catch (const std::exception& e) {
    keep_first(e);
  }
  // A post that failed inside the group still ends it: NCCL's group stays open on this thread
  // otherwise, and holds back every later NCCL operation of the process (DDP's included).
  if (coalescing) {
    try {
      work = group_->endCoalescing(c10::DeviceType::CUDA);
    } catch (const std::exception& e) {
      keep_first(e);
    }
  }
  // One timeout for them all: a wait after a slow or failed one gets what is left of it (at least
  // 1 ms; 0 is c10d's "no timeout"), so that a stalled peer is still reported within the timeout.
  const auto deadline = std::chrono::steady_clock::now() + timeout_;
  const auto left = [&] {
    if (timeout_ <= std::chrono::milliseconds(0)) return timeout_;
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()));
  };
  const auto settle = [&](const c10::intrusive_ptr<c10d::Work>& posted, const std::string& name, size_t bytes) {
    if (!posted) return;
    try {
      wait(posted, name, bytes, left());
    } catch (const CommError&) {
      if (!first) first = std::current_exception();
    }
  };
  settle(work, what, send_bytes + recv_bytes);
  settle(sent, str(what, " (send)"), send_bytes);
  settle(received, str(what, " (receive)"), recv_bytes);
  if (first) std::rethrow_exception(first);
}

void ProcessGroupTransport::check_device(const Device& device) const {
  if (device.kind() != DeviceKind::kCUDA || group_->hasBackendForDeviceType(c10::DeviceType::CUDA)) return;
  std::string types;
  for (const c10::Device& type : group_->getDeviceTypes())
    types += str(types.empty() ? "" : ", ", c10::DeviceTypeName(type.type(), /*lower_case=*/true));
  throw ValueError(
      gradsparse::str("ProcessGroupTransport: the bucket is on ", torch_device(device), ", but the ",
                      group_->getBackendName(), " process group of rank ", rank_,
                      " has no backend for CUDA devices (its backends serve: ", types.empty() ? "none" : types,
                      "). Create the group with one, e.g. dist.init_process_group(backend=\"cpu:gloo,cuda:nccl\") "
                      "or backend=\"nccl\" (backend=\"gloo\" serves CUDA tensors too, through host copies), or "
                      "keep the model on the CPU."));
}

bool ProcessGroupTransport::nccl(const Device& device) const {
  check_device(device);
  return device.kind() == DeviceKind::kCUDA && group_->getBackend(c10::DeviceType::CUDA)->getBackendName() == "nccl";
}

void ProcessGroupTransport::allgather(const Device& device, const void* send, void* recv, size_t bytes) {
  GS_CHECK(bytes > 0, ValueError, "ProcessGroupTransport.allgather: zero-length collective");
  check_device(device);
  std::vector<at::Tensor> inputs{wrap(device, send, static_cast<int64_t>(bytes), at::kByte)};
  const at::Tensor out = wrap(device, recv, static_cast<int64_t>(bytes) * size_, at::kByte);
  std::vector<std::vector<at::Tensor>> outputs{out.chunk(size_)};
  complete([&] { return group_->allgather(outputs, inputs); }, "allgather", bytes);
  count_allgather(bytes);
}

void ProcessGroupTransport::allgatherv(Device& device, const void* send, void* recv, const std::vector<size_t>& sizes) {
  check_allgatherv(sizes, "ProcessGroupTransport");
  check_device(device);
  const std::vector<size_t> offsets = block_offsets(sizes);
  const auto total = static_cast<int64_t>(offsets.back());
  const auto mine = static_cast<int64_t>(sizes[static_cast<size_t>(rank_)]);
  const at::Tensor output = wrap(device, recv, total, at::kByte);
  const bool cuda = device.kind() == DeviceKind::kCUDA;
  if (nccl(device)) {
    // NCCL: an all-to-all with split sizes, every rank's block unpadded to every rank.
    std::vector<int64_t> in_splits(static_cast<size_t>(size_), mine), out_splits(sizes.begin(), sizes.end());
    at::Tensor input = wrap(device, send, mine, at::kByte).repeat({size_});
    at::Tensor out = output;
    complete([&] { return group_->all_to_all_single(out, input, out_splits, in_splits); }, "allgatherv",
             static_cast<size_t>(total));
    count_allgatherv(sizes);
    return;
  }
  // Elsewhere (Gloo, MPI) a ring: in step s every rank sends the block it received in step s - 1
  // (its own first) to the next rank and receives the one before from the previous rank. Each link
  // then carries one stream at a time. Gloo's all-to-all sends to every peer at once instead, and on
  // rate-limited links its P - 1 concurrent streams per host took 1.6x a ring all-gather of the same
  // bytes (docs/benchmarks.md, "Variable-size all-gather on Gloo"). Gloo moves host memory, so CUDA
  // blocks go around the ring through one host copy of the whole output.
  at::Tensor ring = cuda ? at::empty({total}, output.options().device(at::kCPU)) : output;
  const auto block = [&](int r) {
    return ring.narrow(0, static_cast<int64_t>(offsets[static_cast<size_t>(r)]),
                       static_cast<int64_t>(sizes[static_cast<size_t>(r)]));
  };
  if (mine > 0) block(rank_).copy_(wrap(device, send, mine, at::kByte));
  const int next = (rank_ + 1) % size_, previous = (rank_ + size_ - 1) % size_;
  for (int step = 0; step + 1 < size_; ++step) {
    const int out = (rank_ - step + size_) % size_, in = (rank_ - step - 1 + 2 * size_) % size_;
    send_and_receive(block(out), next, block(in), previous, /*coalesced=*/false, "allgatherv's ring");
  }
  if (cuda) output.copy_(ring);
  count_allgatherv(sizes);
}

void ProcessGroupTransport::allreduce_sum(const Device& device, void* data, size_t count, DType dtype) {
  GS_CHECK(count > 0, ValueError, "ProcessGroupTransport.allreduce_sum: zero-length collective");
  check_device(device);
  std::vector<at::Tensor> tensors{wrap(device, data, static_cast<int64_t>(count), scalar_type(dtype))};
  c10d::AllreduceOptions options;
  options.reduceOp = c10d::ReduceOp::SUM;
  complete([&] { return group_->allreduce(tensors, options); }, "allreduce", count * dtype_size(dtype));
  count_allreduce(count * dtype_size(dtype));
}

}  // namespace gradsparse::torch_adapter

namespace gradsparse::torch_adapter {

void ProcessGroupTransport::sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv,
                                     size_t recv_bytes, int src) {
  // Gloo's send and receive read and write the tensor's memory from the host, so CUDA bytes
  // travel through host copies there.
  const bool coalesced = nccl(device);
  const bool staged = device.kind() == DeviceKind::kCUDA && !coalesced;
  at::Tensor out = wrap(device, send, static_cast<int64_t>(send_bytes), at::kByte);
  const at::Tensor device_in = wrap(device, recv, static_cast<int64_t>(recv_bytes), at::kByte);
  at::Tensor in = device_in;
  if (staged) {
    out = out.cpu();  // waits for the current stream
    in = at::empty_like(device_in, device_in.options().device(at::kCPU));
  }
  send_and_receive(out, dst, in, src, coalesced, "sendrecv");
  if (staged && recv_bytes > 0) device_in.copy_(in);  // on the current stream, as the job's next kernels
  count_sendrecv(send_bytes, recv_bytes);
}

}  // namespace gradsparse::torch_adapter
