#include "engine.h"

#include "gradsparse/cpu_device.h"

#include <ATen/core/jit_type.h>

#include "adapter.h"

namespace gradsparse::torch_adapter {
namespace {

class CpuJobDevice final : public JobDevice {
 public:
  void run(const std::function<void(Device&)>& body) override { body(device_); }
  std::vector<c10::Device> future_devices() const override { return {}; }

 private:
  CpuDevice device_;
};

BucketView bucket_view(const at::Tensor& grad, const std::optional<at::Tensor>& residual,
                       const std::optional<at::Tensor>& velocity) {
  return BucketView{core_dtype(grad, "bucket"), grad.numel(), grad.data_ptr(),
                    residual ? residual->data_ptr() : nullptr, velocity ? velocity->data_ptr() : nullptr};
}

/// "<bucket>: <error>", naming the bucket once: reduce_bucket's own errors (a failed allocation,
/// a refused bucket) begin with its name already.
std::string of_bucket(const std::string& bucket, const std::string& error) {
  const bool named = error.compare(0, bucket.size(), bucket) == 0 &&
                     (error.size() == bucket.size() || error[bucket.size()] == ' ' || error[bucket.size()] == ':');
  return named ? error : str(bucket, ": ", error);
}

/// Fails `future` with `error`. A callback of the future that raises (which c10's Future lets
/// through setError) is no concern of the exchanges, as on a completed future: the future carries
/// the error all the same, and the callback's exception must not leave the engine thread, where it
/// ended the process (std::terminate).
void fail(c10::ivalue::Future& future, const std::exception_ptr& error) {
  try {
    future.setErrorIfNeeded(error);
  } catch (...) {
  }
}

}  // namespace

std::unique_ptr<JobDevice> make_cpu_job_device() { return std::make_unique<CpuJobDevice>(); }

#if !defined(GRADSPARSE_WITH_CUDA)
std::unique_ptr<JobDevice> make_cuda_job_device(const at::Tensor& grad, const std::vector<at::Tensor>&) {
  TORCH_CHECK(
      false, "gradsparse: this build has no CUDA support, but the bucket is on ", grad.device(),
      ". Reinstall with a CUDA build of PyTorch and the CUDA toolkit present, or force it with GRADSPARSE_CUDA=1 "
      "(see the README's build variables).");
}
#endif

struct Engine::Shared {
  struct Job {
    at::Tensor grad;
    std::optional<at::Tensor> residual;
    std::optional<at::Tensor> velocity;
    std::shared_ptr<Method> method;
    ReduceOptions options;
    std::shared_ptr<ReduceReport> report;
    std::unique_ptr<JobDevice> device;
    c10::intrusive_ptr<c10::ivalue::Future> future;
  };

  explicit Shared(std::unique_ptr<Transport> t)
      : transport(std::move(t)), rank(transport->rank()), size(transport->size()) {}

  void loop();
  void run(Job& job);

  // Released by the thread as it ends: an MpiTransport under MPI_THREAD_SERIALIZED admits one
  // at a time, and a closed state's kept the next one refused for as long as the state lived.
  std::unique_ptr<Transport> transport;
  const int rank, size;  // the transport's, past its release
  std::mutex mu;
  std::condition_variable cv;
  std::deque<Job> queue;
  bool stopping = false;
  std::string failure;  // set after an error that stops the engine ("<bucket>: <error>"); later jobs fail with it
};

Engine::Engine(std::unique_ptr<Transport> transport) : shared_(std::make_shared<Shared>(std::move(transport))) {
  thread_ = std::thread([shared = shared_] { shared->loop(); });
  thread_id_ = thread_.get_id();
}

Engine::Engine(c10::intrusive_ptr<c10d::ProcessGroup> group, std::chrono::milliseconds timeout)
    : Engine(std::make_unique<ProcessGroupTransport>(std::move(group), timeout)) {}

Engine::~Engine() {
  if (forked()) {
    abandon();
    return;
  }
  if (thread_.joinable() && thread_.get_id() == std::this_thread::get_id()) {
    {
      std::lock_guard<std::mutex> lock(shared_->mu);
      shared_->stopping = true;
    }
    shared_->cv.notify_all();
    thread_.detach();  // we are that thread: it ends after the current job, owning `shared`
    return;
  }
  try {
    shutdown();
  } catch (...) {  // a destructor throws nothing (std::terminate)
  }
}

void Engine::abandon() {
  if (thread_.joinable()) new std::thread(std::move(thread_));   // NOLINT: left behind on purpose
  if (shared_) new std::shared_ptr<Shared>(std::move(shared_));  // NOLINT: its mutexes may be held
}

int Engine::rank() const { return shared_->rank; }
int Engine::size() const { return shared_->size; }

void Engine::shutdown() {
  if (forked()) {
    abandon();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    shared_->stopping = true;
  }
  shared_->cv.notify_all();
  if (std::this_thread::get_id() == thread_id_) return;  // a job's callback: the thread ends after it
  // Joined under a lock: a second caller waits for the first one's join, then finds the thread
  // joined. Two joins of one std::thread at once left the second waiting for ever.
  std::lock_guard<std::mutex> lock(join_mu_);
  if (thread_.joinable()) thread_.join();
}

c10::intrusive_ptr<c10::ivalue::Future> Engine::submit(at::Tensor grad, std::optional<at::Tensor> residual,
                                                       std::optional<at::Tensor> velocity,
                                                       std::shared_ptr<Method> method, ReduceOptions options,
                                                       std::shared_ptr<ReduceReport> report) {
  TORCH_CHECK(!forked() && shared_,
              "gradsparse: this state's engine runs in the process that set the state up, and this process was "
              "forked from it; create the state in this process, after the fork");
  core_dtype(grad, "bucket");
  check_flat(grad, "bucket");
  std::vector<at::Tensor> state;
  for (const auto& [t, name] : {std::pair{&residual, "residual"}, std::pair{&velocity, "velocity"}}) {
    if (!*t) continue;
    check_same(grad, "bucket", **t, name);
    check_flat(**t, name);
    state.push_back(**t);
  }
  Shared::Job job;
  job.device = grad.is_cuda() ? make_cuda_job_device(grad, state) : make_cpu_job_device();
  job.future = c10::make_intrusive<c10::ivalue::Future>(c10::TensorType::get(), job.device->future_devices());
  job.grad = std::move(grad);
  job.residual = std::move(residual);
  job.velocity = std::move(velocity);
  job.method = std::move(method);
  job.options = std::move(options);
  job.report = report ? std::move(report) : std::make_shared<ReduceReport>();
  auto future = job.future;
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    TORCH_CHECK(!shared_->stopping, "gradsparse: the engine has been shut down; create a new state to continue");
    shared_->queue.push_back(std::move(job));
  }
  shared_->cv.notify_one();
  return future;
}

void Engine::Shared::loop() {
  for (;;) {
    Job job;
    {
      std::unique_lock<std::mutex> lock(mu);
      cv.wait(lock, [&] { return stopping || !queue.empty(); });
      if (queue.empty()) break;  // stopping and drained
      job = std::move(queue.front());
      queue.pop_front();
    }
    run(job);
  }
  transport.reset();
}

void Engine::Shared::run(Job& job) {
  std::string earlier;
  {
    std::lock_guard<std::mutex> lock(mu);
    earlier = failure;
  }
  if (!earlier.empty()) {
    fail(*job.future,
         std::make_exception_ptr(CommError(str("gradsparse: ", job.options.bucket_name,
                                               " was not reduced because an earlier bucket failed: ", earlier))));
    return;
  }
  bool reduced = false;
  try {
    job.device->run([&](Device& device) {
      *job.report = reduce_bucket(job.method.get(), *transport, device,
                                  bucket_view(job.grad, job.residual, job.velocity), job.options);
      reduced = true;
      job.future->markCompleted(c10::IValue(job.grad));
    });
  } catch (const NonFiniteError& e) {
    // Raised identically on every rank after an agreed exchange: later buckets can proceed.
    fail(*job.future, std::make_exception_ptr(std::runtime_error(str("gradsparse: ", e.what()))));
  } catch (const ValueError& e) {
    // A refused argument or configuration, refused alike on every rank: later buckets can proceed.
    fail(*job.future, std::make_exception_ptr(
                          std::runtime_error(str("gradsparse: ", of_bucket(job.options.bucket_name, e.what())))));
  } catch (const std::exception& e) {
    // The bucket was reduced and its future completed; what raised was one of the future's
    // callbacks, which is no concern of the exchanges.
    if (reduced) return;
    // Anything else may have happened on this rank alone: a failed collective, a corrupt message,
    // memory running out (std::bad_alloc, or PyTorch's allocators: c10::OutOfMemoryError on CUDA,
    // c10::Error on the CPU), a failed CUDA call. The other ranks may be in this bucket's
    // collectives still, so the ranks' collective sequences can no longer be trusted to match:
    // stop here rather than let the next bucket's collectives meet this one's on the other ranks.
    const std::string error = of_bucket(job.options.bucket_name, error_text(e));
    {
      std::lock_guard<std::mutex> lock(mu);
      failure = error;
    }
    fail(*job.future, std::make_exception_ptr(std::runtime_error(str("gradsparse: ", error))));
  }
}

}  // namespace gradsparse::torch_adapter
