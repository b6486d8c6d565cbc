// The Message unit (message.h): laying out messages (on the host, or through the sink a selection
// kernel writes to), reading them on arrival, and their pairs on the host.
#include "gradsparse/message.h"

#include <cstring>

#include "gradsparse/device.h"
#include "gradsparse/kernels.h"

namespace gradsparse {

std::vector<unsigned char> pack_host(DType dtype, int64_t dense_size, const std::vector<int64_t>& index,
                                     const std::vector<float>* value) {
  const int index_bytes = index_bytes_for(static_cast<uint64_t>(dense_size));
  const uint64_t count = index.size();
  const MessageLayout layout(count, index_bytes, dtype);
  std::vector<unsigned char> host(layout.total_bytes, 0);
  const MessageHeader h = make_header(dtype, index_bytes, static_cast<uint64_t>(dense_size), count);
  std::memcpy(host.data(), &h, sizeof(h));
  for (size_t j = 0; j < index.size(); ++j) {
    GS_CHECK(index[j] >= 0 && index[j] < dense_size && (j == 0 || index[j - 1] < index[j]), ValueError,
             "message indices must be ascending and inside the bucket; index ", index[j], " at position ", j);
  }
  dispatch_dtype(dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_index(index_bytes, [&](auto i) {
      using I = decltype(i);
      auto* idx = reinterpret_cast<I*>(host.data() + layout.indices_offset);
      auto* val = reinterpret_cast<T*>(host.data() + layout.values_offset);
      for (size_t j = 0; j < index.size(); ++j) {
        idx[j] = static_cast<I>(index[j]);
        if (value != nullptr) val[j] = Num<T>::from_float((*value)[j]);
      }
    });
  });
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

HostMessage::HostMessage(Device& device, const MessageView& message) : view_(message) {
  if (device.kind() != DeviceKind::kCPU) {
    copy_.resize(message.bytes());
    device.copy_to_host(copy_.data(), message.data, copy_.size());
    view_.data = copy_.data();
  }
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

/// A sink that allocates `out`'s message on `device` once the count is known, zeroes it
/// (deterministic padding bytes) and writes its header.
PairSink message_sink(Device& device, const BucketView& bucket, int index_bytes, Selection& out) {
  return [&device, &bucket, index_bytes, &out](int64_t count) {
    const MessageLayout layout(static_cast<uint64_t>(count), index_bytes, bucket.dtype);
    out.message = device.allocate(layout.total_bytes);
    out.bytes = layout.total_bytes;
    auto* base = out.message.as<unsigned char>();
    device.fill_zero(base, layout.total_bytes);
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
  return out;
}

}  // namespace

Selection upload(Device& device, const std::vector<unsigned char>& host, int64_t count) {
  Selection out;
  out.message = device.allocate(host.size());
  out.bytes = host.size();
  out.count = count;
  device.copy_from_host(out.message.data(), host.data(), host.size());
  return out;
}

Selection Device::select(const BucketView& bucket, const SelectRule& rule) {
  return into_message(*this, bucket, [&](int index_bytes, const PairSink& sink) {
    return select_pairs(bucket, rule, index_bytes, sink);
  });
}

Selection Device::select_topk(const BucketView& bucket, int64_t k, bool update) {
  return into_message(*this, bucket, [&](int index_bytes, const PairSink& sink) {
    return topk_pairs(bucket, k, update, index_bytes, sink);
  });
}

Selection Device::emit(const BucketView& bucket, const std::vector<int64_t>& index, const std::vector<float>& value,
                       bool zero) {
  GS_ASSERT(index.size() == value.size());
  Selection out =
      upload(*this, pack_host(bucket.dtype, bucket.numel, index, &value), static_cast<int64_t>(index.size()));
  if (zero && bucket.residual != nullptr) zero_at(bucket, out.view(bucket.dtype, bucket.numel));
  return out;
}

Selection Device::gather(const BucketView& bucket, const std::vector<int64_t>& index) {
  Selection out =
      upload(*this, pack_host(bucket.dtype, bucket.numel, index, nullptr), static_cast<int64_t>(index.size()));
  if (!index.empty()) {
    const MessageView view = out.view(bucket.dtype, bucket.numel);
    gather_values(bucket, view, out.message.as<unsigned char>() + view.layout().values_offset);
  }
  return out;
}

}  // namespace gradsparse
