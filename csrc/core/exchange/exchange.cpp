// The exchanges of exchange.h: control words, gather-and-add, union + all-reduce, shared indices.
#include <algorithm>
#include <cstddef>
#include <cstring>

#include "gradsparse/exchange.h"
#include "gradsparse/kernels.h"
#include "gradsparse/rng.h"

namespace gradsparse {

ExchangeKind parse_exchange(const std::string& name, const std::string& option) {
  if (name == "gather") return ExchangeKind::kGather;
  if (name == "union") return ExchangeKind::kUnion;
  if (name == "shared") return ExchangeKind::kShared;
  throw ValueError(str(option, " must be \"gather\", \"union\" or \"shared\", got \"", name, "\""));
}

int64_t ExchangeResult::total_count() const {
  int64_t total = 0;
  for (const ControlWord& w : control) total += w.count;
  return total;
}

std::vector<int> ExchangeResult::nonfinite_ranks() const {
  std::vector<int> ranks;
  for (size_t r = 0; r < control.size(); ++r)
    if (control[r].nonfinite > 0) ranks.push_back(static_cast<int>(r));
  return ranks;
}

void check_control_word(const ControlWord& w, const BucketView& bucket, bool with_message, int r) {
  const int64_t n = bucket.numel;
  GS_CHECK(w.count >= 0 && w.count <= n, CorruptMessageError, "control word from rank ", r, " announces ", w.count,
           " pairs for a bucket of ", n, " elements");
  GS_CHECK(w.nonfinite >= 0 && w.nonfinite <= n, CorruptMessageError, "control word from rank ", r, " announces ",
           w.nonfinite, " non-finite values in a bucket of ", n, " elements");
  const int64_t expected =
      with_message ? static_cast<int64_t>(
                         MessageLayout(static_cast<uint64_t>(w.count), index_bytes_for(n), bucket.dtype).total_bytes)
                   : 0;
  GS_CHECK(w.message_bytes == expected && (with_message || w.count == 0), CorruptMessageError,
           "control word from rank ", r, " announces a ", w.message_bytes, "-byte message of ", w.count,
           " pairs, where that count takes ", expected, " bytes in a bucket of ", n, " elements of ",
           dtype_name(bucket.dtype));
}

std::vector<ControlWord> exchange_control(Transport& transport, Device& device, const ControlWord& mine,
                                          const BucketView& bucket, bool with_message) {
  const int p = transport.size();
  Buffer send = device.allocate(sizeof(ControlWord));
  Buffer recv = device.allocate(sizeof(ControlWord) * p);
  device.copy_from_host(send.data(), &mine, sizeof(ControlWord));
  transport.allgather(device, send.data(), recv.data(), sizeof(ControlWord));
  std::vector<ControlWord> words(p);
  device.copy_to_host(words.data(), recv.data(), sizeof(ControlWord) * p);
  for (int r = 0; r < p; ++r) check_control_word(words[r], bucket, with_message, r);
  return words;
}

int64_t index_digest(Device& device, const Selection& selection, const BucketView& bucket) {
  const MessageHeader h =
      read_device_header(device, selection.message.data(), selection.bytes, bucket.dtype, bucket.numel, -1);
  std::vector<unsigned char> indices(h.count * h.index_bytes);
  device.copy_to_host(indices.data(), selection.message.as<unsigned char>() + kMessageHeaderBytes, indices.size());
  uint64_t digest = mix64(h.count);
  for (size_t j = 0; j < h.count; ++j) {
    uint64_t v = 0;
    std::memcpy(&v, indices.data() + j * h.index_bytes, h.index_bytes);
    digest = mix64(digest ^ v);
  }
  return static_cast<int64_t>(digest);
}

namespace {

/// All-gathers the first `sizes[rank]` bytes of every rank's message, unpadded (the sizes come
/// from the control words); returns the receive buffer and each rank's offset in it.
Buffer allgather_messages(Transport& transport, Device& device, const Selection& mine, const std::vector<size_t>& sizes,
                          std::vector<size_t>& offsets) {
  offsets = block_offsets(sizes);
  Buffer recv = device.allocate(offsets.back());
  transport.allgatherv(device, mine.message.data(), recv.data(), sizes);
  return recv;
}

/// Reads rank r's header from a gathered buffer and checks it against its control word.
MessageHeader checked_header(Device& device, const void* message, size_t bytes, const BucketView& bucket,
                             const ControlWord& control, int r) {
  const MessageHeader h = read_device_header(device, message, bytes, bucket.dtype, bucket.numel, r);
  GS_CHECK(static_cast<int64_t>(h.count) == control.count, CorruptMessageError, "sparse message from rank ", r,
           " holds ", h.count, " pairs but its control word announced ", control.count);
  return h;
}

void gather_and_add(Transport& transport, Device& device, const BucketView& bucket, const Selection& mine,
                    ExchangeResult& result) {
  const int p = transport.size();
  std::vector<size_t> sizes(static_cast<size_t>(p)), offsets;
  for (int r = 0; r < p; ++r) sizes[r] = static_cast<size_t>(result.control[r].message_bytes);
  Buffer recv = allgather_messages(transport, device, mine, sizes, offsets);
  device.fill_zero(bucket.grad, static_cast<size_t>(bucket.numel) * dtype_size(bucket.dtype));
  for (int r = 0; r < p; ++r) {
    const void* message = recv.as<unsigned char>() + offsets[r];
    checked_header(device, message, sizes[r], bucket, result.control[r], r);
    device.scatter_add_message(bucket.dtype, bucket.grad, bucket.numel, message, sizes[r], static_cast<float>(p), r);
  }
  result.union_size = result.total_count();
}

/// All-reduces the values of a message in place (its values region), unless it is empty.
void allreduce_values(Transport& transport, Device& device, const BucketView& bucket, const Selection& message) {
  if (message.count == 0) return;  // every rank knows the count: all skip together
  const MessageLayout layout(static_cast<uint64_t>(message.count), index_bytes_for(bucket.numel), bucket.dtype);
  transport.allreduce_sum(device, message.message.as<unsigned char>() + layout.values_offset,
                          static_cast<size_t>(message.count), bucket.dtype);
}

/// The header and indices of a message of `count` pairs: what the union exchange all-gathers.
size_t index_part_bytes(int64_t count, const BucketView& bucket) {
  return MessageLayout(static_cast<uint64_t>(count), index_bytes_for(bucket.numel), bucket.dtype).values_offset;
}

void union_allreduce(Transport& transport, Device& device, const BucketView& bucket, const Selection& mine,
                     ExchangeResult& result) {
  const int p = transport.size();
  // Only the headers and index lists travel (a message's values follow its indices, so they are a
  // prefix); each rank then contributes its own values on the union to one all-reduce.
  std::vector<size_t> sizes(static_cast<size_t>(p)), offsets;
  for (int r = 0; r < p; ++r) sizes[r] = index_part_bytes(result.control[r].count, bucket);
  Buffer recv = allgather_messages(transport, device, mine, sizes, offsets);
  std::vector<int64_t> all;
  all.reserve(static_cast<size_t>(result.total_count()));
  std::vector<unsigned char> host;
  for (int r = 0; r < p; ++r) {
    host.resize(sizes[r]);
    device.copy_to_host(host.data(), recv.as<unsigned char>() + offsets[r], sizes[r]);
    const MessageHeader h = parse_header(host.data(), bucket.dtype, static_cast<uint64_t>(bucket.numel), r);
    GS_CHECK(static_cast<int64_t>(h.count) == result.control[r].count &&
                 h.index_bytes == index_bytes_for(static_cast<uint64_t>(bucket.numel)),
             CorruptMessageError, "sparse message from rank ", r, " holds ", h.count, " indices of ",
             int(h.index_bytes), " bytes but its control word announced ", result.control[r].count, " of ",
             index_bytes_for(static_cast<uint64_t>(bucket.numel)));
    dispatch_index(h.index_bytes, [&](auto i) {
      using I = decltype(i);
      const auto* idx = reinterpret_cast<const I*>(host.data() + kMessageHeaderBytes);
      for (uint64_t j = 0; j < h.count; ++j) {
        GS_CHECK(index_in_range(idx[j], bucket.numel) && (j == 0 || idx[j - 1] < idx[j]), CorruptMessageError,
                 "sparse message from rank ", r, " has index ", static_cast<long long>(idx[j]), " at position ", j,
                 " outside the bucket or out of order");
        all.push_back(static_cast<int64_t>(idx[j]));
      }
    });
  }
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
  result.union_size = static_cast<int64_t>(all.size());
  Selection u = device.gather(bucket, all);  // this rank's own values on the union
  allreduce_values(transport, device, bucket, u);
  device.fill_zero(bucket.grad, static_cast<size_t>(bucket.numel) * dtype_size(bucket.dtype));
  device.scatter_add_message(bucket.dtype, bucket.grad, bucket.numel, u.message.data(), u.bytes, static_cast<float>(p),
                             -1);
  device.zero_at(bucket, u.message.data(), u.bytes);  // every rank zeroes the whole union
}

void shared_allreduce(Transport& transport, Device& device, const BucketView& bucket, const Selection& mine,
                      ExchangeResult& result) {
  for (size_t r = 1; r < result.control.size(); ++r) {
    GS_CHECK(result.control[r].count == result.control[0].count &&
                 result.control[r].index_digest == result.control[0].index_digest,
             CorruptMessageError, "the shared exchange needs the same indices on every rank, but rank ", r,
             " selected other indices than rank 0 (", result.control[r].count, " against ", result.control[0].count,
             ")");
  }
  allreduce_values(transport, device, bucket, mine);
  device.fill_zero(bucket.grad, static_cast<size_t>(bucket.numel) * dtype_size(bucket.dtype));
  device.scatter_add_message(bucket.dtype, bucket.grad, bucket.numel, mine.message.data(), mine.bytes,
                             static_cast<float>(transport.size()), -1);
  result.union_size = mine.count;
}

/// Gather-and-add of messages whose size every rank knows: no control words; the non-finite
/// counts come from the message headers, so every rank still sees every rank's count.
void fixed_gather_and_add(Transport& transport, Device& device, const BucketView& bucket, const Selection& mine,
                          int64_t count, ExchangeResult& result) {
  const int p = transport.size();
  const size_t bytes =
      MessageLayout(static_cast<uint64_t>(count), index_bytes_for(bucket.numel), bucket.dtype).total_bytes;
  GS_ASSERT(mine.bytes == bytes && mine.count == count);
  Buffer recv = device.allocate(bytes * p);
  transport.allgather(device, mine.message.data(), recv.data(), bytes);
  result.control.resize(p);
  for (int r = 0; r < p; ++r) {
    const void* message = recv.as<unsigned char>() + static_cast<size_t>(r) * bytes;
    const MessageHeader h = read_device_header(device, message, bytes, bucket.dtype, bucket.numel, r);
    GS_CHECK(static_cast<int64_t>(h.count) == count, CorruptMessageError, "sparse message from rank ", r, " holds ",
             h.count, " pairs where every rank sends ", count);
    result.control[r] = ControlWord{static_cast<int64_t>(bytes), count, static_cast<int64_t>(h.nonfinite), 0};
  }
  if (!result.nonfinite_ranks().empty()) {
    result.aborted = true;
    return;
  }
  device.fill_zero(bucket.grad, static_cast<size_t>(bucket.numel) * dtype_size(bucket.dtype));
  for (int r = 0; r < p; ++r) {
    device.scatter_add_message(bucket.dtype, bucket.grad, bucket.numel, recv.as<unsigned char>() + r * bytes, bytes,
                               static_cast<float>(p), r);
  }
  result.union_size = result.total_count();
}

/// This rank's message split at the shard boundaries: one message per owner, its indices local
/// to the owner's shard, laid back to back in `out` (each a multiple of 8 bytes); returns each
/// owner's pair count.
std::vector<int64_t> split_by_owner(Device& device, const BucketView& bucket, const Selection& mine, int p,
                                    std::vector<unsigned char>& out, std::vector<size_t>& offsets) {
  const int64_t shard = bucket.numel / p;
  std::vector<unsigned char> in(mine.bytes);
  device.copy_to_host(in.data(), mine.message.data(), mine.bytes);
  const MessageHeader h = read_header(in.data(), in.size(), bucket.dtype, static_cast<uint64_t>(bucket.numel));
  const MessageLayout layout(h.count, h.index_bytes, bucket.dtype);
  const int index_bytes = index_bytes_for(static_cast<uint64_t>(shard));
  const size_t value_size = dtype_size(bucket.dtype);
  std::vector<int64_t> begin(static_cast<size_t>(p) + 1), counts(static_cast<size_t>(p));
  dispatch_index(h.index_bytes, [&](auto i) {
    using I = decltype(i);
    const I* idx = reinterpret_cast<const I*>(in.data() + layout.indices_offset);
    for (int o = 0; o <= p; ++o) {
      const uint64_t bound = static_cast<uint64_t>(o) * static_cast<uint64_t>(shard);
      begin[o] = std::lower_bound(idx, idx + h.count, bound,
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
    dispatch_index(h.index_bytes, [&](auto i) {
      using I = decltype(i);
      const I* idx = reinterpret_cast<const I*>(in.data() + layout.indices_offset) + begin[o];
      dispatch_index(index_bytes, [&](auto j) {
        using J = decltype(j);
        J* local = reinterpret_cast<J*>(m + part.indices_offset);
        for (uint64_t n = 0; n < count; ++n) local[n] = static_cast<J>(static_cast<uint64_t>(idx[n]) - first);
      });
    });
    std::memcpy(m + part.values_offset, in.data() + layout.values_offset + static_cast<size_t>(begin[o]) * value_size,
                count * value_size);
  }
  return counts;
}

}  // namespace

ExchangeResult scatter_to_owners(Transport& transport, Device& device, const BucketView& bucket,
                                 const Selection& mine) {
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
  const size_t value_size = dtype_size(bucket.dtype);
  device.fill_zero(bucket.grad, static_cast<size_t>(bucket.numel) * value_size);
  void* owned = static_cast<unsigned char*>(bucket.grad) + static_cast<size_t>(me * shard) * value_size;
  for (int r = 0; r < p; ++r) {
    device.scatter_add_message(bucket.dtype, owned, shard, recv.as<unsigned char>() + at[r], sizes[r],
                               static_cast<float>(p), r);
  }
  result.union_size = result.total_count();
  return result;
}

ExchangeResult exchange(ExchangeKind kind, Transport& transport, Device& device, const BucketView& bucket,
                        const Selection& mine, std::optional<int64_t> fixed_count) {
  ExchangeResult result;
  if (kind == ExchangeKind::kGather && fixed_count) {
    if (mine.nonfinite > 0) {  // rare: tell the others through the header
      const uint64_t nonfinite = static_cast<uint64_t>(mine.nonfinite);
      device.copy_from_host(mine.message.as<unsigned char>() + offsetof(MessageHeader, nonfinite), &nonfinite,
                            sizeof(nonfinite));
    }
    fixed_gather_and_add(transport, device, bucket, mine, *fixed_count, result);
    return result;
  }
  ControlWord word{static_cast<int64_t>(mine.bytes), mine.count, mine.nonfinite, 0};
  if (kind == ExchangeKind::kShared) word.index_digest = index_digest(device, mine, bucket);
  result.control = exchange_control(transport, device, word, bucket);
  if (!result.nonfinite_ranks().empty()) {
    result.aborted = true;
    return result;
  }
  switch (kind) {
    case ExchangeKind::kGather:
      gather_and_add(transport, device, bucket, mine, result);
      break;
    case ExchangeKind::kUnion:
      union_allreduce(transport, device, bucket, mine, result);
      break;
    case ExchangeKind::kShared:
      shared_allreduce(transport, device, bucket, mine, result);
      break;
  }
  return result;
}

void dense_allreduce(Transport& transport, Device& device, const BucketView& bucket) {
  if (bucket.numel == 0) return;  // an empty bucket on every rank: nothing to reduce
  device.divide(bucket.dtype, bucket.grad, bucket.numel, static_cast<float>(transport.size()));
  transport.allreduce_sum(device, bucket.grad, static_cast<size_t>(bucket.numel), bucket.dtype);
}

}  // namespace gradsparse
