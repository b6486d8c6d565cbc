// Argument checks and output allocation shared by the CPU and CUDA kernels of the ops.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <cmath>
#include <limits>
#include <optional>
#include <tuple>
#include <utility>

#include "adapter.h"
#include "gradsparse/kernels.h"

namespace gradsparse::torch_adapter {

inline void check_selection_args(const at::Tensor& grad, const std::optional<at::Tensor>& residual) {
  core_dtype(grad, "grad");
  check_flat(grad, "grad");
  if (residual) {
    check_same(grad, "grad", *residual, "residual");
    check_flat(*residual, "residual");
    // residual += grad is elementwise: a residual that is the same memory as grad is well defined
    // (the same tensor, or a view of another shape: both are contiguous, of one size, and the
    // kernels read them flat), but one shifted against it in one storage reads grad values the
    // kernel already wrote into the residual (running sums, in whatever order the kernel writes),
    // as torch's own in-place ops refuse.
    const bool same_memory = residual->data_ptr() == grad.data_ptr();
    TORCH_CHECK_VALUE(same_memory || at::get_overlap_status(*residual, grad) != at::MemOverlapStatus::Partial,
                      "gradsparse: residual partly overlaps grad in memory, so residual += grad would read values the "
                      "kernel already wrote; pass grad.clone() (or a residual of its own)");
  }
}

inline void check_threshold(double threshold) {
  TORCH_CHECK_VALUE(std::isfinite(threshold) && threshold >= 0.0,
                    "gradsparse.select_threshold: threshold must be a finite number >= 0, got ", threshold,
                    "; pass the magnitude to select at, e.g. 1e-3");
}

inline void check_k(int64_t k) {
  TORCH_CHECK_VALUE(k >= 0, "gradsparse.select_topk: k must be >= 0, got ", k,
                    "; pass the number of elements to select, e.g. max(1, int(0.01 * grad.numel()))");
}

inline void check_scatter_args(const at::Tensor& out, const at::Tensor& indices, const at::Tensor& values,
                               double divisor) {
  core_dtype(out, "out");
  check_flat(out, "out");
  TORCH_CHECK_TYPE(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt,
                   "gradsparse.scatter_add_: indices must be int64 or int32, got ", indices.scalar_type());
  TORCH_CHECK_VALUE(indices.dim() == 1 && values.dim() == 1 && indices.numel() == values.numel(),
                    "gradsparse.scatter_add_: indices and values must be 1-D with the same length, got shapes ",
                    indices.sizes(), " and ", values.sizes());
  TORCH_CHECK_TYPE(values.scalar_type() == out.scalar_type(), "gradsparse.scatter_add_: values are ",
                   values.scalar_type(), " but out is ", out.scalar_type(),
                   "; they must have the same dtype: pass values.to(out.dtype)");
  TORCH_CHECK_VALUE(indices.device() == out.device() && values.device() == out.device(),
                    "gradsparse.scatter_add_: out, indices and values must be on the same device, got ", out.device(),
                    ", ", indices.device(), ", ", values.device());
  for (const auto& [t, name] : {std::pair{&indices, "indices"}, std::pair{&values, "values"}}) {
    TORCH_CHECK_VALUE(t->is_contiguous(), "gradsparse.scatter_add_: ", name, " must be contiguous, got strides ",
                      t->strides(), "; call .contiguous() first");
    // One that shares memory with out would read what the kernel already wrote (the result then
    // depends on the order of the writes), as torch's index_add_ refuses.
    const at::MemOverlapStatus overlap = at::get_overlap_status(out, *t);
    TORCH_CHECK_VALUE(overlap != at::MemOverlapStatus::Full && overlap != at::MemOverlapStatus::Partial,
                      "gradsparse.scatter_add_: ", name,
                      " shares memory with out, so the sums would read values "
                      "the kernel already wrote; pass ",
                      name, ".clone()");
  }
  // The kernels divide in float32: a divisor that is 0, NaN or infinite there is refused (a NaN
  // fails the comparison).
  TORCH_CHECK_VALUE(
      std::abs(divisor) <= std::numeric_limits<float>::max() && static_cast<float>(divisor) != 0.0f,
      "gradsparse.scatter_add_: divisor must be finite and non-zero in float32, got ", divisor,
      "; the kernels divide in float32, so scale the values first and pass a divisor whose magnitude lies in [",
      std::numeric_limits<float>::denorm_min(), ", ", std::numeric_limits<float>::max(), "]");
}

/// Bumps the version counter of a tensor the kernel has written (out, a residual), as torch's
/// in-place ops do, so that autograd refuses a backward through a value saved before the write
/// (rather than computing the gradient from the new values), and an inference tensor is refused
/// outside inference mode. PyTorch's autograd fallback bumps only the written tensors an op
/// returns, and these ops return none.
inline void mark_written(const std::optional<at::Tensor>& t) {
  if (t) t->unsafeGetTensorImpl()->bump_version();
}

/// Output tensors of a selection, allocated by the kernel's sink once the count is known.
struct PairTensors {
  explicit PairTensors(const at::Tensor& like) : like_(like) {}
  PairSink sink() {
    return [this](int64_t count) {
      indices_ = at::empty({count}, like_.options().dtype(at::kLong));
      values_ = at::empty({count}, like_.options());
      return PairSpan{indices_.data_ptr(), values_.data_ptr()};
    };
  }
  std::tuple<at::Tensor, at::Tensor> result() const { return {indices_, values_}; }

 private:
  at::Tensor like_, indices_, values_;
};

}  // namespace gradsparse::torch_adapter
