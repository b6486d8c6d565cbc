// Routing a selection's pairs to the owners of their shards: what the sparse reduce-scatter
// (FSDP) and reduce-scatter + all-gather share. The bucket is cut into P shards of
// ceil(n / P) elements (the last shorter, possibly empty); rank o owns shard o.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/transport.h"

namespace gradsparse {

/// The P shards of a bucket of n elements: shard o is [begin(o), begin(o) + length(o)).
struct Shards {
  Shards(int64_t elements, int ranks) : n(elements), p(ranks), chunk(ranks > 0 ? (elements + ranks - 1) / ranks : 0) {}
  int64_t begin(int o) const { return std::min(n, static_cast<int64_t>(o) * chunk); }
  int64_t length(int o) const { return std::min(n, static_cast<int64_t>(o + 1) * chunk) - begin(o); }

  int64_t n;
  int p;
  int64_t chunk;
};

/// A selection split at the shard boundaries: one bare message per owner (no header: the owner
/// learns its count first), with shard-local indices, laid back to back in host memory (owner
/// o's at offsets[o], each a multiple of 8 bytes).
struct OwnerParts {
  std::vector<unsigned char> bytes;
  std::vector<size_t> offsets;  ///< P + 1 entries
  std::vector<int64_t> counts;  ///< pairs per owner

  size_t size(int o) const { return offsets[o + 1] - offsets[o]; }
};

/// This rank's selection (for the bucket) split by owner.
OwnerParts split_by_owner(Device& device, const BucketView& bucket, const Selection& mine, const Shards& shards);

/// The pair count of the part every rank sends this rank (by rank; this rank's own from
/// `parts`): P - 1 rounds of send-receive of one count (count_bytes of a shard's length), in
/// round s with ranks rank + s (to) and rank - s (from). Each announced count is checked against
/// what rank r can send: at most min(most[r], this shard's length) pairs.
std::vector<int64_t> exchange_part_counts(Transport& transport, Device& device, const OwnerParts& parts,
                                          const Shards& shards, const std::vector<int64_t>& most);

/// Sends each owner its part and receives every rank's part of this rank's shard (`counts[r]`
/// pairs from rank r, bare), in P - 1 rounds of send-receive; returns their views in rank order
/// (the kernels that read them check their indices). `storage` holds them.
std::vector<MessageView> route_to_owners(Transport& transport, Device& device, const BucketView& bucket,
                                         const OwnerParts& parts, const Shards& shards,
                                         const std::vector<int64_t>& counts, Buffer& storage);

}  // namespace gradsparse
