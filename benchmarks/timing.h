// Timing helpers of the C++ benchmarks (select_step, union_step, band_counts).
#pragma once

#include <algorithm>
#include <chrono>
#include <vector>

namespace gradsparse::bench {

/// Seconds elapsed since `t0`.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// The median of a non-empty list of timings (the upper one of an even count).
inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace gradsparse::bench
