#include <algorithm>
#include <cstring>

#include "gradsparse/exchange.h"

namespace gradsparse {

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

std::vector<ControlWord> exchange_control(Transport& transport, Device& device, const ControlWord& mine) {
  const int p = transport.size();
  Buffer send = device.allocate(sizeof(ControlWord));
  Buffer recv = device.allocate(sizeof(ControlWord) * p);
  device.copy_from_host(send.data(), &mine, sizeof(ControlWord));
  transport.allgather(device, send.data(), recv.data(), sizeof(ControlWord));
  std::vector<ControlWord> words(p);
  device.copy_to_host(words.data(), recv.data(), sizeof(ControlWord) * p);
  for (int r = 0; r < p; ++r) {
    GS_CHECK(words[r].message_bytes >= 0 && words[r].count >= 0 && words[r].nonfinite >= 0, CorruptMessageError,
             "control word from rank ", r, " is corrupt (negative sizes)");
  }
  return words;
}

ExchangeResult gather_add(Transport& transport, Device& device, const BucketView& bucket, const Selection& mine) {
  ExchangeResult result;
  result.control =
      exchange_control(transport, device, ControlWord{static_cast<int64_t>(mine.bytes), mine.count, mine.nonfinite, 0});
  if (!result.nonfinite_ranks().empty()) {
    result.aborted = true;
    return result;
  }
  const int p = transport.size();
  size_t max_bytes = 0;
  for (const ControlWord& w : result.control) max_bytes = std::max(max_bytes, static_cast<size_t>(w.message_bytes));
  GS_ASSERT(max_bytes >= kMessageHeaderBytes);  // every message has a header: never zero-length

  // Pad this rank's message to the largest one, unless it already is.
  Buffer padded;
  const void* send = mine.message.data();
  if (mine.bytes != max_bytes) {
    padded = device.allocate(max_bytes);
    device.fill_zero(padded.data(), max_bytes);
    device.copy(padded.data(), mine.message.data(), mine.bytes);
    send = padded.data();
  }
  Buffer recv = device.allocate(max_bytes * p);
  transport.allgather(device, send, recv.data(), max_bytes);

  device.fill_zero(bucket.grad, static_cast<size_t>(bucket.numel) * dtype_size(bucket.dtype));
  for (int r = 0; r < p; ++r) {
    const void* message = recv.as<unsigned char>() + static_cast<size_t>(r) * max_bytes;
    const MessageHeader h =
        read_device_header(device, message, max_bytes, bucket.dtype, static_cast<uint64_t>(bucket.numel), r);
    GS_CHECK(static_cast<int64_t>(h.count) == result.control[r].count, CorruptMessageError, "sparse message from rank ",
             r, " holds ", h.count, " pairs but its control word announced ", result.control[r].count);
    device.scatter_add_message(bucket.dtype, bucket.grad, bucket.numel, message, max_bytes, static_cast<float>(p), r);
  }
  return result;
}

void dense_allreduce(Transport& transport, Device& device, const BucketView& bucket) {
  if (bucket.numel == 0) return;  // an empty bucket on every rank: nothing to reduce
  device.divide(bucket.dtype, bucket.grad, bucket.numel, static_cast<float>(transport.size()));
  transport.allreduce_sum(device, bucket.grad, static_cast<size_t>(bucket.numel), bucket.dtype);
}

}  // namespace gradsparse
