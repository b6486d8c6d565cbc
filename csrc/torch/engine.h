// Engine: a background thread per process group that runs bucket reductions in submission order
// (Horovod style), so the DDP hook returns a future at once and communication overlaps the rest
// of the backward pass. Every job is one call of reduce_bucket (core) on one bucket.
//
// Errors complete the job's future with an exception (never a hang on our side): a
// NonFiniteError or a refused configuration (ValueError) is raised identically on every rank and
// later buckets proceed; any other error (a communication error, a corrupt message, memory running
// out, a failed CUDA call) may be this rank's alone and stops the engine, and every later job
// fails at once with the original cause.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <unistd.h>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "gradsparse/method.h"
#include "gradsparse/reduce_bucket.h"
#include "process_group_transport.h"

namespace gradsparse::torch_adapter {

/// The device side of one job. Created on the submitting thread (a CUDA job records the
/// submitting stream there); run() executes the job's body on the engine thread with the right
/// device, stream and allocator.
class JobDevice {
 public:
  virtual ~JobDevice() = default;
  virtual void run(const std::function<void(Device&)>& body) = 0;
  /// Devices of the future that carries the result (empty for CPU).
  virtual std::vector<c10::Device> future_devices() const = 0;
};

std::unique_ptr<JobDevice> make_cpu_job_device();
/// Defined in engine_cuda.cpp when built with CUDA; otherwise throws a clear error.
/// `state`: the bucket's residual and velocity, where it has them.
std::unique_ptr<JobDevice> make_cuda_job_device(const at::Tensor& grad, const std::vector<at::Tensor>& state);

class Engine {
 public:
  /// An engine whose exchanges run on `transport` (a ProcessGroupTransport, or an MpiTransport).
  explicit Engine(std::unique_ptr<Transport> transport);
  /// An engine over a torch.distributed process group.
  Engine(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout);
  /// Stops the thread after the queued jobs. Safe from any thread, including the engine thread
  /// itself (a job's callback may drop the last reference): the thread keeps its own reference
  /// to the shared part and is detached in that case.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  /// Queues the reduction of one bucket. `grad` is reduced in place and is the future's value.
  /// `method` null (or options.dense) means a dense average. `residual` (error feedback) and
  /// `velocity` (momentum correction) have the bucket's shape and dtype. `report` is filled in
  /// before the future completes.
  c10::intrusive_ptr<c10::ivalue::Future> submit(at::Tensor grad, std::optional<at::Tensor> residual,
                                                 std::optional<at::Tensor> velocity, std::shared_ptr<Method> method,
                                                 ReduceOptions options, std::shared_ptr<ReduceReport> report);

  /// Finishes queued jobs and joins the thread. Idempotent, also from several threads at once
  /// (each returns once the thread has ended); also called by the destructor. In a process forked
  /// from the one that made the engine it touches nothing of it (abandon()).
  void shutdown();

  int rank() const;
  int size() const;

 private:
  struct Shared;  // queue, transport and failure state, shared with the thread
  std::shared_ptr<Shared> shared_;
  std::thread thread_;
  std::thread::id thread_id_;  // the engine thread's, read without touching thread_ (which a join rewrites)
  std::mutex join_mu_;         // one join at a time: shutdown() from several threads at once (a second join hung)
  pid_t owner_ = ::getpid();   // the process the thread runs in

  bool forked() const { return ::getpid() != owner_; }
  /// In a forked process the engine thread is not there (fork copies the calling thread only) and
  /// a mutex it held stays held: its handles are left behind, never joined nor destroyed (joining
  /// crashed the child, or ended it in std::terminate).
  void abandon();
};

}  // namespace gradsparse::torch_adapter
