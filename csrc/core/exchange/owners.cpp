// Routing pairs to the owners of their shards (owners.h).
#include "gradsparse/owners.h"

#include <algorithm>
#include <cstring>

namespace gradsparse {

OwnerParts split_by_owner(Device& device, const BucketView& bucket, const Selection& mine, const Shards& shards) {
  const int p = shards.p;
  const HostMessage in(device, mine, bucket);
  const MessageView& whole = in.view();
  const size_t value_size = dtype_size(bucket.dtype);
  std::vector<int64_t> begin(static_cast<size_t>(p) + 1);
  dispatch_index(whole.index_bytes, [&](auto i) {
    using I = decltype(i);
    const I* idx = in.indices<I>();
    for (int o = 0; o <= p; ++o) {
      const uint64_t bound = static_cast<uint64_t>(o < p ? shards.begin(o) : shards.n);
      begin[o] = std::lower_bound(idx, idx + whole.count, bound,
                                  [](I index, uint64_t b) { return static_cast<uint64_t>(index) < b; }) -
                 idx;
    }
  });
  OwnerParts out;
  std::vector<size_t> sizes(static_cast<size_t>(p));
  for (int o = 0; o < p; ++o) {
    out.counts.push_back(begin[o + 1] - begin[o]);
    sizes[o] = MessageLayout(static_cast<uint64_t>(out.counts[o]), index_bytes_for(shards.length(o)), bucket.dtype,
                             /*bare=*/true)
                   .total_bytes;
  }
  out.offsets = block_offsets(sizes);
  out.bytes.assign(out.offsets.back(), 0);
  for (int o = 0; o < p; ++o) {
    const uint64_t count = static_cast<uint64_t>(out.counts[o]);
    if (count == 0) continue;  // an empty part is no bytes (and every part may be: no buffer at all)
    unsigned char* m = out.bytes.data() + out.offsets[o];
    const int index_bytes = index_bytes_for(static_cast<uint64_t>(shards.length(o)));
    const MessageLayout part(count, index_bytes, bucket.dtype, /*bare=*/true);
    const uint64_t first = static_cast<uint64_t>(shards.begin(o));
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
  return out;
}

std::vector<int64_t> exchange_part_counts(Transport& transport, Device& device, const OwnerParts& parts,
                                          const Shards& shards, const std::vector<int64_t>& most) {
  const int p = shards.p, me = transport.rank();
  const size_t width = count_bytes(static_cast<uint64_t>(shards.chunk));  // no shard is longer
  std::vector<int64_t> counts(static_cast<size_t>(p), 0);
  counts[me] = parts.counts[me];
  Buffer send = device.allocate(width), recv = device.allocate(width);
  for (int s = 1; s < p; ++s) {
    const int dst = (me + s) % p, src = (me - s + p) % p;
    unsigned char out[8], in[8];
    write_count(out, parts.counts[dst], width);
    device.copy_from_host(send.data(), out, width);
    transport.sendrecv(device, send.data(), width, dst, recv.data(), width, src);
    device.copy_to_host(in, recv.data(), width);
    counts[src] = read_count(in, width);
  }
  const int64_t length = shards.length(me);
  for (int r = 0; r < p; ++r) {
    GS_CHECK(counts[r] >= 0 && counts[r] <= std::min(most[r], length), CorruptMessageError, "rank ", r,
             " announced a part of ", counts[r], " pairs for the shard of rank ", me, ", where it can send at most ",
             std::min(most[r], length));
  }
  return counts;
}

std::vector<MessageView> route_to_owners(Transport& transport, Device& device, const BucketView& bucket,
                                         const OwnerParts& parts, const Shards& shards,
                                         const std::vector<int64_t>& counts, Buffer& storage) {
  const int p = shards.p, me = transport.rank();
  const int64_t length = shards.length(me);
  std::vector<size_t> sizes;
  for (int64_t count : counts) {
    sizes.push_back(MessageLayout(static_cast<uint64_t>(count), index_bytes_for(static_cast<uint64_t>(length)),
                                  bucket.dtype, /*bare=*/true)
                        .total_bytes);
  }
  const std::vector<size_t> at = block_offsets(sizes);
  Buffer send = device.allocate(parts.bytes.size());
  storage = device.allocate(at.back());
  device.copy_from_host(send.data(), parts.bytes.data(), parts.bytes.size());
  device.copy(storage.as<unsigned char>() + at[me], send.as<unsigned char>() + parts.offsets[me], sizes[me]);
  for (int s = 1; s < p; ++s) {
    const int dst = (me + s) % p, src = (me - s + p) % p;
    transport.sendrecv(device, send.as<unsigned char>() + parts.offsets[dst], parts.size(dst), dst,
                       storage.as<unsigned char>() + at[src], sizes[src], src);
  }
  std::vector<MessageView> received;
  for (int r = 0; r < p; ++r)
    received.push_back(bare_view(storage.as<unsigned char>() + at[r], counts[r], bucket.dtype, length, 0, r));
  return received;
}

}  // namespace gradsparse
