// Exchanges: the sparse all-reduce algorithms (docs/method-spec.md section 3, docs/architecture.md
// "Exchanges"). Each is a strategy behind one interface, in a file of its own in exchange/: it moves
// every rank's selection through a Transport and writes the averaged dense result into the bucket.
// A method names the exchange its selections go through (Method::exchange). Every rank issues the
// same sequence of collectives whatever its data, and no collective is ever zero-length.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "gradsparse/device.h"
#include "gradsparse/transport.h"

namespace gradsparse {

/// The glossary of exchanges: one name each, used by the code, gradsparse.simulate and the docs.
enum class ExchangeKind {
  kGatherAndAdd,            ///< "gather-and-add": every rank's pairs reach every rank; duplicates add up
  kFixedGather,             ///< "fixed-size gather": gather-and-add of equal, known counts (Top-k)
  kExclusiveGather,         ///< "exclusive gather": gather-and-add of selections from disjoint partitions
  kUnionAllreduce,          ///< "union + all-reduce": index lists, then every rank's values on their union
  kSharedIndices,           ///< "shared indices": every rank selected the same indices; values all-reduced
  kSparseReduceScatter,     ///< "sparse reduce-scatter": each pair to the owner of its shard only
  kReduceScatterAllgather,  ///< "reduce-scatter + all-gather": owners reduce and keep the global top K
  kSparDL,                  ///< "SparDL": Spar-Reduce-Scatter, Spar-All-Gather across teams, Bruck all-gather
};

/// Every exchange, in the glossary's order.
inline constexpr ExchangeKind kExchangeKinds[] = {
    ExchangeKind::kGatherAndAdd,           ExchangeKind::kFixedGather,   ExchangeKind::kExclusiveGather,
    ExchangeKind::kUnionAllreduce,         ExchangeKind::kSharedIndices, ExchangeKind::kSparseReduceScatter,
    ExchangeKind::kReduceScatterAllgather, ExchangeKind::kSparDL};

/// The glossary name of an exchange ("gather-and-add", ...).
const char* exchange_name(ExchangeKind kind);

struct ExchangeResult {
  std::vector<ControlWord> control;  ///< every rank's control word, by rank
  /// The step does not apply, on every rank: some rank saw non-finite values (nothing was
  /// exchanged), or a float16 sum passed 65504 (`unheld`, `overflowed`). The output is untouched.
  bool aborted = false;
  int64_t union_size = 0;  ///< elements written (the union for union + all-reduce; pairs otherwise)
  /// SparDL with teams > 1: the pairs of this rank's block once the teams' lists were merged,
  /// before the final top-k (the figure its adaptive h follows); -1 otherwise.
  int64_t merged = -1;
  /// SparDL in float16, by rank: the final-list positions where the rank keeps a partial sum
  /// past float16's largest value (its residual cannot hold it); any > 0 aborts the step. Empty
  /// for every other exchange and dtype.
  std::vector<int64_t> unheld;
  /// The union and shared all-reduces in float16: the sums that came back NaN/Inf from every
  /// rank's finite values / P (the transport rounds each partial sum to float16, and from 10 ranks
  /// of 65504 on Gloo's passed 65504). Every rank reads the same sums, so every rank counts the
  /// same; > 0 aborts the step. 0 for every other exchange and dtype.
  int64_t overflowed = 0;

  int64_t total_count() const;
  std::vector<int> nonfinite_ranks() const;
};

/// An exchange. The stateless ones are shared singletons (below); SparDL's carries the sizes of
/// the step, set by its method.
class Exchange {
 public:
  virtual ~Exchange() = default;
  virtual ExchangeKind kind() const = 0;
  const char* name() const { return exchange_name(kind()); }

  /// Whether a selection for this exchange zeroes its own residual entries when it is made. The
  /// union exchange zeroes the union once the data moved, so its selections leave the residual
  /// alone; SparDL's selection is the error-feedback update alone. After an aborted step, a
  /// selection that zeroed is added back into the residual.
  virtual bool selection_zeroes() const { return true; }

  /// The exchange to run where only this rank's shard of the result is wanted (FSDP's
  /// reduce-scatter): the sparse reduce-scatter for the gather exchanges; the others run whole.
  virtual const Exchange& for_shard() const { return *this; }

  /// Whether run() takes every rank's control word from Selection::agreed when the method agreed
  /// them while selecting (its first collective is agree() on the selection), instead of an
  /// all-gather of its own.
  virtual bool takes_agreed_words() const { return false; }

  /// Refuses a bucket this exchange cannot run on `world_size` ranks: called before the selection,
  /// so that a refusal leaves the residual as it was (and by run() too).
  virtual void check(const BucketView& /*bucket*/, int /*world_size*/) const {}

  /// Moves every rank's selection (`mine` is this rank's) through `transport` and writes the
  /// average into bucket.grad. Returns early (aborted, bucket untouched) when any rank reported
  /// non-finite values, or a float16 sum overflowed (ExchangeResult::aborted).
  virtual ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket,
                             const Selection& mine) const = 0;
};

/// Gather-and-add (exchange/gather_and_add.cpp): control words, then every rank's message
/// (allgatherv, unpadded); every rank adds every message / P in rank order (bit-identical on every
/// rank).
const Exchange& gather_and_add();
/// The exclusive gather: gather-and-add of selections made in disjoint partitions (MiCRO, ExDyna
/// with exchange="gather"), so each element comes from its owner alone and nothing adds up. The
/// same algorithm under its own name: what it moves and costs follows from the partitions.
const Exchange& exclusive_gather();
/// Gather-and-add of messages of one known count (Top-k's exact k): no control words, one
/// fixed-size all-gather; non-finite counts travel in the message headers.
const Exchange& fixed_gather();
/// Union + all-reduce (exchange/union_allreduce.cpp): index lists (allgatherv), their sorted union
/// U, then one all-reduce of every rank's own values on U; every rank zeroes its residual on U.
const Exchange& union_allreduce();
/// Shared indices (exchange/shared_indices.cpp): every rank selected the same indices (checked by
/// the digests of the control words), so only the values are all-reduced.
const Exchange& shared_indices();
/// The sparse reduce-scatter (exchange/sparse_reduce_scatter.cpp): the bucket is P equal shards,
/// rank r owning shard r; every rank splits its selection at the shard boundaries and sends each
/// owner only the pairs in its shard (one all-gather of P + 1 counts per rank, then P - 1 rounds of
/// send-receive). Each owner writes the average of every rank's pairs into its shard (added in
/// rank order) and zeros elsewhere: only its own shard is the result. A rank sends its k pairs
/// once, about k (P - 1) / P of them over the wire, where gather-and-add makes every rank
/// receive every rank's.
const Exchange& sparse_reduce_scatter();

/// Reduce-scatter + all-gather (exchange/reduce_scatter_allgather.cpp), for methods that select
/// k pairs per rank: a sparse all-reduce whose bytes per rank do not grow with P. Control words;
/// each pair to the owner of its shard (P - 1 rounds of send-receive, sizes first); each owner
/// averages what it received and keeps the values in the global top K of the average (K: the
/// largest count of any rank; one threshold for all owners, from an all-reduced histogram of
/// magnitudes in 1024 bins 2^(1/4) apart, so a few more than K when a bin straddles it); every
/// rank all-gathers every owner's kept pairs (counts first). What a rank sent that no owner kept
/// goes back into its residual. About 4 k (P - 1) / P values and indices per rank, where
/// gather-and-add moves 2 k (P - 1); the average is gather-and-add's, restricted to the top K.
const Exchange& reduce_scatter_allgather();

/// The exchange a method's option value names among its `choices` (value, exchange); ValueError
/// naming `owner`, `option` and the choices otherwise.
const Exchange& exchange_option(const std::string& value,
                                const std::vector<std::pair<std::string, const Exchange*>>& choices,
                                const std::string& owner, const std::string& option = "exchange");

/// A method's exchange option: the exchange its value names among the method's `choices`, which
/// may change between steps (exchange="auto" times two of them: Method::set_exchange).
class ExchangeSetting {
 public:
  using Choices = std::vector<std::pair<std::string, const Exchange*>>;
  ExchangeSetting(std::string owner, Choices choices, const std::string& value)
      : owner_(std::move(owner)), choices_(std::move(choices)), exchange_(&exchange_option(value, choices_, owner_)) {}
  const Exchange& get() const { return *exchange_; }
  /// ValueError (nothing changed) for a value outside the choices.
  void set(const std::string& value) { exchange_ = &exchange_option(value, choices_, owner_); }

 private:
  std::string owner_;
  Choices choices_;
  const Exchange* exchange_;
};

/// Bytes of one rank's control word on the wire for a bucket of `numel` elements: its count and
/// non-finite count, count_bytes(numel) each, or, `with_digest`, those and the index digest, 8
/// bytes each.
inline size_t control_bytes(int64_t numel, bool with_digest = false) {
  return with_digest ? 24 : 2 * count_bytes(static_cast<uint64_t>(numel));
}

/// All-gathers the control words of every rank (control_bytes each: index_digest travels only
/// `with_digest`) and checks each against what it must be for `bucket` (peers are not trusted):
/// 0 <= count <= bucket.numel and 0 <= nonfinite <= bucket.numel, and count 0 when
/// `with_message` is false (the word only carries the non-finite count). A violation is a
/// CorruptMessageError naming the rank and the field.
std::vector<ControlWord> exchange_control(Transport& transport, Device& device, const ControlWord& mine,
                                          const BucketView& bucket, bool with_message = true, bool with_digest = false);

/// The check exchange_control applies to rank `source_rank`'s word (exposed for the fuzzers).
void check_control_word(const ControlWord& word, const BucketView& bucket, bool with_message, int source_rank);

/// The first collective of an exchange: every rank's control word (exchange_control), and
/// `aborted` when any rank saw non-finite values.
ExchangeResult agree(Transport& transport, Device& device, const BucketView& bucket, const ControlWord& mine,
                     bool with_message = true, bool with_digest = false);

/// The bytes of a message of `count` (>= 0) pairs for `bucket` (bare: without its header): what
/// a control word announces.
inline int64_t message_bytes(int64_t count, const BucketView& bucket, bool bare = false) {
  return static_cast<int64_t>(MessageLayout(static_cast<uint64_t>(count),
                                            index_bytes_for(static_cast<uint64_t>(bucket.numel)), bucket.dtype, bare)
                                  .total_bytes);
}

/// The control word of this rank's selection.
inline ControlWord control_word(const Selection& mine) { return ControlWord{mine.count, mine.nonfinite, 0}; }

/// agree() on this rank's selection: its control word, or the words the method already agreed
/// (Selection::agreed), checked like received ones and with no collective.
ExchangeResult agree(Transport& transport, Device& device, const BucketView& bucket, const Selection& mine);

/// Each rank's block size in a collective: `size_of(control word)`, by rank.
template <typename SizeOf>
std::vector<size_t> block_sizes(const ExchangeResult& result, SizeOf&& size_of) {
  std::vector<size_t> sizes;
  for (const ControlWord& w : result.control) sizes.push_back(static_cast<size_t>(size_of(w)));
  return sizes;
}

/// All-gathers the first sizes[r] bytes of every rank r's bare message (this rank's is `mine`,
/// sent without its header), laid back to back in the returned buffer (allgatherv: unpadded); no
/// collective, and an empty buffer, where every size is 0.
Buffer allgather_blocks(Transport& transport, Device& device, const Selection& mine, const std::vector<size_t>& sizes);

/// In-place sum over all ranks of a host vector of float64 (every rank passes as many values).
void allreduce_host(Transport& transport, Device& device, std::vector<double>& values);

/// Every rank's `bytes` host bytes at `mine`, by rank, into host memory `all` (size() x bytes),
/// through device buffers.
void allgather_host(Transport& transport, Device& device, const void* mine, void* all, size_t bytes);

/// Every rank's `row` of counts (each 0 <= count < 2^(8 width); any int64 with width 8), rank
/// after rank: one all-gather of `width` (4 or 8: count_bytes) bytes per count. A forged 8-byte
/// count past 2^63 reads negative, for the caller's range check.
std::vector<int64_t> allgather_counts(Transport& transport, Device& device, const std::vector<int64_t>& row,
                                      size_t width);

/// Dense average, DDP style: divide by the world size, then all-reduce (sum) in place.
void dense_allreduce(Transport& transport, Device& device, const BucketView& bucket);

/// Whether exchanges sum values of `dtype` already divided by P: float16 is divided first, as
/// DDP's all-reduce does, since the sum of P float16 values can exceed its largest finite value
/// (65504) where their average does not, and an Inf there would reach the output while the
/// residual was emptied. float32 and bfloat16 are summed, then divided as they are added (the
/// re-statement's exact sums).
inline bool divides_first(DType dtype) { return dtype == DType::kFloat16; }

/// The all-reduce of `count` values of `dtype` at `values` (device memory, summed in place) for
/// the union and shared exchanges, divided first where `divides_first`; returns the divisor
/// their scatter-add still applies. Divided first, the sums are counted for NaN/Inf, which the
/// ranks' values (finite: agree() let the step go on) did not hold: `result.overflowed` gets the
/// count, and any aborts the step (`result.aborted`) before the exchange writes anything.
float allreduce_values(Transport& transport, Device& device, void* values, int64_t count, DType dtype,
                       ExchangeResult& result);

/// out (`numel` values of `dtype`, device memory) = the sum of every message's values / divisor,
/// added in the messages' order: every rank that adds the same messages gets the same bits (the
/// gathers, the sparse reduce-scatter and reduce-scatter + all-gather's owners). float16 and
/// bfloat16 sum in float32 and round once: added one by one in float16, every rank's 65504 / P
/// rounded past 65504 (Inf) from 10 ranks on, where their average is finite; in bfloat16 (8
/// significant bits) each sum rounded again, and 6 to 16 ranks' came back one or two units off.
/// float32 adds in place. A bad index throws CorruptMessageError as scatter_add does.
void add_messages(Device& device, const std::vector<MessageView>& messages, void* out, int64_t numel, DType dtype,
                  float divisor);

/// Zeroes the bucket's output (the exchanges write into zeros).
void clear_output(Device& device, const BucketView& bucket);

/// The union of ascending lists (each without repeats), ascending and without repeats: merged in
/// pairs, then pairs of pairs, so P lists of k cost O(P k log P) steps of a merge (a sort of their
/// concatenation took 2.6x as long at 4 lists of 168 thousand, 1.6x at 16 of 25 thousand).
std::vector<int64_t> ascending_union(std::vector<std::vector<int64_t>> lists);

}  // namespace gradsparse
