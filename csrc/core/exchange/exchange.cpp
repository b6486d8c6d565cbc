// What the exchanges share: the glossary, choosing one by option, control words, and the dense
// all-reduce.
#include "gradsparse/exchange.h"

#include <algorithm>
#include <cmath>
#include <iterator>

namespace gradsparse {

const char* exchange_name(ExchangeKind kind) {
  switch (kind) {
    case ExchangeKind::kGatherAndAdd:
      return "gather-and-add";
    case ExchangeKind::kFixedGather:
      return "fixed-size gather";
    case ExchangeKind::kExclusiveGather:
      return "exclusive gather";
    case ExchangeKind::kUnionAllreduce:
      return "union + all-reduce";
    case ExchangeKind::kSharedIndices:
      return "shared indices";
    case ExchangeKind::kSparseReduceScatter:
      return "sparse reduce-scatter";
    case ExchangeKind::kReduceScatterAllgather:
      return "reduce-scatter + all-gather";
    case ExchangeKind::kSparDL:
      return "SparDL";
  }
  return "unknown";
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

const Exchange& exchange_option(const std::string& value,
                                const std::vector<std::pair<std::string, const Exchange*>>& choices,
                                const std::string& owner, const std::string& option) {
  std::string names;
  for (size_t j = 0; j < choices.size(); ++j) {
    if (choices[j].first == value) return *choices[j].second;
    names += (j == 0 ? "" : j + 1 == choices.size() ? " or " : ", ") + ("\"" + choices[j].first + "\"");
  }
  throw ValueError(str(owner, ": ", option, " must be ", names, ", got \"", value, "\""));
}

void check_control_word(const ControlWord& w, const BucketView& bucket, bool with_message, int r) {
  const int64_t n = bucket.numel;
  GS_CHECK(w.count >= 0 && w.count <= n, CorruptMessageError, "control word from rank ", r, " announces ", w.count,
           " pairs for a bucket of ", n, " elements");
  GS_CHECK(w.nonfinite >= 0 && w.nonfinite <= n, CorruptMessageError, "control word from rank ", r, " announces ",
           w.nonfinite, " non-finite values in a bucket of ", n, " elements");
  GS_CHECK(with_message || w.count == 0, CorruptMessageError, "control word from rank ", r, " announces ", w.count,
           " pairs in a step that sends none this way");
}

std::vector<ControlWord> exchange_control(Transport& transport, Device& device, const ControlWord& mine,
                                          const BucketView& bucket, bool with_message, bool with_digest) {
  std::vector<int64_t> row{mine.count, mine.nonfinite};
  if (with_digest) row.push_back(mine.index_digest);
  const std::vector<int64_t> all =
      allgather_counts(transport, device, row, control_bytes(bucket.numel, with_digest) / row.size());
  std::vector<ControlWord> words(static_cast<size_t>(transport.size()));
  for (size_t r = 0; r < words.size(); ++r) {
    ControlWord& w = words[r];
    w.count = all[r * row.size()];
    w.nonfinite = all[r * row.size() + 1];
    if (with_digest) w.index_digest = all[r * row.size() + 2];
    check_control_word(w, bucket, with_message, static_cast<int>(r));
  }
  return words;
}

ExchangeResult agree(Transport& transport, Device& device, const BucketView& bucket, const ControlWord& mine,
                     bool with_message, bool with_digest) {
  ExchangeResult result;
  result.control = exchange_control(transport, device, mine, bucket, with_message, with_digest);
  result.aborted = !result.nonfinite_ranks().empty();
  return result;
}

ExchangeResult agree(Transport& transport, Device& device, const BucketView& bucket, const Selection& mine) {
  GS_ASSERT(mine.bytes == static_cast<size_t>(message_bytes(mine.count, bucket)));  // what the blocks will send
  if (mine.agreed.empty()) return agree(transport, device, bucket, control_word(mine));
  const int p = transport.size(), me = transport.rank();
  GS_CHECK(static_cast<int>(mine.agreed.size()) == p, CorruptMessageError, "the selection carries ", mine.agreed.size(),
           " agreed control words for ", p, " ranks");
  ExchangeResult result;
  result.control = mine.agreed;
  for (int r = 0; r < p; ++r) check_control_word(result.control[r], bucket, true, r);
  result.aborted = !result.nonfinite_ranks().empty();
  const ControlWord own = control_word(mine), agreed = result.control[me];
  GS_CHECK(result.aborted || (agreed.count == own.count && agreed.nonfinite == own.nonfinite), CorruptMessageError,
           "rank ", me, " selected ", own.count, " pairs where the agreed control word says ", agreed.count);
  return result;
}

Buffer allgather_blocks(Transport& transport, Device& device, const Selection& mine, const std::vector<size_t>& sizes) {
  const size_t total = block_offsets(sizes).back();
  if (total == 0) return Buffer{};  // every rank announced an empty block: nothing to move
  Buffer recv = device.allocate(total);
  transport.allgatherv(device, mine.message.as<unsigned char>() + kMessageHeaderBytes, recv.data(), sizes);
  return recv;
}

void allreduce_host(Transport& transport, Device& device, std::vector<double>& values) {
  if (values.empty()) return;
  const size_t bytes = values.size() * sizeof(double);
  Buffer buffer = device.allocate(bytes);
  device.copy_from_host(buffer.data(), values.data(), bytes);
  transport.allreduce_sum(device, buffer.data(), values.size(), DType::kFloat64);
  device.copy_to_host(values.data(), buffer.data(), bytes);
}

void allgather_host(Transport& transport, Device& device, const void* mine, void* all, size_t bytes) {
  const size_t total = bytes * static_cast<size_t>(transport.size());  // what `all` holds
  Buffer send = device.allocate(bytes), recv = device.allocate(total);
  device.copy_from_host(send.data(), mine, bytes);
  transport.allgather(device, send.data(), recv.data(), bytes);
  device.copy_to_host(all, recv.data(), total);  // not recv.bytes(): a device may round a buffer up
}

std::vector<int64_t> allgather_counts(Transport& transport, Device& device, const std::vector<int64_t>& row,
                                      size_t width) {
  return gather_counts(
      row, width, static_cast<size_t>(transport.size()),
      [&](const void* mine, void* all, size_t bytes) { allgather_host(transport, device, mine, all, bytes); });
}

float allreduce_values(Transport& transport, Device& device, void* values, int64_t count, DType dtype,
                       ExchangeResult& result) {
  const auto p = static_cast<float>(transport.size());
  if (!divides_first(dtype)) {
    transport.allreduce_sum(device, values, static_cast<size_t>(count), dtype);
    return p;
  }
  device.divide(dtype, values, count, p);
  transport.allreduce_sum(device, values, static_cast<size_t>(count), dtype);
  // A scan without sums, range or list: the count alone.
  result.overflowed =
      device.scan(BucketView{dtype, count, values}, false, Range{}, HUGE_VAL, 0, false).moments.nonfinite;
  result.aborted = result.overflowed > 0;
  return 1.0f;
}

void dense_allreduce(Transport& transport, Device& device, const BucketView& bucket) {
  if (bucket.numel == 0) return;  // an empty bucket on every rank: nothing to reduce
  device.divide(bucket.dtype, bucket.grad, bucket.numel, static_cast<float>(transport.size()));
  transport.allreduce_sum(device, bucket.grad, static_cast<size_t>(bucket.numel), bucket.dtype);
}

std::vector<int64_t> ascending_union(std::vector<std::vector<int64_t>> lists) {
  if (lists.empty()) return {};
  for (size_t width = 1; width < lists.size(); width *= 2) {
    for (size_t i = 0; i + width < lists.size(); i += 2 * width) {
      std::vector<int64_t> merged;
      merged.reserve(lists[i].size() + lists[i + width].size());
      std::set_union(lists[i].begin(), lists[i].end(), lists[i + width].begin(), lists[i + width].end(),
                     std::back_inserter(merged));
      lists[i] = std::move(merged);
      std::vector<int64_t>().swap(lists[i + width]);
    }
  }
  return std::move(lists[0]);
}

void add_messages(Device& device, const std::vector<MessageView>& messages, void* out, int64_t numel, DType dtype,
                  float divisor) {
  if (dtype == DType::kFloat32) {
    device.fill_zero(out, static_cast<size_t>(numel) * dtype_size(dtype));
    for (const MessageView& m : messages) device.scatter_add(m, out, divisor);
    return;
  }
  Buffer sums = device.allocate(static_cast<size_t>(numel) * sizeof(float));
  device.fill_zero(sums.data(), static_cast<size_t>(numel) * sizeof(float));
  for (const MessageView& m : messages) device.scatter_add_float32(m, sums.as<float>(), divisor);
  device.round_to(dtype, sums.as<float>(), out, numel);
}

void clear_output(Device& device, const BucketView& bucket) {
  device.fill_zero(bucket.grad, static_cast<size_t>(bucket.numel) * dtype_size(bucket.dtype));
}

}  // namespace gradsparse
