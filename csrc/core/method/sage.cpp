// SAGE (docs/method-spec.md 4.7): the threshold follows the scale of the gradient, measured by the
// mean magnitude of a small random sample. Reference mode applies SAGE's ratio scaling (α β γ);
// the default predicts with the sampled scale ratio and then takes the exact top k inside a band
// around the prediction.
#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <utility>

#include "gradsparse/methods.h"
#include "gradsparse/rng.h"
#include "method_util.h"

namespace gradsparse {

namespace {

/// A threshold times a loss scale (or a change of it), at most the largest double: any threshold
/// that large selects nothing, as the one without loss scaling does. (An initial_threshold of
/// 1e308 under GradScaler's first scale, 2^16, was Inf: reported so, carried so, and, in the
/// reference mode, refused by load_state when the state took back the method state it had saved
/// as DDP rebuilt its buckets after the first step.)
double in_loss_scale(double threshold, double factor) {
  return std::min(threshold * factor, std::numeric_limits<double>::max());
}

}  // namespace

SAGE::SAGE(double density, const std::string& sampling, std::vector<int64_t> segments, bool reference, uint64_t seed,
           std::optional<double> initial_threshold, std::optional<std::string> exchange, Listing listing)
    : density_(density),
      segments_(std::move(segments)),
      reference_(reference),
      seed_(seed),
      initial_(initial_threshold),
      exchange_("SAGE",
                {{"gather", &gather_and_add()},
                 {"union", &union_allreduce()},
                 {"reduce_scatter", &reduce_scatter_allgather()}},
                exchange.value_or(sampling == "per_tensor" ? "gather" : "union")),
      listing_(listing) {
  method_util::check_density("SAGE", density);
  if (sampling == "flat") {
    sampling_ = Sampling::kFlat;
  } else if (sampling == "per_tensor") {
    sampling_ = Sampling::kPerTensor;
  } else {
    throw ValueError(str("SAGE: sampling must be \"flat\" or \"per_tensor\", got \"", sampling, "\""));
  }
  if (initial_) {
    GS_CHECK(std::isfinite(*initial_) && *initial_ > 0.0, ValueError,
             "SAGE: initial_threshold must be a finite number > 0, got ", *initial_);
  }
  for (size_t j = 0; j < segments_.size(); ++j) {
    GS_CHECK(segments_[j] >= 0, ValueError, "SAGE: segments[", j, "] is ", segments_[j],
             "; segments are the element counts of the bucket's parameters, in order, each >= 0");
  }
}

std::vector<int64_t> SAGE::sample_positions(int64_t n, int rank) const {
  const int64_t count = slovin_sample_size(n);
  const uint64_t stream =
      rng_stream(seed_, RngTag::kSage, static_cast<uint64_t>(committed_.t), static_cast<uint64_t>(rank));
  if (sampling_ == Sampling::kFlat || segments_.empty()) return sample_with_replacement(stream, count, n);
  // The tensors that hold elements, at their offsets: an empty one (a parameter of no elements)
  // has no position to sample, so it takes no part in the draw of a tensor either.
  std::vector<int64_t> offsets, sizes;
  int64_t total = 0;
  for (int64_t size : segments_) {
    if (size > 0) {
      offsets.push_back(total);
      sizes.push_back(size);
    }
    total += size;
  }
  GS_CHECK(total == n, ValueError, "SAGE: segments add up to ", total, " elements but the bucket has ", n,
           "; pass the element counts of the bucket's parameters, in order");
  std::vector<int64_t> out(static_cast<size_t>(count));
  const uint64_t tensors = sizes.size();
  for (int64_t i = 0; i < count; ++i) {
    const size_t j = static_cast<size_t>(rng_draw(stream, 2 * static_cast<uint64_t>(i)) % tensors);
    const uint64_t size = static_cast<uint64_t>(sizes[j]);
    out[static_cast<size_t>(i)] =
        offsets[j] + static_cast<int64_t>(rng_draw(stream, 2 * static_cast<uint64_t>(i) + 1) % size);
  }
  return out;
}

Selection SAGE::select(Device& device, const BucketView& bucket, Collective& group) {
  const int64_t n = bucket.numel;
  pending_ = Step{committed_.t};
  reported_ = std::numeric_limits<double>::quiet_NaN();
  if (n == 0) {
    // Nothing to sample, nothing to estimate: the threshold stays for the next step, whose scale
    // change is then unknown (α = 1) and whose band is not restarted. (It was dropped: the
    // reference mode, which scales the last threshold, then selected nothing at every later step.)
    pending_.threshold = committed_.threshold;
    pending_.band = committed_.band;
    return method_util::nothing(device, bucket, 0);
  }
  const int64_t k = target_count(density_, n);
  const std::vector<int64_t> positions = sample_positions(n, group.rank());
  // Reference mode updates the bucket first; the default fuses the update into its candidate
  // pass, so it reads the sample before the update (as the values the update gives it).
  int64_t nonfinite = reference_ ? method_util::update_pass(device, bucket) : 0;
  std::vector<double> magnitudes;
  double sample_sum = 0.0;
  if (reference_) {
    sample_sum = device.sample_abs_sum(bucket, positions);
  } else {
    magnitudes = method_util::sample_magnitudes_before_update(device, bucket, positions);
    for (double m : magnitudes) sample_sum += m;
  }
  const double sample_mean = sample_sum / static_cast<double>(positions.size());
  const double start = in_loss_scale(initial_ ? *initial_ : initial_threshold(k), loss_scale_);
  const int64_t t = committed_.t;
  // No threshold yet: the first step, or every step so far had an empty bucket (which keeps the
  // threshold it found, none). Such a step starts as the first does: a NaN threshold scaled
  // selected nothing at every later step in the reference mode, and at the next one in the default.
  const bool first = t == 0 || std::isnan(committed_.threshold);
  // The sampled scale change since the last step (1 when either mean is zero).
  double alpha = !first ? sample_mean / committed_.sample_mean : 1.0;
  if (!(std::isfinite(alpha) && alpha > 0.0)) alpha = 1.0;
  const bool zero = exchange_.get().selection_zeroes();

  Selection s;
  double lambda = std::numeric_limits<double>::quiet_NaN();
  if (reference_) {
    lambda = start;
    if (!first) {
      const double probe = committed_.threshold * alpha;
      const double exam = static_cast<double>(device.count(bucket, method_util::whole(bucket), {probe}, false)[0]) /
                          static_cast<double>(n);
      // λ is rounded to float32 without the loss scale, as the same run without loss scaling rounds
      // it: its saturation at the largest float32 (method-spec 4.7) is in gradient units, not in
      // scaled ones (from an initial_threshold of 1e36 under a loss scale of 2^16 it saturated at
      // 3.4e38 / 2^16 and reached the gradients about 130 steps early). GradScaler's scales are
      // powers of two: dividing by the scale and multiplying back are exact.
      lambda =
          in_loss_scale(sage_reference_update(committed_.threshold / loss_scale_, alpha, exam, density_), loss_scale_);
    }
    s = device.select(bucket, SelectRule{lambda, false, Range{0, n}, false, zero});
  } else {
    // At the first step, and after a step whose band held fewer than k (the prediction was too
    // high: the band could then fall only by its width a step), from this step's sample.
    const bool sampled = first || committed_.restart;
    double prediction = first ? start : committed_.threshold * alpha;
    if (sampled && !(first && initial_)) prediction = sampled_prediction(std::move(magnitudes), k, n, prediction);
    const double w = sampled ? BandController::band_factor(0) : committed_.band;
    // The band from `low`: its exact top k where it holds k or more; where it holds fewer and is
    // the `last`, all of it, and the next step samples its prediction (a restart); otherwise
    // nothing (false). One pass with the update lists the candidates from the bound (OnePass):
    // where k of them lie above the band's edge, the band holds its top k; the band's count is
    // a pass only where it reaches below them. On a device whose memory the host does not read
    // in place, the count and the selection are passes on the device.
    OnePass pass(device, bucket, bound_, k, listing_, method_util::whole(bucket), /*sums=*/false);
    nonfinite = pass.moments().nonfinite;
    auto band = [&](double low, bool last) {
      const bool enough = pass.holds(low, k);
      if (!enough && !last) return false;
      if (enough) {
        s = pass.largest(k, zero);
        lambda = method_util::least_magnitude(bucket, s);
      } else {
        s = pass.select(low, /*strict=*/false, zero);
        lambda = low;
        pending_.restart = true;
      }
      return true;
    };
    // Where the band of a step that did not sample holds fewer than k, its prediction missed by
    // more than the band's width: once more from as far below.
    if (!band(prediction / w, /*last=*/sampled)) band(prediction / (w * w), true);
    bound_.learn(pass);
    // The next band (MiCRO's rule, method-spec 4.8): twice this prediction's miss of λ, or 0.9 of
    // this band in log scale, from 1.05 to 1.25; the widest after a sampled step (whose prediction
    // is the sample's) and after a restart (whose next step samples).
    pending_.band = sampled || pending_.restart ? BandController::band_factor(1)
                                                : BandController::next_band_factor(w, prediction, lambda);
  }
  pending_.threshold = lambda;
  reported_ = lambda;
  pending_.sample_mean = sample_mean;
  s.nonfinite = nonfinite;
  return s;
}

void SAGE::observe(const BucketView& /*bucket*/, const ExchangeResult& /*result*/) {
  committed_ = pending_;
  ++committed_.t;
}

double SAGE::sampled_prediction(std::vector<double> magnitudes, int64_t k, int64_t n, double otherwise) {
  // The sample's share of k (at least one) estimates the k-th largest magnitude; the band reaches
  // down to half of it. Where fewer of the sample are positive (a bucket mostly of zeros: an
  // embedding's rows), the least positive one: every nonzero element is wanted.
  const auto share = static_cast<int64_t>(
      std::ceil(static_cast<double>(k) * static_cast<double>(magnitudes.size()) / static_cast<double>(n)));
  magnitudes.erase(
      std::remove_if(magnitudes.begin(), magnitudes.end(), [](double m) { return !(m > 0.0 && std::isfinite(m)); }),
      magnitudes.end());
  if (magnitudes.empty()) return otherwise;  // no positive magnitude drawn: nothing to learn
  const auto m = static_cast<size_t>(std::clamp<int64_t>(share, 1, static_cast<int64_t>(magnitudes.size())));
  std::nth_element(magnitudes.begin(), magnitudes.begin() + static_cast<std::ptrdiff_t>(m - 1), magnitudes.end(),
                   std::greater<>());
  return magnitudes[m - 1];
}

MethodState SAGE::state() const {
  MethodState state{{"step", static_cast<double>(committed_.t)},
                    {"threshold", committed_.threshold},
                    {"sample_mean", committed_.sample_mean},
                    {"restart", committed_.restart ? 1.0 : 0.0},
                    {"band", committed_.band}};
  save_loss_scale(state);
  return state;
}

void SAGE::rescale_state(double factor) {
  committed_.threshold = in_loss_scale(committed_.threshold, factor);
  committed_.sample_mean *= factor;
}

void SAGE::load_state(const MethodState& state) {
  Step loaded;
  // Absent from checkpoints before the adaptive band: its widest. A band outside the rule's range
  // (a damaged or hand-made state) is refused before anything loads.
  loaded.band = BandController::saved_band(state, BandController::band_factor(1), BandController::band_factor(1));
  const double loss_scale = saved_loss_scale(state);
  loaded.t = saved_count(state, "step");
  loaded.threshold = saved_value(state, "threshold");
  loaded.sample_mean = saved_value(state, "sample_mean");
  // The reference mode scales the last threshold by α β γ at every step: one of 0, below 0 or
  // infinite, which no step leaves, stayed so for good (every element selected at every step, or
  // none). NaN is no threshold yet (only empty buckets so far): the next step starts as the first.
  GS_CHECK(!reference_ || loaded.t == 0 || std::isnan(loaded.threshold) ||
               (std::isfinite(loaded.threshold) && loaded.threshold > 0.0),
           ValueError, "method state: 'threshold' is ", loaded.threshold, " at step ", loaded.t,
           ", not a finite number > 0; load a state the method saved");
  // absent from checkpoints before the sampled restart: false
  if (auto it = state.find("restart"); it != state.end()) loaded.restart = it->second != 0.0;
  committed_ = loaded;
  loss_scale_ = loss_scale;
}

}  // namespace gradsparse
