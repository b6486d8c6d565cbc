#include "gradsparse/parallel.h"

#include <atomic>
#include <cstdlib>

namespace gradsparse {
namespace {
std::atomic<int> g_threads{0};

int default_threads() {
  if (const char* env = std::getenv("GRADSPARSE_NUM_THREADS")) {
    const int v = std::atoi(env);
    if (v > 0) return v;
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

void set_cpu_threads(int threads) { g_threads.store(threads > 0 ? threads : 0, std::memory_order_relaxed); }

}  // namespace gradsparse
