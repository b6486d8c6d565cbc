// The Message unit (message.h): laying out messages (on the host, or through the sink a selection
// kernel writes to), reading them on arrival, and their pairs on the host.
#include "gradsparse/message.h"

#include <algorithm>
#include <cstring>

#include "gradsparse/device.h"
#include "gradsparse/kernels.h"
#include "gradsparse/parallel.h"
#include "gradsparse/rng.h"

namespace gradsparse {

void pack_pairs(DType dtype, int64_t dense_size, const HostPairs& pairs, unsigned char* dst) {
  const int index_bytes = index_bytes_for(static_cast<uint64_t>(dense_size));
  const uint64_t count = pairs.count;
  const MessageLayout layout(count, index_bytes, dtype);
  const MessageHeader h = make_header(dtype, index_bytes, static_cast<uint64_t>(dense_size), count);
  std::memcpy(dst, &h, sizeof(h));
  std::memset(dst + layout.indices_end, 0, layout.values_offset - layout.indices_end);
  std::memset(dst + layout.values_end, 0, layout.total_bytes - layout.values_end);
  constexpr int64_t kPairs = int64_t{1} << 15;  // pairs per parallel block
  const int64_t blocks = (static_cast<int64_t>(count) + kPairs - 1) / kPairs;
  std::vector<char> bad(static_cast<size_t>(blocks), 0);
  dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_index(index_bytes, [&](auto i) {
      using I = decltype(i);
      auto* idx = reinterpret_cast<I*>(dst + layout.indices_offset);
      auto* val = reinterpret_cast<T*>(dst + layout.values_offset);
      parallel_blocks(blocks, [&](int64_t b) {
        const size_t begin = static_cast<size_t>(b * kPairs), end = std::min<size_t>(count, begin + kPairs);
        int64_t previous = begin == 0 ? -1 : pairs.index[pairs.source(begin - 1)];
        bool ok = true;
        for (size_t j = begin; j < end; ++j) {
          const size_t from = pairs.source(j);
          const int64_t at = pairs.index[from];
          ok &= at > previous && at < dense_size;
          previous = at;
          idx[j] = static_cast<I>(at);
          val[j] = pairs.value == nullptr ? T{} : Num<T>::from_float(pairs.value[from]);
        }
        bad[static_cast<size_t>(b)] = !ok;
      });
    });
  });
  if (std::find(bad.begin(), bad.end(), 1) == bad.end()) return;
  for (size_t j = 0; j < count; ++j) {  // name the first bad index
    const int64_t at = pairs.index[pairs.source(j)];
    GS_CHECK(at >= 0 && at < dense_size && (j == 0 || pairs.index[pairs.source(j - 1)] < at), ValueError,
             "message indices must be ascending and inside the bucket; index ", at, " at position ", j);
  }
}

int64_t index_digest(const int64_t* index, size_t count) {
  uint64_t digest = mix64(count);
  for (size_t i = 0; i < count; ++i) digest += mix64(static_cast<uint64_t>(index[i]) + i * 0xD1B54A32D192ED03ull);
  return static_cast<int64_t>(digest);
}

std::vector<unsigned char> pack_host(DType dtype, int64_t dense_size, const HostPairs& pairs) {
  const MessageLayout layout(pairs.count, index_bytes_for(static_cast<uint64_t>(dense_size)), dtype);
  std::vector<unsigned char> host(layout.total_bytes);
  pack_pairs(dtype, dense_size, pairs, host.data());
  return host;
}

MessageView read_message(Device& device, const void* data, size_t bytes, DType expected_dtype,
                         uint64_t expected_dense_size, int source_rank) {
  check_message_start(data, bytes, source_rank);
  unsigned char host[kMessageHeaderBytes];
  device.copy_to_host(host, data, kMessageHeaderBytes);
  const MessageHeader h = parse_header(host, expected_dtype, expected_dense_size, source_rank);
  check_message_length(h, bytes, source_rank);
  return view_from_header(data, h, source_rank);
}

HostBytes::HostBytes(Device& device, const void* data, size_t bytes) : data_(static_cast<const unsigned char*>(data)) {
  if (device.kind() != DeviceKind::kCPU) {
    copy_.resize(bytes);
    device.copy_to_host(copy_.data(), data, bytes);
    data_ = copy_.data();
  }
}

HostMessage::HostMessage(Device& device, const MessageView& message)
    : bytes_(std::in_place, device, message.data, message.bytes()), view_(message) {
  view_.data = bytes_->data();
}

std::vector<int64_t> HostMessage::index_list() const {
  std::vector<int64_t> out(static_cast<size_t>(size()));
  dispatch_index(view_.index_bytes, [&](auto i) {
    using I = decltype(i);
    const I* idx = indices<I>();
    for (size_t j = 0; j < out.size(); ++j) out[j] = static_cast<int64_t>(idx[j]);
  });
  return out;
}

std::vector<float> HostMessage::value_list() const {
  std::vector<float> out(static_cast<size_t>(size()));
  dispatch_dtype(view_.dtype, [&](auto t) {
    using T = decltype(t);
    const T* val = values<T>();
    for (size_t j = 0; j < out.size(); ++j) out[j] = Num<T>::to_float(val[j]);
  });
  return out;
}

void HostMessage::check_indices() const {
  dispatch_index(view_.index_bytes, [&](auto i) {
    using I = decltype(i);
    const I* idx = indices<I>();
    for (int64_t j = 0; j < size(); ++j) {
      GS_CHECK(index_in_range(idx[j], view_.dense_size) && (j == 0 || idx[j - 1] < idx[j]), CorruptMessageError,
               message_source(view_.source_rank), " has index ", static_cast<long long>(idx[j]), " at position ", j,
               " outside [0, ", view_.dense_size, ") or out of order");
    }
  });
}

namespace {

/// A sink that allocates `out`'s message on `device` once the count is known, zeroes its padding
/// (deterministic bytes; the kernel writes every pair) and writes its header.
PairSink message_sink(Device& device, const BucketView& bucket, int index_bytes, Selection& out) {
  return [&device, &bucket, index_bytes, &out](int64_t count) {
    const MessageLayout layout(static_cast<uint64_t>(count), index_bytes, bucket.dtype);
    out.message = device.allocate(layout.total_bytes);
    out.bytes = layout.total_bytes;
    auto* base = out.message.as<unsigned char>();
    device.fill_zero(base + layout.indices_end, layout.values_offset - layout.indices_end);
    device.fill_zero(base + layout.values_end, layout.total_bytes - layout.values_end);
    const MessageHeader h =
        make_header(bucket.dtype, index_bytes, static_cast<uint64_t>(bucket.numel), static_cast<uint64_t>(count));
    device.copy_from_host(base, &h, sizeof(h));
    return PairSpan{base + layout.indices_offset, base + layout.values_offset};
  };
}

/// Runs a selection kernel through a message sink.
template <typename Kernel>
Selection into_message(Device& device, const BucketView& bucket, Kernel&& kernel) {
  const int index_bytes = index_bytes_for(static_cast<uint64_t>(bucket.numel));
  Selection out;
  const SelectStats stats = kernel(index_bytes, message_sink(device, bucket, index_bytes, out));
  out.count = stats.count;
  out.nonfinite = stats.nonfinite;
  out.kth_key = stats.kth_key;
  return out;
}

/// A message laid out on the host (`count` pairs), copied into a new buffer of `device`.
Selection upload(Device& device, const std::vector<unsigned char>& host, int64_t count) {
  Selection out;
  out.message = device.allocate(host.size());
  out.bytes = host.size();
  out.count = count;
  device.copy_from_host(out.message.data(), host.data(), host.size());
  return out;
}

}  // namespace

Selection Device::select(const BucketView& bucket, const SelectRule& rule) {
  return into_message(*this, bucket, [&](int index_bytes, const PairSink& sink) {
    return select_pairs(bucket, rule, index_bytes, sink);
  });
}

Selection Device::select_topk(const BucketView& bucket, int64_t k, bool update, bool zero) {
  return into_message(*this, bucket, [&](int index_bytes, const PairSink& sink) {
    return topk_pairs(bucket, k, update, zero, index_bytes, sink);
  });
}

Selection Device::emit(const BucketView& bucket, const HostPairs& pairs, bool zero) {
  Selection out;
  if (kind() == DeviceKind::kCPU) {  // laid out in place: no host copy to upload
    const MessageLayout layout(pairs.count, index_bytes_for(static_cast<uint64_t>(bucket.numel)), bucket.dtype);
    out.message = allocate(layout.total_bytes);
    out.bytes = layout.total_bytes;
    out.count = static_cast<int64_t>(pairs.count);
    pack_pairs(bucket.dtype, bucket.numel, pairs, out.message.as<unsigned char>());
  } else {
    out = upload(*this, pack_host(bucket.dtype, bucket.numel, pairs), static_cast<int64_t>(pairs.count));
  }
  if (zero && bucket.residual != nullptr) zero_at(bucket, out.view(bucket.dtype, bucket.numel));
  return out;
}

Selection Device::gather(const BucketView& bucket, const std::vector<int64_t>& index) {
  Selection out = upload(*this, pack_host(bucket.dtype, bucket.numel, HostPairs(index, nullptr)),
                         static_cast<int64_t>(index.size()));
  if (!index.empty()) {
    const MessageView view = out.view(bucket.dtype, bucket.numel);
    gather_values(bucket, view, out.message.as<unsigned char>() + view.layout().values_offset);
  }
  return out;
}

}  // namespace gradsparse
