// KeyBins::count (key_bins.h): keys counted into the bins of a table, in blocks on the CPU
// kernels' threads, 16 a step on the AVX-512 path, 8 on the AVX2 path (gathers on both). The band
// counts of MiCRO and ExDyna at density 0.01 bin up to a million candidates a step; one look-up at
// a time, a key cost 3 to 5 ns (loads of the slot that wait for the key's arithmetic, a branch on
// whether it lies below the band), 16 at a time about half that; 745 thousand took 1.27 ms in one
// thread, 0.67 ms in two (one look-up at a time, two threads gained little: 1.33 -> 1.11 to 1.27
// ms; the AVX2 path's gathers, 8 at a time, 0.6 to 1.0 ms in two) (benchmarks/band_counts.cpp).
#include <algorithm>
#include <type_traits>
#include <vector>

#include "gradsparse/key_bins.h"
#include "gradsparse/numeric.h"
#include "gradsparse/parallel.h"
#include "simd.h"

namespace gradsparse {

namespace {

inline uint32_t key_of(uint32_t key) { return key; }
inline uint32_t key_of(float v) { return Num<float>::key(v); }

/// The bits of an input that key_of keeps, for the vector path's loads.
template <typename In>
constexpr uint32_t kKeyMask = std::is_same_v<In, float> ? 0x7fffffffu : 0xffffffffu;

template <typename In>
void count_portable(const KeyBins::Lookup& bins, const In* in, int64_t begin, int64_t end, int64_t* in_bin) {
  const uint32_t lowest = bins.keys[0];
  for (int64_t i = begin; i < end; ++i) {
    const uint32_t key = key_of(in[i]);
    ++in_bin[key < lowest ? 0 : bins.bin(key) + 1];
  }
}

#if GS_HAVE_AVX2_PATHS
/// count_avx512 in 8 lanes of AVX2 (its gathers; unsigned comparisons as max(a, b) == a).
template <typename In>
GS_TARGET_AVX2 int64_t count_avx2(const KeyBins::Lookup& bins, const In* in, int64_t n, int64_t* in_bin) {
  const __m256i mask = _mm256_set1_epi32(static_cast<int>(kKeyMask<In>));
  const __m256i lowest = _mm256_set1_epi32(static_cast<int>(bins.keys[0]));
  const __m256i base = _mm256_set1_epi32(static_cast<int>(bins.base));
  const __m256i last_slot = _mm256_set1_epi32(static_cast<int>(bins.last_slot));
  const __m256i one = _mm256_set1_epi32(1);
  const __m128i shift = _mm_cvtsi32_si128(bins.shift);
  const auto* next = reinterpret_cast<const int*>(bins.next);
  alignas(32) int32_t at[8];
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i key = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(in + i)), mask);
    const __m256i inside = _mm256_cmpeq_epi32(_mm256_max_epu32(key, lowest), key);  // -1 where key >= keys[0]
    // a key below keys[0] wraps past the last slot and is clamped to it: its look-up is discarded
    const __m256i t = _mm256_min_epu32(_mm256_srl_epi32(_mm256_sub_epi32(key, base), shift), last_slot);
    const __m256i j = _mm256_i32gather_epi32(bins.slot, t, 4);
    const __m256i past = _mm256_cmpeq_epi32(_mm256_max_epu32(key, _mm256_i32gather_epi32(next, t, 4)), key);
    // bin(key) + 1 (j, one more where the key reaches the slot's next key, plus one), or 0 below
    _mm256_store_si256(reinterpret_cast<__m256i*>(at),
                       _mm256_and_si256(_mm256_sub_epi32(_mm256_add_epi32(j, one), past), inside));
    for (int l = 0; l < 8; ++l) ++in_bin[at[l]];
  }
  return i;
}

GS_AVX512_INTRINSICS_BEGIN

/// count_portable over the first n - n % 16 inputs, 16 a step, for a table that is not crowded;
/// returns how many it counted. The lanes' bins go through a small buffer to the scalar
/// increments (several lanes often share a bin).
template <typename In>
GS_TARGET_AVX512 int64_t count_avx512(const KeyBins::Lookup& bins, const In* in, int64_t n, int64_t* in_bin) {
  const __m512i mask = _mm512_set1_epi32(static_cast<int>(kKeyMask<In>));
  const __m512i lowest = _mm512_set1_epi32(static_cast<int>(bins.keys[0]));
  const __m512i base = _mm512_set1_epi32(static_cast<int>(bins.base));
  const __m512i last_slot = _mm512_set1_epi32(static_cast<int>(bins.last_slot));
  const __m512i one = _mm512_set1_epi32(1);
  const __m128i shift = _mm_cvtsi32_si128(bins.shift);
  alignas(64) int32_t at[16];
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i key = _mm512_and_si512(_mm512_loadu_si512(in + i), mask);
    const __mmask16 inside = _mm512_cmpge_epu32_mask(key, lowest);
    // a key below keys[0] wraps past the last slot and is clamped to it: its look-up is discarded
    const __m512i t = _mm512_min_epu32(_mm512_srl_epi32(_mm512_sub_epi32(key, base), shift), last_slot);
    __m512i j = _mm512_i32gather_epi32(t, bins.slot, 4);
    const __m512i next = _mm512_i32gather_epi32(t, bins.next, 4);
    j = _mm512_mask_add_epi32(j, _mm512_cmpge_epu32_mask(key, next), j, one);  // bin(key)
    _mm512_store_si512(at, _mm512_maskz_add_epi32(inside, j, one));            // + 1, or 0 below
    for (int l = 0; l < 16; ++l) ++in_bin[at[l]];
  }
  return i;
}

GS_AVX512_INTRINSICS_END
#endif  // GS_HAVE_AVX2_PATHS

template <typename In>
void count_run(const KeyBins::Lookup& bins, const In* in, int64_t n, int64_t* in_bin) {
  int64_t done = 0;
#if GS_HAVE_AVX2_PATHS
  if (cpu::use_avx512() && !bins.crowded)
    done = count_avx512(bins, in, n, in_bin);
  else if (cpu::use_avx2() && !bins.crowded)
    done = count_avx2(bins, in, n, in_bin);
#endif
  count_portable(bins, in, done, n, in_bin);
}

/// In blocks on the CPU kernels' threads, each thread into bins of its own, added at the end.
template <typename In>
void count_into_bins(const KeyBins::Lookup& bins, const In* in, int64_t n, int64_t* in_bin) {
  if (bins.m == 0) {
    in_bin[0] += n;
    return;
  }
  const int threads = cpu_threads();
  const auto size = static_cast<size_t>(bins.m + 1);
  std::vector<std::vector<int64_t>> own(static_cast<size_t>(threads));
  parallel_blocks(num_blocks(n), threads, [&](int64_t b, int thread) {
    std::vector<int64_t>& mine = own[static_cast<size_t>(thread)];
    if (mine.empty()) mine.assign(size, 0);
    const int64_t begin = b * kCpuBlock;
    count_run(bins, in + begin, std::min(kCpuBlock, n - begin), mine.data());
  });
  for (const std::vector<int64_t>& mine : own)
    for (size_t j = 0; j < mine.size(); ++j) in_bin[j] += mine[j];
}

}  // namespace

void KeyBins::count(const uint32_t* keys, int64_t n, int64_t* in_bin) const {
  count_into_bins(lookup(), keys, n, in_bin);
}

void KeyBins::count(const float* values, int64_t n, int64_t* in_bin) const {
  count_into_bins(lookup(), values, n, in_bin);
}

}  // namespace gradsparse
