// Shared indices (exchange.h): every rank drew the same indices (Random-k, Random-block), so only
// the values travel, in one all-reduce; the digests in the control words check the premise.

#include "gradsparse/exchange.h"

namespace gradsparse {
namespace {

/// index_digest() of a selection's indices: kept by the method that drew them, or hashed from its
/// message.
int64_t digest_of(Device& device, const Selection& selection, const BucketView& bucket) {
  if (selection.index_digest) return *selection.index_digest;
  const std::vector<int64_t> indices = HostMessage(device, selection, bucket).index_list();
  return index_digest(indices.data(), indices.size());
}

class SharedIndices final : public Exchange {
 public:
  ExchangeKind kind() const override { return ExchangeKind::kSharedIndices; }

  ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket,
                     const Selection& mine) const override {
    ControlWord word = control_word(mine);
    word.index_digest = digest_of(device, mine, bucket);
    ExchangeResult result = agree(transport, device, bucket, word, /*with_message=*/true, /*with_digest=*/true);
    if (result.aborted) return result;
    for (size_t r = 1; r < result.control.size(); ++r) {
      GS_CHECK(result.control[r].count == result.control[0].count &&
                   result.control[r].index_digest == result.control[0].index_digest,
               CorruptMessageError, "the shared exchange needs the same indices on every rank, but rank ", r,
               " selected other indices than rank 0 (", result.control[r].count, " against ", result.control[0].count,
               ")");
    }
    // The values are summed in a copy of the message: the selection stays as it was made, which
    // a step that fails in the all-reduce gives back to the residual (reduce_bucket).
    MessageView view = mine.view(bucket);
    Buffer summed;
    float divisor = static_cast<float>(transport.size());
    if (mine.count > 0) {  // every rank has the same count: all skip together
      summed = device.allocate(mine.bytes);
      device.copy(summed.data(), mine.message.data(), mine.bytes);
      view.data = summed.as<unsigned char>();
      divisor = allreduce_values(transport, device, summed.as<unsigned char>() + view.layout().values_offset,
                                 mine.count, bucket.dtype, result);
      if (result.aborted) return result;  // the output as it was; reduce_bucket gives the selection back
    }
    clear_output(device, bucket);
    device.scatter_add(view, bucket.grad, divisor);
    result.union_size = mine.count;
    return result;
  }
};

}  // namespace

const Exchange& shared_indices() {
  static const SharedIndices exchange;
  return exchange;
}

}  // namespace gradsparse
