// The CPU scan alone (cpu::scan, OnePass's pass: the error-feedback update and the candidates at
// or above a key, listed) against a plain residual add on the same data, side by side (target
// `scan_cost` of the CMake build):
//
//     OMP_NUM_THREADS=2 scan_cost [N=25e6] [REPEATS=12]
//
// Three keys: one above every value (nothing listed), and those that list about 1.2% and 3% of
// the elements (DGC's candidates at density 0.01 in select_step, and MiCRO's band). Every repeat
// restores the residual and times the add and the three scans in turn; prints each one's median
// and its ratio to the add's. Checks every listing against a count of the elements at or above
// its key, and fails when they differ.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "gradsparse/kernels.h"
#include "gradsparse/numeric.h"
#include "gradsparse/parallel.h"
#include "timing.h"

using namespace gradsparse;
using bench::median;
using bench::seconds_since;

int main(int argc, char** argv) {
  const auto n = static_cast<int64_t>(argc > 1 ? std::stod(argv[1]) : 25e6);
  const int repeats = argc > 2 ? std::stoi(argv[2]) : 12;
  if (n < 1 || repeats < 1) {
    std::fprintf(stderr, "usage: scan_cost [N >= 1] [REPEATS >= 1]\n");
    return 2;
  }
  std::vector<float> start(static_cast<size_t>(n)), grad(start.size()), residual(start.size());
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& v : start) v = normal(rng) * 5e-4f;
  for (float& g : grad) g = normal(rng) * 1e-3f;
  // residual + grad is normal with this deviation: |v| >= 2.512 sd holds 1.2% of it, 2.17 sd 3%
  const double sd = std::hypot(5e-4, 1e-3);
  const std::vector<std::string> names{"lists nothing", "lists 1.2%", "lists 3%"};
  const std::vector<uint32_t> keys{Num<float>::key(1e30f), Num<float>::key(static_cast<float>(2.512 * sd)),
                                   Num<float>::key(static_cast<float>(2.17 * sd))};
  const int threads = cpu_threads();  // the add runs on the kernels' threads
  std::vector<double> add;
  std::vector<std::vector<double>> scan(keys.size());
  std::vector<int64_t> listed(keys.size());
  HostBuffer<int64_t> index;
  HostBuffer<float> value;
  for (int r = 0; r < repeats; ++r) {
    std::memcpy(residual.data(), start.data(), residual.size() * sizeof(float));
    float* res = residual.data();
    const float* g = grad.data();
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) res[i] += g[i];
    add.push_back(seconds_since(t0));
    for (size_t c = 0; c < keys.size(); ++c) {
      std::memcpy(residual.data(), start.data(), residual.size() * sizeof(float));
      int64_t above = 0;
      const auto t1 = std::chrono::steady_clock::now();
      cpu::scan<float>(Source<float>{res, g, true}, n, Range{0, n}, keys[c], /*capacity=*/-1, /*sums=*/false, above,
                       index, value);
      scan[c].push_back(seconds_since(t1));
      int64_t expected = 0;
      for (int64_t i = 0; i < n; ++i) expected += Num<float>::key(res[i]) >= keys[c];
      bool same = above == expected && static_cast<int64_t>(index.size()) == expected;
      for (size_t j = 0; same && j < index.size(); ++j)
        same = (j == 0 || index[j] > index[j - 1]) && value[j] == res[index[j]];
      if (!same) {
        std::fprintf(stderr, "scan_cost: the scan that %s listed %zu (above %lld), not the %lld elements in order\n",
                     names[c].c_str(), index.size(), static_cast<long long>(above), static_cast<long long>(expected));
        return 1;
      }
      listed[c] = expected;
    }
  }
  std::printf("N %lld, %d repeats, %s kernels, %d threads: add %.2f ms\n", static_cast<long long>(n), repeats,
              cpu_simd_paths(), threads, 1e3 * median(add));
  for (size_t c = 0; c < keys.size(); ++c)
    std::printf("  scan that %-13s (%lld): %.2f ms, scan / add %.2f\n", names[c].c_str(),
                static_cast<long long>(listed[c]), 1e3 * median(scan[c]), median(scan[c]) / median(add));
  return 0;
}
