// CUDA kernels of the gradsparse ops: the same checks as ops_cpu.cpp, then the core's CUDA
// kernels on the current stream with PyTorch's caching allocator.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda_support.h"
#include "ops_common.h"

namespace gradsparse::torch_adapter {
namespace {

CudaDevice current_device(const at::Tensor& t) {
  return torch_cuda_device(c10::cuda::getCurrentCUDAStream(t.device().index()));
}

// check: the op's own argument check, after the common ones, in ops_cpu.cpp's order.
template <typename Check, typename Kernel>
std::tuple<at::Tensor, at::Tensor> select_cuda(const char* op, const at::Tensor& grad,
                                               const std::optional<at::Tensor>& residual, Check&& check,
                                               Kernel&& kernel) {
  return named_errors(op, [&] {
    check_selection_args(grad, residual);
    check();
    const c10::cuda::CUDAGuard guard(grad.device());
    CudaDevice device = current_device(grad);
    PairTensors out(grad);
    dispatch_dtype(core_dtype(grad, "grad"), [&](auto t) {
      using T = decltype(t);
      kernel(device, residual ? static_cast<T*>(residual->data_ptr()) : nullptr, static_cast<const T*>(grad.data_ptr()),
             out.sink());
    });
    mark_written(residual);
    return out.result();
  });
}

std::tuple<at::Tensor, at::Tensor> select_threshold_cuda(const at::Tensor& grad,
                                                         const std::optional<at::Tensor>& residual, double threshold) {
  return select_cuda(
      "select_threshold", grad, residual, [&] { check_threshold(threshold); },
      [&](CudaDevice& device, auto* r, const auto* g, const PairSink& sink) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
        cuda::select<T, int64_t>(device, Source<T>{r, g, true}, grad.numel(), key_at_least<T>(threshold),
                                 Range{0, grad.numel()}, true, sink);
      });
}

std::tuple<at::Tensor, at::Tensor> select_topk_cuda(const at::Tensor& grad, const std::optional<at::Tensor>& residual,
                                                    int64_t k) {
  return select_cuda(
      "select_topk", grad, residual, [&] { check_k(k); },
      [&](CudaDevice& device, auto* r, const auto* g, const PairSink& sink) {
        using T = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
        cuda::select_topk<T, int64_t>(device, Source<T>{r, g, true}, grad.numel(), k, /*zero=*/true, sink);
      });
}

void scatter_add_cuda(at::Tensor& out, const at::Tensor& indices, const at::Tensor& values, double divisor) {
  named_errors("scatter_add_", [&] {
    check_scatter_args(out, indices, values, divisor);
    const c10::cuda::CUDAGuard guard(out.device());
    CudaDevice device = current_device(out);
    dispatch_dtype(core_dtype(out, "out"), [&](auto t) {
      using T = decltype(t);
      auto run = [&](auto* idx) {
        cuda::scatter_add(device, static_cast<T*>(out.data_ptr()), out.numel(), idx,
                          static_cast<const T*>(values.data_ptr()), values.numel(), static_cast<float>(divisor),
                          /*strictly_ascending=*/false);
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

TORCH_LIBRARY_IMPL(gradsparse, CUDA, m) {
  m.impl("select_threshold", &select_threshold_cuda);
  m.impl("select_topk", &select_topk_cuda);
  m.impl("scatter_add_", &scatter_add_cuda);
}

}  // namespace gradsparse::torch_adapter
