// Transport: the few collectives the exchanges need, behind one interface. Exchanges never call
// MPI, Gloo or NCCL themselves. Implementations: ThreadTransport (N ranks as threads of one
// process, for tests and simulation), ProcessGroupTransport (csrc/torch: a torch.distributed
// process group).
//
// Traffic accounting. Every transport counts, per collective, the bytes a bandwidth-optimal
// algorithm moves per rank, so figures are comparable across transports and with the simulator:
//   allgather of b bytes per rank:   sent = received = (P - 1) * b
//   allgatherv of b_r bytes by rank r: sent = received = sum of the other ranks' b_r (a ring
//                                    forwards every block but one; with equal blocks, as above)
//   allreduce of b bytes:            sent = received = floor(2 * (P - 1) * b / P)   (ring)
//   sendrecv of s bytes out, r in:   sent = s, received = r
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "gradsparse/common.h"
#include "gradsparse/device.h"

namespace gradsparse {

/// Where each of blocks laid back to back starts: offsets[r] = sizes[0] + ... + sizes[r - 1], and
/// offsets[sizes.size()] is their total.
inline std::vector<size_t> block_offsets(const std::vector<size_t>& sizes) {
  std::vector<size_t> offsets(sizes.size() + 1, 0);
  for (size_t r = 0; r < sizes.size(); ++r) offsets[r + 1] = offsets[r] + sizes[r];
  return offsets;
}

struct Traffic {
  int64_t bytes_sent = 0;
  int64_t bytes_received = 0;
  int64_t collectives = 0;

  Traffic operator-(const Traffic& o) const {
    return {bytes_sent - o.bytes_sent, bytes_received - o.bytes_received, collectives - o.collectives};
  }
};

class Transport {
 public:
  virtual ~Transport() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  /// Every rank contributes `bytes` bytes from `send`; `recv` (size() * bytes) receives rank r's
  /// contribution at offset r * bytes. Buffers live on `device`. `bytes` must be equal on all ranks
  /// and positive (a zero-length collective is a bug in the caller).
  virtual void allgather(const Device& device, const void* send, void* recv, size_t bytes) = 0;

  /// Every rank r contributes `sizes[r]` bytes (this rank's from `send`); `recv` receives them
  /// back to back, rank r's at offset sizes[0] + ... + sizes[r - 1]. Every rank passes the same
  /// `sizes` (each rank learnt them from the control words); entries may be zero, not all of them.
  /// This default pads every block to the largest and moves them through allgather (counted as
  /// such); transports with a variable-size collective override it and move only the bytes.
  virtual void allgatherv(Device& device, const void* send, void* recv, const std::vector<size_t>& sizes);

  /// In-place elementwise sum over ranks of `count` elements of `dtype` on `device`.
  virtual void allreduce_sum(const Device& device, void* data, size_t count, DType dtype) = 0;

  /// Sends `send_bytes` from `send` to rank `dst` while receiving `recv_bytes` into `recv` from
  /// rank `src` (both may be this rank's partners in a ring or a butterfly). The peer that sends
  /// to this rank must send exactly `recv_bytes`. A zero-byte side is skipped on both ends.
  virtual void sendrecv(const Device& device, const void* send, size_t send_bytes, int dst, void* recv,
                        size_t recv_bytes, int src) = 0;

  /// Bytes moved so far by this rank (see the accounting rule above).
  const Traffic& traffic() const { return traffic_; }

 protected:
  void count_allgather(size_t bytes) {
    const int64_t moved = static_cast<int64_t>(bytes) * (size() - 1);
    traffic_.bytes_sent += moved;
    traffic_.bytes_received += moved;
    ++traffic_.collectives;
  }
  void count_allgatherv(const std::vector<size_t>& sizes) {
    int64_t others = 0;
    for (int r = 0; r < static_cast<int>(sizes.size()); ++r)
      if (r != rank()) others += static_cast<int64_t>(sizes[r]);
    traffic_.bytes_sent += others;
    traffic_.bytes_received += others;
    ++traffic_.collectives;
  }
  /// Checks allgatherv's arguments: one size per rank, not all zero.
  void check_allgatherv(const std::vector<size_t>& sizes, const char* who) const;
  void count_sendrecv(size_t sent, size_t received) {
    traffic_.bytes_sent += static_cast<int64_t>(sent);
    traffic_.bytes_received += static_cast<int64_t>(received);
    ++traffic_.collectives;
  }
  void count_allreduce(size_t bytes) {
    const int64_t p = size();
    const int64_t moved = 2 * (p - 1) * static_cast<int64_t>(bytes) / p;
    traffic_.bytes_sent += moved;
    traffic_.bytes_received += moved;
    ++traffic_.collectives;
  }

 private:
  Traffic traffic_;
};

/// N ranks as threads of one process. Create one group, hand transport(r) to the thread of rank r.
/// Every collective is a rendezvous of all ranks; a rank that does not arrive within `timeout`, or
/// a call to abort(), makes every waiting rank throw CommError.
class ThreadGroup : public std::enable_shared_from_this<ThreadGroup> {
 public:
  static std::shared_ptr<ThreadGroup> create(int size, std::chrono::milliseconds timeout = std::chrono::seconds(60));
  virtual ~ThreadGroup() = default;
  virtual std::unique_ptr<Transport> transport(int rank) = 0;
  /// Fails every pending and future collective of the group with `reason`.
  virtual void abort(const std::string& reason) = 0;
};

}  // namespace gradsparse
