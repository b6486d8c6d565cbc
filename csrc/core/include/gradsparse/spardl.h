// SparDL (docs/method-spec.md 4.11): sparse all-reduce by Spar-Reduce-Scatter (non-recursive, any
// team size), Spar-All-Gather across teams, Bruck all-gather within a team, and global residual
// collection. Selection happens inside the communication schedule, so SparDL is a Method that
// runs its whole step itself (Method::run).
#pragma once

#include <cstdint>
#include <vector>

#include "gradsparse/method.h"

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

class SparDL final : public Method {
 public:
  /// `teams`: the number d of teams; the world size must be a multiple of it.
  SparDL(double density, int teams);
  std::string name() const override { return "spardl"; }
  Selection select(Device& device, const BucketView& bucket, Collective& group) override;
  bool runs_exchange() const override { return true; }
  ExchangeResult run(Transport& transport, Device& device, const BucketView& bucket) override;
  MethodState state() const override;
  void load_state(const MethodState& state) override;

 private:
  double density_;
  int teams_;
  int64_t chunk_ = -1;  // the chunk size h was set up for
  int64_t h_ = 0;       // per-team-rank top-h size (d > 1), adapted every step
  int64_t h_step_ = 0;
  bool inertia_ = false;
};

}  // namespace gradsparse
