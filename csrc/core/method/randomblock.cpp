// Random-block (docs/method-spec.md 4.12): k contiguous elements from a random start, the same
// on every rank.
#include <algorithm>

#include "gradsparse/methods.h"
#include "gradsparse/rng.h"

namespace gradsparse {

std::vector<int64_t> RandomBlock::positions(int64_t n) const {
  std::vector<int64_t> out;  // ascending: the wrapped part [0, start + k - n) first
  if (n == 0) return out;
  const int64_t k = target_count(density_, n);
  const uint64_t stream = rng_stream(seed_, RngTag::kRandomBlock, static_cast<uint64_t>(step_), kSharedLane);
  const int64_t start = static_cast<int64_t>(rng_draw(stream, 0) % static_cast<uint64_t>(n));
  for (int64_t i = 0; i < start + k - n; ++i) out.push_back(i);
  for (int64_t i = start; i < std::min(n, start + k); ++i) out.push_back(i);
  return out;
}

}  // namespace gradsparse
