// The element kernels of the core, on raw pointers. CPU versions are declared here (namespace cpu);
// the CUDA versions with the same semantics are in kernels/cuda and are reached through CudaDevice.
//
// Semantics shared by every selection kernel:
// - With a residual (error feedback), each element first becomes a = residual + grad (rounded to the
//   dtype); the residual takes `a`, the selection looks at `a`, and every selected residual element
//   is zeroed. Without a residual (nullptr), the selection looks at `grad` and writes nothing.
// - An element whose `a` is not finite keeps its old residual, and the selection sees that old
//   value (without a residual: zero). It is counted in SelectStats::nonfinite, and callers abort
//   the step (docs/method-spec.md, ruling 5). The selected values are therefore always finite.
// - Pairs come out in ascending index order, whatever the number of threads.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>

#include "gradsparse/common.h"
#include "gradsparse/numeric.h"
#include "gradsparse/parallel.h"

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
  uint32_t kth_key = 0;   ///< select_topk with k >= 1: the key of the k-th largest, the least taken
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
    default:
      break;
  }
  throw ValueError(str("dtype ", dtype_name(dtype), " is not a bucket dtype (float32, float16 or bfloat16)"));
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

/// Where a kernel reads the values a selection sees (the header comment above), and whether it
/// first applies the error-feedback update, with momentum correction fused in when there is a
/// velocity.
template <typename T>
struct Source {
  T* residual = nullptr;    ///< error-feedback residual (updated and zeroed in place), or nullptr
  const T* grad = nullptr;  ///< the gradient (unused when `residual` is set and `update` is false)
  bool update = false;      ///< fuse residual += grad into this pass (the first pass of a step)
  /// Momentum correction, applied by the update (needs a residual): the velocity (updated in
  /// place), its factor, and momentum factor masking (numeric.h momentum_value).
  T* velocity = nullptr;
  float momentum = 0.0f;
  bool masking = false;

  /// The selection value of element i once the update is done.
  GS_HD T value(int64_t i) const { return selection_value<T>(residual, grad, i); }

  /// What the update adds to the residual at element i: the gradient, or with a velocity the new
  /// velocity (stored; read before the residual changes, for the masking).
  GS_HD T addend(int64_t i) const {
    if (velocity == nullptr) return grad[i];
    return momentum_value(grad[i], velocity[i], momentum_emptied(masking, residual[i]), momentum);
  }

  /// The update of element i (with a residual): residual += addend(i); false `finite` when the
  /// sum is not finite (the residual then keeps its value).
  GS_HD void update_element(int64_t i, bool& finite) const { ef_accumulate(residual[i], addend(i), finite); }

  /// The selection value element i will have once the update is done (with `update`), computed
  /// without writing the residual or the velocity.
  GS_HD T peek(int64_t i) const {
    if (!update || residual == nullptr) return value(i);
    return updated_value(residual[i], grad[i], velocity != nullptr ? velocity + i : nullptr, momentum, masking);
  }
};

/// Refuses a `src` that cannot be read for n > 0 elements: no gradient where the selection reads
/// it (no residual, or the update fused in), or a velocity without a residual.
template <typename T>
void check_source(const Source<T>& src, int64_t n, const char* op) {
  if (n == 0) return;
  GS_CHECK(src.grad != nullptr || (src.residual != nullptr && !src.update), ValueError, op,
           ": grad is null for n = ", n, " elements; pass the gradient's data (or a residual, without update)");
  GS_CHECK(src.velocity == nullptr || src.residual != nullptr, ValueError, op,
           ": a velocity (momentum) needs a residual, which is null");
}

/// Refuses a threshold that is NaN or negative (+infinity selects nothing and counts the
/// non-finite elements).
inline void check_threshold(double threshold, const char* op) {
  GS_CHECK(threshold >= 0.0, ValueError, op, ": threshold must be a number >= 0, got ", threshold,
           "; pass the magnitude to select at, for example 1e-3");
}

/// Refuses a divisor the kernels cannot divide by in float32: zero, NaN or infinite.
inline void check_divisor(float divisor, const char* op) {
  GS_CHECK(std::isfinite(divisor) && divisor != 0.0f, ValueError, op,
           ": divisor must be finite and non-zero in float32, got ", divisor,
           "; pass the number of ranks (or the scale) to divide the sums by");
}

/// sink(count), refused when it gives no room for the pairs (the caller's sink is wrong).
inline PairSpan pairs_at(const PairSink& sink, int64_t count) {
  const PairSpan span = sink(count);
  GS_CHECK(count == 0 || (span.indices != nullptr && span.values != nullptr), ValueError,
           "the PairSink returned a null ", span.indices == nullptr ? "indices" : "values", " buffer for ", count,
           " pairs; it must return room for `count` indices and `count` values");
  return span;
}

/// A sub-range [begin, end) of a bucket.
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
};

/// The part of a bucket that a sampled statistic reads: the blocks of kCpuBlock elements whose
/// number is a multiple of `every` (blocks 0, every, 2 every, ...); every = 1 is the whole bucket.
/// Whole blocks keep the CPU kernels' order of addition; spread evenly over the bucket, they take
/// a share of every tensor at least `every` blocks long (a shorter one may be left out).
struct BlockSample {
  int64_t every = 1;

  /// At least `blocks` blocks of a bucket of n elements: every block when it has fewer than 2 * blocks.
  static BlockSample at_least(int64_t n, int64_t blocks) {
    return BlockSample{std::max<int64_t>(1, num_blocks(n) / blocks)};
  }
  bool holds(int64_t index) const { return (index / kCpuBlock) % every == 0; }
  /// The bucket position of the j-th element read (j < size(n)).
  GS_HD int64_t element(int64_t j) const { return j / kCpuBlock * every * kCpuBlock + j % kCpuBlock; }
  /// How many of a bucket's n elements it reads.
  int64_t size(int64_t n) const {
    if (n <= 0) return 0;
    const int64_t last = (num_blocks(n) - 1) / every * every;  // the last block read
    return last / every * kCpuBlock + std::min(n, (last + 1) * kCpuBlock) - last * kCpuBlock;
  }
};

/// Moments of the selection values: sums in float64 (a float32 bucket's over float32 runs of at most
/// 8 elements; docs/method-spec.md ruling 8).
struct Moments {
  double sum_abs = 0.0;
  double sum = 0.0;
  double sum_sq = 0.0;
  double max_abs = 0.0;
  int64_t nonfinite = 0;
};

/// Moments of y = |v| * scale over the elements whose key reaches a given key.
struct Exceedance {
  int64_t count = 0;
  double sum = 0.0;
  double sum_sq = 0.0;
  double min = 0.0;  ///< meaningful when count > 0

  /// The figures of a pass made in parts: `parts` in order (a part without elements counts nothing).
  template <typename Parts>
  static Exceedance combine(const Parts& parts) {
    Exceedance total;
    total.min = std::numeric_limits<double>::infinity();
    for (const auto& e : parts) {
      total.count += static_cast<int64_t>(e.count);
      total.sum += e.sum;
      total.sum_sq += e.sum_sq;
      total.min = std::min(total.min, static_cast<double>(e.min));
    }
    if (total.count == 0) total.min = 0.0;
    return total;
  }
};

/// The CPU's order of an exceedance's sums within a block of kCpuBlock elements: the t-th element
/// taken (in index order, from 0) adds to lane t % 4, and the lanes add in lane order. Every CPU
/// path that takes the same elements (the AVX2 pass adds four at a time, the portable pass and
/// OnePass's answers from candidates one at a time) gets the same bits.
struct ExceedanceLanes {
  double sum[4] = {};
  double sum_sq[4] = {};
  double min = std::numeric_limits<double>::infinity();
  int64_t count = 0;

  void take(double y) {
    const int64_t lane = count & 3;
    sum[lane] += y;
    sum_sq[lane] += y * y;
    min = std::min(min, y);
    ++count;
  }
  Exceedance total() const {
    Exceedance e;
    e.count = count;
    e.sum = ((sum[0] + sum[1]) + sum[2]) + sum[3];
    e.sum_sq = ((sum_sq[0] + sum_sq[1]) + sum_sq[2]) + sum_sq[3];
    e.min = min;
    return e;
  }
};

/// Checks that `range` lies inside a bucket of n elements (ValueError naming `what` otherwise).
inline void check_range(Range range, int64_t n, const char* what) {
  GS_CHECK(0 <= range.begin && range.begin <= range.end && range.end <= n, ValueError, what, ": range [", range.begin,
           ", ", range.end, ") is not inside the bucket [0, ", n, ")");
}

/// A key no finite value reaches: a selection with it selects nothing.
constexpr uint32_t kNoKey = 0xFFFFFFFFu;

/// The largest float32 plus half its last place: a double from here up rounds to +inf in float32
/// (below it, up to the largest float32, to a finite threshold).
constexpr double kFloat32RoundsToInf = 3.4028235677973366e38;

/// The key of `|v| >= tau` with tau rounded to T (ruling 8); kNoKey for tau = +inf or NaN.
template <typename T>
uint32_t key_at_least(double tau) {
  if (!(tau < kFloat32RoundsToInf)) return kNoKey;
  if (tau <= 0.0) return 0;
  return threshold_key<T>(tau);
}

/// The key of `|v| > tau` with tau rounded to T.
template <typename T>
uint32_t key_above(double tau) {
  if (!(tau < kFloat32RoundsToInf)) return kNoKey;
  if (tau < 0.0) return 0;
  const uint32_t k = threshold_key<T>(tau);
  return k >= Num<T>::kInfKey ? kNoKey : k + 1;
}

namespace cpu {

/// Selection by key: every element of `range` whose selection value has key >= `key` (one pass;
/// with `src.update` the error-feedback update of the whole bucket is fused into it). With `zero`,
/// the selected residual entries are zeroed.
template <typename T, typename I>
SelectStats select(Source<T> src, int64_t n, uint32_t key, Range range, bool zero, const PairSink& sink);

/// Fused error feedback + threshold selection over the whole bucket: |a| >= threshold, compared
/// in the bucket's dtype (select() with key_at_least and src.update).
template <typename T, typename I>
SelectStats select_threshold(T* residual, const T* grad, int64_t n, double threshold, const PairSink& sink);

/// Exact top-k by magnitude: selects min(k, n) elements; among equal magnitudes at the boundary
/// the lowest indices win, so the result is deterministic. `src.update` fuses error feedback. With
/// `zero`, the selected residual entries are zeroed.
template <typename T, typename I>
SelectStats select_topk(Source<T> src, int64_t n, int64_t k, bool zero, const PairSink& sink);

/// Fused error feedback + exact top-k (select_topk with src.update).
template <typename T, typename I>
SelectStats select_topk(T* residual, const T* grad, int64_t n, int64_t k, const PairSink& sink);

/// Moments of the selection values of the whole bucket (with `src.update`: fused with the update).
template <typename T>
Moments moments(Source<T> src, int64_t n);

/// One pass that serves a threshold estimator (with `src.update`: fused with the update): returns
/// the moments of the whole bucket (without `sums` only their `nonfinite`, the sums left zero),
/// sets `above` to the number of elements of `range` with key >= `key` and, when they are at most
/// `capacity` (< 0: any number), lists them ascending in `index` and `value` (exact as float);
/// more than `capacity` leaves both empty. When listed, those whose key also reaches `zero_key`
/// are zeroed in the residual (`src.residual` must be set unless zero_key is kNoKey), each while
/// its block is in cache; when not listed, nothing is zeroed.
template <typename T>
Moments scan(Source<T> src, int64_t n, Range range, uint32_t key, int64_t capacity, bool sums, int64_t& above,
             HostBuffer<int64_t>& index, HostBuffer<float>& value, uint32_t zero_key = kNoKey);

/// counts[j] = number of elements of `range` with key >= keys[j]; `keys` ascending, read-only.
template <typename T>
void count_keys(Source<T> src, int64_t n, Range range, const uint32_t* keys, int m, int64_t* counts);

/// Exceedance moments of y = |v| * scale over the elements of `sample` with key >= `key`, read-only.
template <typename T>
Exceedance exceedance(Source<T> src, int64_t n, uint32_t key, double scale, BlockSample sample);

/// Sum over the elements of `sample` of ln(|v| * scale + eps), in float64, read-only.
template <typename T>
double log_sum(Source<T> src, int64_t n, double scale, double eps, BlockSample sample);

/// The elements of `range` with key >= `key`, ascending, read-only (values exact as float).
template <typename T>
void collect(Source<T> src, int64_t n, Range range, uint32_t key, HostBuffer<int64_t>& index, HostBuffer<float>& value);

/// The keys (Num<T>::key) at or above `key` of the selection values of the elements of `sample`,
/// in index order. Read-only: with `src.update` the values the update will give are computed, not
/// written (Source::peek), for a look at them before the pass that updates.
template <typename T>
void sample_keys(Source<T> src, int64_t n, uint32_t key, BlockSample sample, std::vector<uint32_t>& keys);

/// Sum of |v| at the given positions (repeats allowed), read-only.
template <typename T>
double sample_abs_sum(Source<T> src, const int64_t* positions, int64_t count);

/// out[j] = v[indices[j]] (read-only gather of selection values).
template <typename T, typename I>
void gather(Source<T> src, const I* indices, int64_t count, T* out);

/// residual[indices[j]] = 0.
template <typename T, typename I>
void zero_at(T* residual, const I* indices, int64_t count);

/// out[indices[i]] += values[i] / divisor for every pair (computed in float32, rounded once to
/// O: the values' type T, or float32 for the exchanges' 16-bit sums, which round_to rounds once),
/// accumulating duplicates in pair order. Every index is validated first: an index outside [0, n)
/// throws CorruptMessageError and nothing is written. With `strictly_ascending` (the invariant of
/// a message) the indices must also be strictly ascending, and the pairs are added in parallel.
template <typename T, typename I, typename O = T>
void scatter_add(O* out, int64_t n, const I* indices, const T* values, int64_t count, float divisor,
                 bool strictly_ascending = false);

/// out[indices[i]] = values[i]; indices validated first (in range, strictly ascending): a bad
/// index throws CorruptMessageError and nothing is written.
template <typename T, typename I>
void assign(T* out, int64_t n, const I* indices, const T* values, int64_t count);

/// data /= divisor, elementwise (DDP divides before summing to avoid overflow in 16-bit types).
template <typename T>
void divide(T* data, int64_t n, float divisor);

/// out[i] = in[i] rounded to T (to nearest even).
template <typename T>
void round_to(const float* in, T* out, int64_t n);

/// momentum_step (numeric.h) for every element; `residual` may be null (no masking then).
template <typename T>
void momentum(T* grad, T* velocity, const T* residual, int64_t n, float factor, bool masking);

/// Number of elements that are NaN or Inf.
template <typename T>
int64_t count_nonfinite(const T* data, int64_t n);

}  // namespace cpu
}  // namespace gradsparse
