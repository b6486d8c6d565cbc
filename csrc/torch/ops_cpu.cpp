// CPU kernels of the gradsparse ops: argument checks, one dtype dispatch, then the core kernels.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "adapter.h"
#include "gradsparse/kernels.h"
#include "ops_common.h"

namespace gradsparse::torch_adapter {
namespace {

std::tuple<at::Tensor, at::Tensor> select_threshold_cpu(const at::Tensor& grad,
                                                        const std::optional<at::Tensor>& residual, double threshold) {
  return named_errors("select_threshold", [&] {
    check_selection_args(grad, residual);
    check_threshold(threshold);
    PairTensors out(grad);
    dispatch_dtype(core_dtype(grad, "grad"), [&](auto t) {
      using T = decltype(t);
      cpu::select_threshold<T, int64_t>(residual ? static_cast<T*>(residual->data_ptr()) : nullptr,
                                        static_cast<const T*>(grad.data_ptr()), grad.numel(), threshold, out.sink());
    });
    mark_written(residual);
    return out.result();
  });
}

std::tuple<at::Tensor, at::Tensor> select_topk_cpu(const at::Tensor& grad, const std::optional<at::Tensor>& residual,
                                                   int64_t k) {
  return named_errors("select_topk", [&] {
    check_selection_args(grad, residual);
    check_k(k);
    PairTensors out(grad);
    dispatch_dtype(core_dtype(grad, "grad"), [&](auto t) {
      using T = decltype(t);
      cpu::select_topk<T, int64_t>(residual ? static_cast<T*>(residual->data_ptr()) : nullptr,
                                   static_cast<const T*>(grad.data_ptr()), grad.numel(), k, out.sink());
    });
    mark_written(residual);
    return out.result();
  });
}

void scatter_add_cpu(at::Tensor& out, const at::Tensor& indices, const at::Tensor& values, double divisor) {
  named_errors("scatter_add_", [&] {
    check_scatter_args(out, indices, values, divisor);
    dispatch_dtype(core_dtype(out, "out"), [&](auto t) {
      using T = decltype(t);
      auto run = [&](auto* idx) {
        cpu::scatter_add(static_cast<T*>(out.data_ptr()), out.numel(), idx, static_cast<const T*>(values.data_ptr()),
                         values.numel(), static_cast<float>(divisor));
      };
      if (indices.scalar_type() == at::kLong) {
        run(indices.data_ptr<int64_t>());
      } else {
        run(indices.data_ptr<int32_t>());
      }
    });
    mark_written(out);
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(gradsparse, CPU, m) {
  m.impl("select_threshold", &select_threshold_cpu);
  m.impl("select_topk", &select_topk_cpu);
  m.impl("scatter_add_", &scatter_add_cpu);
}

}  // namespace gradsparse::torch_adapter
