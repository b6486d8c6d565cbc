#include "gradsparse/parallel.h"

#include <atomic>
#include <cstdio>
#include <cstdlib>

#include "simd.h"

namespace gradsparse {
namespace {
std::atomic<int> g_threads{0};

int default_threads() {
  if (const char* env = std::getenv("GRADSPARSE_NUM_THREADS"); env != nullptr && *env != '\0') {
    // Digits between spaces only, as import gradsparse checks it (strtol alone would take "+2").
    const char* digits = env;
    while (*digits == ' ') ++digits;
    char* end = nullptr;
    const long v = *digits >= '0' && *digits <= '9' ? std::strtol(digits, &end, 10) : 0;
    while (end != nullptr && *end == ' ') ++end;
    if (end != nullptr && *end == '\0' && v > 0 && v <= 4096) return static_cast<int>(v);
    // Read once, by the first kernel of a step, where an error would fail that step on this rank
    // alone: a warning and the default instead (import gradsparse refuses it on every rank first).
    std::fprintf(stderr,
                 "gradsparse: GRADSPARSE_NUM_THREADS=%s is not a whole number from 1 to 4096; the CPU kernels use "
                 "OpenMP's default (set it to, for example, 2, or unset it)\n",
                 env);
  }
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}
}  // namespace

int cpu_threads() {
  const int t = g_threads.load(std::memory_order_relaxed);
  if (t > 0) return t;
  static const int fallback = default_threads();
  return fallback;
}

void set_cpu_threads(int threads) {
  GS_CHECK(threads >= 0, ValueError, "set_cpu_threads: threads must be >= 0, got ", threads,
           "; pass the number of threads, or 0 for the default");
  g_threads.store(threads, std::memory_order_relaxed);
}

const char* cpu_simd_paths() {
  switch (cpu::simd_paths()) {
    case cpu::Simd::kAvx512:
      return "avx512";
    case cpu::Simd::kAvx2:
      return "avx2";
    case cpu::Simd::kPortable:
      break;
  }
  return "portable";
}

}  // namespace gradsparse
