// CPU statistics kernels: the moments, counts and sums that threshold estimators need, each one
// pass over memory (the first one fused with the error-feedback update). Sums are float64 and
// block-ordered, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "gradsparse/kernels.h"
#include "gradsparse/parallel.h"

namespace gradsparse {
namespace cpu {
namespace {

/// Runs f(begin, end, block) over the blocks of [0, n) and returns the per-block results.
template <typename R, typename F>
std::vector<R> per_block(int64_t n, F&& f) {
  const int64_t nblocks = num_blocks(n);
  std::vector<R> out(static_cast<size_t>(nblocks));
  parallel_blocks(nblocks, [&](int64_t b) { out[b] = f(b * kCpuBlock, std::min(n, (b + 1) * kCpuBlock)); });
  return out;
}

void check_read_only(bool update, const char* what) {
  GS_CHECK(!update, ValueError, what, " reads values only; apply the error-feedback update first");
}

}  // namespace

template <typename T>
Moments moments(Source<T> src, int64_t n) {
  const auto blocks = per_block<Moments>(n, [&](int64_t begin, int64_t end) {
    Moments m;
    if (src.update && src.residual != nullptr) {
      for (int64_t i = begin; i < end; ++i) {
        bool finite;
        ef_accumulate(src.residual[i], src.grad[i], finite);
        m.nonfinite += !finite;
      }
    } else if (src.residual == nullptr) {
      for (int64_t i = begin; i < end; ++i) m.nonfinite += !is_finite(src.grad[i]);
    }
    double sum_abs = 0.0, sum = 0.0, sum_sq = 0.0, max_abs = 0.0;
#pragma omp simd reduction(+ : sum_abs, sum, sum_sq) reduction(max : max_abs)
    for (int64_t i = begin; i < end; ++i) {
      const double v = Num<T>::to_float(src.value(i));
      const double a = std::fabs(v);
      sum_abs += a;
      sum += v;
      sum_sq += v * v;
      max_abs = std::max(max_abs, a);
    }
    m.sum_abs = sum_abs;
    m.sum = sum;
    m.sum_sq = sum_sq;
    m.max_abs = max_abs;
    return m;
  });
  Moments total;
  for (const Moments& m : blocks) {
    total.sum_abs += m.sum_abs;
    total.sum += m.sum;
    total.sum_sq += m.sum_sq;
    total.max_abs = std::max(total.max_abs, m.max_abs);
    total.nonfinite += m.nonfinite;
  }
  return total;
}

template <typename T>
void count_keys(Source<T> src, int64_t n, Range range, const uint32_t* keys, int m, int64_t* counts) {
  check_read_only(src.update, "count_keys");
  GS_CHECK(m >= 0 && std::is_sorted(keys, keys + m), ValueError, "count_keys: keys must be ascending");
  GS_CHECK(0 <= range.begin && range.begin <= range.end && range.end <= n, ValueError, "count_keys: range [",
           range.begin, ", ", range.end, ") is not inside the bucket [0, ", n, ")");
  std::fill(counts, counts + m, 0);
  if (m == 0) return;
  const auto blocks = per_block<std::vector<int64_t>>(n, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> bins(static_cast<size_t>(m), 0);  // bins[j]: keys in [keys[j], keys[j+1])
    const int64_t lo = std::max(begin, range.begin), hi = std::min(end, range.end);
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t key = Num<T>::key(src.value(i));
      if (key < keys[0]) continue;  // most elements: one comparison
      const int j = static_cast<int>(std::upper_bound(keys, keys + m, key) - keys) - 1;
      ++bins[static_cast<size_t>(j)];
    }
    return bins;
  });
  for (const auto& bins : blocks)
    for (int j = 0; j < m; ++j) counts[j] += bins[static_cast<size_t>(j)];
  for (int j = m - 2; j >= 0; --j) counts[j] += counts[j + 1];  // at least keys[j]
}

template <typename T>
Exceedance exceedance(Source<T> src, int64_t n, uint32_t key, double scale) {
  check_read_only(src.update, "exceedance");
  const auto blocks = per_block<Exceedance>(n, [&](int64_t begin, int64_t end) {
    Exceedance e;
    e.min = std::numeric_limits<double>::infinity();
    for (int64_t i = begin; i < end; ++i) {
      const T v = src.value(i);
      if (Num<T>::key(v) < key) continue;
      const double y = std::fabs(static_cast<double>(Num<T>::to_float(v))) * scale;
      ++e.count;
      e.sum += y;
      e.sum_sq += y * y;
      e.min = std::min(e.min, y);
    }
    return e;
  });
  Exceedance total;
  total.min = std::numeric_limits<double>::infinity();
  for (const Exceedance& e : blocks) {
    total.count += e.count;
    total.sum += e.sum;
    total.sum_sq += e.sum_sq;
    total.min = std::min(total.min, e.min);
  }
  if (total.count == 0) total.min = 0.0;
  return total;
}

template <typename T>
double log_sum(Source<T> src, int64_t n, double scale, double eps) {
  check_read_only(src.update, "log_sum");
  const auto blocks = per_block<double>(n, [&](int64_t begin, int64_t end) {
    double s = 0.0;
    for (int64_t i = begin; i < end; ++i)
      s += std::log(std::fabs(static_cast<double>(Num<T>::to_float(src.value(i)))) * scale + eps);
    return s;
  });
  double total = 0.0;
  for (double s : blocks) total += s;
  return total;
}

template <typename T>
double sample_abs_sum(Source<T> src, const int64_t* positions, int64_t count) {
  check_read_only(src.update, "sample_abs_sum");
  double s = 0.0;
  for (int64_t i = 0; i < count; ++i) s += std::fabs(static_cast<double>(Num<T>::to_float(src.value(positions[i]))));
  return s;
}

template <typename T>
int64_t count_nonfinite(const T* data, int64_t n) {
  const auto blocks = per_block<int64_t>(n, [&](int64_t begin, int64_t end) {
    int64_t c = 0;
    for (int64_t i = begin; i < end; ++i) c += !is_finite(data[i]);
    return c;
  });
  int64_t total = 0;
  for (int64_t c : blocks) total += c;
  return total;
}

#define GS_INSTANTIATE_STATISTICS(T)                                                      \
  template Moments moments<T>(Source<T>, int64_t);                                        \
  template void count_keys<T>(Source<T>, int64_t, Range, const uint32_t*, int, int64_t*); \
  template Exceedance exceedance<T>(Source<T>, int64_t, uint32_t, double);                \
  template double log_sum<T>(Source<T>, int64_t, double, double);                         \
  template double sample_abs_sum<T>(Source<T>, const int64_t*, int64_t);                  \
  template int64_t count_nonfinite<T>(const T*, int64_t);

GS_INSTANTIATE_STATISTICS(float)
GS_INSTANTIATE_STATISTICS(Half)
GS_INSTANTIATE_STATISTICS(BFloat16)

}  // namespace cpu
}  // namespace gradsparse
