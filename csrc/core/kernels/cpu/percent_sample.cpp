// in_percent_sample_bits and in_percent_sample_positions (rng.h): the hashed 1% sample's
// membership of many positions, listed or a whole range. A hash is two 64-bit multiplications and
// a few shifts; the AVX-512 path takes eight positions a step, each multiplication as three of
// 32 x 32 bits (AVX-512F has no 64-bit one). Listing the sample of 25M positions on two threads
// took 37 to 41 ms hashing each position twice, one at a time (positions_where, DGC's fallback
// until 2026-12-04), and 10 to 12 ms by in_percent_sample_positions.
#include <algorithm>
#include <vector>

#include "gradsparse/parallel.h"
#include "gradsparse/rng.h"
#include "simd.h"

namespace gradsparse {

namespace {

/// The positions hashed: a list of them, or the run first, first + 1, ...
struct Listed {
  const int64_t* positions;
  int64_t operator[](int64_t j) const { return positions[j]; }
};
struct Run {
  int64_t first;
  int64_t operator[](int64_t j) const { return first + j; }
};

template <typename Positions>
void bits_portable(uint64_t stream, Positions positions, int64_t begin, int64_t n, uint64_t* bits) {
  for (int64_t j = begin; j < n; ++j) {
    if (j % 64 == 0) bits[j / 64] = 0;
    bits[j / 64] |= uint64_t{in_percent_sample(stream, static_cast<uint64_t>(positions[j])) ? 1u : 0u} << (j % 64);
  }
}

#if GS_HAVE_AVX2_PATHS
GS_AVX512_INTRINSICS_BEGIN

/// The low 64 bits of a * b in each lane.
GS_TARGET_AVX512 inline __m512i mul64_avx512(__m512i a, uint64_t b) {
  const __m512i b_low = _mm512_set1_epi64(static_cast<int64_t>(b & 0xffffffffu));
  const __m512i b_high = _mm512_set1_epi64(static_cast<int64_t>(b >> 32));
  const __m512i cross =
      _mm512_add_epi64(_mm512_mul_epu32(_mm512_srli_epi64(a, 32), b_low), _mm512_mul_epu32(a, b_high));
  return _mm512_add_epi64(_mm512_mul_epu32(a, b_low), _mm512_slli_epi64(cross, 32));
}

/// Positions j to j + 7.
GS_TARGET_AVX512 inline __m512i load8(Listed p, int64_t j) { return _mm512_loadu_si512(p.positions + j); }
GS_TARGET_AVX512 inline __m512i load8(Run p, int64_t j) {
  return _mm512_add_epi64(_mm512_set1_epi64(p.first + j), _mm512_set_epi64(7, 6, 5, 4, 3, 2, 1, 0));
}

/// bits_portable over the first n - n % 64 positions; returns how many it did.
template <typename Positions>
GS_TARGET_AVX512 int64_t bits_avx512(uint64_t stream, Positions positions, int64_t n, uint64_t* bits) {
  // mix64 (rng.h) of stream + p, lane by lane
  const __m512i start = _mm512_set1_epi64(static_cast<int64_t>(stream + 0x9E3779B97F4A7C15ull));
  const __m512i cut = _mm512_set1_epi64(static_cast<int64_t>(kPercentCut));
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    uint64_t word = 0;
    for (int part = 0; part < 8; ++part) {
      __m512i z = _mm512_add_epi64(load8(positions, j + 8 * part), start);
      z = mul64_avx512(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), 0xBF58476D1CE4E5B9ull);
      z = mul64_avx512(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), 0x94D049BB133111EBull);
      z = _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
      word |= uint64_t{_mm512_cmplt_epu64_mask(z, cut)} << (8 * part);
    }
    bits[j / 64] = word;
  }
  return j;
}

GS_AVX512_INTRINSICS_END
#endif  // GS_HAVE_AVX2_PATHS

template <typename Positions>
void sample_bits(uint64_t stream, Positions positions, int64_t n, uint64_t* bits) {
  int64_t done = 0;
#if GS_HAVE_AVX2_PATHS
  if (cpu::use_avx512()) done = bits_avx512(stream, positions, n, bits);
#endif
  bits_portable(stream, positions, done, n, bits);
}

}  // namespace

void in_percent_sample_bits(uint64_t stream, const int64_t* positions, int64_t n, uint64_t* bits) {
  sample_bits(stream, Listed{positions}, n, bits);
}

std::vector<int64_t> in_percent_sample_positions(uint64_t stream, int64_t begin, int64_t end) {
  const int64_t blocks = num_blocks(std::max<int64_t>(end - begin, 0));
  std::vector<std::vector<int64_t>> parts(static_cast<size_t>(blocks));
  parallel_blocks(blocks, [&](int64_t b) {
    const int64_t first = begin + b * kCpuBlock, size = std::min(kCpuBlock, end - first);
    uint64_t bits[kCpuBlock / 64];
    sample_bits(stream, Run{first}, size, bits);
    std::vector<int64_t>& part = parts[static_cast<size_t>(b)];
    for (int64_t w = 0; w < (size + 63) / 64; ++w)
      for (uint64_t word = bits[w]; word != 0; word &= word - 1) part.push_back(first + 64 * w + __builtin_ctzll(word));
  });
  std::vector<int64_t> out;
  for (const std::vector<int64_t>& part : parts) out.insert(out.end(), part.begin(), part.end());
  return out;
}

}  // namespace gradsparse
