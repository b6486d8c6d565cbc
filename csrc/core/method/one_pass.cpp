// OnePass, CandidateBound and DensityControl (gradsparse/one_pass.h), the estimating methods'
// checkpointed control, and Device::scan's unfused default.
//
// Every comparison here is one of keys in the bucket's dtype, with the threshold rounded to that
// dtype as the kernels round it (key_at_least, key_above), so an answer from the candidates is
// the answer of a pass over the bucket, element for element.
#include "gradsparse/one_pass.h"

#include <algorithm>
#include <cmath>
#include <functional>

#include "gradsparse/key_bins.h"
#include "gradsparse/methods.h"
#include "gradsparse/parallel.h"
#include "gradsparse/rng.h"
#include "method_util.h"

namespace gradsparse {

namespace {
constexpr size_t kFewKeys = 8;  ///< counts at up to this many keys compare every candidate with each

/// The magnitudes of the sampled candidates (none when they are not `listed`), in candidate order.
/// `sampled(index, n, bits)` writes whether each of n candidates' positions is sampled as bits
/// (in_percent_sample_bits' layout). About one candidate in a hundred is: the set bits are gone
/// through, not the candidates. In blocks on the pool's threads: asking whether a position is
/// sampled (a hash of it) is most of the work.
template <typename Sampled>
std::vector<float> sampled_candidates(const Candidates& c, bool listed, const Sampled& sampled) {
  std::vector<float> magnitude;
  if (!listed) return magnitude;
  const int64_t n = static_cast<int64_t>(c.size());
  std::vector<std::vector<float>> parts(static_cast<size_t>(num_blocks(n)));
  parallel_blocks(num_blocks(n), [&](int64_t b) {
    const int64_t begin = b * kCpuBlock, size = std::min(n - begin, kCpuBlock);
    uint64_t bits[kCpuBlock / 64];
    sampled(c.index.data() + begin, size, bits);
    std::vector<float>& part = parts[static_cast<size_t>(b)];
    for (int64_t w = 0; w < (size + 63) / 64; ++w) {
      for (uint64_t word = bits[w]; word != 0; word &= word - 1)
        part.push_back(std::fabs(c.value[begin + 64 * w + __builtin_ctzll(word)]));
    }
  });
  for (const std::vector<float>& part : parts) magnitude.insert(magnitude.end(), part.begin(), part.end());
  return magnitude;
}

/// How many of the keys reach each of a few keys `at` (0 for kNoKey, which no key reaches): in
/// blocks on the pool's threads, each block compared with every key of `at` while it is in cache,
/// one vectorised comparison loop (no branch) per key of `at`.
template <typename Keys>
std::vector<int64_t> count_reaching(const Keys& keys, const std::vector<uint32_t>& at) {
  const int64_t n = static_cast<int64_t>(keys.size()), m = static_cast<int64_t>(at.size());
  std::vector<int64_t> in_block(static_cast<size_t>(num_blocks(n) * m), 0);
  parallel_blocks(num_blocks(n), [&](int64_t b) {
    const int64_t begin = b * kCpuBlock, end = std::min(n, begin + kCpuBlock);
    for (int64_t i = 0; i < m; ++i) {
      const uint32_t key = at[static_cast<size_t>(i)];
      int64_t c = 0;
      for (int64_t j = begin; j < end; ++j) c += keys[static_cast<size_t>(j)] >= key ? 1 : 0;
      in_block[static_cast<size_t>(b * m + i)] = c;
    }
  });
  std::vector<int64_t> counts(static_cast<size_t>(m), 0);
  for (size_t x = 0; x < in_block.size(); ++x) counts[x % static_cast<size_t>(m)] += in_block[x];
  return counts;
}

/// Leaves the residual zero at exactly the chosen candidates among those the scan zeroed
/// (Candidates::zeroed): writes back the zeroed ones not chosen and zeroes the chosen ones not
/// zeroed. Then nothing is zeroed (kNoKey). The chosen candidates are those whose key reaches
/// `chosen_from` (kNoKey: none), or where `chosen` is given, exactly those (positions in the
/// candidate lists, ascending). Host memory only, as the scan that zeroes (the CPU's).
void settle_zeroed(const BucketView& bucket, Candidates& c, uint32_t chosen_from, const Positions* chosen = nullptr) {
  if (c.zeroed == kNoKey) return;
  const int64_t n = static_cast<int64_t>(c.size());
  // Which candidates are chosen, as bytes: comparing them with what the scan zeroed then takes no
  // branch a candidate (a merge with the positions waits on each load of the next one).
  HostBuffer<uint8_t> taken(chosen == nullptr ? 0 : c.size());
  if (chosen != nullptr) {
    const int64_t m = static_cast<int64_t>(chosen->size());
    parallel_blocks(num_blocks(n), [&](int64_t b) {
      std::fill(taken.begin() + b * kCpuBlock, taken.begin() + std::min(n, (b + 1) * kCpuBlock), uint8_t{0});
    });
    parallel_blocks(num_blocks(m), [&](int64_t b) {
      for (int64_t i = b * kCpuBlock; i < std::min(m, (b + 1) * kCpuBlock); ++i) taken[(*chosen)[i]] = 1;
    });
  } else if (chosen_from == c.zeroed) {  // the scan zeroed exactly the chosen ones
    c.zeroed = kNoKey;
    return;
  }
  // Chosen by key, a candidate differs where its key lies from the lower of the two keys to below
  // the higher: one unsigned comparison, tested for a run of candidates at once without a branch
  // (a vectorised loop); the rare runs that hold one are gone through again.
  const uint32_t low = std::min(chosen_from, c.zeroed), span = std::max(chosen_from, c.zeroed) - low;
  constexpr int64_t kRun = 64;
  dispatch_dtype(bucket.dtype, [&](auto t) {
    using T = decltype(t);
    T* residual = static_cast<T*>(bucket.residual);
    const float* value = c.value.data();
    auto key = [&](int64_t j) { return Num<T>::key(Num<T>::from_float(value[j])); };
    parallel_blocks(num_blocks(n), [&](int64_t b) {
      const int64_t end = std::min(n, (b + 1) * kCpuBlock);
      for (int64_t run = b * kCpuBlock; run < end; run += kRun) {
        const int64_t run_end = std::min(end, run + kRun);
        if (chosen == nullptr) {
          uint32_t differs = 0;
          for (int64_t j = run; j < run_end; ++j) differs |= key(j) - low < span ? 1u : 0u;
          if (differs == 0) continue;
        }
        for (int64_t j = run; j < run_end; ++j) {
          const uint32_t k = key(j);
          const bool is_taken = chosen != nullptr ? taken[j] != 0 : k >= chosen_from;
          // Rarely true (the scan zeroed from about this step's threshold): a predicted branch.
          if (is_taken != (k >= c.zeroed))
            residual[c.index[j]] = is_taken ? Num<T>::zero() : Num<T>::from_float(value[j]);
        }
      }
    });
  });
  c.zeroed = kNoKey;
}

/// This step's k-th largest magnitude of the update, estimated from a sample of the bucket's
/// blocks (the same blocks every step: 16, about, or as many as hold 64 of the k largest, where
/// the density is below 0.012%) read before the scan, the update computed and nothing written
/// (Device::sample_keys); NaN where it is not made: where the threshold moved by less than 1% a
/// step lately (standard deviation, CandidateBound::moves: the sample would cost more than it
/// saves where it does not move at all: about a quarter of a millisecond a step at 25M, a
/// thirtieth of an add), before the bound has one, where the bucket is short for its sample (its
/// scan too), where the sample holds too few at or above `floor`, on a device that does not look
/// (a GPU, whose scan lists nothing) and over a part of the bucket. At 25M elements and density
/// 0.01 it is off by about 0.2% (the rank of 5,600 among 560 thousand).
double estimated_kth(Device& device, const BucketView& bucket, Range range, bool update, int64_t k,
                     const CandidateBound& bound, double floor) {
  constexpr int64_t kBlocks = 16;     // blocks read, about, at the least
  constexpr int64_t kLeastRank = 64;  // of the sample at or above the estimate: fewer cannot place it
  constexpr double kNone = std::numeric_limits<double>::quiet_NaN();
  const int64_t n = bucket.numel;
  // At 25M elements and density 0.0001 16 blocks held 56 of the k largest: no estimate, and the
  // bound, left to follow moves of 6% a step by itself where the count at the k-th largest of a
  // normal moves by 2.5 times, missed or overflowed every few steps (DGC's step took 9.7 adds).
  const int64_t blocks = std::max<int64_t>(
      kBlocks, static_cast<int64_t>(std::ceil(static_cast<double>(kLeastRank) * static_cast<double>(n) /
                                              (static_cast<double>(std::max<int64_t>(k, 1)) * kCpuBlock))));
  if (!std::isfinite(bound.lower()) || bound.moves() < 0.01 || bucket.residual == nullptr || range.begin != 0 ||
      range.end != n || num_blocks(n) < 4 * blocks)
    return kNone;
  const BlockSample sample = BlockSample::at_least(n, blocks);
  const auto rank = static_cast<int64_t>(
      std::ceil(static_cast<double>(k) * static_cast<double>(sample.size(n)) / static_cast<double>(n)));
  if (rank < kLeastRank) return kNone;  // too few of the sample above it to place it
  std::vector<uint32_t> keys = device.sample_keys(bucket, update, sample, floor);
  if (static_cast<int64_t>(keys.size()) < rank) return kNone;
  std::nth_element(keys.begin(), keys.begin() + (rank - 1), keys.end(), std::greater<>());
  return method_util::key_value(bucket.dtype, keys[static_cast<size_t>(rank - 1)]);
}

}  // namespace

Scan Device::scan(const BucketView& bucket, bool update, Range range, double lower, int64_t capacity, bool sums,
                  double /*zero_from*/) {
  Scan s;
  s.moments = moments(bucket, update);
  if (!sums) {  // as a device that skips them
    Moments only;
    only.nonfinite = s.moments.nonfinite;
    s.moments = only;
  }
  if (capacity == 0) {  // on a GPU OnePass lists nothing (CandidateBound::capacity): a count would be a wasted read
    s.above = Scan::kNotCounted;
    return s;
  }
  s.above = count(bucket, range, {lower}, false)[0];
  if (s.above > 0 && (capacity < 0 || s.above <= capacity)) s.candidates = collect(bucket, range, lower, false);
  return s;
}

void CandidateBound::learn(const OnePass& pass) {
  const double t = pass.lowest_asked();
  const bool asked = std::isfinite(t) && t > 0.0;
  if (asked && std::isfinite(last_)) {
    const double move = std::log(t / last_);
    moves_ = 0.9 * moves_ + 0.1 * std::fabs(move);
  }
  if (asked) last_ = t;
  estimate_ = pass.estimate();
  // Where the threshold moves, OnePass moves the bound by its estimate (OnePass::rescale): then
  // the bound stands below the lowest question's usual place relative to the estimate (a moving
  // mean of its log ratio) by that ratio's spread, which holds both the estimate's error and a
  // method's own questions away from the k-th largest (RedSync's first count moves with the
  // largest magnitude). Otherwise below the last lowest question, by the spread of its moves.
  // Both spreads are mean absolute deviations (times sqrt(pi / 2), a standard deviation where
  // they are normal), which one far question moves in proportion to its distance, not its
  // square: a single question 30% below the estimate widened a standard deviation so much that
  // the bound listed 3.5k candidates and still 1.7k forty steps later (k about 23 thousand), and
  // where the threshold stood still it kept the steps estimating for 53 steps (now 21).
  const bool follows = asked && std::isfinite(estimate_) && estimate_ > 0.0;
  if (follows) {
    const double r = std::log(t / estimate_);
    // Over the first twenty ratios plain means (weight 1 / count), then moving ones: a spread
    // that starts at 0 and grows by a twentieth a step left the bound above a method's recurring
    // question for dozens of steps, each of which missed.
    ratios_ = std::min(ratios_ + 1, 20);
    const double w = 1.0 / ratios_;
    ratio_deviation_ = ratios_ > 1 ? (1.0 - w) * ratio_deviation_ + w * std::fabs(r - ratio_mean_) : 0.0;
    ratio_mean_ = (1.0 - w) * ratio_mean_ + w * r;
  }
  // The estimate is followed only where it places the lowest question better than the last
  // question does (follows()).
  const bool by_estimate = follows && moves() >= 0.01 && kDeviationToSpread * ratio_deviation_ < moves();
  follows_ = by_estimate || !follows;
  const double spread = by_estimate ? kDeviationToSpread * ratio_deviation_ : moves();
  // A question fell below the candidates: start lower. Otherwise (also where the candidates were
  // too many, which a closer start lists fewer of) halfway closer, but never within 2.5 times
  // that spread (0.98 where nothing moves): a spread that grew widens it at once.
  const double closest = std::exp(-std::max(0.02, 2.5 * spread));
  if (pass.missed() && !pass.overflowed()) {
    factor_ = std::max(0.25, factor_ * 0.8);
  } else {
    factor_ = std::min(closest, 1.0 - (1.0 - factor_) / 2.0);
  }
  const double from = by_estimate ? estimate_ * std::exp(ratio_mean_) : t;
  lower_ = asked ? factor_ * from : std::numeric_limits<double>::infinity();
  zero_from_ = pass.zeroed_from();
}

double DensityControl::threshold(OnePass& pass, double estimate, int64_t k) {
  discard();
  if (!(estimate > 0.0) || !std::isfinite(estimate)) return estimate;
  double& slope = pending_.slope;
  const double target = static_cast<double>(k);
  auto count = [&](double t) { return static_cast<double>(pass.counts({t}, /*strict=*/true)[0]); };
  auto log_count = [](double c) { return std::log(std::max(c, 0.5)); };  // no count is 0 in log space
  // A scale learned against estimates far from this one can take their product past the doubles
  // (Inf) or below them (0): counts of 0 or of everything, where no step moves (an infinite or
  // zero next threshold stops them), committed as the scale for every later step. The estimate
  // itself then.
  double t = estimate * committed_.scale;
  if (!(t > 0.0) || !std::isfinite(t)) t = estimate;
  double c = count(t);
  double best_t = t, best_c = c;
  // The highest threshold seen to hold some element, the lowest to hold none (counts fall as the
  // threshold rises): where they close in on each other, what the first holds lies between them.
  double held = 0.0, none = std::numeric_limits<double>::infinity();
  auto seen = [&](double at, double count_at) {
    if (count_at > 0.0) held = std::max(held, at);
    if (count_at == 0.0) none = std::min(none, at);
  };
  seen(t, c);
  double low = 0.0, high = std::numeric_limits<double>::infinity();  // thresholds known too low, too high
  for (int step = 0; step < kSteps && std::fabs(c - target) > kTolerance * target; ++step) {
    if (c > target) low = std::max(low, t);
    if (c < target) high = std::min(high, t);
    // count ~ t^-slope: the threshold that would hold k; outside what is known (or on its edge,
    // where a secant step returns), the middle in log space. The relative margins keep rounding
    // in the last bits of the estimate from changing a decision.
    double next = t * std::exp((log_count(c) - std::log(target)) / slope);
    const bool inside = next > low * (1.0 + kMargin) && next < high * (1.0 - kMargin);
    if (!inside && low > 0.0 && std::isfinite(high)) next = std::sqrt(low * high);
    if (!(next > 0.0) || !std::isfinite(next) || std::fabs(next - t) <= kMargin * t) break;
    const double c_next = count(next);
    if (c_next != c) {
      slope = std::clamp((log_count(c) - log_count(c_next)) / (std::log(next) - std::log(t)), kLeastSlope, kMostSlope);
    } else if (!(low > 0.0 && std::isfinite(high))) {
      // The same count, and no threshold on the other side of k known yet: a flat stretch (every
      // count 0 far above the data, or all of it far below), where the slope says nothing. Halving
      // it doubles the next step, so a scale learned far off is left within a step, not at 1/64
      // of the log ratio a count.
      slope = std::max(kLeastSlope, slope / 2.0);
    }
    t = next;
    c = c_next;
    seen(t, c);
    // Of equal counts the latest: an earlier one may be a secant step's overshoot far beyond the
    // data (a count of 0 at 10^4 times the threshold), which as the scale would start the next
    // step there.
    if (std::fabs(c - target) <= std::fabs(best_c - target)) {
      best_t = t;
      best_c = c;
    }
  }
  // Nothing chosen, though a threshold held some: where more than 2k of the largest magnitudes tie
  // (a plain sum's identical gradients, which error feedback keeps tied), every count is 0 or more
  // than 2k, and 0, nearer k, was chosen at every step: the bucket was never sent (k = 1, three
  // tied: every count 0 or 3). Bisection (in log space) between the highest threshold that held
  // some and the lowest that held none: down to the largest magnitudes, whose group, once the two
  // are within kTieSpread, is sent (k overshot by its ties), unless a count as near k turns up.
  while (best_c == 0.0 && held > 0.0 && none > held * (1.0 + kTieSpread)) {
    const double mid = std::sqrt(held) * std::sqrt(none);  // neither overflows nor underflows
    if (!(mid > held && mid < none)) break;
    const double c_mid = count(mid);
    seen(mid, c_mid);
    if (std::fabs(c_mid - target) <= std::fabs(best_c - target)) {
      best_t = mid;
      best_c = c_mid;
    }
  }
  if (best_c == 0.0 && held > 0.0) best_t = held;
  // Not kept where it is not a positive finite number (an estimate among the smallest doubles):
  // the next step would start from it at Inf or 0, and a saved state holding it is refused.
  const double scale = best_t / estimate;
  if (scale > 0.0 && std::isfinite(scale)) pending_.scale = scale;
  return best_t;
}

void DensityControl::save(std::map<std::string, double>& state) const {
  state["control.scale"] = committed_.scale;
  state["control.slope"] = committed_.slope;
}

void DensityControl::load(const std::map<std::string, double>& state) {
  // Every step starts at the estimate times the scale and moves by the slope: a scale that is not a
  // positive finite number (NaN, Inf, 0, negative) selected nothing or everything at every step
  // from then on, and a slope of NaN or 0 never moved. threshold() keeps the slope in
  // [kLeastSlope, kMostSlope]; a damaged or hand-made state is refused naming the entry, before
  // anything is loaded.
  Learned loaded = committed_;
  if (auto it = state.find("control.scale"); it != state.end()) {
    GS_CHECK(std::isfinite(it->second) && it->second > 0.0, ValueError, "method state: 'control.scale' is ", it->second,
             ", not a finite number > 0; load a state the method saved");
    loaded.scale = it->second;
  }
  if (auto it = state.find("control.slope"); it != state.end()) {
    GS_CHECK(it->second >= kLeastSlope && it->second <= kMostSlope, ValueError, "method state: 'control.slope' is ",
             it->second, ", not a number from ", kLeastSlope, " to ", kMostSlope, "; load a state the method saved");
    loaded.slope = it->second;
  }
  committed_ = loaded;
}

MethodState EstimatingMethod::state() const {
  MethodState state;
  if (!reference_) control_.save(state);
  return state;
}

void EstimatingMethod::load_state(const MethodState& state) {
  if (!reference_) control_.load(state);
}

void EstimatingMethod::observe(const BucketView& /*bucket*/, const ExchangeResult& /*result*/) { control_.commit(); }

Selection EstimatingMethod::finish(OnePass& pass, double threshold, int64_t nonfinite) {
  threshold_ = threshold;
  Selection s = pass.select(threshold, /*strict=*/true, /*zero=*/true);
  s.nonfinite = nonfinite;
  bound_.learn(pass);
  return s;
}

OnePass::OnePass(Device& device, const BucketView& bucket, const CandidateBound& bound, int64_t k, Listing listing,
                 Range range, bool sums, bool update)
    : device_(device),
      bucket_(bucket),
      range_(range.end < 0 ? Range{range.begin, bucket.numel} : range),
      capacity_(CandidateBound::capacity(device, k, listing)) {
  // Where the threshold moves, the bound and the zeroing follow this step's estimated k-th largest
  // (CandidateBound::learn, CandidateBound::follows): the bound by its move since the last step's estimate (from the
  // same blocks), the zeroing to it. Where the last step's zeroing selection did not hold, no zeroing. The sample lists
  // from 0.85 of the bound (a fall of 15% since the last step).
  estimate_ = estimated_kth(device, bucket, range_, update, k, bound, 0.85 * bound.lower());
  const bool follow = bound.follows() && std::isfinite(estimate_);  // else learned from, not followed
  if (follow && std::isfinite(bound.estimate())) rescale_ = estimate_ / bound.estimate();
  const double lower = bound.lower() * rescale_;
  const double zero_from = std::isfinite(bound.zero_from()) && follow ? estimate_ : bound.zero_from();
  scan_ = device.scan(bucket, update, range_, lower, capacity_, sums, zero_from);
  lower_key_ = key_of(lower, false);
}

OnePass::~OnePass() { settle_zeroed(bucket_, scan_.candidates, kNoKey); }

uint32_t OnePass::key_of(double threshold, bool strict) const {
  return dispatch_dtype(bucket_.dtype, [&](auto t) {
    using T = decltype(t);
    return strict ? key_above<T>(threshold) : key_at_least<T>(threshold);
  });
}

void OnePass::asked(double threshold, int64_t elements, bool covered) {
  if (elements > capacity_) return;  // no bound could have listed them
  lowest_asked_ = std::min(lowest_asked_, threshold);
  missed_ = missed_ || !covered;
}

const HostBuffer<uint32_t>& OnePass::keys() {
  if (keys_.size() != scan_.candidates.size()) {
    const int64_t n = static_cast<int64_t>(scan_.candidates.size());
    keys_.resize(static_cast<size_t>(n));
    dispatch_dtype(bucket_.dtype, [&](auto t) {
      using T = decltype(t);
      const float* value = scan_.candidates.value.data();
      parallel_blocks(num_blocks(n), [&](int64_t b) {
        for (int64_t j = b * kCpuBlock; j < std::min(n, (b + 1) * kCpuBlock); ++j)
          keys_[j] = Num<T>::key(Num<T>::from_float(value[j]));
      });
    });
  }
  return keys_;
}

Device& OnePass::reading() {
  settle_zeroed(bucket_, scan_.candidates, kNoKey);
  written_back_ = 0;  // with the rest
  passed_ = true;
  return device_;
}

template <typename Read>
auto OnePass::reading(BlockSample sample, const Read& read) {
  if (sample.every == 1) return read(reading());
  if (scan_.candidates.zeroed != kNoKey && written_back_ != sample.every) {
    zero_written_back();
    write_sample(sample.every, /*zero=*/false);
    written_back_ = sample.every;
  }
  return read(device_);
}

void OnePass::zero_written_back() {
  if (written_back_ != 0) write_sample(written_back_, /*zero=*/true);
  written_back_ = 0;
}

void OnePass::write_sample(int64_t every, bool zero) {
  const Candidates& c = scan_.candidates;
  // The candidates ascend: those of a sampled block are one run of them, found by bisection.
  dispatch_dtype(bucket_.dtype, [&](auto t) {
    using T = decltype(t);
    T* residual = static_cast<T*>(bucket_.residual);
    const int64_t* index = c.index.data();
    const int64_t* end = index + c.size();
    parallel_blocks((num_blocks(bucket_.numel) + every - 1) / every, [&](int64_t s) {
      const int64_t b = s * every;
      for (const int64_t* j = std::lower_bound(index, end, b * kCpuBlock); j != end && *j < (b + 1) * kCpuBlock; ++j) {
        const T v = Num<T>::from_float(c.value[static_cast<size_t>(j - index)]);
        if (Num<T>::key(v) >= c.zeroed) residual[*j] = zero ? Num<T>::zero() : v;
      }
    });
  });
}

Selection OnePass::emit(const Positions& chosen, uint32_t chosen_from, bool zero, double threshold) {
  if (zero) zeroed_from_ = threshold;
  zero_written_back();
  Candidates& c = scan_.candidates;
  Selection s = method_util::emit_subset(device_, bucket_, c, chosen, zero && c.zeroed == kNoKey);
  // where the scan zeroed some of them; a selection that does not zero chose none of them to zero
  settle_zeroed(bucket_, c, zero ? chosen_from : kNoKey, zero && chosen_from == kNoKey ? &chosen : nullptr);
  return s;
}

double OnePass::log_sum(double scale, double eps, BlockSample sample) {
  return reading(sample, [&](Device& device) { return device.log_sum(bucket_, scale, eps, sample); });
}

template <typename F>
decltype(auto) OnePass::with_keys(const F& f) {
  if (bucket_.dtype == DType::kFloat32) return f(method_util::float_keys(scan_.candidates.value));
  return f(keys());
}

Positions OnePass::reaching(uint32_t key) {
  return with_keys([&](const auto& k) { return positions_where(k.size(), [&](size_t j) { return k[j] >= key; }); });
}

OnePass::Counts::Counts(OnePass& pass, std::vector<double> thresholds, bool strict)
    : pass_(pass),
      thresholds_(std::move(thresholds)),
      strict_(strict),
      value_(thresholds_.size(), 0),
      known_(thresholds_.size(), false) {
  for (double t : thresholds_) keys_.push_back(pass_.key_of(t, strict_));
}

int64_t OnePass::Counts::operator[](size_t j) {
  if (!known_[j]) {
    const bool covered = pass_.covers(keys_[j]);
    // Every threshold not known yet on the same side of the bound as this one, in one look:
    // the covered ones over the candidates, the others in one read-only pass over the bucket.
    std::vector<size_t> which;
    for (size_t i = 0; i < thresholds_.size(); ++i)
      if (!known_[i] && pass_.covers(keys_[i]) == covered) which.push_back(i);
    std::vector<int64_t> counts(which.size(), 0);
    if (covered) {
      // No branch on a candidate's key: whether it reaches a key is as good as random, and a
      // mispredicted branch per candidate cost more than the count. A few keys: one vectorised
      // comparison loop per key; more: one look-up per candidate in a table of bins.
      if (which.size() <= kFewKeys) {
        std::vector<uint32_t> at;
        for (size_t i : which) at.push_back(keys_[i]);
        counts = pass_.with_keys([&](const auto& keys) { return count_reaching(keys, at); });
      } else {
        const HostBuffer<uint32_t>& keys = pass_.keys();
        std::vector<uint32_t> sorted;
        for (size_t i : which) sorted.push_back(keys_[i]);
        std::sort(sorted.begin(), sorted.end());
        sorted.erase(std::unique(sorted.begin(), sorted.end()), sorted.end());
        // in_bin[b + 1]: candidates from sorted[b] up to the next key; in_bin[0]: those below all.
        std::vector<int64_t> in_bin(sorted.size() + 1, 0);
        KeyBins(sorted.data(), static_cast<int>(sorted.size()))
            .count(keys.data(), static_cast<int64_t>(keys.size()), in_bin.data());
        for (size_t b = sorted.size(); b > 1; --b) in_bin[b - 1] += in_bin[b];  // now: at or above
        for (size_t i = 0; i < which.size(); ++i) {
          const uint32_t key = keys_[which[i]];
          counts[i] =
              key == kNoKey ? 0 : in_bin[std::lower_bound(sorted.begin(), sorted.end(), key) - sorted.begin() + 1];
        }
      }
    } else {
      std::vector<double> thresholds;
      for (size_t i : which) thresholds.push_back(thresholds_[i]);
      counts = pass_.reading().count(pass_.bucket_, pass_.range_, thresholds, strict_);
    }
    for (size_t i = 0; i < which.size(); ++i) {
      value_[which[i]] = counts[i];
      known_[which[i]] = true;
    }
  }
  pass_.asked(thresholds_[j], value_[j], pass_.covers(keys_[j]));
  return value_[j];
}

Exceedance OnePass::exceedance(double threshold, bool strict, double scale, BlockSample sample) {
  GS_ASSERT(range_.begin == 0 && range_.end == bucket_.numel);
  const uint32_t key = key_of(threshold, strict);
  // The bound learns how many elements of the whole bucket a question holds.
  auto whole = [&](int64_t count) {
    if (sample.every == 1) return count;
    const double read = static_cast<double>(sample.size(bucket_.numel));
    return static_cast<int64_t>(std::llround(static_cast<double>(count) * static_cast<double>(bucket_.numel) / read));
  };
  if (!covers(key)) {
    const Exceedance e =
        reading(sample, [&](Device& device) { return device.exceedance(bucket_, threshold, strict, scale, sample); });
    asked(threshold, whole(e.count), false);
    return e;
  }
  // In the CPU kernel's order: ExceedanceLanes' within each block, then the blocks in order.
  // The candidates ascend, so whether the sample holds them is asked once per block.
  std::vector<Exceedance> parts;
  ExceedanceLanes block;
  int64_t at = -1;
  bool held = false;
  for (size_t j : reaching(key)) {
    if (scan_.candidates.index[j] / kCpuBlock != at) {
      if (held) parts.push_back(block.total());
      at = scan_.candidates.index[j] / kCpuBlock;
      held = sample.holds(scan_.candidates.index[j]);
      block = ExceedanceLanes{};
    }
    if (held) block.take(std::fabs(static_cast<double>(scan_.candidates.value[j])) * scale);
  }
  if (held) parts.push_back(block.total());
  const Exceedance e = Exceedance::combine(parts);
  asked(threshold, whole(e.count), true);
  return e;
}

Selection OnePass::select(double threshold, bool strict, bool zero) {
  const uint32_t key = key_of(threshold, strict);
  Selection s;
  if (covers(key)) {
    const Positions chosen = reaching(key);
    asked(threshold, static_cast<int64_t>(chosen.size()), true);
    s = emit(chosen, key, zero, threshold);
  } else {
    s = reading().select(bucket_, SelectRule{threshold, strict, range_, false, zero});
    asked(threshold, s.count, false);
  }
  stale_ = stale_ || zero;
  return s;
}

Selection OnePass::largest(int64_t k, bool zero) {
  GS_ASSERT(range_.begin == 0 && range_.end == bucket_.numel);
  k = std::min(k, bucket_.numel);
  if (k <= 0) return device_.emit(bucket_, {}, {}, false);
  Selection s;
  if (scan_.complete() && !stale_ && scan_.above >= k) {
    uint32_t kth_key;
    bool ties_cut;
    const Positions chosen =
        with_keys([&](const auto& keys) { return method_util::largest_positions(keys, k, kth_key, &ties_cut); });
    asked(method_util::key_value(bucket_.dtype, kth_key), k, true);
    // Where no tie at the k-th key was left out, the chosen are every candidate from that key up:
    // the settle then compares keys and builds no array of the chosen (its fill and marks were a
    // quarter of the settle's time, about 0.1 ms a step at 25M and density 0.01).
    s = emit(chosen, ties_cut ? kNoKey : kth_key, zero, method_util::key_value(bucket_.dtype, kth_key));
    s.kth_key = kth_key;
  } else {  // the k-th largest lies below the candidates, or they are out of date
    s = reading().select_topk(bucket_, k, /*update=*/false, zero);
    // The bound learns the k-th magnitude only where it could be listed.
    if (k <= capacity_) asked(method_util::least_magnitude(bucket_, s), k, false);
  }
  stale_ = stale_ || zero;
  return s;
}

bool OnePass::holds(double threshold, int64_t k) {
  // Whether the k-th largest reaches the threshold: not a question for the bound to cover, since
  // a bound at the k-th largest answers it (the step's selection then asks the k-th largest).
  if (!scan_.complete() || stale_ || scan_.above < k)
    return reading().count(bucket_, range_, {threshold}, /*strict=*/false)[0] >= k;
  const uint32_t key = key_of(threshold, false);
  if (key <= lower_key_) return true;
  return with_keys([&](const auto& keys) { return count_reaching(keys, {key})[0] >= k; });
}

double OnePass::kth_sampled(const std::vector<uint64_t>& sampled, int64_t count, int64_t s) {
  GS_ASSERT(s >= 1 && s <= count);
  const bool listed = scan_.complete() && !stale_;
  std::vector<float> magnitude =
      sampled_candidates(scan_.candidates, listed, [&](const int64_t* p, int64_t n, uint64_t* bits) {
        std::fill(bits, bits + (n + 63) / 64, uint64_t{0});
        for (int64_t j = 0; j < n; ++j) bits[j / 64] |= ((sampled[p[j] >> 6] >> (p[j] & 63)) & 1) << (j % 64);
      });
  const bool covered = listed && static_cast<int64_t>(magnitude.size()) >= s;
  if (!covered) magnitude = magnitudes_at(set_positions(sampled));
  return kth_of(magnitude, s, count, covered);
}

std::optional<double> OnePass::kth_hashed(uint64_t stream, int64_t s) {
  GS_ASSERT(s >= 1);
  const bool listed = scan_.complete() && !stale_;
  std::vector<float> magnitude = sampled_candidates(
      scan_.candidates, listed,
      [&](const int64_t* p, int64_t n, uint64_t* bits) { in_percent_sample_bits(stream, p, n, bits); });
  const bool covered = listed && static_cast<int64_t>(magnitude.size()) >= s;
  int64_t count = (range_.end - range_.begin + 99) / 100;  // the sample's expected size
  if (!covered) {
    const std::vector<int64_t> positions = in_percent_sample_positions(stream, range_.begin, range_.end);
    if (static_cast<int64_t>(positions.size()) < s) return std::nullopt;
    magnitude = magnitudes_at(positions);
    count = static_cast<int64_t>(positions.size());
  }
  return kth_of(magnitude, s, std::max<int64_t>(count, s), covered);
}

double OnePass::kth_of(std::vector<float>& magnitude, int64_t s, int64_t count, bool covered) {
  std::nth_element(magnitude.begin(), magnitude.begin() + (s - 1), magnitude.end(), std::greater<float>());
  const double kth = magnitude[static_cast<size_t>(s - 1)];
  // About s / count of the range lies at or above it: the question a threshold there asks.
  asked(kth, s * (range_.end - range_.begin) / count, covered);
  return kth;
}

std::vector<float> OnePass::magnitudes_at(const std::vector<int64_t>& positions) {
  std::vector<float> magnitude;
  magnitude.reserve(positions.size());
  const Selection all = reading().gather(bucket_, positions);
  for (float v : HostMessage(device_, all, bucket_).value_list()) magnitude.push_back(std::fabs(v));
  return magnitude;
}

}  // namespace gradsparse
