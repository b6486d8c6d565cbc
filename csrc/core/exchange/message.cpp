#include "gradsparse/message.h"
#include "gradsparse/device.h"

namespace gradsparse {

MessageHeader read_device_header(Device& device, const void* message, size_t bytes, DType dtype, uint64_t numel,
                                 int source_rank) {
  check_message_start(message, bytes, source_rank);
  unsigned char host[kMessageHeaderBytes];
  device.copy_to_host(host, message, kMessageHeaderBytes);
  const MessageHeader h = parse_header(host, dtype, numel, source_rank);
  check_message_length(h, bytes, source_rank);
  return h;
}

}  // namespace gradsparse
