// Exchanges: the sparse all-reduce algorithms (docs/method-spec.md section 3). Each moves every
// rank's selection through a Transport and writes the averaged dense result into the bucket.
// Every rank issues the same sequence of collectives whatever its data, and no collective is
// ever zero-length.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/transport.h"

namespace gradsparse {

/// The exchanges a method can ask for.
enum class ExchangeKind {
  kGather,  ///< gather-and-add: every rank's pairs reach every rank; duplicates accumulate
  kUnion,   ///< union + all-reduce: the union of the indices, every rank's own values there
  kShared,  ///< all ranks selected the same indices: all-reduce the values
};

/// Parses "gather", "union" or "shared"; ValueError naming `option` otherwise.
ExchangeKind parse_exchange(const std::string& name, const std::string& option = "exchange");

/// What every exchange sends first (one allgather of 32 bytes per rank): the size of each rank's
/// message, its pair count, whether it saw non-finite values, and a digest of its indices, so
/// that all ranks agree on buffer sizes and on aborting the step before any data moves.
struct ControlWord {
  int64_t message_bytes = 0;
  int64_t count = 0;
  int64_t nonfinite = 0;
  int64_t index_digest = 0;  ///< hash of the selected indices (checked by the shared exchange)
};
static_assert(sizeof(ControlWord) == 32, "control word must be 32 bytes");

struct ExchangeResult {
  std::vector<ControlWord> control;  ///< every rank's control word, by rank
  bool aborted = false;              ///< some rank saw non-finite values: nothing was exchanged
  int64_t union_size = 0;            ///< elements written (the union for kUnion; pairs otherwise)

  int64_t total_count() const;
  std::vector<int> nonfinite_ranks() const;
};

/// All-gathers the control words of every rank and checks each against what it must be for
/// `bucket` (peers are not trusted): 0 <= count <= bucket.numel, 0 <= nonfinite <= bucket.numel,
/// and message_bytes equal to the layout of `count` pairs, or 0 (with count 0) when
/// `with_message` is false (the word only carries the non-finite count). A violation is a
/// CorruptMessageError naming the rank and the field.
std::vector<ControlWord> exchange_control(Transport& transport, Device& device, const ControlWord& mine,
                                          const BucketView& bucket, bool with_message = true);

/// The check exchange_control applies to rank `source_rank`'s word (exposed for the fuzzers).
void check_control_word(const ControlWord& word, const BucketView& bucket, bool with_message, int source_rank);

/// Runs the exchange `kind` for this rank's selection and writes the average into bucket.grad.
/// Returns early (aborted, bucket untouched) if any rank reported non-finite values.
///
/// - kGather: all-gather every message padded to the largest, scatter-add all pairs divided by
///   the world size, in rank order (bit-identical on every rank). The selection zeroed its own
///   residual entries.
/// - kUnion: all-gather the index lists, form the sorted union U, all-reduce every rank's own
///   selection values at U, write sum / P there, and zero every rank's residual on U (the
///   selection must not have zeroed anything).
/// - kShared: check that every rank selected the same indices (CorruptMessageError otherwise),
///   all-reduce the values in place, write sum / P.
///
/// With `fixed_count` (kGather only: every rank's message holds exactly that many pairs), the
/// control words are skipped: one fixed-size all-gather, and the non-finite counts travel in the
/// message headers.
ExchangeResult exchange(ExchangeKind kind, Transport& transport, Device& device, const BucketView& bucket,
                        const Selection& mine, std::optional<int64_t> fixed_count = std::nullopt);

/// The sparse reduce-scatter (FSDP's gradient reduction, docs/architecture.md "FSDP2"): the
/// bucket is P equal shards, rank r owning shard r. Every rank splits its selection (made with
/// gather-and-add's semantics: residual zeroed at the selected pairs) at the shard boundaries and
/// sends each owner only the pairs in its shard: one all-gather of P + 1 counts per rank, then
/// P - 1 rounds of send-receive. Each owner writes the average of every rank's pairs into its
/// shard (added in rank order) and zeros elsewhere: only its own shard is the result. A rank thus
/// sends its k pairs once, about k (P - 1) / P of them over the wire, where gather-and-add makes
/// every rank receive every rank's. Returns early (aborted) on non-finite values, like exchange().
ExchangeResult scatter_to_owners(Transport& transport, Device& device, const BucketView& bucket, const Selection& mine);

/// Dense average, DDP style: divide by the world size, then all-reduce (sum) in place.
void dense_allreduce(Transport& transport, Device& device, const BucketView& bucket);

/// A 64-bit digest of a message's indices (the shared exchange compares them across ranks).
int64_t index_digest(Device& device, const Selection& selection, const BucketView& bucket);

}  // namespace gradsparse
