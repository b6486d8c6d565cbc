// Exchanges: the sparse all-reduce algorithms. Each moves every rank's selection through a
// Transport and writes the averaged dense result into the bucket. Every rank issues the same
// sequence of collectives whatever its data, and no collective is ever zero-length.
#pragma once

#include <cstdint>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/transport.h"

namespace gradsparse {

/// What every exchange sends first (one allgather of 32 bytes per rank): the size of each rank's
/// message, its pair count, and whether it saw non-finite values, so that all ranks agree on
/// buffer sizes and on aborting the step before any data moves.
struct ControlWord {
  int64_t message_bytes = 0;
  int64_t count = 0;
  int64_t nonfinite = 0;
  int64_t reserved = 0;
};
static_assert(sizeof(ControlWord) == 32, "control word must be 32 bytes");

struct ExchangeResult {
  std::vector<ControlWord> control;  ///< every rank's control word, by rank
  bool aborted = false;              ///< some rank saw non-finite values: nothing was exchanged

  int64_t total_count() const;
  std::vector<int> nonfinite_ranks() const;
};

/// All-gathers the control words of every rank.
std::vector<ControlWord> exchange_control(Transport& transport, Device& device, const ControlWord& mine);

/// Gather-and-add (SIDCo/SAGE style): exchange control words, all-gather every rank's message
/// padded to the largest, then scatter-add all pairs into bucket.grad (zeroed first) divided by
/// the world size. Duplicate indices accumulate; pairs are added in rank order, so every rank
/// computes bit-identical results. Returns early (aborted, bucket untouched) if any rank
/// reported non-finite values.
ExchangeResult gather_add(Transport& transport, Device& device, const BucketView& bucket, const Selection& mine);

/// Dense average, DDP style: divide by the world size, then all-reduce (sum) in place.
void dense_allreduce(Transport& transport, Device& device, const BucketView& bucket);

}  // namespace gradsparse
