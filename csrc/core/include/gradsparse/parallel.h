// CPU parallelism of the core: fixed-size blocks processed by OpenMP threads. Block boundaries do
// not depend on the thread count, so every kernel's output is identical for any number of threads.
#pragma once

#include <cstdint>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace gradsparse {

/// Elements per CPU block: 32 Ki elements keep a block's residual and gradient in L2.
constexpr int64_t kCpuBlock = int64_t{1} << 15;

inline int64_t num_blocks(int64_t n) { return (n + kCpuBlock - 1) / kCpuBlock; }

/// Threads used by the CPU kernels: GRADSPARSE_NUM_THREADS if set, else OpenMP's default.
int cpu_threads();
/// Overrides the thread count for this process (0 restores the default).
void set_cpu_threads(int threads);

/// Runs f(block, thread) for block in [0, blocks) on up to `threads` threads (thread < threads),
/// in parallel when there is more than one block. `f` must not throw.
template <typename F>
void parallel_blocks(int64_t blocks, int threads, F&& f) {
#if defined(_OPENMP)
  if (blocks > 1 && threads > 1) {
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < blocks; ++b) f(b, omp_get_thread_num());
    return;
  }
#else
  (void)threads;  // built without OpenMP: serial
#endif
  for (int64_t b = 0; b < blocks; ++b) f(b, 0);
}

/// Runs f(block) for block in [0, blocks) on cpu_threads() threads. `f` must not throw.
template <typename F>
void parallel_blocks(int64_t blocks, F&& f) {
  parallel_blocks(blocks, cpu_threads(), [&](int64_t b, int) { f(b); });
}

}  // namespace gradsparse
