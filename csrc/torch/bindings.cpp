// The Python module gradsparse._C: stateful objects (selection methods, the engine, reports, and
// a thread-rank group for tests) through pybind11. Importing it also registers the TORCH_LIBRARY
// ops (ops*.cpp).
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cmath>
#include <memory>

#include "adapter.h"
#include "engine.h"
#include "gradsparse/cpu_device.h"
#include "gradsparse/methods.h"
#include "gradsparse/mpi_transport.h"
#include "gradsparse/parallel.h"
#include "gradsparse/reduce_bucket.h"
#include "gradsparse/spardl.h"
#include "gradsparse/transport.h"

namespace py = pybind11;
using namespace gradsparse;
using gradsparse::torch_adapter::Engine;

namespace {

NonFinitePolicy parse_policy(const std::string& s) {
  if (s == "raise") return NonFinitePolicy::kRaise;
  if (s == "skip") return NonFinitePolicy::kSkip;
  throw ValueError(str("nonfinite must be \"raise\" or \"skip\", got \"", s, "\""));
}

bool built_with_cuda() {
#if defined(GRADSPARSE_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

/// Deletes an engine without holding the GIL: its thread may need the GIL to finish a callback,
/// and joining it while holding the GIL would deadlock.
struct EngineDeleter {
  void operator()(Engine* engine) const {
    if (Py_IsInitialized() && PyGILState_Check()) {
      py::gil_scoped_release nogil;
      delete engine;
    } else {
      delete engine;
    }
  }
};

/// A method that keeps the indices of each selection it makes (for tests of the selections); the
/// step itself is the wrapped method's.
class Recorder final : public Method {
 public:
  explicit Recorder(Method& method) : method_(method) {}
  std::string name() const override { return method_.name(); }
  Selection select(Device& device, const BucketView& bucket, Collective& group) override {
    Selection s = method_.select(device, bucket, group);
    indices = HostMessage(device, s, bucket).index_list();
    return s;
  }
  const Exchange& exchange() const override { return method_.exchange(); }
  void observe(const BucketView& bucket, const ExchangeResult& result) override { method_.observe(bucket, result); }
  MethodReport report() const override { return method_.report(); }
  MethodState state() const override { return method_.state(); }
  void load_state(const MethodState& state) override { method_.load_state(state); }

  std::vector<int64_t> indices;

 protected:
  void rescale_state(double factor) override { method_.rescale(factor); }

 private:
  Method& method_;
};

/// N ranks as threads of this process (ThreadTransport over CPU tensors), for tests that drive
/// methods and exchanges from Python without spawning processes: each Python thread calls
/// reduce() with its rank.
class PyThreadGroup {
 public:
  PyThreadGroup(int size, double timeout_seconds) : group_(ThreadGroup::create(size, timeout_ms(timeout_seconds))) {
    for (int r = 0; r < size; ++r) transports_.push_back(group_->transport(r));
  }

  /// The report of one bucket's step, and this rank's selected indices (empty for a dense step).
  std::pair<ReduceReport, std::vector<int64_t>> reduce(int rank, const at::Tensor& grad,
                                                       std::optional<at::Tensor> residual,
                                                       const std::shared_ptr<Method>& method, bool dense,
                                                       const std::string& nonfinite, bool record, bool shard_only,
                                                       std::optional<at::Tensor> velocity, double momentum,
                                                       bool momentum_masking) {
    TORCH_CHECK_VALUE(rank >= 0 && rank < static_cast<int>(transports_.size()), "ThreadGroup.reduce: rank ", rank,
                      " is outside the group of ", transports_.size());
    TORCH_CHECK_VALUE(grad.device().is_cpu(), "ThreadGroup.reduce: CPU tensors only");
    torch_adapter::check_flat(grad, "grad");
    for (const auto& [t, name] : {std::pair{&residual, "residual"}, std::pair{&velocity, "velocity"}}) {
      if (!*t) continue;
      torch_adapter::check_same(grad, "grad", **t, name);
      torch_adapter::check_flat(**t, name);
    }
    ReduceOptions options;
    options.dense = dense;
    options.nonfinite = parse_policy(nonfinite);
    options.bucket_name = "bucket (rank " + std::to_string(rank) + ")";
    options.shard_only = shard_only;
    options.momentum = static_cast<float>(momentum);
    options.momentum_masking = momentum_masking;
    const BucketView view{torch_adapter::core_dtype(grad, "grad"), grad.numel(), grad.data_ptr(),
                          residual ? residual->data_ptr() : nullptr, velocity ? velocity->data_ptr() : nullptr};
    CpuDevice device;
    py::gil_scoped_release nogil;
    if (!method || !record) return {reduce_bucket(method.get(), *transports_[rank], device, view, options), {}};
    Recorder recorder(*method);
    ReduceReport report = reduce_bucket(&recorder, *transports_[rank], device, view, options);
    return {std::move(report), std::move(recorder.indices)};
  }

  void abort(const std::string& reason) { group_->abort(reason); }

 private:
  /// The ranks wait on a steady clock in 64-bit nanoseconds: a timeout that is not finite (inf, as
  /// for "no timeout") or past 2^62 ns became a negative wait, and the first rank at a collective
  /// failed at once ("waited -9223372036854775808 ms"); one under a millisecond waited 0 ms.
  static std::chrono::milliseconds timeout_ms(double seconds) {
    constexpr int64_t most = 4611686018;  // 2^62 ns, as gradsparse's timeouts (config.check_timeout)
    GS_CHECK(std::isfinite(seconds) && seconds >= 0.001 && seconds <= static_cast<double>(most), ValueError,
             "ThreadGroup: timeout_seconds must be a positive number of seconds, from 0.001 (the ranks wait in whole "
             "milliseconds) to ",
             most, " (146 years), got ", seconds, "; for example timeout_seconds=60");
    return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1e3));
  }

  std::shared_ptr<ThreadGroup> group_;
  std::vector<std::unique_ptr<Transport>> transports_;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "gradsparse C++ core: selection methods, the exchange engine, and the TORCH_LIBRARY ops";

  py::register_exception<CorruptMessageError>(m, "CorruptMessageError", PyExc_IndexError);
  py::register_exception<NonFiniteError>(m, "NonFiniteError", PyExc_FloatingPointError);
  py::register_exception<CommError>(m, "CommError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ValueError& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  m.def("built_with_cuda", &built_with_cuda, "True when the CUDA kernels were compiled into this build.");
  m.def("set_num_threads", &set_cpu_threads, py::arg("threads"),
        "Threads used by the CPU kernels (0 restores the default: GRADSPARSE_NUM_THREADS or OpenMP's).");
  m.def("get_num_threads", &cpu_threads, "Threads used by the CPU kernels.");
  m.def("simd_paths", &cpu_simd_paths,
        "The widest SIMD paths the CPU kernels take here: avx512, avx2 or portable (GRADSPARSE_SIMD narrows them).");
  m.def("target_count", &target_count, py::arg("density"), py::arg("n"),
        "floor(density * n), at least 1 when n > 0, at most n.");

  py::class_<Method, std::shared_ptr<Method>>(m, "Method", "A per-bucket selection method (C++ core).")
      .def_property_readonly("name", &Method::name)
      .def_property_readonly(
          "exchange", [](const Method& method) { return std::string(method.exchange().name()); },
          "The exchange its selections go through, by its glossary name (docs/architecture.md).")
      .def_property_readonly("threshold", [](const Method& method) { return method.report().threshold; })
      .def("set_exchange", &Method::set_exchange, py::arg("exchange"),
           "The exchange of the steps to come, by option value, where the exchange option offers \"auto\" "
           "(which times \"gather\" and \"reduce_scatter\" on the first steps); ValueError for the others.")
      .def("state", &Method::state, "Checkpointable state as {name: float}.")
      .def("load_state", &Method::load_state, py::arg("state"))
      .def("rescale", &Method::rescale, py::arg("factor"),
           "Loss scaling: the gradients to come are `factor` times the earlier ones; the thresholds and "
           "estimates the method carries, and its fixed magnitudes, follow.");
  // No defaults here: python/gradsparse/methods.py declares every option and its default once,
  // and builds these objects with every option given (State, or gradsparse.methods.core_method).
  py::class_<PerRankMethod, Method, std::shared_ptr<PerRankMethod>>(m, "PerRankMethod");
  py::class_<TopK, PerRankMethod, std::shared_ptr<TopK>>(m, "TopK").def(py::init<double, const std::string&>(),
                                                                        py::arg("density"), py::arg("exchange"));
  py::class_<Threshold, PerRankMethod, std::shared_ptr<Threshold>>(m, "Threshold")
      .def(py::init<std::optional<double>, std::optional<double>, const std::string&>(), py::arg("threshold"),
           py::arg("density"), py::arg("exchange"));
  py::class_<RandomK, Method, std::shared_ptr<RandomK>>(m, "RandomK")
      .def(py::init<double, uint64_t>(), py::arg("density"), py::arg("seed"));
  py::class_<RandomBlock, Method, std::shared_ptr<RandomBlock>>(m, "RandomBlock")
      .def(py::init<double, uint64_t>(), py::arg("density"), py::arg("seed"));
  py::class_<GaussianK, PerRankMethod, std::shared_ptr<GaussianK>>(m, "GaussianK")
      .def(py::init<double, const std::string&, const std::string&, bool>(), py::arg("density"), py::arg("variant"),
           py::arg("exchange"), py::arg("reference"));
  py::class_<DGC, PerRankMethod, std::shared_ptr<DGC>>(m, "DGC").def(
      py::init<double, uint64_t, const std::string&, bool>(), py::arg("density"), py::arg("seed"), py::arg("exchange"),
      py::arg("reference"));
  py::class_<RedSync, PerRankMethod, std::shared_ptr<RedSync>>(m, "RedSync")
      .def(py::init<double, const std::string&, bool>(), py::arg("density"), py::arg("exchange"), py::arg("reference"));
  py::class_<SAGE, Method, std::shared_ptr<SAGE>>(m, "SAGE").def(
      py::init<double, const std::string&, std::vector<int64_t>, bool, uint64_t, std::optional<double>,
               std::optional<std::string>>(),
      py::arg("density"), py::arg("sampling"), py::arg("segments"), py::arg("reference"), py::arg("seed"),
      py::arg("initial_threshold"), py::arg("exchange"));
  py::class_<MiCRO, Method, std::shared_ptr<MiCRO>>(m, "MiCRO")
      .def(py::init<double, const std::string&, bool, uint64_t>(), py::arg("density"), py::arg("exchange"),
           py::arg("reference"), py::arg("seed"));
  py::class_<ExDyna, Method, std::shared_ptr<ExDyna>>(m, "ExDyna")
      .def(py::init<double, const std::string&, bool, uint64_t>(), py::arg("density"), py::arg("exchange"),
           py::arg("reference"), py::arg("seed"));
  py::class_<SIDCo, PerRankMethod, std::shared_ptr<SIDCo>>(m, "SIDCo")
      .def(py::init<double, const std::string&, int, double, std::optional<double>, const std::string&, bool>(),
           py::arg("density"), py::arg("fit"), py::arg("stages"), py::arg("first_ratio"), py::arg("iratio"),
           py::arg("exchange"), py::arg("reference"))
      .def_property_readonly("stages", &SIDCo::stages);
  py::class_<SparDL, Method, std::shared_ptr<SparDL>>(m, "SparDL")
      .def(py::init<double, int>(), py::arg("density"), py::arg("teams"));
  m.def(
      "exchanges",
      [] {
        std::vector<std::string> names;
        for (ExchangeKind kind : kExchangeKinds) names.push_back(exchange_name(kind));
        return names;
      },
      "The glossary names of the exchanges (docs/architecture.md, \"Exchanges and transports\").");
  m.attr("WIRE_VERSION") = kWireVersion;  // what the ranks exchange: every rank of a group must have the same
  m.def("mpi_available", &mpi_available, "True when this build has MPI support (transport=\"mpi\").");
  m.def("mpi_abort", &mpi_abort, py::arg("code"),
        "Ends every process of the MPI job (MPI_Abort) when MPI is initialised and not finalised.",
        py::call_guard<py::gil_scoped_release>());

  py::class_<ReduceReport, std::shared_ptr<ReduceReport>>(m, "ReduceReport",
                                                          "What one bucket's reduction did on this rank.")
      .def(py::init<>())
      .def_readonly("dense", &ReduceReport::dense)
      .def_readonly("skipped", &ReduceReport::skipped)
      .def_readonly("numel", &ReduceReport::numel)
      .def_readonly("selected", &ReduceReport::selected)
      .def_readonly("selected_all", &ReduceReport::selected_all)
      .def_readonly("counts", &ReduceReport::counts)
      .def_readonly("union_size", &ReduceReport::union_size)
      .def_readonly("nonfinite", &ReduceReport::nonfinite)
      .def_readonly("threshold", &ReduceReport::threshold)
      .def_readonly("imbalance", &ReduceReport::imbalance)
      .def_readonly("exchange", &ReduceReport::exchange)
      .def_property_readonly("bytes_sent", [](const ReduceReport& r) { return r.traffic.bytes_sent; })
      .def_property_readonly("bytes_received", [](const ReduceReport& r) { return r.traffic.bytes_received; })
      .def_property_readonly("collectives", [](const ReduceReport& r) { return r.traffic.collectives; })
      .def_readonly("select_seconds", &ReduceReport::select_seconds)
      .def_readonly("exchange_seconds", &ReduceReport::exchange_seconds)
      .def(
          "taken_message",
          [](const ReduceReport& r, const c10::Device& device) -> std::optional<at::Tensor> {
            if (r.taken == nullptr) return std::nullopt;
            std::shared_ptr<const Selection> taken = r.taken;  // the tensor keeps the message alive
            return at::from_blob(
                taken->message.data(), {static_cast<int64_t>(taken->bytes)}, [taken](void*) {},
                at::TensorOptions().dtype(at::kByte).device(device));
          },
          py::arg("device"),
          "With keep_taken: what the step took from the residual (its values at every position the step "
          "rewrote), as a message (gradsparse.unpack) in the memory of `device`, the bucket's; None otherwise.");

  py::class_<PyThreadGroup>(m, "ThreadGroup", "N ranks as threads of this process (for tests).")
      .def(py::init<int, double>(), py::arg("size"), py::arg("timeout_seconds") = 60.0)
      .def("reduce", &PyThreadGroup::reduce, py::arg("rank"), py::arg("grad"), py::arg("residual"), py::arg("method"),
           py::arg("dense") = false, py::arg("nonfinite") = "raise", py::arg("record") = true,
           py::arg("shard_only") = false, py::arg("velocity") = py::none(), py::arg("momentum") = 0.0,
           py::arg("momentum_masking") = false,
           "Reduce one bucket as `rank` (call it from one Python thread per rank); returns the report and, with "
           "`record`, this rank's selected indices (their host copy is timed as part of the selection). With "
           "`shard_only`, only this rank's 1/P of the bucket is the result (FSDP's reduce-scatter). With a "
           "`velocity`, momentum correction runs first (timed as part of the selection).")
      .def("abort", &PyThreadGroup::abort, py::arg("reason"));

  py::class_<Engine, std::unique_ptr<Engine, EngineDeleter>>(m, "Engine",
                                                             "Background exchange thread over one process group.")
      .def(py::init([](const c10::intrusive_ptr<c10d::ProcessGroup>& group, double timeout_seconds) {
             return std::unique_ptr<Engine, EngineDeleter>(
                 new Engine(group, std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000.0))));
           }),
           py::arg("process_group"), py::arg("timeout_seconds"))
      .def_static(
          "mpi",
          [](int other_mpi_threads) {
            std::unique_ptr<Transport> transport = MpiTransport::world(other_mpi_threads);
            return std::unique_ptr<Engine, EngineDeleter>(new Engine(std::move(transport)));
          },
          py::arg("other_mpi_threads") = 0,
          "An engine over MPI_COMM_WORLD (programs launched with mpirun). `other_mpi_threads`: the threads of "
          "this process besides gradsparse's engines that call MPI (torch.distributed's MPI process group runs "
          "one); above zero, MPI below MPI_THREAD_MULTIPLE is refused.")
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def(
          "submit",
          [](Engine& engine, const at::Tensor& grad, std::optional<at::Tensor> residual, std::shared_ptr<Method> method,
             bool dense, const std::string& nonfinite, const std::string& bucket_name,
             std::shared_ptr<ReduceReport> report, bool shard_only, std::optional<at::Tensor> velocity, double momentum,
             bool momentum_masking, bool keep_taken) {
            ReduceOptions options;
            options.dense = dense;
            options.shard_only = shard_only;
            options.nonfinite = parse_policy(nonfinite);
            options.bucket_name = bucket_name;
            options.momentum = static_cast<float>(momentum);
            options.momentum_masking = momentum_masking;
            options.keep_taken = keep_taken;
            auto future = engine.submit(grad, std::move(residual), std::move(velocity), std::move(method), options,
                                        std::move(report));
            return torch::jit::toPyObject(c10::IValue(future));
          },
          py::arg("grad"), py::arg("residual"), py::arg("method"), py::arg("dense"), py::arg("nonfinite"),
          py::arg("bucket_name"), py::arg("report"), py::arg("shard_only") = false, py::arg("velocity") = py::none(),
          py::arg("momentum") = 0.0, py::arg("momentum_masking") = false, py::arg("keep_taken") = false,
          "Queue one bucket; returns a torch.futures.Future holding `grad`, reduced in place (with `shard_only`, "
          "only this rank's 1/P of it, in rank order). With a `velocity`, momentum correction with factor "
          "`momentum` runs first (`momentum_masking`: where the residual is zero the velocity restarts). With "
          "`keep_taken`, the report keeps what a sparse step took from the residual (ReduceReport.taken_message).")
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>(),
           "Finish queued work and stop the thread.");
}
