// Shared indices (exchange.h): every rank drew the same indices (Random-k, Random-block), so only
// the values travel, in one all-reduce; the digests in the control words check the premise.
#include <cstring>

#include "gradsparse/exchange.h"
#include "gradsparse/rng.h"

namespace gradsparse {
namespace {

/// A 64-bit digest of a selection's indices.
int64_t index_digest(Device& device, const Selection& selection, const BucketView& bucket) {
  uint64_t digest = mix64(static_cast<uint64_t>(selection.count));
  for (int64_t index : HostMessage(device, selection, bucket).index_list())
    digest = mix64(digest ^ static_cast<uint64_t>(index));
  return static_cast<int64_t>(digest);
}

class SharedIndices final : public Exchange {
 public:
  ExchangeKind kind() const override { return ExchangeKind::kSharedIndices; }

  ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket,
                     const Selection& mine) const override {
    ControlWord word = control_word(mine);
    word.index_digest = index_digest(device, mine, bucket);
    ExchangeResult result = agree(transport, device, bucket, word);
    if (result.aborted) return result;
    for (size_t r = 1; r < result.control.size(); ++r) {
      GS_CHECK(result.control[r].count == result.control[0].count &&
                   result.control[r].index_digest == result.control[0].index_digest,
               CorruptMessageError, "the shared exchange needs the same indices on every rank, but rank ", r,
               " selected other indices than rank 0 (", result.control[r].count, " against ", result.control[0].count,
               ")");
    }
    const MessageView view = mine.view(bucket);
    if (mine.count > 0) {  // every rank has the same count: all skip together
      transport.allreduce_sum(device, mine.message.as<unsigned char>() + view.layout().values_offset,
                              static_cast<size_t>(mine.count), bucket.dtype);
    }
    clear_output(device, bucket);
    device.scatter_add(view, bucket.grad, static_cast<float>(transport.size()));
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
