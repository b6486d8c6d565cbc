// The Message unit: the one place that lays out, reads and validates the sparse message, one
// contiguous buffer holding a header, the indices and the values of the (index, value) pairs one
// rank sends. Every receiver validates a message's header once, on arrival (read_message,
// view_host_message), and hands its MessageView to the kernels, which check the indices as they
// read them. Device-side helpers (reading a message in a device's memory, host copies of its
// pairs, selections packed as messages) are in device.h and exchange/message.cpp.
// Indices are strictly ascending, so a message never names an element twice: receivers add
// messages one after another, deterministically, without atomics.
//
// A message travels bare (its body alone, without the 32-byte header) wherever the receiver
// already knows its count from an earlier collective (control words, part counts): a bare
// message is the header-less rest of the layout below, its offsets 32 bytes lower. Only the
// fixed-size gather, which sends no control words, and SparDL's steps, whose sizes travel as
// bytes, send headers (the receiver checks count, dense size and non-finite count from them).
//
// Layout (little-endian, offsets in bytes):
//   0  uint32 magic 0x4D505347 ("GSPM")     8  uint64 dense_size (length of the bucket)
//   4  uint8  version (1)                   16 uint64 count (number of pairs)
//   5  uint8  dtype (DType)                 24 uint64 nonfinite (sender's NaN/Inf count)
//   6  uint8  index_bytes (4 or 8)          32 indices[count], unsigned, strictly ascending
//   7  uint8  flags, zero                   32 + pad8(count * index_bytes): values[count] in dtype
// total = 32 + pad8(count * index_bytes) + pad8(count * dtype_size)
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "gradsparse/common.h"

namespace gradsparse {

constexpr uint32_t kMessageMagic = 0x4D505347u;
constexpr uint8_t kMessageVersion = 1;  // the layout of a message with its header (gs.pack, gs.unpack)
/// What the ranks of a group exchange, which they must agree on (State.setup compares it): 2 since
/// messages travel bare where their count came first and control words are compact.
constexpr int kWireVersion = 2;
constexpr size_t kMessageHeaderBytes = 32;

struct MessageHeader {
  uint32_t magic = kMessageMagic;
  uint8_t version = kMessageVersion;
  uint8_t dtype = 0;
  uint8_t index_bytes = 0;
  uint8_t flags = 0;
  uint64_t dense_size = 0;
  uint64_t count = 0;
  uint64_t nonfinite = 0;  ///< how many NaN/Inf the sender saw (the fixed-size path has no control word)
};
static_assert(sizeof(MessageHeader) == kMessageHeaderBytes, "message header must be 32 bytes");

inline size_t pad8(size_t bytes) { return (bytes + 7) & ~static_cast<size_t>(7); }

/// Index width for a bucket of `dense_size` elements: 4 bytes when every index (< dense_size) fits in uint32.
inline int index_bytes_for(uint64_t dense_size) { return dense_size <= 0x100000000ull ? 4 : 8; }

/// Where each part of a message with these parameters lives: the header (none when bare), the
/// indices from indices_offset to indices_end, zero padding up to values_offset, the values up
/// to values_end, zero padding up to total_bytes (a multiple of 8).
struct MessageLayout {
  size_t indices_offset = kMessageHeaderBytes;
  size_t indices_end = 0;
  size_t values_offset = 0;
  size_t values_end = 0;
  size_t total_bytes = 0;

  MessageLayout(uint64_t count, int index_bytes, DType dtype, bool bare = false)
      : indices_offset(bare ? 0 : kMessageHeaderBytes),
        indices_end(indices_offset + count * index_bytes),
        values_offset(pad8(indices_end)),
        values_end(values_offset + count * dtype_size(dtype)),
        total_bytes(pad8(values_end)) {}
};

/// Builds a header after checking its fields; throws ValueError on inconsistent arguments.
inline MessageHeader make_header(DType dtype, int index_bytes, uint64_t dense_size, uint64_t count) {
  GS_CHECK(index_bytes == 4 || index_bytes == 8, ValueError, "message index_bytes must be 4 or 8, got ", index_bytes);
  GS_CHECK(count <= dense_size, ValueError, "a message cannot hold more pairs (", count, ") than its dense_size (",
           dense_size, ")");
  GS_CHECK(index_bytes == 8 || dense_size <= 0x100000000ull, ValueError, "dense_size ", dense_size,
           " needs 8-byte indices, got index_bytes=4");
  MessageHeader h;
  h.dtype = static_cast<uint8_t>(dtype);
  h.index_bytes = static_cast<uint8_t>(index_bytes);
  h.dense_size = dense_size;
  h.count = count;
  return h;
}

inline std::string message_source(int source_rank) {
  return source_rank >= 0 ? str("sparse message from rank ", source_rank) : std::string("sparse message");
}

/// Validates the 32 header bytes of a received message. Throws CorruptMessageError naming the
/// broken field. `expected_dtype` and `expected_dense_size` are what the receiving bucket holds.
inline MessageHeader parse_header(const void* header, DType expected_dtype, uint64_t expected_dense_size,
                                  int source_rank = -1) {
  MessageHeader h;
  std::memcpy(&h, header, sizeof(h));
  GS_CHECK(h.magic == kMessageMagic, CorruptMessageError, message_source(source_rank), " has bad magic 0x", std::hex,
           h.magic, std::dec, " (not a gradsparse message, or corrupted in transit)");
  GS_CHECK(h.version == kMessageVersion, CorruptMessageError, message_source(source_rank), " has version ",
           int(h.version), ", this build reads version ", int(kMessageVersion),
           " (mixed gradsparse versions across ranks?)");
  GS_CHECK(h.dtype <= 2, CorruptMessageError, message_source(source_rank), " has unknown dtype code ", int(h.dtype));
  GS_CHECK(static_cast<DType>(h.dtype) == expected_dtype, CorruptMessageError, message_source(source_rank), " carries ",
           dtype_name(static_cast<DType>(h.dtype)), " values but the bucket is ", dtype_name(expected_dtype));
  GS_CHECK(h.index_bytes == 4 || h.index_bytes == 8, CorruptMessageError, message_source(source_rank),
           " has index_bytes=", int(h.index_bytes), ", expected 4 or 8");
  GS_CHECK(h.flags == 0, CorruptMessageError, message_source(source_rank), " has non-zero reserved flags");
  GS_CHECK(h.dense_size == expected_dense_size, CorruptMessageError, message_source(source_rank),
           " is for a bucket of ", h.dense_size, " elements but the receiving bucket has ", expected_dense_size,
           " (ranks disagree on the bucket layout?)");
  GS_CHECK(h.count <= h.dense_size, CorruptMessageError, message_source(source_rank), " claims ", h.count,
           " pairs for a bucket of ", h.dense_size, " elements");
  return h;
}

/// Checks that a message whose header is `h` fits in the `bytes` that arrived (a padded
/// collective may deliver more than the message).
inline void check_message_length(const MessageHeader& h, size_t bytes, int source_rank = -1) {
  // Every pair takes index_bytes + dtype_size bytes: a count past bytes / that cannot fit, and its
  // layout's sizes (count * width) would wrap around 2^64 (2^62 pairs of 8-byte indices: 0 bytes).
  const size_t pair_bytes = static_cast<size_t>(h.index_bytes) + dtype_size(static_cast<DType>(h.dtype));
  GS_CHECK(h.count <= bytes / pair_bytes, CorruptMessageError, message_source(source_rank), " claims ", h.count,
           " pairs (", pair_bytes, " bytes each) but only ", bytes, " bytes arrived");
  const MessageLayout layout(h.count, h.index_bytes, static_cast<DType>(h.dtype));
  GS_CHECK(layout.total_bytes <= bytes, CorruptMessageError, message_source(source_rank), " claims ", h.count,
           " pairs (", layout.total_bytes, " bytes) but only ", bytes, " bytes arrived");
}

/// Checks that a message of `bytes` bytes at `data` can hold its header and starts 8-byte aligned,
/// so that its indices and values (at multiples of 8 from the start) are read aligned.
inline void check_message_start(const void* data, size_t bytes, int source_rank = -1) {
  GS_CHECK(data != nullptr && bytes >= kMessageHeaderBytes, CorruptMessageError, message_source(source_rank), " is ",
           bytes, " bytes, shorter than its 32-byte header");
  GS_CHECK(reinterpret_cast<uintptr_t>(data) % 8 == 0, CorruptMessageError, message_source(source_rank),
           " starts at an address that is not 8-byte aligned (a preceding message's size is not a multiple of 8)");
}

/// Validates a whole message in host memory: its start, its header, its length.
inline MessageHeader read_header(const void* data, size_t bytes, DType expected_dtype, uint64_t expected_dense_size,
                                 int source_rank = -1) {
  check_message_start(data, bytes, source_rank);
  const MessageHeader h = parse_header(data, expected_dtype, expected_dense_size, source_rank);
  check_message_length(h, bytes, source_rank);
  return h;
}

/// A message whose header has been validated (or that this rank laid out itself), wherever it
/// lives: in a device's memory or on the host. The kernels that read its pairs check every index
/// (in range, strictly ascending) as they go, so a view is all they need: no header is read twice.
struct MessageView {
  const unsigned char* data = nullptr;  ///< the first byte of the header (of the indices when bare)
  DType dtype = DType::kFloat32;
  int64_t dense_size = 0;  ///< elements of the bucket (or shard) the indices address
  int64_t count = 0;       ///< pairs
  int index_bytes = 4;
  int64_t nonfinite = 0;  ///< the sender's NaN/Inf count, from the header
  int source_rank = -1;   ///< who sent it, for error messages (-1: this rank)
  bool bare = false;      ///< no header: the indices start at `data`

  MessageLayout layout() const { return MessageLayout(static_cast<uint64_t>(count), index_bytes, dtype, bare); }
  size_t bytes() const { return layout().total_bytes; }
  const void* indices() const { return data + layout().indices_offset; }
  const void* values() const { return data + layout().values_offset; }
};

/// The view of a message whose (already validated) header `h` starts at `data`.
inline MessageView view_from_header(const void* data, const MessageHeader& h, int source_rank) {
  return MessageView{static_cast<const unsigned char*>(data),
                     static_cast<DType>(h.dtype),
                     static_cast<int64_t>(h.dense_size),
                     static_cast<int64_t>(h.count),
                     h.index_bytes,
                     static_cast<int64_t>(h.nonfinite),
                     source_rank};
}

/// The view of a bare message of `count` pairs at `data`, for a bucket (or shard) of
/// `dense_size` elements: what its sender announced in an earlier collective, already checked
/// (0 <= count <= dense_size). Its indices are checked by whichever kernel reads them.
inline MessageView bare_view(const void* data, int64_t count, DType dtype, int64_t dense_size, int64_t nonfinite,
                             int source_rank) {
  return MessageView{static_cast<const unsigned char*>(data),
                     dtype,
                     dense_size,
                     count,
                     index_bytes_for(static_cast<uint64_t>(dense_size)),
                     nonfinite,
                     source_rank,
                     /*bare=*/true};
}

/// Bytes of one count on the wire (control words, part and kept counts), where no count exceeds
/// `most`: 4, or 8 past 2^32 - 1.
inline size_t count_bytes(uint64_t most) { return most < 0x100000000ull ? 4 : 8; }

/// A count on the wire: `width` (4 or 8) little-endian bytes at `at`. An 8-byte count past 2^63
/// reads negative, for the caller's range check.
inline int64_t read_count(const unsigned char* at, size_t width) {
  if (width == 8) {
    int64_t v;
    std::memcpy(&v, at, 8);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, at, 4);
  return static_cast<int64_t>(v);
}

/// Writes `value` as read_count reads it (any int64 in 8 bytes; 0 to 2^32 - 1 in 4).
inline void write_count(unsigned char* at, int64_t value, size_t width) {
  GS_ASSERT(width == 8 || (value >= 0 && value <= int64_t{0xFFFFFFFF}));
  if (width == 8) {
    std::memcpy(at, &value, 8);
  } else {
    const uint32_t v = static_cast<uint32_t>(value);
    std::memcpy(at, &v, 4);
  }
}

/// Every rank's `row` of counts, rank after rank, through `allgather(mine, all, bytes)`: a host
/// all-gather of `bytes` bytes per rank into `all` (ranks x bytes). Each count travels as
/// write_count writes it in `width` bytes (count_bytes), so a forged 8-byte count past 2^63 reads
/// negative, for the caller's range check.
template <typename AllGather>
std::vector<int64_t> gather_counts(const std::vector<int64_t>& row, size_t width, size_t ranks, AllGather&& allgather) {
  const size_t n = row.size();
  std::vector<unsigned char> mine(width * n), all(width * n * ranks);
  for (size_t j = 0; j < n; ++j) write_count(mine.data() + width * j, row[j], width);
  allgather(mine.data(), all.data(), mine.size());
  std::vector<int64_t> out(n * ranks);
  for (size_t j = 0; j < out.size(); ++j) out[j] = read_count(all.data() + width * j, width);
  return out;
}

/// Checks that a received message is exactly the `bytes` its sender announced.
inline void check_message_size(const MessageView& m, size_t bytes) {
  GS_CHECK(m.bytes() == bytes, CorruptMessageError, message_source(m.source_rank), " holds ", m.count, " pairs (",
           m.bytes(), " bytes) but was announced as ", bytes, " bytes");
}

/// Validates a received message of `bytes` bytes in host memory (read_header) and returns its view.
inline MessageView view_host_message(const void* data, size_t bytes, DType expected_dtype, uint64_t expected_dense_size,
                                     int source_rank = -1) {
  return view_from_header(data, read_header(data, bytes, expected_dtype, expected_dense_size, source_rank),
                          source_rank);
}

/// Pairs in host memory to lay out as a message: pair j is (index[j], value[j]), or with `at`,
/// (index[at[j]], value[at[j]]) (a subset of candidates without copying it out first).
struct HostPairs {
  const int64_t* index = nullptr;
  const float* value = nullptr;  ///< null: the values are left zero, for a kernel to fill
  const size_t* at = nullptr;
  size_t count = 0;

  HostPairs() = default;
  HostPairs(const std::vector<int64_t>& i, const std::vector<float>* v)
      : index(i.data()), value(v == nullptr ? nullptr : v->data()), count(i.size()) {
    GS_ASSERT(v == nullptr || v->size() == i.size());
  }
  /// The pairs at `positions` of `i` and `v` (std::vector or HostBuffer), in that order.
  template <typename Index, typename Value>
  HostPairs(const Index& i, const Value& v, const Positions& positions)
      : index(i.data()), value(v.data()), at(positions.data()), count(positions.size()) {
    GS_ASSERT(v.size() == i.size());
  }
  size_t source(size_t j) const { return at == nullptr ? j : at[j]; }
};

/// Lays out `pairs` as a message at `dst` (MessageLayout's total_bytes for their count): the
/// header, the indices (checked: inside [0, dense_size), strictly ascending; ValueError
/// otherwise), the values rounded to `dtype` (zeros without values) and zero padding. In host
/// memory; parallel over blocks of pairs.
void pack_pairs(DType dtype, int64_t dense_size, const HostPairs& pairs, unsigned char* dst);

/// pack_pairs into a new host buffer.
std::vector<unsigned char> pack_host(DType dtype, int64_t dense_size, const HostPairs& pairs);

/// A 64-bit digest of `count` indices in their order: a sum of independent hashes, one per index
/// and position, so that it costs no chain of dependent steps over a long list.
int64_t index_digest(const int64_t* index, size_t count);

/// What every exchange sends first (one allgather per step, unless the ranks agreed them while
/// selecting: Selection::agreed): each rank's pair count, whether it saw non-finite values, and
/// a digest of its indices, so that all ranks agree on buffer sizes (a message's size follows
/// from its count: message_bytes) and on aborting the step before any data moves. On the wire
/// the count and the non-finite count take count_bytes(numel) each, and the digest 8 bytes where
/// the exchange checks one (exchange_control).
struct ControlWord {
  int64_t count = 0;
  int64_t nonfinite = 0;
  int64_t index_digest = 0;  ///< hash of the selected indices (checked by the shared exchange)
};

}  // namespace gradsparse
