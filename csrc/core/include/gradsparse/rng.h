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

/// A hashed (Bernoulli) sample at rate 1 / 100: position p belongs to it when
/// draw(stream, p) < kPercentCut. Membership of any position is one hash, with no list to build
/// or search: a method that needs the sampled elements among a few candidates hashes only those.
inline constexpr uint64_t kPercentCut = ~uint64_t{0} / 100;
GS_HD inline bool in_percent_sample(uint64_t stream, uint64_t p) { return rng_draw(stream, p) < kPercentCut; }
/// in_percent_sample(stream, positions[j]) for j in [0, n), as bit j % 64 of bits[j / 64] ((n + 63) / 64
/// words written). Host code (kernels/cpu/percent_sample.cpp): eight hashes a step on the AVX-512
/// path, where DGC's default mode hashes its candidates (about 300 thousand a step at 25M elements and
/// density 0.01).
void in_percent_sample_bits(uint64_t stream, const int64_t* positions, int64_t n, uint64_t* bits);
/// The positions p in [begin, end) with in_percent_sample(stream, p), ascending: the whole hashed
/// sample of a range, in blocks on the CPU kernels' threads, each position hashed once (on the
/// AVX-512 path eight a step).
std::vector<int64_t> in_percent_sample_positions(uint64_t stream, int64_t begin, int64_t end);

/// `count` positions in [0, n), drawn with replacement: draw(stream, i) % n.
inline std::vector<int64_t> sample_with_replacement(uint64_t stream, int64_t count, int64_t n) {
  std::vector<int64_t> out(static_cast<size_t>(count > 0 && n > 0 ? count : 0));
  for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<int64_t>(rng_draw(stream, i) % static_cast<uint64_t>(n));
  return out;
}

/// A hint that `*address` is written soon (no effect where the compiler has no prefetch).
inline void prefetch_for_write(const void* address) {
#if defined(__GNUC__)
  __builtin_prefetch(address, 1, 0);
#else
  (void)address;
#endif
}

/// The positions of sample_distinct(stream, count, n) below, as a bitmap of [0, n) (bit p of
/// word p / 64), written into `bits` (resized and cleared here, so a caller that keeps it across
/// steps allocates once). A method that only asks whether a position was drawn tests a bit
/// instead of reading out and searching a list.
inline void sample_distinct_bits(uint64_t stream, int64_t count, int64_t n, std::vector<uint64_t>& bits) {
  bits.assign(static_cast<size_t>(n > 0 ? (n + 63) / 64 : 0), 0);
  if (n <= 0 || count <= 0) return;
  if (count >= n || count > n / 2) {
    // All of [0, n), less the n - count positions drawn to be left out (so the walk stays short).
    std::vector<uint64_t> left_out;
    if (count < n) sample_distinct_bits(stream, n - count, n, left_out);
    for (size_t w = 0; w < bits.size(); ++w) bits[w] = ~(count < n ? left_out[w] : 0);
    if (n % 64 != 0) bits.back() &= (uint64_t{1} << (n % 64)) - 1;
    return;
  }
  // The first distinct values of draw(stream, i) % n: one bit test per draw. A draw does not
  // depend on the bitmap, so each word is prefetched kAhead draws before its test: at large n the
  // bitmap outgrows the caches (3 MB at n = 25M) and the tests, one after the other, would each
  // wait on memory (250 thousand draws at n = 25M: 2.2 ms without the prefetch, 1.6 ms with it).
  constexpr uint64_t kAhead = 32;
  const auto draw = [&](uint64_t i) { return rng_draw(stream, i) % static_cast<uint64_t>(n); };
  uint64_t ahead[kAhead];
  for (uint64_t i = 0; i < kAhead; ++i) {
    ahead[i] = draw(i);
    prefetch_for_write(&bits[ahead[i] >> 6]);
  }
  int64_t found = 0;
  for (uint64_t i = 0; found < count; ++i) {
    const uint64_t p = ahead[i % kAhead];
    ahead[i % kAhead] = draw(i + kAhead);
    prefetch_for_write(&bits[ahead[i % kAhead] >> 6]);
    uint64_t& word = bits[p >> 6];
    const uint64_t bit = uint64_t{1} << (p & 63);
    found += (word & bit) == 0;
    word |= bit;
  }
}

/// The set positions of a bitmap of [0, n), ascending.
inline std::vector<int64_t> set_positions(const std::vector<uint64_t>& bits) {
  std::vector<int64_t> out;
  for (size_t w = 0; w < bits.size(); ++w) {
    for (uint64_t b = bits[w]; b != 0; b &= b - 1)
      out.push_back(static_cast<int64_t>(w * 64 + static_cast<size_t>(__builtin_ctzll(b))));
  }
  return out;
}

/// `count` distinct positions in [0, n), ascending: the first distinct values of draw(stream, i) % n
/// for i = 0, 1, ...; all of [0, n) when count >= n; when count > n / 2, the n - count positions
/// to leave out are drawn that way instead (so the walk stays short).
inline std::vector<int64_t> sample_distinct(uint64_t stream, int64_t count, int64_t n) {
  std::vector<int64_t> out;
  if (n <= 0 || count <= 0) return out;
  if (count > n / 2 || n / 64 <= 16 * count) {
    // Dense enough for a bitmap of [0, n): no hashing, and the ascending order comes from reading
    // the bitmap (no sort). Same positions as below.
    std::vector<uint64_t> bits;
    sample_distinct_bits(stream, count, n, bits);
    return set_positions(bits);
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
