// MiCRO and ExDyna (docs/method-spec.md 4.8, 4.9): each rank selects only inside its partition of
// the bucket (partitions rotate every step), with one threshold for all ranks.
//
// Reference mode keeps the original rule: the threshold is scaled by 1.005, 1.00125 or 0.995
// from the previous step's total count, and a rank that selects nothing sends one dummy element.
// The default agrees on the threshold every step: a prediction (a sampled histogram at the first
// step and after a step whose counts put it far off, otherwise the trend or the mean of the
// agreed thresholds, whichever missed less lately),
// candidates inside a band around it (narrower while the predictions hit), and one
// collective of their counts in fine bins, from which every rank picks the same threshold (and,
// up to 4 ranks, learns every rank's count: the exchange's control words travel with it).
#include <algorithm>
#include <cmath>
#include <map>
#include <numeric>
#include <utility>
#include <vector>

#include "gradsparse/key_bins.h"
#include "gradsparse/methods.h"
#include "gradsparse/parallel.h"
#include "gradsparse/rng.h"
#include "method_util.h"

namespace gradsparse {

namespace {

/// Whether the edges are the plain comparisons band_bin makes (sorted, no NaN): always, unless a
/// prediction went wrong.
bool plain_edges(const std::vector<double>& edges) {
  return std::is_sorted(edges.begin(), edges.end()) &&
         std::none_of(edges.begin(), edges.end(), [](double e) { return std::isnan(e); });
}

/// counts[BandController::band_bin(edges, |v|)] += 1 for every value; returns how many of them are
/// below the band (|v| < edges[0], counted in bin 0). The values are float32 (exact for every
/// bucket dtype) and, for such a value, |v| >= edges[b] in float64 is |v| >= the smallest float32
/// at or above edges[b] (method_util::dtype_ceil), a comparison of keys: so the bins are KeyBins'
/// (a table look-up, 16 values a step on the AVX-512 path) rather than a binary search of the
/// edges per value.
int64_t add_band_counts(const std::vector<double>& edges, const HostBuffer<float>& values,
                        std::vector<double>& counts) {
  int64_t below = 0;
  if (!plain_edges(edges)) {  // not expected; band_bin defines the bins
    for (float v : values) {
      counts[BandController::band_bin(edges, std::fabs(v))] += 1.0;
      below += std::fabs(v) < edges[0] ? 1 : 0;
    }
    return below;
  }
  std::vector<uint32_t> keys(edges.size());
  for (size_t b = 0; b < edges.size(); ++b) keys[b] = method_util::float_key_at_least(edges[b]);
  std::vector<int64_t> in_bin(keys.size() + 1, 0);  // [0]: below the band; [b + 1]: bin b
  const KeyBins table(keys.data(), static_cast<int>(keys.size()));
  table.count(values.data(), static_cast<int64_t>(values.size()), in_bin.data());
  below = in_bin[0];
  counts[0] += static_cast<double>(below);
  for (size_t b = 1; b < in_bin.size(); ++b)  // band_bin clamps to [0, kBandBins]
    counts[std::min<size_t>(b - 1, BandController::kBandBins)] += static_cast<double>(in_bin[b]);
  return below;
}

constexpr int kBins = BandController::kBandBins + 1;

/// add_band_counts for what collect would list at edges[0], from one counting pass on the device
/// instead: bin b holds the elements at or above edges[b] less those at or above edges[b + 1],
/// each edge raised to the bucket's dtype (dtype_ceil), which compares as add_band_counts' float64
/// comparisons do. collect compares with edges[0] rounded to the dtype, so it may list elements
/// just below edges[0]: they are counted at that rounding too, and are the count returned.
int64_t add_band_counts_by_pass(Device& device, const BucketView& bucket, Range range, const std::vector<double>& edges,
                                std::vector<double>& counts) {
  std::vector<double> thresholds{edges[0]};
  for (double e : edges) thresholds.push_back(method_util::dtype_ceil(bucket.dtype, e));
  const std::vector<int64_t> at_least = device.count(bucket, range, thresholds, /*strict=*/false);
  const size_t bins = edges.size();
  for (size_t b = 0; b < bins; ++b)
    counts[b] += static_cast<double>(at_least[b + 1] - (b + 1 < bins ? at_least[b + 2] : 0));
  const int64_t below = at_least[0] - at_least[1];
  counts[0] += static_cast<double>(below);
  return below;
}

/// Whether the band counts travel folded (agree_on_band): where that sends no more bytes, by
/// transport.h's accounting, than the all-reduce of the 257 float64 counts and the all-gather of
/// the control words it replaces, which holds up to 4 ranks (4-byte counts); beyond, the
/// all-gather of every rank's counts would grow with P.
bool fold_agreement(int p, int64_t numel) {
  const int64_t folded = (p - 1) * (2 + kBins) * static_cast<int64_t>(count_bytes(static_cast<uint64_t>(numel)));
  const int64_t apart = 2 * (p - 1) * kBins * 8 / p + (p - 1) * static_cast<int64_t>(control_bytes(numel));
  return folded <= apart;
}

/// Every rank's row of counts (`mine` is this rank's), count_bytes(numel) bytes per count. Peers
/// are not trusted: a count outside [0, numel] is a CorruptMessageError naming the rank.
std::vector<std::vector<int64_t>> allgather_counts(Collective& group, const std::vector<int64_t>& mine, int64_t numel) {
  const size_t n = mine.size();
  const std::vector<int64_t> all =
      gather_counts(mine, count_bytes(static_cast<uint64_t>(numel)), static_cast<size_t>(group.size()),
                    [&](const void* send, void* recv, size_t bytes) { group.allgather(send, recv, bytes); });
  std::vector<std::vector<int64_t>> rows(group.size(), std::vector<int64_t>(n));
  for (int r = 0; r < group.size(); ++r) {
    for (size_t j = 0; j < n; ++j) {
      const int64_t v = all[static_cast<size_t>(r) * n + j];
      GS_CHECK(v >= 0 && v <= numel, CorruptMessageError, "band counts from rank ", r, " hold ", v, " at position ", j,
               " for a bucket of ", numel, " elements");
      rows[r][j] = v;
    }
  }
  return rows;
}

/// The bin of the agreed threshold from every rank's band counts (`counts`: this rank's, summed
/// over the ranks on return). Folded (where the exchange reads agreed control words and
/// fold_agreement holds), every rank's counts travel in one all-gather with its
/// non-finite count and its candidates below the band, so every rank's count at the threshold is
/// known: `agreed` receives every rank's control word, and the exchange sends none (one
/// collective instead of two). Apart, one all-reduce of the counts, and `agreed` stays empty.
int agree_on_band(Collective& group, const BucketView& bucket, const std::vector<double>& edges,
                  std::vector<double>& counts, int64_t below, int64_t nonfinite, int64_t k,
                  std::vector<ControlWord>& agreed) {
  const int p = group.size();
  if (!group.exchange_takes_agreed_words() || !fold_agreement(p, bucket.numel) || !plain_edges(edges)) {
    group.sum(counts);
    return BandController::choose(counts, static_cast<double>(k));
  }
  std::vector<int64_t> mine{nonfinite, below};
  for (double c : counts) mine.push_back(static_cast<int64_t>(c));
  // rows[r]: rank r's non-finite count, below-band count and 257 band counts
  const std::vector<std::vector<int64_t>> rows = allgather_counts(group, mine, bucket.numel);
  std::fill(counts.begin(), counts.end(), 0.0);
  for (const auto& row : rows)
    for (int b = 0; b < kBins; ++b) counts[b] += static_cast<double>(row[2 + b]);
  const int best = BandController::choose(counts, static_cast<double>(k));
  agreed.clear();
  for (int r = 0; r < p; ++r) {
    int64_t count = best == 0 ? -rows[r][1] : 0;  // bin 0 also holds the candidates below the band
    for (int b = best; b < kBins; ++b) count += rows[r][2 + b];
    // a negative count (forged) keeps its sign for agree()'s check of the word
    agreed.push_back(ControlWord{count, rows[r][0], 0});
  }
  return best;
}

}  // namespace

PartitionedMethod::PartitionedMethod(double density, const std::string& exchange, bool reference, uint64_t seed,
                                     Listing listing)
    : density_(density),
      exchange_(
          &exchange_option(exchange, {{"union", &union_allreduce()}, {"gather", &exclusive_gather()}}, "MiCRO/ExDyna")),
      reference_(reference),
      seed_(seed),
      listing_(listing) {
  method_util::check_density("MiCRO/ExDyna", density);
}

Selection PartitionedMethod::select(Device& device, const BucketView& bucket, Collective& group) {
  const int64_t k = target_count(density_, bucket.numel);
  const int partition = partition_of(committed_.t, group.rank(), group.size());
  const Range range = partition_range(partition, bucket.numel, group.size());
  pending_ = committed_;
  return reference_ ? select_reference(device, bucket, range, k) : select_default(device, bucket, group, range, k);
}

Selection PartitionedMethod::select_reference(Device& device, const BucketView& bucket, Range range, int64_t k) {
  const int64_t t = committed_.t;
  const double lambda =
      t == 0 ? initial_threshold(k) * loss_scale_
             : committed_.threshold * online_scaling_factor(static_cast<double>(committed_.k_prev) /
                                                            static_cast<double>(std::max<int64_t>(k, 1)));
  pending_.threshold = lambda;
  const bool zero = exchange_->selection_zeroes();
  Selection s = device.select(bucket, SelectRule{lambda, false, range, true, zero});
  const int64_t length = range.end - range.begin;
  if (s.count == 0 && length > 0) {  // the dummy element: every rank sends something
    const int64_t nonfinite = s.nonfinite;
    s = device.gather(bucket, {range.begin + t % length});
    if (zero) device.zero_at(bucket, s.view(bucket));
    s.nonfinite = nonfinite;
  }
  return s;
}

Selection PartitionedMethod::select_default(Device& device, const BucketView& bucket, Collective& group, Range range,
                                            int64_t k) {
  const int64_t t = committed_.t;
  int64_t nonfinite = 0;
  double prediction = 0.0, by_trend = 0.0, by_mean = 0.0;
  // A sampled prediction at the first step, and where the last step's counts left no estimate
  // (they put the threshold far off the band: a step of zeros, a jump in scale), since the
  // estimate could move only one band width a step: the controller starts again, as at t = 0.
  const bool sampled = t == 0 || !(committed_.estimate > 0.0 && std::isfinite(committed_.estimate));
  const double w = sampled ? BandController::band_factor(0) : committed_.band;
  if (!sampled) {  // the prediction needs no look at this step's values: of two, the one that missed less lately
    by_trend = BandController::predict_from_trend(committed_.estimate, committed_.before_last, t);
    by_mean = BandController::predict_from_mean(committed_.estimate, committed_.before_last, t);
    prediction = committed_.trend_miss <= committed_.mean_miss ? by_trend : by_mean;
  } else {
    nonfinite = method_util::update_pass(device, bucket);
    // Sampled histogram of |v| over every rank's partition, weighted to estimate counts.
    const int64_t length = range.end - range.begin;
    const int64_t samples = std::min<int64_t>(4096, length);
    std::vector<double> weights(BandController::kSampleBins, 0.0);
    if (samples > 0) {
      const uint64_t stream =
          rng_stream(seed_, RngTag::kPartitionSample, static_cast<uint64_t>(t), static_cast<uint64_t>(group.rank()));
      std::map<int64_t, int> multiplicity;
      for (int64_t p : sample_with_replacement(stream, samples, length)) ++multiplicity[range.begin + p];
      std::vector<int64_t> positions;
      for (const auto& [p, _] : multiplicity) positions.push_back(p);
      const Selection sample = device.gather(bucket, positions);
      const std::vector<float> values = HostMessage(device, sample, bucket).value_list();
      const double weight = static_cast<double>(length) / static_cast<double>(samples);
      // (binned as unscaled magnitudes: the histogram's edges are fixed, and follow the loss scale)
      for (size_t j = 0; j < positions.size(); ++j)
        weights[BandController::sample_bin(std::fabs(values[j]) / loss_scale_)] += weight * multiplicity[positions[j]];
    }
    group.sum(weights);
    prediction = BandController::predict_from_samples(weights, static_cast<double>(k)) * loss_scale_;
  }
  // Zero is never a candidate: the band's lowest edge stays at or above the dtype's least positive
  // value (a sample of zeros predicts the histogram's lowest edge, which rounds to 0 in the dtype).
  prediction = std::max(prediction, w * smallest_positive(bucket.dtype));
  const std::vector<double> edges = BandController::band_edges(prediction, w);
  // Where the host reads the bucket in place (the CPU), the band's candidates are listed, then
  // binned and chosen on the host. Elsewhere (a GPU, where a listed candidate is a copy to the
  // host) the counts at the band's edges and the selection are passes on the device; the same
  // results, by the same comparisons of keys.
  const bool listed = lists_candidates(device, listing_) || !plain_edges(edges);
  Candidates c;
  if (!sampled) {  // one pass updates the residual and lists the band (or only updates it)
    Scan scan = device.scan(bucket, /*update=*/true, range, edges[0], /*capacity=*/listed ? -1 : 0, /*sums=*/false);
    nonfinite = scan.moments.nonfinite;
    c = std::move(scan.candidates);
  } else if (listed) {
    c = device.collect(bucket, range, edges[0], false);
  }
  std::vector<double> counts(kBins, 0.0);
  const int64_t below =
      listed ? add_band_counts(edges, c.value, counts) : add_band_counts_by_pass(device, bucket, range, edges, counts);
  std::vector<ControlWord> agreed;
  const double lambda = edges[agree_on_band(group, bucket, edges, counts, below, nonfinite, k, agreed)];
  pending_.threshold = lambda;
  pending_.estimate = BandController::next_estimate(edges, counts, static_cast<double>(k), lambda);
  // After a sampled step the band stays wide: at t = 1 the residual joins the gradient, and the
  // k-th largest magnitude grew past the narrower band (by about sqrt 2 on a steady stream).
  pending_.band = sampled ? w : BandController::next_band_factor(w, prediction, pending_.estimate);
  if (!sampled) {  // a sampled prediction is neither's: their misses stay as they were (0 at t = 0)
    auto decayed = [&](double before, double predicted) {
      const double m = BandController::miss(predicted, pending_.estimate);
      return BandController::kMissDecay * before + (std::isnan(m) ? 0.0 : m);
    };
    pending_.trend_miss = decayed(committed_.trend_miss, by_trend);
    pending_.mean_miss = decayed(committed_.mean_miss, by_mean);
  }
  const bool zero = exchange_->selection_zeroes();
  Selection s;
  if (listed) {
    // |v| >= lambda in float64 as a comparison of keys (the listed values are exact as float): an
    // integer test per candidate, which the counting loop vectorises.
    const uint32_t from = method_util::float_key_at_least(lambda);
    const method_util::FloatKeys keys = method_util::float_keys(c.value);
    const Positions chosen = positions_where(keys.size(), [&](size_t j) { return keys[j] >= from; });
    s = method_util::emit_subset(device, bucket, c, chosen, zero);
  } else {
    // |v| >= lambda exactly, as the listed path compares: lambda raised to the dtype.
    const double at = method_util::dtype_ceil(bucket.dtype, lambda);
    s = device.select(bucket, SelectRule{at, /*strict=*/false, range, /*update=*/false, zero});
  }
  s.nonfinite = nonfinite;
  s.agreed = std::move(agreed);
  return s;
}

void PartitionedMethod::observe(const BucketView& /*bucket*/, const ExchangeResult& result) {
  std::vector<int64_t> counts;
  int64_t total = 0, largest = 0;
  for (const ControlWord& w : result.control) {
    counts.push_back(w.count);
    total += w.count;
    largest = std::max(largest, w.count);
  }
  const double p = static_cast<double>(counts.size());
  imbalance_ = total > 0 ? static_cast<double>(largest) * p / static_cast<double>(total) - 1.0 : 0.0;
  rebalance(counts, pending_.t, total);
  const double before_last = committed_.estimate;
  committed_ = pending_;
  committed_.t += 1;
  committed_.before_last = before_last;
  committed_.k_prev = total;
}

void PartitionedMethod::rescale_state(double factor) {
  committed_.threshold *= factor;
  committed_.estimate *= factor;
  committed_.before_last *= factor;
}

MethodState PartitionedMethod::state() const {
  MethodState s{{"step", static_cast<double>(committed_.t)},
                {"threshold", committed_.threshold},
                {"estimate", committed_.estimate},
                {"before_last", committed_.before_last},
                {"k_prev", static_cast<double>(committed_.k_prev)},
                {"band", committed_.band},
                {"trend_miss", committed_.trend_miss},
                {"mean_miss", committed_.mean_miss}};
  save_layout(s);
  save_loss_scale(s);
  return s;
}

void PartitionedMethod::load_state(const MethodState& state) {
  Step loaded;
  loaded.t = saved_count(state, "step");
  loaded.threshold = saved_value(state, "threshold");
  loaded.estimate = saved_value(state, "estimate");
  loaded.before_last = saved_value(state, "before_last");
  loaded.k_prev = saved_count(state, "k_prev");
  // Reference mode scales the last threshold by a factor near 1 at every step after the first:
  // one that is not a positive finite number (NaN, Inf, 0, negative), which no step leaves, would
  // stay so for good, every rank selecting everything or only its one dummy element.
  GS_CHECK(!reference_ || loaded.t == 0 || (std::isfinite(loaded.threshold) && loaded.threshold > 0.0), ValueError,
           "method state: 'threshold' is ", loaded.threshold, " at step ", loaded.t,
           ", not a finite number > 0; load a state the method saved");
  // Absent from checkpoints before the adaptive band: then its start. After the sampled step the
  // band stays at that step's width (band_factor(0)), and narrows from the next.
  loaded.band = BandController::saved_band(state, BandController::band_factor(0), loaded.band);
  // Absent before the second prediction: 0, as at the start. Each is a decayed sum of |log|
  // misses, finite and >= 0; a NaN would stay NaN and pin the choice to the mean for good.
  for (auto [key, miss] : {std::pair{"trend_miss", &loaded.trend_miss}, std::pair{"mean_miss", &loaded.mean_miss}}) {
    const auto it = state.find(key);
    if (it == state.end()) continue;
    GS_CHECK(it->second >= 0.0 && std::isfinite(it->second), ValueError, "method state: '", key, "' is ", it->second,
             ", not a finite number >= 0; load a state the method saved");
    *miss = it->second;
  }
  const double loss_scale = saved_loss_scale(state);
  load_layout(state);
  committed_ = loaded;
  loss_scale_ = loss_scale;
}

Range MiCRO::partition_range(int partition, int64_t n, int world_size) {
  if (!layout_ || layout_->size() != world_size || layout_->numel() != n) layout_.emplace(n, world_size);
  return layout_->range(partition);
}

Range ExDyna::partition_range(int partition, int64_t n, int world_size) {
  if (!layout_ || layout_->size() != world_size || layout_->numel() != n) {
    // The first layout takes the checkpoint's blocks; a bucket of another size keeps the blocks
    // its partitions hold (shares of the same 1024); another world size starts even.
    const bool fresh = !layout_;
    const std::vector<int64_t> blocks = fresh ? saved_blocks_ : layout_->blocks();
    const bool kept = fresh || layout_->size() == world_size;
    if (fresh) check_saved_blocks(blocks, world_size);  // before a layout exists, so that a retry checks again
    layout_.emplace(n, world_size);
    if (kept && !blocks.empty()) layout_->set_blocks(blocks);
  }
  return layout_->range(partition);
}

void ExDyna::rebalance(const std::vector<int64_t>& counts, int64_t t, int64_t total) {
  if (layout_) layout_->rebalance(counts, t, total);
}

void ExDyna::save_layout(MethodState& state) const {
  // Before its first step a method that loaded a layout still holds it only as saved_blocks_: a
  // checkpoint loaded and saved again before a step keeps it (it was dropped, and the run resumed
  // from that second checkpoint started from an even layout).
  const std::vector<int64_t>& blocks = layout_ ? layout_->blocks() : saved_blocks_;
  for (size_t p = 0; p < blocks.size(); ++p) state["blocks." + std::to_string(p)] = static_cast<double>(blocks[p]);
}

void ExDyna::load_layout(const MethodState& state) {
  std::vector<int64_t> blocks;
  for (size_t p = 0;; ++p) {
    const auto it = state.find("blocks." + std::to_string(p));
    if (it == state.end()) break;
    blocks.push_back(saved_count(state, it->first));
  }
  const int64_t total = std::accumulate(blocks.begin(), blocks.end(), int64_t{0});
  GS_CHECK(blocks.empty() || total == BlockPartition::kBlocks, ValueError, "method state: 'blocks.0' to 'blocks.",
           blocks.size() - 1, "' hold ", total, " blocks in all, not ", BlockPartition::kBlocks,
           "; load a state the method saved");
  if (layout_) check_saved_blocks(blocks, layout_->size());
  // The next step lays out the loaded blocks, or even partitions where the state holds none (saved
  // before its first step): a method that had run kept its own rebalanced layout there.
  layout_.reset();
  saved_blocks_ = std::move(blocks);
}

void ExDyna::check_saved_blocks(const std::vector<int64_t>& blocks, int world_size) {
  // The layout is per world size: a checkpoint of another one (whose partitions the loaded
  // blocks are) cannot be mapped onto this run's ranks.
  GS_CHECK(blocks.empty() || static_cast<int64_t>(blocks.size()) == world_size, ValueError,
           "ExDyna: the loaded state's block layout ('blocks.0' to 'blocks.", blocks.size() - 1, "') has ",
           blocks.size(), " partitions, from a run of ", blocks.size(), " ranks, but this run has ", world_size,
           "; load a state saved at ", world_size,
           " ranks, or leave out its 'blocks.' entries to start from an even layout");
}

}  // namespace gradsparse
