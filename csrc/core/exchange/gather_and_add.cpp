// Gather-and-add and its fixed-size variant (exchange.h): every rank receives every rank's pairs
// and adds them, divided by the world size, in rank order (float16 and bfloat16 in float32 sums,
// rounded once: add_messages), so the result is bit-identical on every rank.
#include <cstddef>

#include "gradsparse/exchange.h"

namespace gradsparse {
namespace {

/// The output: the sum of every message / P, in rank order.
void add_all(Device& device, const BucketView& bucket, const std::vector<MessageView>& messages,
             ExchangeResult& result) {
  add_messages(device, messages, bucket.grad, bucket.numel, bucket.dtype, static_cast<float>(messages.size()));
  result.union_size = result.total_count();
}

/// Gather-and-add, and the exclusive gather (the same algorithm, named for disjoint selections).
class GatherAndAdd final : public Exchange {
 public:
  explicit GatherAndAdd(ExchangeKind kind) : kind_(kind) {}
  ExchangeKind kind() const override { return kind_; }
  const Exchange& for_shard() const override { return sparse_reduce_scatter(); }
  bool takes_agreed_words() const override { return true; }

  ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket,
                     const Selection& mine) const override {
    ExchangeResult result = agree(transport, device, bucket, mine);
    if (result.aborted) return result;
    // Every rank's message travels bare: its control word fixed its count.
    const std::vector<size_t> sizes =
        block_sizes(result, [&](const ControlWord& w) { return message_bytes(w.count, bucket, /*bare=*/true); });
    const Buffer recv = allgather_blocks(transport, device, mine, sizes);
    const std::vector<size_t> offsets = block_offsets(sizes);
    std::vector<MessageView> messages;
    for (size_t r = 0; r < sizes.size(); ++r)
      messages.push_back(bare_view(recv.as<unsigned char>() + offsets[r], result.control[r].count, bucket.dtype,
                                   bucket.numel, 0, static_cast<int>(r)));
    add_all(device, bucket, messages, result);
    return result;
  }

 private:
  ExchangeKind kind_;
};

/// Every rank's message holds the same known count (this rank's), so one fixed-size all-gather
/// moves them with no control words; the non-finite counts travel in the message headers, so
/// every rank still sees every rank's count before it writes anything.
class FixedGather final : public Exchange {
 public:
  ExchangeKind kind() const override { return ExchangeKind::kFixedGather; }
  const Exchange& for_shard() const override { return sparse_reduce_scatter(); }

  ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket,
                     const Selection& mine) const override {
    const int p = transport.size();
    if (mine.nonfinite > 0) {  // rare: tell the others through the header
      const uint64_t nonfinite = static_cast<uint64_t>(mine.nonfinite);
      device.copy_from_host(mine.message.as<unsigned char>() + offsetof(MessageHeader, nonfinite), &nonfinite,
                            sizeof(nonfinite));
    }
    Buffer recv = device.allocate(mine.bytes * p);
    transport.allgather(device, mine.message.data(), recv.data(), mine.bytes);
    ExchangeResult result;
    result.control.assign(p, ControlWord{mine.count, 0, 0});
    std::vector<MessageView> messages;
    for (int r = 0; r < p; ++r) {
      const MessageView m = read_message(device, recv.as<unsigned char>() + mine.bytes * r, mine.bytes, bucket.dtype,
                                         static_cast<uint64_t>(bucket.numel), r);
      GS_CHECK(m.count == mine.count, CorruptMessageError, "sparse message from rank ", r, " holds ", m.count,
               " pairs where every rank sends ", mine.count);
      result.control[r].nonfinite = m.nonfinite;
      check_control_word(result.control[r], bucket, /*with_message=*/true, r);  // the header's non-finite count
      messages.push_back(m);
    }
    result.aborted = !result.nonfinite_ranks().empty();
    if (!result.aborted) add_all(device, bucket, messages, result);
    return result;
  }
};

}  // namespace

const Exchange& gather_and_add() {
  static const GatherAndAdd exchange(ExchangeKind::kGatherAndAdd);
  return exchange;
}

const Exchange& exclusive_gather() {
  static const GatherAndAdd exchange(ExchangeKind::kExclusiveGather);
  return exchange;
}

const Exchange& fixed_gather() {
  static const FixedGather exchange;
  return exchange;
}

}  // namespace gradsparse
