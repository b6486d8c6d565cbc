// The sparse reduce-scatter (exchange.h): each rank's pairs go only to the owner of their shard.
#include <algorithm>
#include <cstring>

#include "gradsparse/exchange.h"

namespace gradsparse {
namespace {

/// This rank's selection split at the shard boundaries: one message per owner, its indices local
/// to the owner's shard, laid back to back in `out` (each a multiple of 8 bytes); returns each
/// owner's pair count.
std::vector<int64_t> split_by_owner(Device& device, const BucketView& bucket, const Selection& mine, int p,
                                    std::vector<unsigned char>& out, std::vector<size_t>& offsets) {
  const int64_t shard = bucket.numel / p;
  const HostMessage in(device, mine, bucket);
  const MessageView& whole = in.view();
  const int index_bytes = index_bytes_for(static_cast<uint64_t>(shard));
  const size_t value_size = dtype_size(bucket.dtype);
  std::vector<int64_t> begin(static_cast<size_t>(p) + 1), counts(static_cast<size_t>(p));
  dispatch_index(whole.index_bytes, [&](auto i) {
    using I = decltype(i);
    const I* idx = in.indices<I>();
    for (int o = 0; o <= p; ++o) {
      const uint64_t bound = static_cast<uint64_t>(o) * static_cast<uint64_t>(shard);
      begin[o] = std::lower_bound(idx, idx + whole.count, bound,
                                  [](I index, uint64_t b) { return static_cast<uint64_t>(index) < b; }) -
                 idx;
    }
  });
  std::vector<size_t> sizes(static_cast<size_t>(p));
  for (int o = 0; o < p; ++o) {
    counts[o] = begin[o + 1] - begin[o];
    sizes[o] = MessageLayout(static_cast<uint64_t>(counts[o]), index_bytes, bucket.dtype).total_bytes;
  }
  offsets = block_offsets(sizes);
  out.assign(offsets.back(), 0);
  for (int o = 0; o < p; ++o) {
    unsigned char* m = out.data() + offsets[o];
    const uint64_t count = static_cast<uint64_t>(counts[o]);
    const MessageHeader sub = make_header(bucket.dtype, index_bytes, static_cast<uint64_t>(shard), count);
    std::memcpy(m, &sub, sizeof(sub));
    const MessageLayout part(count, index_bytes, bucket.dtype);
    const uint64_t first = static_cast<uint64_t>(o) * static_cast<uint64_t>(shard);
    dispatch_index(whole.index_bytes, [&](auto i) {
      using I = decltype(i);
      const I* idx = in.indices<I>() + begin[o];
      dispatch_index(index_bytes, [&](auto j) {
        using J = decltype(j);
        J* local = reinterpret_cast<J*>(m + part.indices_offset);
        for (uint64_t n = 0; n < count; ++n) local[n] = static_cast<J>(static_cast<uint64_t>(idx[n]) - first);
      });
    });
    std::memcpy(m + part.values_offset,
                static_cast<const unsigned char*>(whole.values()) + static_cast<size_t>(begin[o]) * value_size,
                count * value_size);
  }
  return counts;
}

class SparseReduceScatter final : public Exchange {
 public:
  ExchangeKind kind() const override { return ExchangeKind::kSparseReduceScatter; }

  ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket,
                     const Selection& mine) const override {
    const int p = transport.size(), me = transport.rank();
    GS_CHECK(bucket.numel % p == 0, ValueError, "sparse reduce-scatter: a bucket of ", bucket.numel,
             " elements does not split into ", p, " equal shards; pad it to a multiple of the world size (FSDP does)");
    const int64_t shard = bucket.numel / p;
    std::vector<unsigned char> parts;
    std::vector<size_t> offsets;
    const std::vector<int64_t> counts = split_by_owner(device, bucket, mine, p, parts, offsets);

    // Control: every rank's non-finite count and its pair count for each owner.
    const size_t row = static_cast<size_t>(p) + 1;
    std::vector<int64_t> table(row * static_cast<size_t>(p));
    {
      std::vector<int64_t> mine_row(row);
      mine_row[0] = mine.nonfinite;
      std::copy(counts.begin(), counts.end(), mine_row.begin() + 1);
      Buffer send = device.allocate(row * 8), recv = device.allocate(row * 8 * static_cast<size_t>(p));
      device.copy_from_host(send.data(), mine_row.data(), row * 8);
      transport.allgather(device, send.data(), recv.data(), row * 8);
      device.copy_to_host(table.data(), recv.data(), table.size() * 8);
    }
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
      GS_CHECK(words[0] >= 0 && words[0] <= bucket.numel, CorruptMessageError, "control word from rank ", r,
               " announces ", words[0], " non-finite values in a bucket of ", bucket.numel, " elements");
      const auto bytes = MessageLayout(static_cast<uint64_t>(total), index_bytes_for(bucket.numel), bucket.dtype);
      result.control[r] = ControlWord{static_cast<int64_t>(bytes.total_bytes), total, words[0], 0};
    }
    if (!result.nonfinite_ranks().empty()) {
      result.aborted = true;
      return result;
    }

    // Data: each owner receives every rank's pairs in its shard (rank me + s sends to me in round s).
    const int index_bytes = index_bytes_for(static_cast<uint64_t>(shard));
    std::vector<size_t> sizes(static_cast<size_t>(p));
    for (int r = 0; r < p; ++r) {
      const int64_t count = table[static_cast<size_t>(r) * row + 1 + static_cast<size_t>(me)];
      sizes[r] = MessageLayout(static_cast<uint64_t>(count), index_bytes, bucket.dtype).total_bytes;
    }
    const std::vector<size_t> at = block_offsets(sizes);
    Buffer send = device.allocate(parts.size()), recv = device.allocate(at.back());
    device.copy_from_host(send.data(), parts.data(), parts.size());
    device.copy(recv.as<unsigned char>() + at[me], send.as<unsigned char>() + offsets[me], sizes[me]);
    for (int s = 1; s < p; ++s) {
      const int dst = (me + s) % p, src = (me - s + p) % p;
      transport.sendrecv(device, send.as<unsigned char>() + offsets[dst], offsets[dst + 1] - offsets[dst], dst,
                         recv.as<unsigned char>() + at[src], sizes[src], src);
    }
    clear_output(device, bucket);
    void* owned = static_cast<unsigned char*>(bucket.grad) + static_cast<size_t>(me * shard) * dtype_size(bucket.dtype);
    for (int r = 0; r < p; ++r) {
      const MessageView m = read_message(device, recv.as<unsigned char>() + at[r], sizes[r], bucket.dtype,
                                         static_cast<uint64_t>(shard), r);
      device.scatter_add(m, owned, static_cast<float>(p));
    }
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
