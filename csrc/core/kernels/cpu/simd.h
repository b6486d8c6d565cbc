// Run-time choice of the AVX2 code paths of the CPU kernels (private to kernels/cpu). The build
// uses no -march flag: AVX2 functions carry a target attribute, and the kernels call them only
// when the CPU reports AVX2 (and GRADSPARSE_SIMD is not "0"); otherwise the portable code runs.
// Both paths give the same results to the bit (the AVX2 code adds in the portable code's order).
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

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

#if GS_HAVE_AVX2_PATHS
/// Calls hit(j), in ascending order, for every j in [begin, end) whose float32 value v[j] has
/// key (|v| bits) >= `key`: 32 keys compared per step, so elements below the key cost little.
template <typename Hit>
GS_TARGET_AVX2 inline void scan_keys_avx2(const float* v, int64_t begin, int64_t end, uint32_t key, Hit&& hit) {
  if (key > 0x7fffffffu) return;  // above every finite key (and keys are compared as signed)
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256i below = _mm256_set1_epi32(static_cast<int>(key) - 1);
  int64_t j = begin;
  for (; j + 32 <= end; j += 32) {
    uint32_t bits = 0;
    for (int q = 0; q < 4; ++q) {
      const __m256i k = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(v + j + 8 * q)), magnitude);
      bits |= static_cast<uint32_t>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, below)))) << (8 * q);
    }
    while (bits != 0) {
      hit(j + __builtin_ctz(bits));
      bits &= bits - 1;
    }
  }
  for (; j < end; ++j) {
    uint32_t bits;
    std::memcpy(&bits, v + j, sizeof(bits));
    if ((bits & 0x7fffffffu) >= key) hit(j);
  }
}
#endif

}  // namespace cpu
}  // namespace gradsparse
