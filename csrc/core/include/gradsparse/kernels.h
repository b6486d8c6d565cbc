// The element kernels of the core, on raw pointers. CPU versions are declared here (namespace cpu);
// the CUDA versions with the same semantics are in kernels/cuda and are reached through CudaDevice.
//
// Semantics shared by every selection kernel:
// - With a residual (error feedback), each element first becomes a = residual + grad (rounded to the
//   dtype); the residual takes `a`, the selection looks at `a`, and every selected residual element
//   is zeroed. Without a residual (nullptr), the selection looks at `grad` and writes nothing.
// - An element whose `a` is not finite keeps its old residual, and the selection sees that old
//   value (without a residual: zero). It is counted in SelectStats::nonfinite, and callers abort
//   the step (ALGORITHMS.md, project decision 5). The selected values are therefore always finite.
// - Pairs come out in ascending index order, whatever the number of threads.
#pragma once

#include <cstdint>
#include <functional>

#include "gradsparse/common.h"
#include "gradsparse/numeric.h"

namespace gradsparse {

/// Destination of a selection's pairs: given the final count, returns where to write `count`
/// indices (of the kernel's index type) and `count` values (of the bucket's dtype).
struct PairSpan {
  void* indices = nullptr;
  void* values = nullptr;
};
using PairSink = std::function<PairSpan(int64_t count)>;

struct SelectStats {
  int64_t count = 0;      ///< pairs written
  int64_t nonfinite = 0;  ///< elements whose residual + grad was NaN or Inf
};

/// Calls f(T{}) with T the storage type of `dtype`.
template <typename F>
decltype(auto) dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat16:
      return f(Half{});
    case DType::kBFloat16:
      return f(BFloat16{});
  }
  throw ValueError(str("unsupported dtype code ", int(dtype)));
}

/// Calls f(I{}) with I the unsigned index type of a message with `index_bytes`-wide indices.
template <typename F>
decltype(auto) dispatch_index(int index_bytes, F&& f) {
  if (index_bytes == 4) return f(uint32_t{});
  GS_CHECK(index_bytes == 8, ValueError, "index width must be 4 or 8 bytes, got ", index_bytes);
  return f(uint64_t{});
}

/// True when an index of any integer type addresses [0, n).
template <typename I>
GS_HD inline bool index_in_range(I index, int64_t n) {
  if constexpr (static_cast<I>(-1) < I{0}) {
    if (index < 0) return false;
  }
  return static_cast<uint64_t>(index) < static_cast<uint64_t>(n);
}

namespace cpu {

/// Fused error feedback + threshold selection: selects every element with |a| >= threshold,
/// comparing in the bucket's dtype. One pass over memory.
template <typename T, typename I>
SelectStats select_threshold(T* residual, const T* grad, int64_t n, double threshold, const PairSink& sink);

/// Fused error feedback + exact top-k by magnitude: selects min(k, n) elements; among equal
/// magnitudes at the boundary the lowest indices win, so the result is deterministic.
template <typename T, typename I>
SelectStats select_topk(T* residual, const T* grad, int64_t n, int64_t k, const PairSink& sink);

/// out[indices[i]] += values[i] / divisor for every pair (computed in float32, rounded once),
/// accumulating duplicates in pair order. Every index is validated first: an index outside [0, n)
/// throws CorruptMessageError and nothing is written. With `strictly_ascending` (the invariant of
/// a message) the indices must also be strictly ascending, and the pairs are added in parallel.
template <typename T, typename I>
void scatter_add(T* out, int64_t n, const I* indices, const T* values, int64_t count, float divisor,
                 bool strictly_ascending = false);

/// data /= divisor, elementwise (DDP divides before summing to avoid overflow in 16-bit types).
template <typename T>
void divide(T* data, int64_t n, float divisor);

/// Number of elements that are NaN or Inf.
template <typename T>
int64_t count_nonfinite(const T* data, int64_t n);

}  // namespace cpu
}  // namespace gradsparse
