// Counter-based random numbers (docs/method-spec.md section 2): every draw is a hash of
// (seed, tag, step, lane, i), so any rank, device or test re-statement reproduces it exactly.
#pragma once

#include <algorithm>
#include <cstdint>
#include <unordered_set>
#include <vector>

#include "gradsparse/common.h"

namespace gradsparse {

/// splitmix64 step: add the golden-ratio increment, then the finaliser.
GS_HD inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Stream tags of the methods that draw random numbers.
enum class RngTag : uint64_t { kSage = 1, kRandomK = 2, kDgc = 3, kPartitionSample = 4, kRandomBlock = 5 };

/// Lane of a stream shared by every rank (a rank-private stream uses the rank as its lane).
constexpr uint64_t kSharedLane = 0xFFFFFFFFull;

GS_HD inline uint64_t rng_stream(uint64_t seed, RngTag tag, uint64_t step, uint64_t lane) {
  return mix64(mix64(mix64(seed ^ static_cast<uint64_t>(tag)) ^ step) ^ lane);
}

GS_HD inline uint64_t rng_draw(uint64_t stream, uint64_t i) { return mix64(stream + i); }

/// `count` positions in [0, n), drawn with replacement: draw(stream, i) % n.
inline std::vector<int64_t> sample_with_replacement(uint64_t stream, int64_t count, int64_t n) {
  std::vector<int64_t> out(static_cast<size_t>(count > 0 && n > 0 ? count : 0));
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int64_t>(rng_draw(stream, i) % static_cast<uint64_t>(n));
  return out;
}

/// `count` distinct positions in [0, n), ascending: the first distinct values of draw(stream, i) % n
/// for i = 0, 1, ...; all of [0, n) when count >= n; when count > n / 2, the n - count positions
/// to leave out are drawn that way instead (so the walk stays short).
inline std::vector<int64_t> sample_distinct(uint64_t stream, int64_t count, int64_t n) {
  std::vector<int64_t> out;
  if (n <= 0 || count <= 0) return out;
  if (count >= n) {
    out.resize(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = i;
    return out;
  }
  if (count > n / 2) {
    const std::vector<int64_t> left_out = sample_distinct(stream, n - count, n);
    out.reserve(static_cast<size_t>(count));
    size_t j = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (j < left_out.size() && left_out[j] == i) {
        ++j;
      } else {
        out.push_back(i);
      }
    }
    return out;
  }
  if (n / 64 <= 16 * count) {
    // Dense enough for a bitmap of [0, n): one bit test per draw, and the ascending order
    // comes from reading the bitmap (no hashing, no sort). Same positions as below.
    std::vector<uint64_t> taken(static_cast<size_t>((n + 63) / 64), 0);
    int64_t found = 0;
    for (uint64_t i = 0; found < count; ++i) {
      const uint64_t p = rng_draw(stream, i) % static_cast<uint64_t>(n);
      uint64_t& word = taken[p >> 6];
      const uint64_t bit = uint64_t{1} << (p & 63);
      found += (word & bit) == 0;
      word |= bit;
    }
    out.reserve(static_cast<size_t>(count));
    for (size_t w = 0; w < taken.size(); ++w) {
      for (uint64_t bits = taken[w]; bits != 0; bits &= bits - 1)
        out.push_back(static_cast<int64_t>(w * 64 + static_cast<size_t>(__builtin_ctzll(bits))));
    }
    return out;
  }
  std::unordered_set<int64_t> taken;
  taken.reserve(static_cast<size_t>(count) * 2);
  out.reserve(static_cast<size_t>(count));
  for (uint64_t i = 0; static_cast<int64_t>(out.size()) < count; ++i) {
    const int64_t p = static_cast<int64_t>(rng_draw(stream, i) % static_cast<uint64_t>(n));
    if (taken.insert(p).second) out.push_back(p);
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace gradsparse
