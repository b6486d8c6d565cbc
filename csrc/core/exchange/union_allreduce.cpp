// Union + all-reduce (exchange.h): every rank's index list reaches every rank, and one all-reduce
// sums every rank's own values on the sorted union of the lists, so every rank's value of every
// selected element counts, not only the value of the rank that selected it.
#include "gradsparse/exchange.h"

namespace gradsparse {
namespace {

/// The indices of a bare message of `count` pairs (its values follow them, so they are a prefix
/// of the message): what travels in the first collective.
size_t index_part_bytes(int64_t count, const BucketView& bucket) {
  return MessageLayout(static_cast<uint64_t>(count), index_bytes_for(bucket.numel), bucket.dtype, /*bare=*/true)
      .values_offset;
}

class UnionAllreduce final : public Exchange {
 public:
  ExchangeKind kind() const override { return ExchangeKind::kUnionAllreduce; }
  bool selection_zeroes() const override { return false; }
  bool takes_agreed_words() const override { return true; }

  ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket,
                     const Selection& mine) const override {
    ExchangeResult result = agree(transport, device, bucket, mine);
    if (result.aborted) return result;
    const int p = transport.size();
    // Only the index lists travel first, bare (a message's values follow its indices).
    const std::vector<size_t> sizes =
        block_sizes(result, [&](const ControlWord& w) { return index_part_bytes(w.count, bucket); });
    const std::vector<size_t> offsets = block_offsets(sizes);
    const Buffer recv = allgather_blocks(transport, device, mine, sizes);

    // Every rank's index list on the host at once (one wait, not one per rank).
    const HostBytes host(device, recv.data(), offsets.back());
    std::vector<std::vector<int64_t>> lists;
    for (int r = 0; r < p; ++r) {
      const HostMessage indices(
          bare_view(host.data() + offsets[r], result.control[r].count, bucket.dtype, bucket.numel, 0, r));
      indices.check_indices();  // only the indices of rank r's message arrived: index_list reads no value
      lists.push_back(indices.index_list());
    }
    const std::vector<int64_t> all = ascending_union(std::move(lists));
    result.union_size = static_cast<int64_t>(all.size());

    Selection u = device.gather(bucket, all);  // this rank's own values on the union
    const MessageView view = u.view(bucket);
    float divisor = static_cast<float>(p);
    if (u.count > 0) {  // every rank knows the union's size: all skip together
      divisor = allreduce_values(transport, device, u.message.as<unsigned char>() + view.layout().values_offset,
                                 u.count, bucket.dtype, result);
      if (result.aborted) return result;  // the output and the residual as they were
    }
    clear_output(device, bucket);
    device.scatter_add(view, bucket.grad, divisor);
    if (bucket.taken != nullptr) *bucket.taken = device.gather(bucket, all);  // before the union is zeroed
    device.zero_at(bucket, view);                                             // every rank zeroes the whole union
    return result;
  }
};

}  // namespace

const Exchange& union_allreduce() {
  static const UnionAllreduce exchange;
  return exchange;
}

}  // namespace gradsparse
