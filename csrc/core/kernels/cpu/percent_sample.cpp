// in_percent_sample_bits (rng.h): the hashed 1% sample's membership of many positions. A hash is
// two 64-bit multiplications and a few shifts; the AVX-512 path takes eight positions a step, each
// multiplication as three of 32 x 32 bits (AVX-512F has no 64-bit one).
#include "gradsparse/rng.h"
#include "simd.h"

namespace gradsparse {

namespace {

void bits_portable(uint64_t stream, const int64_t* positions, int64_t begin, int64_t n, uint64_t* bits) {
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

/// bits_portable over the first n - n % 64 positions; returns how many it did.
GS_TARGET_AVX512 int64_t bits_avx512(uint64_t stream, const int64_t* positions, int64_t n, uint64_t* bits) {
  // mix64 (rng.h) of stream + p, lane by lane
  const __m512i start = _mm512_set1_epi64(static_cast<int64_t>(stream + 0x9E3779B97F4A7C15ull));
  const __m512i cut = _mm512_set1_epi64(static_cast<int64_t>(kPercentCut));
  int64_t j = 0;
  for (; j + 64 <= n; j += 64) {
    uint64_t word = 0;
    for (int part = 0; part < 8; ++part) {
      __m512i z = _mm512_add_epi64(_mm512_loadu_si512(positions + j + 8 * part), start);
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

}  // namespace

void in_percent_sample_bits(uint64_t stream, const int64_t* positions, int64_t n, uint64_t* bits) {
  int64_t done = 0;
#if GS_HAVE_AVX2_PATHS
  if (cpu::use_avx512()) done = bits_avx512(stream, positions, n, bits);
#endif
  bits_portable(stream, positions, done, n, bits);
}

}  // namespace gradsparse
