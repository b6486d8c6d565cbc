// Reduce-scatter + all-gather (exchange.h): a sparse all-reduce whose bytes per rank do not grow
// with the world size. Each rank sends every selected pair once, to the owner of its shard; each
// owner averages what it received, keeps the values that make the global top K of the average
// (K = the largest selection of any rank), and every rank gathers every owner's kept pairs. A rank
// takes back into its residual what it sent that no owner kept, so nothing is lost.
#include <algorithm>
#include <vector>

#include "gradsparse/exchange.h"
#include "gradsparse/numeric.h"
#include "gradsparse/owners.h"

namespace gradsparse {
namespace {

constexpr int kBins = 1024;  // magnitude bins of the global threshold: 2^(1/4) apart

/// The bin of a magnitude: the top 10 bits of its float32 key (8 exponent, 2 mantissa bits).
int magnitude_bin(float v) { return static_cast<int>(Num<float>::key(v) >> 21); }

/// The first bin of the kept values: the highest bin from which the bins above hold at least
/// `budget` values (0, keeping everything, when all of them hold fewer).
int first_kept_bin(const std::vector<double>& histogram, int64_t budget) {
  double above = 0.0;
  for (int b = kBins - 1; b > 0; --b) {
    above += histogram[b];
    if (above >= static_cast<double>(budget)) return b;
  }
  return 0;
}

class ReduceScatterAllgather final : public Exchange {
 public:
  ExchangeKind kind() const override { return ExchangeKind::kReduceScatterAllgather; }
  const Exchange& for_shard() const override { return sparse_reduce_scatter(); }
  bool takes_agreed_words() const override { return true; }

  ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket,
                     const Selection& mine) const override {
    ExchangeResult result = agree(transport, device, bucket, mine);
    if (result.aborted) return result;
    const int p = transport.size(), me = transport.rank();
    const Shards shards(bucket.numel, p);
    std::vector<int64_t> counts_by_rank;  // each rank's selection: the most it can send an owner
    for (const ControlWord& w : result.control) counts_by_rank.push_back(w.count);
    const int64_t budget = *std::max_element(counts_by_rank.begin(), counts_by_rank.end());

    // 1. Reduce-scatter: every rank's pairs in this rank's shard, averaged.
    const OwnerParts parts = split_by_owner(device, bucket, mine, shards);
    const std::vector<int64_t> counts_in = exchange_part_counts(transport, device, parts, shards, counts_by_rank);
    Buffer received;
    const std::vector<MessageView> incoming =
        route_to_owners(transport, device, bucket, parts, shards, counts_in, received);
    const int64_t length = shards.length(me);
    Buffer sum = device.allocate(static_cast<size_t>(length) * dtype_size(bucket.dtype));
    add_messages(device, incoming, sum.data(), length, bucket.dtype, static_cast<float>(p));  // checks every index
    std::vector<std::vector<int64_t>> lists;
    for (const MessageView& m : incoming) lists.push_back(HostMessage(device, m).index_list());
    const std::vector<int64_t> touched = ascending_union(std::move(lists));  // shard-local
    // Read as stored (the sum as the residual): a selection value without one reads Inf as zero,
    // which would hand back 0 where gather-and-add hands back an average past the dtype's range.
    const Selection reduced = device.gather(BucketView{bucket.dtype, length, sum.data(), sum.data()}, touched);
    const std::vector<float> values = HostMessage(device, reduced.view(bucket.dtype, length)).value_list();

    // 2. The global top K of the average: one threshold bin for every owner, from the summed
    //    histogram of every owner's values.
    std::vector<double> histogram(kBins, 0.0);
    for (float v : values) histogram[magnitude_bin(v)] += 1.0;
    allreduce_host(transport, device, histogram);
    const int first = first_kept_bin(histogram, budget);
    std::vector<int64_t> kept_index;
    std::vector<float> kept_value;
    for (size_t j = 0; j < values.size(); ++j) {
      if (magnitude_bin(values[j]) < first) continue;
      kept_index.push_back(shards.begin(me) + touched[j]);
      kept_value.push_back(values[j]);
    }

    // 3. All-gather every owner's kept pairs (counts first, then the bare messages), into the
    //    cleared output.
    const Selection kept =
        device.emit(BucketView{bucket.dtype, bucket.numel, nullptr, nullptr}, kept_index, kept_value, /*zero=*/false);
    const std::vector<int64_t> counts =
        allgather_counts(transport, device, {kept.count}, count_bytes(static_cast<uint64_t>(shards.chunk)));
    std::vector<size_t> sizes;
    for (int r = 0; r < p; ++r) {
      GS_CHECK(counts[r] >= 0 && counts[r] <= shards.length(r), CorruptMessageError, "rank ", r, " announces ",
               counts[r], " kept pairs for its shard of ", shards.length(r), " elements");
      sizes.push_back(static_cast<size_t>(message_bytes(counts[r], bucket, /*bare=*/true)));
    }
    const Buffer gathered = allgather_blocks(transport, device, kept, sizes);
    const std::vector<size_t> offsets = block_offsets(sizes);
    clear_output(device, bucket);
    std::vector<int64_t> global;  // every kept index, ascending (the owners' shards ascend)
    for (int r = 0; r < p; ++r) {
      const MessageView m =
          bare_view(gathered.as<unsigned char>() + offsets[r], counts[r], bucket.dtype, bucket.numel, 0, r);
      device.scatter_add(m, bucket.grad, 1.0f);  // checks every index first (in range, ascending)
      const std::vector<int64_t> index = HostMessage(device, m).index_list();
      GS_CHECK(index.empty() || (index.front() >= shards.begin(r) && index.back() < shards.begin(r) + shards.length(r)),
               CorruptMessageError, message_source(r), " holds pairs outside its shard");
      global.insert(global.end(), index.begin(), index.end());
    }
    result.union_size = static_cast<int64_t>(global.size());

    // 4. What this rank sent and no owner kept goes back into its residual (zeroed there by the
    //    selection, so the values come back exactly).
    if (bucket.residual != nullptr && mine.count > 0) {
      const HostMessage own(device, mine, bucket);
      const std::vector<int64_t> index = own.index_list();
      const std::vector<float> value = own.value_list();
      std::vector<int64_t> dropped_index;
      std::vector<float> dropped_value;
      for (size_t j = 0, g = 0; j < index.size(); ++j) {
        while (g < global.size() && global[g] < index[j]) ++g;
        if (g < global.size() && global[g] == index[j]) continue;
        dropped_index.push_back(index[j]);
        dropped_value.push_back(value[j]);
      }
      if (!dropped_index.empty()) {
        const Selection back = device.emit(BucketView{bucket.dtype, bucket.numel, nullptr, nullptr}, dropped_index,
                                           dropped_value, /*zero=*/false);
        device.scatter_add(back.view(bucket), bucket.residual, 1.0f);
      }
    }
    return result;
  }
};

}  // namespace

const Exchange& reduce_scatter_allgather() {
  static const ReduceScatterAllgather exchange;
  return exchange;
}

}  // namespace gradsparse
