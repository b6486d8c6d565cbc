// Run-time choice of the AVX2 code paths of the CPU kernels (private to kernels/cpu). The build
// uses no -march flag: AVX2 functions carry a target attribute, and the kernels call them only
// when the CPU reports AVX2 (and GRADSPARSE_SIMD is not "0"); otherwise the portable code runs.
// Both paths give the same results to the bit (the AVX2 code adds in the portable code's order).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "gradsparse/kernels.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define GS_HAVE_AVX2_PATHS 1
#define GS_TARGET_AVX2 __attribute__((target("avx2")))
#else
#define GS_HAVE_AVX2_PATHS 0
#endif

namespace gradsparse {
namespace cpu {

/// True when the AVX2 paths may run: the CPU has AVX2 and GRADSPARSE_SIMD is not "0" (read once).
inline bool use_avx2() {
#if GS_HAVE_AVX2_PATHS
  static const bool enabled = [] {
    const char* env = std::getenv("GRADSPARSE_SIMD");
    if (env != nullptr && std::strcmp(env, "0") == 0) return false;
    return static_cast<bool>(__builtin_cpu_supports("avx2"));
  }();
  return enabled;
#else
  return false;
#endif
}

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
/// is not finite (their residual is kept).
GS_TARGET_AVX2 inline __m256 update8_avx2(const Source<float>& src, int64_t j, __m256i& nonfinite) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256 old = _mm256_loadu_ps(src.residual + j);
  __m256 addend = _mm256_loadu_ps(src.grad + j);
  if (src.velocity != nullptr) {
    const __m256 u = _mm256_loadu_ps(src.velocity + j);
    __m256 kept = u;
    if (src.masking) {  // +0 where the residual is +-0 (momentum_emptied)
      const __m256i empty =
          _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(old), magnitude), _mm256_setzero_si256());
      kept = _mm256_andnot_ps(_mm256_castsi256_ps(empty), u);
    }
    addend = _mm256_add_ps(_mm256_mul_ps(_mm256_set1_ps(src.momentum), kept), addend);  // scale_add
    _mm256_storeu_ps(src.velocity + j, _mm256_blendv_ps(addend, u, _mm256_castsi256_ps(not_finite8_avx2(addend))));
  }
  const __m256 a = _mm256_add_ps(old, addend);
  nonfinite = not_finite8_avx2(a);
  const __m256 v = _mm256_blendv_ps(a, old, _mm256_castsi256_ps(nonfinite));
  _mm256_storeu_ps(src.residual + j, v);
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

/// Writes j to index[] and v[j] to value[], in ascending order, for every j in [begin, end) whose
/// key (|v| bits) is >= `key`, and returns how many. The first two such elements of each 32 are
/// written without a branch (a chunk's position and value are stored whether or not they count),
/// so at the densities of candidates, where most chunks hold none or one and which is as good as
/// random, no branch is mispredicted. index and value need room for end - begin + 2 entries.
GS_TARGET_AVX2 inline int64_t list_keys_avx2(const float* v, int64_t begin, int64_t end, uint32_t key, int64_t* index,
                                             float* value) {
  if (key > 0x7fffffffu) return 0;
  const __m256i below = _mm256_set1_epi32(static_cast<int>(key) - 1);
  int64_t n = 0, j = begin;
  for (; j + 32 <= end; j += 32) {
    uint32_t bits = keys_above32_avx2(v + j, below);
    for (int first = 0; first < 2; ++first) {  // without a branch: n moves on only for a hit
      const int64_t i = j + __builtin_ctz(bits | 0x80000000u);
      index[n] = i;
      value[n] = v[i];
      n += bits != 0;
      bits &= bits - 1;
    }
    for (; bits != 0; bits &= bits - 1, ++n) {  // a third and more: rare below a few percent
      const int64_t i = j + __builtin_ctz(bits);
      index[n] = i;
      value[n] = v[i];
    }
  }
  for (; j < end; ++j) {
    uint32_t bits;
    std::memcpy(&bits, v + j, sizeof(bits));
    index[n] = j;
    value[n] = v[j];
    n += (bits & 0x7fffffffu) >= key;
  }
  return n;
}
#endif

}  // namespace cpu
}  // namespace gradsparse
