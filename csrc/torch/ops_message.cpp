// pack and unpack: the sparse message format (gradsparse/message.h) as tensors, for any device.
// Written with tensor operations, so one CompositeExplicitAutograd kernel serves CPU and CUDA.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstring>

#include "adapter.h"
#include "gradsparse/message.h"

namespace gradsparse::torch_adapter {
namespace {

/// Every index in [0, dense_size) and strictly ascending, or IndexError naming the first problem.
void check_message_indices(const at::Tensor& indices, int64_t dense_size, const char* op) {
  if (indices.numel() == 0) return;
  const at::Tensor idx = indices.to(at::kLong);
  const int64_t lo = idx.min().item<int64_t>(), hi = idx.max().item<int64_t>();
  TORCH_CHECK_INDEX(lo >= 0 && hi < dense_size, "gradsparse.", op, ": indices must lie in [0, ", dense_size,
                    "), got values in [", lo, ", ", hi, "]");
  if (idx.numel() > 1) {
    const at::Tensor out_of_order = (idx.slice(0, 1) <= idx.slice(0, 0, -1)).nonzero();
    if (out_of_order.numel() > 0) {
      const int64_t at = out_of_order[0][0].item<int64_t>();
      TORCH_CHECK_INDEX(false, "gradsparse.", op,
                        ": indices must be strictly ascending (a message names each element once), but position ",
                        at + 1, " holds ", idx[at + 1].item<int64_t>(), " after ", idx[at].item<int64_t>(),
                        "; sort the pairs first (order = indices.argsort(); indices, values = indices[order], "
                        "values[order]) and add up the values of a repeated index");
    }
  }
}

/// Refuses the dtype argument where an intact header names another, as the caller's argument
/// (parse_header's check speaks of the receiving bucket, as the exchanges read a message).
void refuse_another_dtype(const void* header, DType dtype) {
  MessageHeader given;
  std::memcpy(&given, header, sizeof(given));
  if (given.magic != kMessageMagic || given.version != kMessageVersion || given.dtype > 2) return;
  const char* carried = dtype_name(static_cast<DType>(given.dtype));
  TORCH_CHECK_TYPE(static_cast<DType>(given.dtype) == dtype, "gradsparse.unpack: the message carries ", carried,
                   " values, but dtype=torch.", dtype_name(dtype), " was passed; pass dtype=torch.", carried,
                   " (the dtype of the values given to pack)");
}

/// The bytes of a 1-D tensor. contiguous() keeps a one-element tensor as it is, with whatever
/// stride it has (2 for x[::2], 0 for an expanded scalar), which view(kByte) refuses.
at::Tensor bytes_of(const at::Tensor& t) {
  const at::Tensor dense = t.contiguous();
  return dense.as_strided({dense.numel()}, {1}).view(at::kByte);
}

at::Tensor pack(const at::Tensor& indices, const at::Tensor& values, int64_t dense_size) {
  TORCH_CHECK_TYPE(indices.scalar_type() == at::kLong || indices.scalar_type() == at::kInt,
                   "gradsparse.pack: indices must be int64 or int32, got ", indices.scalar_type());
  const DType dtype = core_dtype(values, "values");
  TORCH_CHECK_VALUE(indices.dim() == 1 && values.dim() == 1 && indices.numel() == values.numel(),
                    "gradsparse.pack: indices and values must be 1-D with the same length, got shapes ",
                    indices.sizes(), " and ", values.sizes());
  TORCH_CHECK_VALUE(indices.device() == values.device(), "gradsparse.pack: indices are on ", indices.device(),
                    " but values are on ", values.device());
  TORCH_CHECK_VALUE(dense_size >= 0, "gradsparse.pack: dense_size must be >= 0, got ", dense_size);
  check_message_indices(indices, dense_size, "pack");
  const int64_t count = values.numel();
  const int index_bytes = index_bytes_for(static_cast<uint64_t>(dense_size));
  const MessageHeader header = translate_errors(
      [&] { return make_header(dtype, index_bytes, static_cast<uint64_t>(dense_size), static_cast<uint64_t>(count)); });
  const MessageLayout layout(static_cast<uint64_t>(count), index_bytes, dtype);
  at::Tensor message = at::zeros({static_cast<int64_t>(layout.total_bytes)}, values.options().dtype(at::kByte));
  at::Tensor head = at::empty({static_cast<int64_t>(sizeof(header))}, at::TensorOptions().dtype(at::kByte));
  std::memcpy(head.data_ptr(), &header, sizeof(header));
  message.slice(0, 0, sizeof(header)).copy_(head);
  if (count > 0) {
    // uint32 indices are stored as int32 bit patterns (two's complement truncation).
    message.slice(0, layout.indices_offset, layout.indices_end)
        .copy_(bytes_of(indices.to(index_bytes == 4 ? at::kInt : at::kLong)));
    message.slice(0, layout.values_offset, layout.values_end).copy_(bytes_of(values));
  }
  return message;
}

std::tuple<at::Tensor, at::Tensor> unpack(const at::Tensor& message, at::ScalarType dtype, int64_t dense_size) {
  TORCH_CHECK_TYPE(message.scalar_type() == at::kByte && message.dim() == 1,
                   "gradsparse.unpack: message must be a 1-D uint8 tensor, got ", message.scalar_type(), " of shape ",
                   message.sizes(),
                   "; pass the tensor gradsparse.pack returned, or received bytes as "
                   "buffer.view(torch.uint8).flatten()");
  TORCH_CHECK_VALUE(dense_size >= 0, "gradsparse.unpack: dense_size must be >= 0, got ", dense_size);
  const DType core = core_dtype(at::empty({0}, at::TensorOptions().dtype(dtype)), "dtype");
  // The indices and values are read as views of int32/int64 and of the values' dtype, which needs
  // the message to start at a multiple of their sizes in its storage; a message received behind a
  // prefix in a larger buffer need not, and is read from a copy.
  at::Tensor bytes = message.contiguous();
  if (bytes.storage_offset() % 8 != 0) bytes = bytes.clone();
  const size_t total = static_cast<size_t>(bytes.numel());
  const MessageHeader h = translate_errors([&] {
    GS_CHECK(total >= kMessageHeaderBytes, CorruptMessageError, "sparse message is ", total,
             " bytes, shorter than its 32-byte header");
    const at::Tensor head = bytes.slice(0, 0, kMessageHeaderBytes).cpu();
    refuse_another_dtype(head.data_ptr(), core);
    const MessageHeader header = parse_header(head.data_ptr(), core, static_cast<uint64_t>(dense_size));
    check_message_length(header, total);
    return header;
  });
  const MessageLayout layout(h.count, h.index_bytes, core);
  at::Tensor indices = bytes.slice(0, layout.indices_offset, layout.indices_end)
                           .view(h.index_bytes == 4 ? at::kInt : at::kLong)
                           .to(at::kLong, /*non_blocking=*/false, /*copy=*/true);
  if (h.index_bytes == 4) indices = indices.bitwise_and(0xffffffffLL);  // the stored values are uint32
  check_message_indices(indices, dense_size, "unpack");
  at::Tensor values = bytes.slice(0, layout.values_offset, layout.values_end).view(dtype).clone();
  return {indices, values};
}

}  // namespace

TORCH_LIBRARY_IMPL(gradsparse, CompositeExplicitAutograd, m) {
  m.impl("pack", [](const at::Tensor& indices, const at::Tensor& values, int64_t dense_size) {
    return named_errors("pack", [&] { return pack(indices, values, dense_size); });
  });
  m.impl("unpack", [](const at::Tensor& message, at::ScalarType dtype, int64_t dense_size) {
    return named_errors("unpack", [&] { return unpack(message, dtype, dense_size); });
  });
}

}  // namespace gradsparse::torch_adapter
