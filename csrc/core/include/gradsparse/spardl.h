// SparDL (docs/method-spec.md 4.11): a sparse all-reduce whose selection is part of its schedule.
// The method (method/spardl.cpp) is small: the error-feedback update, the per-block sizes k and h
// of the step, and h's adaptation. The exchange (exchange/spardl.cpp) is the schedule: the
// Spar-Reduce-Scatter within a team (non-recursive, any team size), the Spar-All-Gather across
// teams, the Bruck all-gather within a team, and global residual collection.
#pragma once

#include <cstdint>
#include <vector>

#include "gradsparse/method.h"
#include "gradsparse/one_pass.h"

namespace gradsparse {

/// One step of the Spar-Reduce-Scatter schedule of a team member (team-local ranks and blocks).
struct SrsStep {
  int send_block;
  int dest;
  int recv_block;
  int source;
};

/// The P'-1 single-block steps of team rank `rank` in a team of `size` (§4.2): rounds of sizes
/// [P' - 2^(R-1), 2^(R-2), ..., 1] with gaps [2^(R-1), ..., 1], R = ceil(log2 P'), flattened.
std::vector<SrsStep> srs_schedule(int size, int rank);

/// One round of a Bruck all-gather: send the blocks `send` to `dest`, receive the blocks `recv`
/// from `source` (team-local).
struct BruckRound {
  int dest;
  int source;
  std::vector<int> send;
  std::vector<int> recv;
};

/// The ceil(log2 size) rounds of the Bruck all-gather of rank `rank` (§4.3 step 5): round s with
/// gap 2^s sends blocks rank .. rank + min(gap, size - gap) - 1 to rank - gap and receives the
/// next ones from rank + gap.
std::vector<BruckRound> bruck_rounds(int size, int rank);

/// SparDL's exchange. The bucket is cut into P' blocks of ceil(n / P') elements (P' = P / teams;
/// block b is owned by team rank b). Within a team, the Spar-Reduce-Scatter sends the top-k of one
/// block (accumulated with everything received for it so far) per step, so that at the end each
/// rank's own block holds every team member's contribution, of which it keeps the top h; across
/// the teams (teams > 1) the owners of a block merge their top-h lists and keep the top k; a Bruck
/// all-gather then gives every rank every block's final list. The averaged bucket is the final
/// lists / P; each rank's residual is its residual + gradient except on the final lists, where it
/// keeps what it accumulated but did not send on. The selection it takes is the error-feedback
/// update alone (no pairs): the residual is the accumulation's start.
class SparDLExchange final : public Exchange {
 public:
  /// The per-block sizes of one step: k pairs per block in the reduce-scatter and after the
  /// merge across teams, h of the own block before it (h = k with one team).
  struct Sizes {
    int teams = 1;
    int64_t k = 0;
    int64_t h = 0;
  };

  ExchangeKind kind() const override { return ExchangeKind::kSparDL; }
  bool selection_zeroes() const override { return false; }
  ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket,
                     const Selection& mine) const override;

  Sizes sizes;
  /// Where the selections list candidates (OnePass): by default on the CPU, whose memory the host
  /// reads in place. Listing::kNowhere makes every selection the exact top-k's passes over its
  /// block, as on a GPU: the same pairs (the tests compare the two).
  Listing listing = Listing::kHostMemory;
  /// Where each selection of the schedule (the blocks sent at steps 0 .. P' - 2, then the own
  /// block) starts listing candidates: a cache of the step's time, never of its result, so not
  /// part of a checkpoint.
  const std::vector<CandidateBound>& bounds() const { return bounds_; }

 private:
  mutable std::vector<CandidateBound> bounds_;
};

class SparDL final : public Method {
 public:
  /// `teams`: the number d of teams; the world size must be a multiple of it.
  SparDL(double density, int teams);
  std::string name() const override { return "spardl"; }
  /// The error-feedback update, and this step's block sizes for the exchange.
  Selection select(Device& device, const BucketView& bucket, Collective& group) override;
  const Exchange& exchange() const override { return exchange_; }
  /// Adapts h from the merged size of this rank's block (teams > 1).
  void observe(const BucketView& bucket, const ExchangeResult& result) override;
  MethodState state() const override;
  void load_state(const MethodState& state) override;

 private:
  double density_;
  int teams_;
  SparDLExchange exchange_;
  /// The most h and |h_step| grow to (2^52: exact in a checkpoint's doubles, far past any block).
  static constexpr int64_t kMostH = int64_t{1} << 52;
  int64_t chunk_ = -1;  // the chunk size h was set up for
  int64_t h_ = 0;       // per-team-rank top-h size (d > 1), adapted every step
  int64_t h_step_ = 0;
  bool inertia_ = false;
};

}  // namespace gradsparse
