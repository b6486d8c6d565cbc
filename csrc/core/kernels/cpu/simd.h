// Run-time choice of the SIMD code paths of the CPU kernels (private to kernels/cpu). The build
// uses no -march flag: AVX2 and AVX-512 functions carry a target attribute, and the kernels call
// them only when the CPU reports the instructions and GRADSPARSE_SIMD allows them ("0": portable
// code only, "avx2": no AVX-512, anything else: the widest the CPU has). Every path gives the
// same results to the bit (the vector code adds in the portable code's order).
// On other CPUs the portable code is compiled alone (CI builds and tests it for aarch64:
// scripts/cross_check.sh).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "gradsparse/kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GS_HAVE_AVX2_PATHS 1
// (every AVX2 CPU has POPCNT: their loops count a mask's bits with the instruction)
#define GS_TARGET_AVX2 __attribute__((target("avx2,popcnt")))
#define GS_TARGET_AVX512 __attribute__((target("avx2,avx512f,popcnt")))
// Code that only the AVX2 paths reach may count bits with the POPCNT instruction (every AVX2 CPU
// has it); without it GCC calls libgcc's __popcountdi2 for each word.
#define GS_TARGET_POPCNT __attribute__((target("popcnt")))
// Around code that calls AVX-512 intrinsics: GCC 12's pass an undefined vector that
// -W(maybe-)uninitialized reports (GCC bug 105593); no code here reads one.
#if defined(__GNUC__) && !defined(__clang__)
#define GS_AVX512_INTRINSICS_BEGIN                                                     \
  _Pragma("GCC diagnostic push") _Pragma("GCC diagnostic ignored \"-Wuninitialized\"") \
      _Pragma("GCC diagnostic ignored \"-Wmaybe-uninitialized\"")
#define GS_AVX512_INTRINSICS_END _Pragma("GCC diagnostic pop")
#else
#define GS_AVX512_INTRINSICS_BEGIN
#define GS_AVX512_INTRINSICS_END
#endif
#else
#define GS_HAVE_AVX2_PATHS 0
#define GS_TARGET_POPCNT
#endif

namespace gradsparse {
namespace cpu {

/// The widest SIMD paths the kernels may take: the CPU's, narrowed by GRADSPARSE_SIMD (read once).
enum class Simd { kPortable, kAvx2, kAvx512 };

inline Simd simd_paths() {
  static const Simd paths = [] {
    const char* env = std::getenv("GRADSPARSE_SIMD");
    const bool portable = env != nullptr && std::strcmp(env, "0") == 0;
    const bool no_avx512 = env != nullptr && std::strcmp(env, "avx2") == 0;
    // A bad value is named on every CPU, also where the kernels have no SIMD paths to narrow.
    if (env != nullptr && *env != '\0' && !portable && !no_avx512 && std::strcmp(env, "1") != 0) {
      // Read inside parallel loops, where nothing may throw (import gradsparse refuses it first).
      std::fprintf(stderr,
                   "gradsparse: GRADSPARSE_SIMD=%s is not 1, avx2 or 0; the CPU kernels take the widest paths "
                   "the CPU has (set it to 1, avx2 or 0, or unset it)\n",
                   env);
    }
#if GS_HAVE_AVX2_PATHS
    if (portable || !__builtin_cpu_supports("avx2")) return Simd::kPortable;
    if (no_avx512 || !__builtin_cpu_supports("avx512f")) return Simd::kAvx2;
    return Simd::kAvx512;
#else
    return Simd::kPortable;
#endif
  }();
  return paths;
}

/// True when the AVX2 paths may run.
inline bool use_avx2() { return simd_paths() != Simd::kPortable; }
/// True when the AVX-512 paths may run (they are taken where they measured faster than AVX2).
inline bool use_avx512() { return simd_paths() == Simd::kAvx512; }

/// A float32 view of a source of any type (for code instantiated for every type but run for
/// float32 only).
template <typename T>
Source<float> as_f32(const Source<T>& s) {
  return Source<float>{reinterpret_cast<float*>(s.residual),
                       reinterpret_cast<const float*>(s.grad),
                       s.update,
                       reinterpret_cast<float*>(s.velocity),
                       s.momentum,
                       s.masking};
}

#if GS_HAVE_AVX2_PATHS
GS_TARGET_AVX2 inline __m256i not_finite8_avx2(__m256 x) {  // -1 in the lanes holding NaN or +-Inf
  return _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7fffffff)),
                            _mm256_set1_epi32(0x7f800000 - 1));
}

/// The first pass's update of float32 elements j..j+7 (Source::update_element in 8 lanes, to the
/// bit): momentum correction when the source has a velocity, then residual += addend where the
/// sum is finite. Returns the residual's new values; `nonfinite` holds -1 in the lanes whose sum
/// is not finite (their residual is kept). kVelocity says whether src.velocity is set; without
/// kStore the new residual and velocity are computed but not stored (a read-only look at them).
template <bool kVelocity, bool kStore = true>
GS_TARGET_AVX2 inline __m256 update8_avx2(const Source<float>& src, int64_t j, __m256i& nonfinite) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256 old = _mm256_loadu_ps(src.residual + j);
  __m256 addend = _mm256_loadu_ps(src.grad + j);
  if constexpr (kVelocity) {
    const __m256 u = _mm256_loadu_ps(src.velocity + j);
    __m256 kept = u;
    if (src.masking) {  // +0 where the residual is +-0 (momentum_emptied)
      const __m256i empty =
          _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(old), magnitude), _mm256_setzero_si256());
      kept = _mm256_andnot_ps(_mm256_castsi256_ps(empty), u);
    }
    addend = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(src.momentum), kept), addend);  // scale_add
    if constexpr (kStore)
      _mm256_storeu_ps(src.velocity + j, _mm256_blendv_ps(addend, u, _mm256_castsi256_ps(not_finite8_avx2(addend))));
  }
  const __m256 a = _mm256_add_ps(old, addend);
  nonfinite = not_finite8_avx2(a);
  const __m256 v = _mm256_blendv_ps(a, old, _mm256_castsi256_ps(nonfinite));
  if constexpr (kStore) _mm256_storeu_ps(src.residual + j, v);
  return v;
}

GS_TARGET_AVX512 inline __mmask16 not_finite16_avx512(__m512 x) {  // a bit per lane holding NaN or +-Inf
  return _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7fffffff)),
                                 _mm512_set1_epi32(0x7f800000 - 1));
}

/// update8_avx2 for elements j..j+15, to the bit; `nonfinite` gets a bit per lane whose sum is
/// not finite. kVelocity says whether src.velocity is set (a loop calls the version for its case,
/// not a test per vector); kStore as in update8_avx2.
template <bool kVelocity, bool kStore = true>
GS_TARGET_AVX512 inline __m512 update16_avx512(const Source<float>& src, int64_t j, __mmask16& nonfinite) {
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  const __m512 old = _mm512_loadu_ps(src.residual + j);
  __m512 addend = _mm512_loadu_ps(src.grad + j);
  if constexpr (kVelocity) {
    const __m512 u = _mm512_loadu_ps(src.velocity + j);
    // +0 where the residual is +-0 when masking (momentum_emptied)
    const __m512 kept =
        src.masking ? _mm512_maskz_mov_ps(_mm512_test_epi32_mask(_mm512_castps_si512(old), magnitude), u) : u;
    addend = _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(src.momentum), kept), addend);  // scale_add
    if constexpr (kStore)
      _mm512_storeu_ps(src.velocity + j, _mm512_mask_blend_ps(not_finite16_avx512(addend), addend, u));
  }
  const __m512 a = _mm512_add_ps(old, addend);
  nonfinite = not_finite16_avx512(a);
  // A branch, not a blend: a sum is all but always finite, and a blend on every vector cost the
  // scan 4% to 6% of its time (docs/benchmarks.md).
  const __m512 v = __builtin_expect(nonfinite != 0, 0) ? _mm512_mask_blend_ps(nonfinite, a, old) : a;
  if constexpr (kStore) _mm512_storeu_ps(src.residual + j, v);
  return v;
}

/// Bit q of the result is set when the key (|v| bits) of v[q], q < 32, is above `below` (a key
/// minus one, compared as signed: keys are at most 0x7fffffff).
GS_TARGET_AVX2 inline uint32_t keys_above32_avx2(const float* v, __m256i below) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  uint32_t bits = 0;
  for (int q = 0; q < 4; ++q) {
    const __m256i k = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(v + 8 * q)), magnitude);
    bits |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, below)))) << (8 * q);
  }
  return bits;
}

/// Calls hit(j), in ascending order, for every j in [begin, end) whose float32 value v[j] has
/// key (|v| bits) >= `key`: 32 keys compared per step, so elements below the key cost little.
template <typename Hit>
GS_TARGET_AVX2 inline void scan_keys_avx2(const float* v, int64_t begin, int64_t end, uint32_t key, Hit&& hit) {
  if (key > 0x7fffffffu) return;  // above every finite key (and keys are compared as signed)
  const __m256i below = _mm256_set1_epi32(static_cast<int>(key) - 1);
  int64_t j = begin;
  for (; j + 32 <= end; j += 32) {
    for (uint32_t bits = keys_above32_avx2(v + j, below); bits != 0; bits &= bits - 1) hit(j + __builtin_ctz(bits));
  }
  for (; j < end; ++j) {
    uint32_t bits;
    std::memcpy(&bits, v + j, sizeof(bits));
    if ((bits & 0x7fffffffu) >= key) hit(j);
  }
}

/// scan_keys_avx2 for 16-bit values (float16, bfloat16: the key is the bits without the sign).
template <typename Hit>
GS_TARGET_AVX2 inline void scan_keys16_avx2(const uint16_t* v, int64_t begin, int64_t end, uint32_t key, Hit&& hit) {
  if (key > 0x7fffu) return;  // above every key
  const __m256i below = _mm256_set1_epi16(static_cast<int16_t>(static_cast<int>(key) - 1));
  const __m256i magnitude = _mm256_set1_epi16(0x7fff);
  int64_t j = begin;
  for (; j + 32 <= end; j += 32) {
    const __m256i a = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j)), magnitude);
    const __m256i b = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j + 16)), magnitude);
    // one byte per element; packs interleaves the 128-bit halves, the permutation puts them in order
    const __m256i hits =
        _mm256_permute4x64_epi64(_mm256_packs_epi16(_mm256_cmpgt_epi16(a, below), _mm256_cmpgt_epi16(b, below)), 0xd8);
    for (auto bits = static_cast<uint32_t>(_mm256_movemask_epi8(hits)); bits != 0; bits &= bits - 1)
      hit(j + __builtin_ctz(bits));
  }
  for (; j < end; ++j)
    if ((v[j] & 0x7fffu) >= key) hit(j);
}

#endif

/// Calls f(first, bits) for each 64-bit word of `mask` that covers [lo, hi), in ascending order:
/// bit t of the mask stands for element base + t, `first` is the element of the word's bit 0 and
/// `bits` the word with the bits outside [lo, hi) cleared. The mask must be readable up to the end
/// of the last word (room for a multiple of 8 bytes).
template <typename F>
inline void for_mask_words(const uint8_t* mask, int64_t base, int64_t lo, int64_t hi, F&& f) {
  if (lo >= hi) return;
  const int64_t first = (lo - base) / 64, last = (hi - base - 1) / 64;
  for (int64_t w = first; w <= last; ++w) {
    uint64_t bits;
    std::memcpy(&bits, mask + 8 * w, sizeof(bits));
    const int64_t from = base + 64 * w;
    if (lo > from) bits &= ~uint64_t{0} << (lo - from);
    if (hi < from + 64) bits &= (uint64_t{1} << (hi - from)) - 1;
    f(from, bits);
  }
}

/// How many positions of each mask word list_marked writes without a branch, for marks at about
/// `found` per `length` elements (the block before's): the fewest that leave few words with more.
/// A word's count of marks is as good as random, so each word whose count passes them costs a
/// mispredicted branch, and each one written without a mark costs a few instructions. Listing
/// one block's marks again and again (32K elements in cache, one thread; ms per 763 blocks):
/// at 0.85% and 1.8% of the elements marked (a word holds 0.5 and 1.2 on average) two such
/// positions took 1.1 and 1.6 ms, four 1.7 and 1.9; at 2.5% three took 1.9 ms against 2.6 for
/// two; at 4% (MiCRO's band at density 0.01) four took 2.5 ms against 3.1 for three and 4.9 for two.
inline int unmarked_writes(int64_t found, int64_t length) {
  const int64_t per_word = 64 * found;  // marks per 64 elements, times length
  return length <= 0 || per_word < 5 * length / 4 ? 2 : per_word < 2 * length ? 3 : 4;
}

/// Writes i - origin to index[] and v[i] to value[], in ascending order, for every i in [lo, hi)
/// whose bit is set in `mask` (for_mask_words), and returns how many: the listing of a block only
/// partly inside [lo, hi) (whole ones list as the pass reads them: CandidateList). The first
/// `writes` (2 to 4)
/// of each word are written without a branch (a word's next position and its value are stored
/// whether or not it counts; unmarked_writes chooses how many), so few branches are mispredicted
/// at the densities of candidates. A group of four words (256 elements) without a mark is passed over
/// with one test: where the candidates gather in a few layers, the blocks of the others have
/// none. index and value need room for hi - lo + 2 entries; `mask` must be readable up to the end
/// of the last group (room for a multiple of 32 bytes from `base`).
template <typename I>
int64_t list_marked(const float* v, const uint8_t* mask, int64_t base, int64_t lo, int64_t hi, I* index, float* value,
                    int writes, int64_t origin = 0) {
  int64_t n = 0;
  auto list_word = [&](int64_t from, uint64_t bits) {
    for (int first = 0; first < writes; ++first) {  // without a branch: n moves on only for a hit
      const int64_t i = std::min(from + __builtin_ctzll(bits | (uint64_t{1} << 63)), hi - 1);  // in [lo, hi)
      index[n] = static_cast<I>(i - origin);
      value[n] = v[i];
      n += bits != 0;
      bits &= bits - 1;
    }
    for (; bits != 0; bits &= bits - 1, ++n) {  // the rest
      const int64_t i = from + __builtin_ctzll(bits);
      index[n] = static_cast<I>(i - origin);
      value[n] = v[i];
    }
  };
  constexpr int64_t kGroup = 256;
  for (int64_t g = (std::max(lo, base) - base) / kGroup * kGroup; base + g < hi; g += kGroup) {
    uint64_t words[4];
    std::memcpy(words, mask + g / 8, sizeof(words));
    if ((words[0] | words[1] | words[2] | words[3]) == 0) continue;
    for_mask_words(mask, base, std::max(lo, base + g), std::min(hi, base + g + kGroup), list_word);
  }
  return n;
}

/// Where a float32 pass on the AVX2 or AVX-512 path lists a block's candidates while their values
/// are in registers, instead of marking them for list_marked: each one's position less `origin`
/// (the block's first) goes to offset[size] and its value to value[size], size counting on. Whole
/// vectors are stored, so both need room for 16 entries past the last one listed.
struct CandidateList {
  uint32_t* offset;
  float* value;
  int64_t origin;
  int64_t size = 0;
};

/// How many bits of `mask` are set for the elements of [lo, hi) (for_mask_words). Only the AVX2
/// paths mark, so it may use POPCNT: a scan past its capacity, which counts its blocks' marks
/// instead of listing them (25M elements, 1.2% marked, A/B of 8 rounds), took 1.18x and 1.14x a
/// plain add with libgcc's popcount, 1.07x and 1.05x with the instruction.
GS_TARGET_POPCNT inline int64_t count_marked(const uint8_t* mask, int64_t base, int64_t lo, int64_t hi) {
  int64_t n = 0;
  for_mask_words(mask, base, lo, hi, [&](int64_t, uint64_t bits) { n += __builtin_popcountll(bits); });
  return n;
}

/// The float32 pass of the scan's AVX2 and AVX-512 loops (statistics.cpp) over one block
/// [begin, end) without sums: the error-feedback update when `src.update`, and in `mask` (room
/// for (end - begin) / 8 bytes, a multiple of 32) bit t set when element begin + t has key >=
/// `key` (without a mask: the update alone). With a `list` the elements at or above `key` are
/// listed there instead (CandidateList; the mask is left as it was). Returns
/// the count of non-finite sums. Only where use_avx2().
int64_t mark_block_f32(const Source<float>& src, int64_t begin, int64_t end, uint32_t key, uint8_t* mask,
                       CandidateList* list = nullptr);

/// The error-feedback update of the float16 or bfloat16 elements [begin, end) of a source with a
/// residual, momentum correction included (statistics.cpp; in AVX2/F16C vectors where the CPU
/// has them, to the portable code's bits): returns the count of non-finite sums.
template <typename T>
int64_t update_16(const Source<T>& src, int64_t begin, int64_t end);

}  // namespace cpu
}  // namespace gradsparse
