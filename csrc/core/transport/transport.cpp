// What every Transport shares: allgatherv's checks and its padded fallback.
#include "gradsparse/transport.h"

#include <algorithm>

namespace gradsparse {

void Transport::check_allgatherv(const std::vector<size_t>& sizes, const char* who) const {
  GS_CHECK(static_cast<int>(sizes.size()) == size(), ValueError, who, ".allgatherv: ", sizes.size(), " sizes for ",
           size(), " ranks");
  GS_CHECK(std::any_of(sizes.begin(), sizes.end(), [](size_t b) { return b > 0; }), ValueError, who,
           ".allgatherv: zero-length collective");
}

void Transport::allgatherv(Device& device, const void* send, void* recv, const std::vector<size_t>& sizes) {
  check_allgatherv(sizes, "Transport");
  const size_t largest = *std::max_element(sizes.begin(), sizes.end());
  const size_t mine = sizes[static_cast<size_t>(rank())];
  Buffer padded = device.allocate(largest);
  Buffer gathered = device.allocate(largest * static_cast<size_t>(size()));
  device.fill_zero(padded.data(), largest);
  device.copy(padded.data(), send, mine);
  allgather(device, padded.data(), gathered.data(), largest);
  const std::vector<size_t> offsets = block_offsets(sizes);
  for (int r = 0; r < size(); ++r)
    device.copy(static_cast<unsigned char*>(recv) + offsets[r], gathered.as<unsigned char>() + r * largest, sizes[r]);
}

}  // namespace gradsparse
