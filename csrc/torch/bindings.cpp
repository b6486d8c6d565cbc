// The Python module gradsparse._C: stateful objects (selection methods, the engine, reports)
// through pybind11. Importing it also registers the TORCH_LIBRARY ops (ops*.cpp).
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/extension.h>

#include <chrono>

#include "engine.h"
#include "gradsparse/method.h"
#include "gradsparse/parallel.h"
#include "gradsparse/reduce_bucket.h"

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
  m.def("target_count", &target_count, py::arg("density"), py::arg("n"),
        "floor(density * n), at least 1 when n > 0, at most n.");

  py::class_<Method, std::shared_ptr<Method>>(m, "Method", "A per-bucket selection method (C++ core).")
      .def_property_readonly("name", &Method::name)
      .def_property_readonly("threshold", &Method::threshold)
      .def("state", &Method::state, "Checkpointable state as {name: float}.")
      .def("load_state", &Method::load_state, py::arg("state"));
  py::class_<TopK, Method, std::shared_ptr<TopK>>(m, "TopK").def(py::init<double>(), py::arg("density"));
  py::class_<Threshold, Method, std::shared_ptr<Threshold>>(m, "Threshold")
      .def(py::init<double>(), py::arg("threshold"));

  py::class_<ReduceReport, std::shared_ptr<ReduceReport>>(m, "ReduceReport",
                                                          "What one bucket's reduction did on this rank.")
      .def(py::init<>())
      .def_readonly("dense", &ReduceReport::dense)
      .def_readonly("skipped", &ReduceReport::skipped)
      .def_readonly("numel", &ReduceReport::numel)
      .def_readonly("selected", &ReduceReport::selected)
      .def_readonly("selected_all", &ReduceReport::selected_all)
      .def_readonly("nonfinite", &ReduceReport::nonfinite)
      .def_readonly("threshold", &ReduceReport::threshold)
      .def_property_readonly("bytes_sent", [](const ReduceReport& r) { return r.traffic.bytes_sent; })
      .def_property_readonly("bytes_received", [](const ReduceReport& r) { return r.traffic.bytes_received; })
      .def_property_readonly("collectives", [](const ReduceReport& r) { return r.traffic.collectives; })
      .def_readonly("select_seconds", &ReduceReport::select_seconds)
      .def_readonly("exchange_seconds", &ReduceReport::exchange_seconds);

  py::class_<Engine, std::shared_ptr<Engine>>(m, "Engine", "Background exchange thread over one process group.")
      .def(py::init([](const c10::intrusive_ptr<c10d::ProcessGroup>& group, double timeout_seconds) {
             return std::make_shared<Engine>(group,
                                             std::chrono::milliseconds(static_cast<int64_t>(timeout_seconds * 1000.0)));
           }),
           py::arg("process_group"), py::arg("timeout_seconds"))
      .def_property_readonly("rank", &Engine::rank)
      .def_property_readonly("size", &Engine::size)
      .def(
          "submit",
          [](Engine& engine, const at::Tensor& grad, std::optional<at::Tensor> residual, std::shared_ptr<Method> method,
             bool dense, const std::string& nonfinite, const std::string& bucket_name,
             std::shared_ptr<ReduceReport> report) {
            ReduceOptions options;
            options.dense = dense;
            options.nonfinite = parse_policy(nonfinite);
            options.bucket_name = bucket_name;
            auto future = engine.submit(grad, std::move(residual), std::move(method), options, std::move(report));
            return torch::jit::toPyObject(c10::IValue(future));
          },
          py::arg("grad"), py::arg("residual"), py::arg("method"), py::arg("dense"), py::arg("nonfinite"),
          py::arg("bucket_name"), py::arg("report"),
          "Queue one bucket; returns a torch.futures.Future holding `grad`, reduced in place.")
      .def("shutdown", &Engine::shutdown, py::call_guard<py::gil_scoped_release>(),
           "Finish queued work and stop the thread.");
}
