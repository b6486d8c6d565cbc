// libFuzzer target: one received message (and one control word) through validation and
// scatter-add, as a receiver meets them from an untrusted peer.
//
// Input: mode, dtype, bucket size, seed, k, then either edits (offset, byte) applied to a valid
// message of the top-k of a random gradient (mode bit 0 clear: deep cases), or the raw bytes of
// the message (bit 0 set). Bit 1 truncates the message, bit 2 places it 4 bytes off alignment,
// bit 3 decodes its first bytes as a control word on the wire (count and non-finite count,
// count_bytes(n) each) and checks it as one that carries a message, bit 4 reads the
// bytes after the header as a bare message of k pairs (the count a control word announced), as
// every exchange but the fixed-size gather and SparDL receives its messages.
// Properties: no out-of-bounds or misaligned access (ASan, UBSan); a rejection is a
// CorruptMessageError and leaves the output untouched; a misaligned message with a header is
// always rejected.
#include <cstring>
#include <vector>

#include "fuzz_input.h"
#include "gradsparse/cpu_device.h"
#include "gradsparse/exchange.h"
#include "gradsparse/message.h"

using namespace gradsparse;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fuzz::Input in(data, size);
  const uint8_t mode = in.u8();
  const DType dtype = static_cast<DType>(in.u8() % 3);
  const int64_t n = in.u16() % 5000;
  const uint8_t seed = in.u8();
  const int64_t k = n > 0 ? in.u16() % (n + 1) : 0;
  CpuDevice device;

  std::vector<unsigned char> message;
  if (mode & 1) {
    message.assign(in.rest(), in.rest() + in.rest_size());
  } else {
    std::vector<unsigned char> grad = fuzz::random_bucket(dtype, n, seed);
    const Selection s = device.select_topk(BucketView{dtype, n, grad.data(), nullptr}, k, /*update=*/false);
    message.assign(s.message.as<unsigned char>(), s.message.as<unsigned char>() + s.bytes);
    if (mode & 2) message.resize(message.size() - std::min<size_t>(message.size(), in.u8()));
    while (!in.done() && !message.empty()) {
      const size_t at = in.u16() % message.size();
      message[at] = in.u8();
    }
  }

  // Place the message in 8-byte aligned storage, or 4 bytes off.
  const size_t shift = (mode & 4) ? 4 : 0;
  std::vector<uint64_t> storage((message.size() + shift) / 8 + 1);
  unsigned char* at = reinterpret_cast<unsigned char*>(storage.data()) + shift;
  if (!message.empty()) std::memcpy(at, message.data(), message.size());

  const size_t width = count_bytes(static_cast<uint64_t>(n));
  if ((mode & 8) && message.size() >= 2 * width) {  // a control word as it travels: count, non-finite count
    const ControlWord word{read_count(message.data(), width), read_count(message.data() + width, width), 0};
    try {
      check_control_word(word, BucketView{dtype, n, nullptr, nullptr}, /*with_message=*/true, 1);
    } catch (const CorruptMessageError&) {
    }
  }

  std::vector<unsigned char> out = fuzz::random_bucket(dtype, n, seed + 1);
  const std::vector<unsigned char> before = out;
  if (mode & 16) {
    const MessageView bare = bare_view(at + kMessageHeaderBytes, k, dtype, n, 0, 1);
    if (message.size() < kMessageHeaderBytes + bare.bytes()) return 0;  // a bare message arrives at its size
    try {
      device.scatter_add(bare, out.data(), 2.0f);
    } catch (const CorruptMessageError&) {
      if (out != before) __builtin_trap();  // a rejected message wrote to the output
    }
    return 0;
  }
  try {
    device.scatter_add(read_message(device, at, message.size(), dtype, n, 1), out.data(), 2.0f);
    if (shift != 0) __builtin_trap();  // a misaligned message was accepted
  } catch (const CorruptMessageError&) {
    if (out != before) __builtin_trap();  // a rejected message wrote to the output
  }
  return 0;
}
