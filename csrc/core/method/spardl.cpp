// SparDL (docs/method-spec.md 4.11): the method's part. Its selection happens inside its exchange
// (exchange/spardl.cpp, SparDLExchange): per block, the top k of what a rank accumulated, and the
// top h of its own block. The method sets k and h for each step and adapts h to the size of the
// merged lists across teams.
#include "gradsparse/spardl.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "method_util.h"

namespace gradsparse {

SparDL::SparDL(double density, int teams) : density_(density), teams_(teams) {
  method_util::check_density("SparDL", density);
  GS_CHECK(teams >= 1, ValueError, "SparDL: teams must be >= 1, got ", teams);
}

Selection SparDL::select(Device& device, const BucketView& bucket, Collective& group) {
  const int p = group.size();
  GS_CHECK(p % teams_ == 0, ValueError, "SparDL: the world size ", p, " is not a multiple of teams=", teams_,
           "; choose teams dividing the number of ranks");
  const int64_t team_size = p / teams_;
  const int64_t chunk = (bucket.numel + team_size - 1) / team_size;
  const int64_t k = chunk > 0 ? std::max<int64_t>(1, static_cast<int64_t>(std::floor(chunk * density_))) : 0;
  if (chunk != chunk_) {  // h starts at floor(chunk δ / d) for a new bucket size
    chunk_ = chunk;
    h_ = std::max<int64_t>(1, static_cast<int64_t>(std::floor(chunk * density_ / teams_)));
    h_step_ = static_cast<int64_t>(std::floor((chunk * density_ - static_cast<double>(h_)) / 100.0));
    inertia_ = false;
  }
  exchange_.sizes = SparDLExchange::Sizes{teams_, k, teams_ == 1 ? k : h_};
  Selection s;
  s.nonfinite = method_util::update_pass(device, bucket);
  return s;
}

void SparDL::observe(const BucketView& /*bucket*/, const ExchangeResult& result) {
  if (teams_ == 1 || result.merged < 0) return;
  // Keep going (doubling every second time) while the merged list stays on the same side of k,
  // else turn back at half the step. h and its step stop at kMostH: they grow that far only
  // while the merged list cannot exceed k (a block of at most k elements, as at density 1), where
  // h is past the block and any larger h selects the same.
  const int64_t k = exchange_.sizes.k;
  if ((result.merged > k) != (h_step_ > 0)) {
    if (inertia_) {
      h_step_ = std::clamp<int64_t>(h_step_ * 2, -kMostH, kMostH);
      inertia_ = false;
    } else {
      inertia_ = true;
    }
  } else {
    h_step_ = std::llabs(h_step_) > 1 ? static_cast<int64_t>(-0.5 * static_cast<double>(h_step_)) : -h_step_;
    inertia_ = false;
  }
  h_ = std::max<int64_t>({std::min(h_ + h_step_, kMostH), k / teams_, 1});
}

MethodState SparDL::state() const {
  return {{"chunk", static_cast<double>(chunk_)},
          {"h", static_cast<double>(h_)},
          {"h_step", static_cast<double>(h_step_)},
          {"inertia", inertia_ ? 1.0 : 0.0}};
}

void SparDL::load_state(const MethodState& state) {
  // Whole numbers within what the method saves (chunk -1: no step yet), so that h + h_step cannot
  // overflow: a damaged or hand-made state is a ValueError naming the entry.
  const int64_t chunk = saved_count(state, "chunk", -1);
  const int64_t h = saved_count(state, "h");
  GS_CHECK(h <= kMostH, ValueError, "method state: 'h' is ", h, ", more than ", kMostH,
           "; load a state the method saved");
  const int64_t h_step = saved_count(state, "h_step", -kMostH);
  GS_CHECK(h_step <= kMostH, ValueError, "method state: 'h_step' is ", h_step, ", more than ", kMostH,
           "; load a state the method saved");
  const int64_t inertia = saved_count(state, "inertia");
  GS_CHECK(inertia <= 1, ValueError, "method state: 'inertia' is ", inertia,
           ", not 0 or 1; load a state the method saved");
  chunk_ = chunk;
  h_ = h;
  h_step_ = h_step;
  inertia_ = inertia != 0;
}

}  // namespace gradsparse
