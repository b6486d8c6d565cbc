// Partition layouts of MiCRO (static) and ExDyna (blocks, rebalanced).
#include <gtest/gtest.h>

#include <numeric>

#include "gradsparse/partition.h"

using namespace gradsparse;

TEST(StaticPartition, SplitsEvenlyWithTheRemainderFirst) {
  StaticPartition p(10, 3);
  EXPECT_EQ(p.range(0).begin, 0);
  EXPECT_EQ(p.range(0).end, 4);
  EXPECT_EQ(p.range(1).end, 7);
  EXPECT_EQ(p.range(2).end, 10);
  StaticPartition tiny(2, 4);  // fewer elements than ranks: empty partitions
  EXPECT_EQ(tiny.range(2).begin, tiny.range(2).end);
  EXPECT_EQ(partition_of(5, 2, 4), 3);
}

TEST(BlockPartition, MatchesTheWorkedExampleOfTheOriginal) {
  // ResNet-18's 11,173,962 elements on 4 ranks; counts by rank at t = 0 of 20000, 5000, 10000,
  // 9000: partition 0 gives one block to partition 1 (verified against the original code).
  BlockPartition p(11173962, 4);
  EXPECT_EQ(p.block_size(), 10912);
  EXPECT_EQ(p.leftover(), 74);
  EXPECT_EQ(p.blocks(), (std::vector<int64_t>{256, 256, 256, 256}));
  p.rebalance({20000, 5000, 10000, 9000}, /*t=*/0, /*k_prev=*/44000);
  EXPECT_EQ(p.blocks(), (std::vector<int64_t>{255, 257, 256, 256}));
  EXPECT_EQ(p.positions(), (std::vector<int64_t>{0, 255, 512, 768}));
  EXPECT_EQ(p.range(1).begin, 2782560);
  EXPECT_EQ(p.range(1).end, 5586944);
  EXPECT_EQ(p.range(3).end, 11173962);  // the leftover stays in the last partition
}

TEST(BlockPartition, RespectsTheMinimumAndSmallBuckets) {
  BlockPartition p(1 << 20, 2);
  for (int t = 0; t < 2000; ++t) p.rebalance({100000, 1}, t, 100001);  // rank order swaps with t
  for (int64_t c : p.blocks()) EXPECT_GE(static_cast<double>(c), 1024.0 / 8.0);
  EXPECT_EQ(std::accumulate(p.blocks().begin(), p.blocks().end(), int64_t{0}), 1024);
  BlockPartition small(1000, 3);  // fewer than 32 * 1024 elements: blocks are empty
  EXPECT_EQ(small.block_size(), 0);
  EXPECT_EQ(small.range(0).begin, small.range(0).end);
  EXPECT_EQ(small.range(2).end, 1000);  // the last partition owns everything
}

TEST(BlockPartition, MovesFloorOfBlockSizeTimesCountOverSize) {
  // k_move = floor(sz K_prev / n) (docs/method-spec.md 4.9) = floor(1504 * 3072 / 1540096) = 3,
  // where sz * (K_prev / n) in floating point is 2.9999...: with 2, partition 1's running load
  // (729 + 2 = 731 of an average 768) stays below 0.95238 and takes a block from partition 2 too,
  // whose load then no longer gives one to partition 3.
  BlockPartition p(1540096, 4);
  ASSERT_EQ(p.block_size(), 1504);
  p.rebalance({807, 729, 807, 729}, /*t=*/0, /*k_prev=*/3072);
  EXPECT_EQ(p.blocks(), (std::vector<int64_t>{255, 257, 255, 257}));
}
