// MiCRO's and ExDyna's band counts on the host: KeyBins::count (on the CPU kernels' threads, 16
// keys a step on the AVX-512 path) against the look-up one key at a time in one thread, side by
// side on the same values (target
// `band_counts` of the CMake build):
//
//     band_counts [VALUES=984e3] [REPEATS=7]
//
// The values are a normal's tail (|v| >= 1.95), as a band's candidates are; the table has 257
// geometric edges from 2.0 over a factor of 1.3, as a band has. Prints the medians of both ways
// and their ratio; checks that both give the same counts.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gradsparse/key_bins.h"
#include "gradsparse/numeric.h"
#include "timing.h"

using namespace gradsparse;
using bench::median;
using bench::seconds_since;

namespace {

/// The bins of the values one look-up at a time (KeyBins::Lookup::bin), as count() defines them.
void count_one_at_a_time(const KeyBins& table, const std::vector<float>& values, int64_t* in_bin) {
  const KeyBins::Lookup bins = table.lookup();
  const uint32_t lowest = bins.keys[0];
  for (float v : values) {
    const uint32_t key = Num<float>::key(v);
    ++in_bin[key < lowest ? 0 : bins.bin(key) + 1];
  }
}

}  // namespace

int main(int argc, char** argv) {
  const auto size = static_cast<int64_t>(argc > 1 ? std::stod(argv[1]) : 984e3);
  const int repeats = argc > 2 ? std::stoi(argv[2]) : 7;
  if (size < 1 || repeats < 1) {
    std::fprintf(stderr, "usage: band_counts [VALUES >= 1] [REPEATS >= 1]\n");
    return 2;
  }
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values;
  while (static_cast<int64_t>(values.size()) < size) {
    const float v = normal(rng);
    if (std::fabs(v) >= 1.95f) values.push_back(v);
  }
  std::vector<uint32_t> keys(257);
  for (int b = 0; b < 257; ++b) keys[b] = Num<float>::key(static_cast<float>(2.0 * std::pow(1.3, b / 256.0)));
  const KeyBins table(keys.data(), static_cast<int>(keys.size()));
  std::vector<double> single_s, count_s;
  std::vector<int64_t> single, counted;
  for (int r = 0; r < repeats; ++r) {
    single.assign(keys.size() + 1, 0);
    counted.assign(keys.size() + 1, 0);
    auto t0 = std::chrono::steady_clock::now();
    count_one_at_a_time(table, values, single.data());
    single_s.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    table.count(values.data(), size, counted.data());
    count_s.push_back(seconds_since(t0));
  }
  if (single != counted) {
    std::fprintf(stderr, "band_counts: the two ways count differently\n");
    return 1;
  }
  std::printf("%lld values, 257 edges, median of %d: one at a time %.2f ms, KeyBins::count %.2f ms, ratio %.2f\n",
              static_cast<long long>(size), repeats, 1e3 * median(single_s), 1e3 * median(count_s),
              median(single_s) / median(count_s));
  return 0;
}
