// Partition allocation for the exclusive-selection methods (docs/method-spec.md 4.8 and 4.9):
// the bucket is split into P contiguous, disjoint partitions, and rank r works on partition
// (t + r) mod P at step t, so every rank visits every partition.
#pragma once

#include <cstdint>
#include <vector>

#include "gradsparse/kernels.h"

namespace gradsparse {

/// The partition rank `rank` works on at step t.
inline int partition_of(int64_t t, int rank, int world_size) {
  return static_cast<int>((t % world_size + rank) % world_size);
}

/// MiCRO's static split (§2): q = n div P elements each, the first n mod P partitions one more.
class StaticPartition {
 public:
  StaticPartition(int64_t n, int world_size);
  Range range(int partition) const;
  int size() const { return static_cast<int>(begin_.size()); }
  int64_t numel() const { return end_.empty() ? 0 : end_.back(); }

 private:
  std::vector<int64_t> begin_;
  std::vector<int64_t> end_;
};

/// ExDyna's block-based dynamic allocation (§1.1, §1.2 step 2): 1024 blocks of `block_size`
/// elements (a multiple of 32), the leftover elements always in the last partition; after each
/// step neighbouring partitions trade at most one block to even out their selection counts.
class BlockPartition {
 public:
  static constexpr int kBlocks = 1024;

  BlockPartition(int64_t n, int world_size);
  Range range(int partition) const;
  /// Rebalances from the counts of the step `t` that just ended (counts indexed by rank) and its
  /// total `k_prev`.
  void rebalance(const std::vector<int64_t>& counts_by_rank, int64_t t, int64_t k_prev);

  int size() const { return world_size_; }
  int64_t numel() const { return n_; }
  int64_t block_size() const { return block_size_; }
  int64_t leftover() const { return leftover_; }
  const std::vector<int64_t>& blocks() const { return count_; }
  const std::vector<int64_t>& positions() const { return position_; }
  /// Restores a layout (checkpoints).
  void set_blocks(const std::vector<int64_t>& counts);

 private:
  int64_t n_;
  int world_size_;
  int64_t block_size_;
  int64_t leftover_;
  double min_blocks_;
  std::vector<int64_t> count_;     // blocks per partition
  std::vector<int64_t> position_;  // first block of each partition (prefix sums of count_)
};

}  // namespace gradsparse
