// The sparse message format: packing by a selection, validation of every field on receipt, and
// rejection of corrupt messages without writing out of bounds.
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "gradsparse/cpu_device.h"
#include "gradsparse/message.h"
#include "reference.h"

using namespace gradsparse;
namespace ref = gradsparse::reference;

namespace {

struct Packed {
  std::vector<unsigned char> bytes;
  int64_t count = 0;
};

Packed pack_threshold(std::vector<float> grad, double thr) {
  CpuDevice device;
  BucketView bucket{DType::kFloat32, static_cast<int64_t>(grad.size()), grad.data(), nullptr};
  Selection sel = device.select_threshold(bucket, thr);
  const auto* p = sel.message.as<unsigned char>();
  return Packed{std::vector<unsigned char>(p, p + sel.bytes), sel.count};
}

/// Receives a message as the exchanges do: its header read and validated once, then its pairs
/// added (the kernel checks every index).
void receive(Device& device, const unsigned char* data, size_t bytes, std::vector<float>& out, int rank) {
  const MessageView m = read_message(device, data, bytes, DType::kFloat32, out.size(), rank);
  device.scatter_add(m, out.data(), 1.0f);
}

TEST(Message, LayoutIsHeaderThenIndicesThenValues) {
  const Packed m = pack_threshold({0.0f, 3.0f, -0.5f, -4.0f, 1.0f}, 1.0);
  ASSERT_EQ(m.count, 3);
  const MessageHeader h = read_header(m.bytes.data(), m.bytes.size(), DType::kFloat32, 5);
  EXPECT_EQ(h.count, 3u);
  EXPECT_EQ(h.index_bytes, 4);
  const MessageLayout layout(3, 4, DType::kFloat32);
  EXPECT_EQ(layout.values_offset, 32u + 16u);  // 12 bytes of indices padded to 16
  EXPECT_EQ(layout.total_bytes, m.bytes.size());
  uint32_t idx[3];
  float val[3];
  std::memcpy(idx, m.bytes.data() + 32, sizeof(idx));
  std::memcpy(val, m.bytes.data() + layout.values_offset, sizeof(val));
  EXPECT_EQ(std::vector<uint32_t>(idx, idx + 3), (std::vector<uint32_t>{1, 3, 4}));
  EXPECT_EQ(std::vector<float>(val, val + 3), (std::vector<float>{3.0f, -4.0f, 1.0f}));
}

TEST(Message, PaddingBytesAreZero) {
  const Packed m = pack_threshold({0.0f, 3.0f, -0.5f, -4.0f, 1.0f}, 1.0);  // 3 pairs: 4 + 4 bytes of padding
  const MessageLayout layout(3, 4, DType::kFloat32);
  for (size_t b = 32 + 12; b < layout.values_offset; ++b) EXPECT_EQ(m.bytes[b], 0) << "byte " << b;
  for (size_t b = layout.values_offset + 12; b < layout.total_bytes; ++b) EXPECT_EQ(m.bytes[b], 0) << "byte " << b;
}

/// Device::emit lays a subset of candidates out in place, in parallel blocks of pairs: the same
/// bytes as the selection kernel's message of the same pairs, and a bad index in any block is
/// named with its position.
TEST(Message, EmittedSubsetIsTheKernelsMessage) {
  const int64_t n = 1'000'003;
  std::vector<float> grad(static_cast<size_t>(n), 0.25f);
  std::vector<int64_t> index;  // candidates: every 7th element
  std::vector<float> value;
  std::vector<size_t> chosen;  // of which every other one, 71,429 pairs: three blocks of pairs
  for (int64_t i = 0; i < n; i += 7) {
    if (index.size() % 2 == 0) {
      chosen.push_back(index.size());
      grad[static_cast<size_t>(i)] = 1.0f + static_cast<float>(i % 13);
    }
    index.push_back(i);
    value.push_back(grad[static_cast<size_t>(i)]);
  }
  CpuDevice device;
  BucketView bucket{DType::kFloat32, n, grad.data(), nullptr};
  HostPairs pairs(index, &value);
  pairs.at = chosen.data();
  pairs.count = chosen.size();
  const Selection emitted = device.emit(bucket, pairs, false);
  const Packed kernel = pack_threshold(grad, 1.0);
  ASSERT_EQ(emitted.count, static_cast<int64_t>(chosen.size()));
  ASSERT_EQ(kernel.count, emitted.count);
  const auto* p = emitted.message.as<unsigned char>();
  EXPECT_EQ(std::vector<unsigned char>(p, p + emitted.bytes), kernel.bytes);

  for (size_t at : {size_t{5}, size_t{40'000}, chosen.size() - 1}) {  // in the first, second and last block
    std::vector<int64_t> bad = index;
    bad[chosen[at]] = at + 1 < chosen.size() ? index[chosen[at + 1]] : n;  // a repeat, or past the end
    HostPairs b(bad, &value);
    b.at = chosen.data();
    b.count = chosen.size();
    const size_t named = at + 1 < chosen.size() ? at + 1 : at;
    try {
      device.emit(bucket, b, false);
      ADD_FAILURE() << "no error for a bad index at position " << at;
    } catch (const ValueError& e) {
      EXPECT_NE(std::string(e.what()).find("at position " + std::to_string(named)), std::string::npos) << e.what();
    }
  }
}

TEST(Message, EmptySelectionIsAValidHeaderOnlyMessage) {
  const Packed m = pack_threshold({0.1f, 0.2f}, 5.0);
  EXPECT_EQ(m.count, 0);
  EXPECT_EQ(m.bytes.size(), kMessageHeaderBytes);
  EXPECT_NO_THROW(read_header(m.bytes.data(), m.bytes.size(), DType::kFloat32, 2));
}

TEST(Message, MakeHeaderValidatesItsArguments) {
  EXPECT_THROW(make_header(DType::kFloat32, 2, 10, 1), ValueError);
  EXPECT_THROW(make_header(DType::kFloat32, 4, 10, 11), ValueError);
  EXPECT_THROW(make_header(DType::kFloat32, 4, uint64_t{1} << 33, 1), ValueError);
  EXPECT_NO_THROW(make_header(DType::kFloat32, 8, uint64_t{1} << 33, 1));
}

// Each corruption of a valid message must be rejected with CorruptMessageError (by read_message
// for the header, by the kernel for the indices), and the output must stay untouched.
TEST(Message, CorruptMessagesAreRejectedWithoutWriting) {
  const Packed good = pack_threshold({0.0f, 3.0f, -0.5f, -4.0f, 1.0f}, 1.0);
  const MessageLayout layout(3, 4, DType::kFloat32);
  struct Case {
    const char* what;
    std::function<void(std::vector<unsigned char>&)> corrupt;
    size_t length_delta;  // bytes removed from the end
  };
  const std::vector<Case> cases = {
      {"magic", [](auto& b) { b[0] ^= 0xff; }, 0},
      {"version", [](auto& b) { b[4] = 9; }, 0},
      {"dtype code", [](auto& b) { b[5] = 7; }, 0},
      {"dtype mismatch", [](auto& b) { b[5] = 1; }, 0},
      {"index width", [](auto& b) { b[6] = 3; }, 0},
      {"flags", [](auto& b) { b[7] = 1; }, 0},
      {"dense size", [](auto& b) { b[8] = 6; }, 0},
      {"count above dense size", [](auto& b) { b[16] = 9; }, 0},
      {"count beyond the buffer", [](auto& b) { b[16] = 5; }, 0},
      {"truncated", [](auto&) {}, 4},
      {"shorter than a header", [](auto&) {}, good.bytes.size() - 10},
      {"index out of range", [&](auto& b) { b[layout.indices_offset + 8] = 200; }, 0},
      {"indices not ascending", [&](auto& b) { b[layout.indices_offset + 4] = 0; }, 0},
      {"duplicate index", [&](auto& b) { b[layout.indices_offset + 4] = 1; }, 0},
  };
  CpuDevice device;
  for (const Case& c : cases) {
    std::vector<unsigned char> bad = good.bytes;
    c.corrupt(bad);
    bad.resize(bad.size() - c.length_delta);
    std::vector<float> out(5, 7.0f);
    EXPECT_THROW(receive(device, bad.data(), bad.size(), out, 2), CorruptMessageError) << c.what;
    EXPECT_EQ(out, std::vector<float>(5, 7.0f)) << c.what;
  }
  std::vector<float> out(5, 0.0f);
  receive(device, good.bytes.data(), good.bytes.size(), out, 0);
  EXPECT_EQ(out, (std::vector<float>{0.0f, 3.0f, 0.0f, -4.0f, 1.0f}));
}

// Indices and values sit at multiples of 8 from a message's start, so a message that does not
// start 8-byte aligned (after a peer's size that is not a multiple of 8) would be read misaligned:
// it is rejected before any read.
TEST(Message, AMisalignedMessageIsRejected) {
  const Packed good = pack_threshold({0.0f, 3.0f, -0.5f, -4.0f, 1.0f}, 1.0);
  std::vector<uint64_t> storage(good.bytes.size() / 8 + 1);  // 8-byte aligned
  auto* shifted = reinterpret_cast<unsigned char*>(storage.data()) + 4;
  std::memcpy(shifted, good.bytes.data(), good.bytes.size());
  CpuDevice device;
  std::vector<float> out(5, 7.0f);
  EXPECT_THROW(receive(device, shifted, good.bytes.size(), out, 1), CorruptMessageError);
  EXPECT_THROW(read_header(shifted, good.bytes.size(), DType::kFloat32, 5, 1), CorruptMessageError);
  EXPECT_EQ(out, std::vector<float>(5, 7.0f));
}

// A count whose layout (count * index_bytes, count * dtype_size) wraps around 2^64 laid out in a
// few bytes: a lone 32-byte header claiming 2^62 pairs passed the length check, and its view
// named 2^62 pairs in a buffer of 64 bytes.
TEST(Message, ACountWhoseSizeWrapsAround64BitsIsRejected) {
  for (const int index_bytes : {4, 8}) {
    MessageHeader h = make_header(DType::kFloat32, 8, uint64_t{1} << 63, 0);
    h.index_bytes = static_cast<uint8_t>(index_bytes);
    h.count = uint64_t{1} << 62;
    std::vector<uint64_t> storage(8, 0);  // 64 bytes, 8-byte aligned
    std::memcpy(storage.data(), &h, sizeof(h));
    try {
      read_header(storage.data(), 64, DType::kFloat32, uint64_t{1} << 63, 2);
      FAIL() << "no exception for index_bytes " << index_bytes;
    } catch (const CorruptMessageError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("rank 2 claims 4611686018427387904 pairs"), std::string::npos) << msg;
      EXPECT_NE(msg.find("only 64 bytes arrived"), std::string::npos) << msg;
    }
  }
}

TEST(Message, ErrorNamesTheSourceRankAndTheField) {
  const Packed good = pack_threshold({0.0f, 3.0f}, 1.0);
  std::vector<unsigned char> bad = good.bytes;
  bad[8] = 9;
  try {
    read_header(bad.data(), bad.size(), DType::kFloat32, 2, 3);
    FAIL() << "no exception";
  } catch (const CorruptMessageError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("rank 3"), std::string::npos) << msg;
    EXPECT_NE(msg.find("9 elements"), std::string::npos) << msg;
  }
}

}  // namespace
