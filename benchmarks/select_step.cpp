// One method's selection step against a plain residual add, in C++ (target `select_step` of the
// CMake build). For comparing two builds of the core binary against binary without rebuilding the
// Python extension: build each (cmake -S <tree> -B <dir> -DCMAKE_BUILD_TYPE=Release, then
// ninja -C <dir> select_step) and run the two binaries in turn, several times:
//
//     OMP_NUM_THREADS=2 <dir>/select_step gaussiank 0.01 [steps=20] [n=25e6]
//
// Every step restores the residual first and takes its gradient as benchmarks/select.py's
// step_gradient does (one of 4 draws in turn, at a scale of its own: the threshold moves as in
// training),
// skips the method's first 20 steps (benchmarks.select's warm-up), times a residual add on the
// same data just before each step, and reads the step's
// select_seconds and exchange_seconds from reduce_bucket's report (one rank); prints the medians
// and the ratio of the medians. Methods: topk, gaussiank, dgc, redsync, sage, micro, exdyna, sidco (exp,
// adaptive stages), sidco_gpareto and sidco_gamma (2 stages), in their default modes; and the
// stateless exact top-k kernel alone (cpu::select_topk, what gs.select_topk runs on float32):
// topk_op with error feedback (residual += gradient fused), topk_op_nores on the gradient alone.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/estimators.h"
#include "gradsparse/kernels.h"
#include "gradsparse/methods.h"
#include "gradsparse/parallel.h"
#include "gradsparse/reduce_bucket.h"
#include "gradsparse/transport.h"
#include "timing.h"

using namespace gradsparse;
using bench::median;
using bench::seconds_since;

namespace {

std::unique_ptr<Method> make(const std::string& name, double density) {
  if (name == "topk") return std::make_unique<TopK>(density);
  if (name == "gaussiank") return std::make_unique<GaussianK>(density, "spardl");
  if (name == "dgc") return std::make_unique<DGC>(density, 1);
  if (name == "redsync") return std::make_unique<RedSync>(density);
  if (name == "sage")
    return std::make_unique<SAGE>(density, "flat", std::vector<int64_t>{}, false, 0, std::nullopt, std::nullopt);
  if (name == "micro") return std::make_unique<MiCRO>(density, "union", false, 0);
  if (name == "exdyna") return std::make_unique<ExDyna>(density, "union", false, 0);
  if (name == "sidco") return std::make_unique<SIDCo>(density, "exp", -1, 0.25, std::nullopt);
  if (name == "sidco_gpareto") return std::make_unique<SIDCo>(density, "gpareto", 2, 0.25, std::nullopt);
  if (name == "sidco_gamma") return std::make_unique<SIDCo>(density, "gamma_gpareto", 2, 0.25, std::nullopt);
  return nullptr;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: select_step METHOD DENSITY [STEPS] [N]\n");
    return 2;
  }
  const std::string name = argv[1];
  const double density = std::stod(argv[2]);
  const int steps = argc > 3 ? std::stoi(argv[3]) : 20;
  const auto n = static_cast<int64_t>(argc > 4 ? std::stod(argv[4]) : 25e6);
  const bool op = name == "topk_op" || name == "topk_op_nores";
  std::unique_ptr<Method> method = make(name, density);
  if ((method == nullptr && !op) || steps < 1 || n < 1) {
    std::fprintf(stderr,
                 "select_step: unknown method %s (topk, gaussiank, dgc, redsync, micro, exdyna, sidco, sidco_gpareto, "
                 "sidco_gamma, topk_op, topk_op_nores), or STEPS/N < 1\n",
                 name.c_str());
    return 2;
  }
  constexpr int kDraws = 4;  // as benchmarks.select: each draw has its own largest magnitudes
  std::vector<std::vector<float>> draws(kDraws, std::vector<float>(static_cast<size_t>(n)));
  std::vector<float> start(static_cast<size_t>(n)), residual(start.size()), out(start.size());
  std::mt19937 rng(0);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (size_t i = 0; i < start.size(); ++i) start[i] = normal(rng) * 5e-4f;
  for (std::vector<float>& draw : draws)
    for (float& g : draw) g = normal(rng) * 1e-3f;
  auto group = ThreadGroup::create(1);
  auto transport = group->transport(0);
  CpuDevice device;
  const int threads = cpu_threads();  // the add runs on the kernels' threads
  std::vector<double> select, add, exchange;
  std::vector<int64_t> indices;  // topk_op's pairs, kept from step to step as a caller's buffers
  std::vector<float> values;
  const PairSink sink = [&](int64_t count) {
    indices.resize(static_cast<size_t>(count));
    values.resize(static_cast<size_t>(count));
    return PairSpan{indices.data(), values.data()};
  };
  const int64_t k = target_count(density, n);  // topk_op's, as the Top-k method counts it
  constexpr int kWarmup = 20;  // as benchmarks.select: a method's first steps, while it learns the scale
  for (int s = 0; s < steps + kWarmup; ++s) {
    std::memcpy(residual.data(), start.data(), residual.size() * sizeof(float));
    const float* g = draws[static_cast<size_t>(s % kDraws)].data();
    const auto t0 = std::chrono::steady_clock::now();
    float* r = residual.data();
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < n; ++i) r[i] += g[i];
    const double t_add = seconds_since(t0);
    std::memcpy(residual.data(), start.data(), residual.size() * sizeof(float));
    // The step's draw at a scale of its own, exp(0.06 z) with z a standard normal seeded by the
    // step, as benchmarks.select's step_gradient scales it (other numbers, the same spread).
    std::mt19937 scale_rng(static_cast<unsigned>(s));
    const auto scale = static_cast<float>(std::exp(0.06 * std::normal_distribution<double>(0.0, 1.0)(scale_rng)));
    for (size_t i = 0; i < out.size(); ++i) out[i] = g[i] * scale;
    double t_select = 0.0, t_exchange = 0.0;
    if (op) {
      const auto t1 = std::chrono::steady_clock::now();
      cpu::select_topk<float, int64_t>(name == "topk_op" ? residual.data() : nullptr, out.data(), n, k, sink);
      t_select = seconds_since(t1);
    } else {
      BucketView bucket{DType::kFloat32, n, out.data(), residual.data()};
      const ReduceReport report = reduce_bucket(method.get(), *transport, device, bucket, ReduceOptions{});
      t_select = report.select_seconds;
      t_exchange = report.exchange_seconds;
    }
    if (s < kWarmup) continue;
    select.push_back(t_select);
    add.push_back(t_add);
    exchange.push_back(t_exchange);
  }
  std::printf(
      "%s density %g, N %lld, %d steps, %s kernels: select %.2f ms, add %.2f ms, select / add %.2f, exchange %.2f "
      "ms\n",
      name.c_str(), density, static_cast<long long>(n), steps, cpu_simd_paths(), 1e3 * median(select),
      1e3 * median(add), median(select) / median(add), 1e3 * median(exchange));
  return 0;
}
