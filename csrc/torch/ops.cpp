// The gradsparse operator library: schemas of every TORCH_LIBRARY op. CPU kernels are registered
// in ops_cpu.cpp, CUDA kernels in ops_cuda.cu; Python wrappers and fake kernels in ops.py.
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

// k and dense_size are SymInts, so that torch.compile and torch.export trace them from a dynamic
// shape (an int is specialized to one value: one compilation per size); the kernels take int64_t.
TORCH_LIBRARY(gradsparse, m) {
  // Fused error feedback + threshold selection. With a residual: residual += grad, select
  // |residual| >= threshold, zero what was selected. Without: select from grad. Returns (indices
  // int64 ascending, values).
  m.def("select_threshold(Tensor grad, Tensor(a!)? residual, float threshold) -> (Tensor, Tensor)");
  // Fused error feedback + exact top-k by magnitude (ties: lowest index first).
  m.def("select_topk(Tensor grad, Tensor(a!)? residual, SymInt k) -> (Tensor, Tensor)");
  // out[indices] += values / divisor, accumulating duplicates; every index validated first.
  m.def("scatter_add_(Tensor(a!) out, Tensor indices, Tensor values, float divisor=1.0) -> ()");
  // Packs pairs (strictly ascending indices) into the sparse message format (uint8 tensor).
  m.def("pack(Tensor indices, Tensor values, SymInt dense_size) -> Tensor");
  // Validates a message and returns its (indices int64, values).
  m.def("unpack(Tensor message, ScalarType dtype, SymInt dense_size) -> (Tensor, Tensor)");
}

// The ops have no derivative: a backward through their results raises (rather than PyTorch's
// warning and a gradient that silently stops there), and so does an in-place write into a leaf
// tensor that requires grad.
TORCH_LIBRARY_IMPL(gradsparse, Autograd, m) {
  for (const char* op : {"select_threshold", "select_topk", "scatter_add_", "pack", "unpack"})
    m.impl(op, torch::autograd::autogradNotImplementedFallback());
}
