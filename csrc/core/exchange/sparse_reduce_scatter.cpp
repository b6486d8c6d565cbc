// The sparse reduce-scatter (exchange.h): each rank's pairs go only to the owner of their shard.
#include "gradsparse/exchange.h"
#include "gradsparse/owners.h"

namespace gradsparse {
namespace {

class SparseReduceScatter final : public Exchange {
 public:
  ExchangeKind kind() const override { return ExchangeKind::kSparseReduceScatter; }

  void check(const BucketView& bucket, int world_size) const override {
    GS_CHECK(bucket.numel % world_size == 0, ValueError, "sparse reduce-scatter: a bucket of ", bucket.numel,
             " elements does not split into ", world_size,
             " equal shards; pad it to a multiple of the world size (FSDP does)");
  }

  ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket,
                     const Selection& mine) const override {
    const int p = transport.size(), me = transport.rank();
    check(bucket, p);
    const int64_t shard = bucket.numel / p;
    const Shards shards(bucket.numel, p);
    const OwnerParts parts = split_by_owner(device, bucket, mine, shards);

    // Control: every rank's non-finite count and its pair count for each owner, count_bytes wide.
    std::vector<int64_t> mine_row{mine.nonfinite};
    mine_row.insert(mine_row.end(), parts.counts.begin(), parts.counts.end());
    const size_t row = mine_row.size();  // P + 1
    const std::vector<int64_t> table =
        allgather_counts(transport, device, mine_row, count_bytes(static_cast<uint64_t>(bucket.numel)));
    ExchangeResult result;
    result.control.resize(static_cast<size_t>(p));
    for (int r = 0; r < p; ++r) {
      const int64_t* words = table.data() + static_cast<size_t>(r) * row;
      int64_t total = 0;
      for (int o = 0; o < p; ++o) {
        GS_CHECK(words[1 + o] >= 0 && words[1 + o] <= shard, CorruptMessageError, "control word from rank ", r,
                 " announces ", words[1 + o], " pairs for the shard of rank ", o, ", which holds ", shard, " elements");
        total += words[1 + o];
      }
      result.control[r] = ControlWord{total, words[0], 0};
      check_control_word(result.control[r], bucket, /*with_message=*/true, r);  // the non-finite count's range
    }
    if (!result.nonfinite_ranks().empty()) {
      result.aborted = true;
      return result;
    }

    // Data: each owner receives every rank's pairs in its shard (rank me + s sends to me in round s).
    std::vector<int64_t> counts(static_cast<size_t>(p));
    for (int r = 0; r < p; ++r) counts[r] = table[static_cast<size_t>(r) * row + 1 + static_cast<size_t>(me)];
    Buffer received;
    const std::vector<MessageView> incoming =
        route_to_owners(transport, device, bucket, parts, shards, counts, received);
    clear_output(device, bucket);
    void* owned = static_cast<unsigned char*>(bucket.grad) + static_cast<size_t>(me * shard) * dtype_size(bucket.dtype);
    add_messages(device, incoming, owned, shard, bucket.dtype, static_cast<float>(p));
    result.union_size = result.total_count();
    return result;
  }
};

}  // namespace

const Exchange& sparse_reduce_scatter() {
  static const SparseReduceScatter exchange;
  return exchange;
}

}  // namespace gradsparse
