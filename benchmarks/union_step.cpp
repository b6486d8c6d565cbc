// The sorted union of the ranks' index lists, the host step of union + all-reduce (MiCRO, ExDyna,
// SAGE) and of reduce-scatter + all-gather's owners: ascending_union (exchange.h, pairwise
// merges) against a sort of the concatenation and a unique, side by side on the same lists
// (target `union_step` of the CMake build):
//
//     union_step [LISTS=4] [PER_LIST=168e3] [N=25e6] [REPEATS=7]
//
// Each list holds PER_LIST distinct random positions below N, ascending. Prints the medians of
// both ways and their ratio; checks that both give the same union.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "gradsparse/exchange.h"
#include "timing.h"

using namespace gradsparse;
using bench::median;
using bench::seconds_since;

int main(int argc, char** argv) {
  const int lists = argc > 1 ? std::stoi(argv[1]) : 4;
  const auto per_list = static_cast<int64_t>(argc > 2 ? std::stod(argv[2]) : 168e3);
  const auto n = static_cast<int64_t>(argc > 3 ? std::stod(argv[3]) : 25e6);
  const int repeats = argc > 4 ? std::stoi(argv[4]) : 7;
  if (lists < 1 || per_list < 1 || per_list > n || repeats < 1) {
    std::fprintf(stderr, "usage: union_step [LISTS >= 1] [PER_LIST in 1..N] [N] [REPEATS >= 1]\n");
    return 2;
  }
  std::mt19937_64 rng(0);
  std::uniform_int_distribution<int64_t> position(0, n - 1);
  std::vector<std::vector<int64_t>> input(static_cast<size_t>(lists));
  for (std::vector<int64_t>& list : input) {
    while (static_cast<int64_t>(list.size()) < per_list) {
      list.push_back(position(rng));
      if (static_cast<int64_t>(list.size()) == per_list) {  // drop repeats, draw again for them
        std::sort(list.begin(), list.end());
        list.erase(std::unique(list.begin(), list.end()), list.end());
      }
    }
  }
  std::vector<double> merged_s, sorted_s;
  std::vector<int64_t> merged, sorted;
  for (int r = 0; r < repeats; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    merged = ascending_union(input);  // takes a copy, as the exchanges hand it theirs
    merged_s.push_back(seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    sorted.clear();
    for (const std::vector<int64_t>& list : input) sorted.insert(sorted.end(), list.begin(), list.end());
    std::sort(sorted.begin(), sorted.end());
    sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
    sorted_s.push_back(seconds_since(t0));
  }
  if (merged != sorted) {
    std::fprintf(stderr, "union_step: the two unions differ\n");
    return 1;
  }
  std::printf(
      "%d lists of %lld in %lld, union %zu, median of %d: sort + unique %.2f ms, ascending_union %.2f ms, "
      "ratio %.2f\n",
      lists, static_cast<long long>(per_list), static_cast<long long>(n), merged.size(), repeats,
      1e3 * median(sorted_s), 1e3 * median(merged_s), median(sorted_s) / median(merged_s));
  return 0;
}
