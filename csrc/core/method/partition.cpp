#include "gradsparse/partition.h"

#include <numeric>

#include "gradsparse/common.h"

namespace gradsparse {

StaticPartition::StaticPartition(int64_t n, int world_size) {
  GS_CHECK(world_size >= 1, ValueError, "partition: world size must be >= 1, got ", world_size);
  const int64_t q = n / world_size, m = n % world_size;
  int64_t at = 0;
  for (int p = 0; p < world_size; ++p) {
    begin_.push_back(at);
    at += q + (p < m ? 1 : 0);
    end_.push_back(at);
  }
}

Range StaticPartition::range(int partition) const { return Range{begin_[partition], end_[partition]}; }

BlockPartition::BlockPartition(int64_t n, int world_size)
    : n_(n),
      world_size_(world_size),
      block_size_((n / kBlocks) - (n / kBlocks) % 32),
      leftover_(n - kBlocks * ((n / kBlocks) - (n / kBlocks) % 32)),
      min_blocks_(static_cast<double>(kBlocks) / (4.0 * world_size)) {
  GS_CHECK(world_size >= 1, ValueError, "partition: world size must be >= 1, got ", world_size);
  const int q = kBlocks / world_size, m = kBlocks % world_size;
  count_.resize(world_size);
  for (int p = 0; p < world_size; ++p) count_[p] = q + (p < m ? 1 : 0);
  position_.resize(world_size);
  std::exclusive_scan(count_.begin(), count_.end(), position_.begin(), int64_t{0});
}

Range BlockPartition::range(int partition) const {
  const int64_t begin = position_[partition] * block_size_;
  int64_t end = (position_[partition] + count_[partition]) * block_size_;
  if (partition == world_size_ - 1) end += leftover_;
  return Range{begin, end};
}

void BlockPartition::set_blocks(const std::vector<int64_t>& counts) {
  GS_CHECK(static_cast<int>(counts.size()) == world_size_ &&
               std::accumulate(counts.begin(), counts.end(), int64_t{0}) == kBlocks,
           ValueError, "ExDyna: a saved block layout must have ", world_size_, " partitions holding ", kBlocks,
           " blocks");
  count_ = counts;
  std::exclusive_scan(count_.begin(), count_.end(), position_.begin(), int64_t{0});
}

void BlockPartition::rebalance(const std::vector<int64_t>& counts_by_rank, int64_t t, int64_t k_prev) {
  const int p = world_size_;
  if (p < 2 || n_ <= 0) return;
  // In step t, rank i worked on partition (t + i) mod P: its count is that partition's load.
  std::vector<int64_t> load(p, 0);
  for (int i = 0; i < p; ++i) load[partition_of(t, i, p)] = counts_by_rank[i];
  const int64_t k_avg = k_prev / p;
  if (k_avg <= 0) return;
  // floor(sz K_prev / n) in integers (exact; sz (K_prev / n) in floating point can fall just
  // below a whole number and move one less).
  const auto move = static_cast<int64_t>(static_cast<unsigned __int128>(block_size_) *
                                         static_cast<unsigned __int128>(k_prev) / static_cast<unsigned __int128>(n_));
  for (int i = 0; i + 1 < p; ++i) {
    const double left = static_cast<double>(load[i]) / static_cast<double>(k_avg);
    const double right = static_cast<double>(load[i + 1]) / static_cast<double>(k_avg);
    if (left > 1.05 && right < 0.95238) {  // move the last block of i to i + 1
      if (static_cast<double>(count_[i] - 1) < min_blocks_) continue;
      --count_[i];
      ++count_[i + 1];
      --position_[i + 1];
      load[i] -= move;
      load[i + 1] += move;
    } else if (left < 0.95238 && right > 1.05) {  // move the first block of i + 1 to i
      if (static_cast<double>(count_[i + 1] - 1) < min_blocks_) continue;
      ++count_[i];
      --count_[i + 1];
      ++position_[i + 1];
      load[i] += move;
      load[i + 1] -= move;
    }
  }
}

}  // namespace gradsparse
