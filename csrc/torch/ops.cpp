// The gradsparse operator library: schemas of every TORCH_LIBRARY op. CPU kernels are registered
// in ops_cpu.cpp, CUDA kernels in ops_cuda.cu; Python wrappers and fake kernels in ops.py.
#include <torch/library.h>

TORCH_LIBRARY(gradsparse, m) {
  // Fused error feedback + threshold selection. With a residual: residual += grad, select
  // |residual| >= threshold, zero what was selected. Without: select from grad. Returns (indices
  // int64 ascending, values).
  m.def("select_threshold(Tensor grad, Tensor(a!)? residual, float threshold) -> (Tensor, Tensor)");
  // Fused error feedback + exact top-k by magnitude (ties: lowest index first).
  m.def("select_topk(Tensor grad, Tensor(a!)? residual, int k) -> (Tensor, Tensor)");
  // out[indices] += values / divisor, accumulating duplicates; every index validated first.
  m.def("scatter_add_(Tensor(a!) out, Tensor indices, Tensor values, float divisor=1.0) -> ()");
  // Packs pairs (strictly ascending indices) into the sparse message format (uint8 tensor).
  m.def("pack(Tensor indices, Tensor values, int dense_size) -> Tensor");
  // Validates a message and returns its (indices int64, values).
  m.def("unpack(Tensor message, ScalarType dtype, int dense_size) -> (Tensor, Tensor)");
}
