// CPU selection kernels: selection by key (fused with error feedback), exact top-k, and
// candidate collection.
//
// Both work on fixed blocks of kCpuBlock elements. Each block collects its pairs into a buffer of
// its own (thread-local workspace, reused across calls), then the blocks are concatenated in order,
// so the output is ascending and independent of the thread count.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <type_traits>
#include <vector>

#include "gradsparse/kernels.h"
#include "gradsparse/parallel.h"
#include "simd.h"

namespace gradsparse {
namespace cpu {
namespace {

/// The pairs one block selected, as offsets inside the block.
template <typename T>
struct BlockPairs {
  HostBuffer<uint32_t> offsets;
  HostBuffer<T> values;
  HostBuffer<uint32_t> tie_offsets;  // top-k only: elements exactly at the k-th magnitude
  HostBuffer<T> tie_values;
  int64_t nonfinite = 0;
  int writes = 2;  // list_marked's writes without a branch, from this block's last selection

  void clear() {
    offsets.clear();
    values.clear();
    tie_offsets.clear();
    tie_values.clear();
    nonfinite = 0;
  }
};

/// Per-calling-thread block buffers; their capacity is kept between calls.
template <typename T>
std::vector<BlockPairs<T>>& block_workspace(int64_t blocks) {
  thread_local std::vector<BlockPairs<T>> workspace;
  if (static_cast<int64_t>(workspace.size()) < blocks) workspace.resize(blocks);
  return workspace;
}

/// Copies every block's pairs into the sink's arrays, in block order. `ties_taken[b]` is how many
/// of block b's tie pairs are part of the output (merged by offset with its other pairs). When
/// `residual` is given, the emitted elements are zeroed there (kernels that know their final
/// selection during the pass zero it then, while the data is in cache, and pass nullptr).
template <typename T, typename I>
SelectStats emit_blocks(std::vector<BlockPairs<T>>& blocks, int64_t nblocks, const std::vector<int64_t>& ties_taken,
                        T* residual, const PairSink& sink) {
  std::vector<int64_t> start(nblocks + 1, 0);
  SelectStats stats;
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t taken = ties_taken.empty() ? 0 : ties_taken[b];
    start[b + 1] = start[b] + static_cast<int64_t>(blocks[b].offsets.size()) + taken;
    stats.nonfinite += blocks[b].nonfinite;
  }
  stats.count = start[nblocks];
  const PairSpan span = pairs_at(sink, stats.count);
  I* out_idx = static_cast<I*>(span.indices);
  T* out_val = static_cast<T*>(span.values);
  parallel_blocks(nblocks, [&](int64_t b) {
    const BlockPairs<T>& p = blocks[b];
    const int64_t base = b * kCpuBlock;
    const size_t taken = ties_taken.empty() ? 0 : static_cast<size_t>(ties_taken[b]);
    int64_t o = start[b];
    size_t i = 0, j = 0;
    // Merge the block's strictly-selected pairs and its first `taken` ties by offset.
    while (i < p.offsets.size() || j < taken) {
      const bool take_tie = j < taken && (i == p.offsets.size() || p.tie_offsets[j] < p.offsets[i]);
      const uint32_t off = take_tie ? p.tie_offsets[j] : p.offsets[i];
      const T val = take_tie ? p.tie_values[j++] : p.values[i++];
      out_idx[o] = static_cast<I>(base + off);
      out_val[o] = val;
      if (residual != nullptr) residual[base + off] = Num<T>::zero();
      ++o;
    }
  });
  return stats;
}

/// Hands every element of [begin, end) to `visit(i, value)`, applying the error-feedback update
/// first when `src.update`; counts non-finite sums.
template <typename T, typename Visit>
void visit_block(Source<T> src, int64_t begin, int64_t end, int64_t& nonfinite, Visit&& visit) {
  if (src.update && src.residual != nullptr) {
    for (int64_t i = begin; i < end; ++i) {
      bool finite;
      src.update_element(i, finite);
      nonfinite += !finite;
      visit(i, src.residual[i]);
    }
  } else {
    for (int64_t i = begin; i < end; ++i) {
      if (src.residual == nullptr) nonfinite += !is_finite(src.grad[i]);
      visit(i, src.value(i));
    }
  }
}

#if GS_HAVE_AVX2_PATHS
/// float32 with error feedback on the AVX2 and AVX-512 paths, the hot path: the scan's pass
/// (mark_block_f32) updates the block's residual (and velocity, with momentum correction) and
/// marks the elements whose new residual reaches `key`; list_marked lists those in [lo, hi) from
/// the mask, while the block is in cache, and zeroes them there when `zero`.
void update_select_f32_marked(const Source<float>& src, int64_t begin, int64_t end, int64_t lo, int64_t hi,
                              uint32_t key, bool zero, BlockPairs<float>& p) {
  uint8_t mask[kCpuBlock / 8 + 8] = {};
  p.offsets.resize(static_cast<size_t>(hi - lo + 16));
  p.values.resize(p.offsets.size());
  // a block inside [lo, hi) is listed by the pass itself (CandidateList)
  const bool whole = lo == begin && hi == end;
  CandidateList list{p.offsets.data(), p.values.data(), begin};
  p.nonfinite += mark_block_f32(src, begin, end, key, mask, whole ? &list : nullptr);
  const int64_t found =  // marks outside [lo, hi) are not listed
      whole ? list.size
            : list_marked(src.residual, mask, begin, lo, hi, p.offsets.data(), p.values.data(), p.writes, begin);
  p.offsets.resize(static_cast<size_t>(found));
  p.values.resize(static_cast<size_t>(found));
  p.writes = unmarked_writes(found, hi - lo);
  if (zero)
    for (const uint32_t off : p.offsets) src.residual[begin + off] = 0.0f;
}
#endif

// float32 with error feedback in portable code. One pass updates the residual (and the velocity,
// with momentum correction) and writes, per 8 elements, a bit mask of the candidates: the elements
// whose new residual reaches the threshold key or whose sum is not finite; a second look at the
// masks, from cache, checks each candidate's residual and collects the few selected pairs.
int64_t update_block_f32_portable(const Source<float>& src, int64_t begin, int64_t len, uint32_t tkey,
                                  uint8_t* __restrict mask) {
  float* r = src.residual + begin;  // not restrict: src.addend reads the residual too (masking)
  int64_t bad = 0;
  for (int64_t j0 = 0; j0 < len; j0 += 8) {
    uint32_t bits = 0;
    const int64_t n = std::min<int64_t>(8, len - j0);
    for (int64_t k = 0; k < n; ++k) {
      const float a = r[j0 + k] + src.addend(begin + j0 + k);
      const uint32_t key = float_bits(a) & 0x7fffffffu;
      const uint32_t finite = key < 0x7f800000u;
      r[j0 + k] = finite ? a : r[j0 + k];
      bits |= static_cast<uint32_t>(key >= tkey) << k;
      bad += finite ^ 1u;
    }
    mask[j0 / 8] = static_cast<uint8_t>(bits);
  }
  return bad;
}

/// The float32 update of [begin, end) with selection by `tkey` (kNoKey: update only); calls
/// visit(i, value) for the selected elements.
template <typename Visit>
void update_select_f32(const Source<float>& src, int64_t begin, int64_t end, uint32_t tkey, int64_t& nonfinite,
                       Visit&& visit) {
  uint8_t mask[kCpuBlock / 8 + 8] = {};
  const int64_t len = end - begin;
  const float* residual = src.residual;
  nonfinite += update_block_f32_portable(src, begin, len, tkey, mask);
  for (int64_t w = 0; w * 64 < len; ++w) {  // 64 elements (8 mask bytes) at a time
    uint64_t word;
    std::memcpy(&word, mask + w * 8, sizeof(word));
    while (word != 0) {
      const int bit = __builtin_ctzll(word);
      word &= word - 1;
      const int64_t j = begin + w * 64 + bit;
      const float v = residual[j];
      if ((float_bits(v) & 0x7fffffffu) >= tkey) visit(j, v);
    }
  }
}

/// select()'s work on block b (with the update of the whole block when src.update): its pairs in
/// the range whose key reaches `key`, into p, zeroed in the residual when `zero`.
template <typename T>
void select_block(const Source<T>& src, int64_t n, int64_t b, Range range, uint32_t key, bool zero, BlockPairs<T>& p) {
  p.clear();
  const int64_t begin = b * kCpuBlock, end = std::min(n, begin + kCpuBlock);
  const int64_t lo = std::clamp(range.begin, begin, end), hi = std::clamp(range.end, begin, end);
  auto take = [&](int64_t i, T v) {
    p.offsets.push_back(static_cast<uint32_t>(i - begin));
    p.values.push_back(v);
    if (zero && src.residual != nullptr) src.residual[i] = Num<T>::zero();  // zeroed while in cache
  };
  if constexpr (std::is_same_v<T, float>) {
    if (src.update && src.residual != nullptr) {
#if GS_HAVE_AVX2_PATHS
      if (use_avx2()) {
        update_select_f32_marked(src, begin, end, lo, hi, key, zero, p);
        return;
      }
#endif
      update_select_f32(src, begin, lo, kNoKey, p.nonfinite, take);
      update_select_f32(src, lo, hi, key, p.nonfinite, take);
      update_select_f32(src, hi, end, kNoKey, p.nonfinite, take);
      return;
    }
#if GS_HAVE_AVX2_PATHS
    if (src.residual != nullptr && use_avx2()) {  // read-only: compare 8 keys at a time
      float* r = src.residual;
      scan_keys_avx2(r, lo, hi, key, [&](int64_t i) { take(i, r[i]); });
      return;
    }
    if (src.residual == nullptr && key <= Num<float>::kInfKey && use_avx2()) {
      // No residual (no error feedback): the gradient's keys compared 32 at a time. A non-finite
      // gradient's key reaches every finite threshold's, so each one is a hit: counted there,
      // and selected as the zero it is read as (selection_value) where the key is 0.
      const float* g = src.grad;
      for (int64_t i = begin; i < lo; ++i) p.nonfinite += !is_finite(g[i]);
      for (int64_t i = hi; i < end; ++i) p.nonfinite += !is_finite(g[i]);
      scan_keys_avx2(g, lo, hi, key, [&](int64_t i) {
        if (is_finite(g[i])) {
          take(i, g[i]);
        } else {
          ++p.nonfinite;
          if (key == 0) take(i, 0.0f);
        }
      });
      return;
    }
#endif
  }
#if GS_HAVE_AVX2_PATHS
  if constexpr (sizeof(T) == 2) {  // float16, bfloat16: the update in vectors, then 32 keys compared at a time
    if (src.residual != nullptr && use_avx2()) {
      if (src.update) p.nonfinite += update_16(src, begin, end);
      const T* r = src.residual;
      scan_keys16_avx2(reinterpret_cast<const uint16_t*>(r), lo, hi, key, [&](int64_t i) { take(i, r[i]); });
      return;
    }
  }
#endif
  visit_block(src, begin, end, p.nonfinite, [&](int64_t i, T v) {
    if (i >= lo && i < hi && Num<T>::key(v) >= key) take(i, v);
  });
}

/// Per-thread histograms of `bins` bins over blocks [0, nblocks), summed: count(b, h) adds block
/// b's counts to h. The sums lie in a workspace of the calling thread, valid until its next call
/// (allocated once: a fresh one took longer than the counting, 0.5 ms for two threads' 65,536
/// bins). One histogram per thread that counts (no more than the blocks), zeroed and summed in
/// parallel: every histogram costs a fill and a sum of all its bins, 32 MB and 4 million additions
/// for 64 threads' 65,536 bins, which summed on one thread took longer than counting a bucket of a
/// million elements.
template <typename Count>
const int64_t* block_histogram(int64_t nblocks, int64_t bins, Count&& count) {
  const int threads = static_cast<int>(std::clamp<int64_t>(nblocks, 1, cpu_threads()));
  thread_local HostBuffer<int64_t> hist;
  hist.resize(static_cast<size_t>(threads) * bins);
  int64_t* sums = hist.data();  // (in the lambdas `hist` would be each worker thread's own)
  parallel_blocks(threads, threads, [&](int64_t t, int) { std::fill_n(sums + t * bins, bins, int64_t{0}); });
  parallel_blocks(nblocks, threads, [&](int64_t b, int t) { count(b, sums + static_cast<size_t>(t) * bins); });
  if (threads > 1) {
    constexpr int64_t kBinsPerPart = 4096;
    parallel_blocks((bins + kBinsPerPart - 1) / kBinsPerPart, threads, [&](int64_t part, int) {
      const int64_t begin = part * kBinsPerPart, end = std::min(bins, begin + kBinsPerPart);
      for (int t = 1; t < threads; ++t) {
        const int64_t* h = sums + static_cast<size_t>(t) * bins;
        for (int64_t i = begin; i < end; ++i) sums[i] += h[i];
      }
    });
  }
  return sums;
}

/// The highest of `bins` bins at which the counts from the top reach `need` (bin 0 if none);
/// `above` gets the counts of the bins above it.
inline int64_t find_bin(const int64_t* hist, int64_t bins, int64_t need, int64_t& above) {
  above = 0;
  for (int64_t bin = bins - 1; bin > 0; --bin) {
    if (above + hist[bin] >= need) return bin;
    above += hist[bin];
  }
  return 0;
}

/// The k-th largest of the keys of T that blocks [0, nblocks) hold, by a radix select in two
/// rounds of histograms. first(b, f) calls f(key) for every key of block b, counted by their high
/// 16 bits (a round that may do work of its own, as the error-feedback update: it runs even for
/// k = 0, which returns 0). For float32, again(b, from, f) then calls f at least for every key of
/// block b at or above `from` (and may for others), and the low bits of those in the k-th's bin of
/// high bits are counted; a 16-bit type's first round counts every bit. `above` gets how many
/// keys exceed the k-th.
template <typename T, typename First, typename Again>
uint32_t kth_key_by_histograms(int64_t nblocks, int64_t k, First&& first, Again&& again, int64_t& above) {
  constexpr int kKeyBits = Num<T>::kKeyBits;
  constexpr int kHighShift = kKeyBits > 16 ? kKeyBits - 16 : 0;
  constexpr int64_t kHighBins = int64_t{1} << (kKeyBits - kHighShift), kLowBins = int64_t{1} << kHighShift;
  const int64_t* high_hist = block_histogram(
      nblocks, kHighBins, [&](int64_t b, int64_t* h) { first(b, [&](uint32_t key) { ++h[key >> kHighShift]; }); });
  above = 0;
  if (k == 0) return 0;
  const auto high = static_cast<uint32_t>(find_bin(high_hist, kHighBins, k, above));
  uint32_t tkey = high << kHighShift;
  if constexpr (kHighShift > 0) {
    const int64_t* low_hist = block_histogram(nblocks, kLowBins, [&](int64_t b, int64_t* h) {
      again(b, tkey, [&](uint32_t key) {
        if ((key >> kHighShift) == high) ++h[key & (kLowBins - 1)];
      });
    });
    int64_t above_low = 0;
    tkey |= static_cast<uint32_t>(find_bin(low_hist, kLowBins, k - above, above_low));
    above += above_low;
  }
  return tkey;
}

/// select_topk's end, once the blocks hold the pairs above the k-th largest key `tkey` and up to
/// `ties_needed` ties at it each: the lowest-index ties win, the tie quota handed out in block
/// order.
template <typename T, typename I>
SelectStats emit_topk(std::vector<BlockPairs<T>>& blocks, int64_t nblocks, int64_t k, int64_t ties_needed,
                      uint32_t tkey, T* zero_residual, const PairSink& sink) {
  std::vector<int64_t> ties_taken(nblocks, 0);
  int64_t quota = ties_needed;
  for (int64_t b = 0; b < nblocks && quota > 0; ++b) {
    ties_taken[b] = std::min<int64_t>(quota, static_cast<int64_t>(blocks[b].tie_offsets.size()));
    quota -= ties_taken[b];
  }
  GS_ASSERT(quota == 0);
  SelectStats stats = emit_blocks<T, I>(blocks, nblocks, ties_taken, zero_residual, sink);
  GS_ASSERT(stats.count == k);
  stats.kth_key = tkey;
  return stats;
}

#if GS_HAVE_AVX2_PATHS
/// About how many blocks select_topk_listed's sample reads; it runs on 4 times as many or more.
constexpr int64_t kTopKSample = 16;

/// select_topk for float32 on the AVX2 paths: the candidates listed in one pass, where the
/// counting path (select_topk_counted, below) reads the bucket three times (at 25M elements 4.2x
/// to 5.7x a plain add, against 1.3x to 2.2x). First about kTopKSample blocks evenly spread
/// (BlockSample) are updated (with a residual and src.update), and a histogram of their selection
/// values' keys places a floor at the sample's (2 k share + 64)-th largest: about twice the k
/// largest reach it. Then one pass updates the other blocks and lists, in every block, the
/// elements whose key reaches the floor (select_block), and the k largest are found among them
/// (kth_key_by_histograms): the counting path's selection, whatever the floor. Where the
/// candidates are fewer than k and a few sampled blocks held most of the sample's elements at the
/// floor (an outlying layer), a floor from the other sampled blocks lists once more. Returns false
/// where the candidates are fewer than k (the floor was too high for the bucket) or past the cap
/// (4 times the sample's count at the floor, scaled: too low, or a bucket of ties), with the
/// update done and its non-finite sums in `nonfinite`: the caller then runs the counting path on
/// the residual, read-only (or on the gradient again, which counts its own non-finite values).
template <typename I>
bool select_topk_listed(const Source<float>& src, int64_t n, int64_t k, bool zero, const PairSink& sink,
                        SelectStats& stats, int64_t& nonfinite) {
  const int64_t nblocks = num_blocks(n);
  const BlockSample sample = BlockSample::at_least(n, kTopKSample);
  const int64_t sampled = (nblocks + sample.every - 1) / sample.every;
  const double share = static_cast<double>(sample.size(n)) / static_cast<double>(n);
  std::vector<int64_t> block_nonfinite(nblocks, 0);
  const bool updates = src.update && src.residual != nullptr;

  // The sample: updated (where the call updates), and a histogram of its keys' high 16 bits.
  constexpr int kShift = Num<float>::kKeyBits - 16;
  constexpr int64_t kBins = int64_t{1} << 16;
  const int64_t* hist = block_histogram(sampled, kBins, [&](int64_t s, int64_t* h) {
    const int64_t b = s * sample.every, begin = b * kCpuBlock, end = std::min(n, begin + kCpuBlock);
    if (updates) block_nonfinite[b] = mark_block_f32(src, begin, end, kNoKey, /*mask=*/nullptr);
    for (int64_t i = begin; i < end; ++i) ++h[Num<float>::key(src.value(i)) >> kShift];
  });
  const auto rank = static_cast<int64_t>(std::ceil(2.0 * static_cast<double>(k) * share)) + 64;
  int64_t above_floor = 0;
  const int64_t bin = find_bin(hist, kBins, rank, above_floor);
  const uint32_t floor = static_cast<uint32_t>(bin) << kShift;
  const int64_t reaching = above_floor + hist[bin];  // the sample's elements at or above the floor
  const auto cap = static_cast<int64_t>(4.0 * static_cast<double>(reaching) / share) + 1024;

  // A listing pass: every block's elements of from(b) whose key reaches `at`, until more than
  // `limit` are listed; past that, a block is only updated (where from(b) updates). Returns the
  // count listed; each block's non-finite count stays in its pairs' `nonfinite`.
  auto& blocks = block_workspace<float>(nblocks);
  auto list_at = [&](uint32_t at, int64_t limit, auto&& from) {
    std::atomic<int64_t> listed{0};
    parallel_blocks(nblocks, [&](int64_t b) {
      BlockPairs<float>& p = blocks[b];
      const Source<float>& s = from(b);
      if (listed.load(std::memory_order_relaxed) > limit) {
        p.clear();
        const int64_t begin = b * kCpuBlock;
        if (s.update) p.nonfinite = mark_block_f32(s, begin, std::min(n, begin + kCpuBlock), kNoKey, nullptr);
      } else {
        select_block(s, n, b, Range{0, n}, at, /*zero=*/false, p);
        listed.fetch_add(static_cast<int64_t>(p.offsets.size()), std::memory_order_relaxed);
      }
    });
    return listed.load();
  };

  // The pass: the other blocks updated, every block's candidates listed until they pass the cap.
  const Source<float> updated{src.residual, src.grad, false};
  int64_t candidates = list_at(
      floor, cap, [&](int64_t b) -> const Source<float>& { return updates && b % sample.every != 0 ? src : updated; });
  for (int64_t b = 0; b < nblocks; ++b) block_nonfinite[b] += blocks[b].nonfinite;
  nonfinite = updates ? std::accumulate(block_nonfinite.begin(), block_nonfinite.end(), int64_t{0}) : 0;
  int64_t most = cap;

  // Too few: the floor stood above the bucket's k-th largest. Where a few sampled blocks held
  // most of the sample's elements at the floor (each more than a quarter), they were an outlying
  // layer, not the bucket: DDP's first bucket starts with the model's last layer, and a
  // classifier's weights (14 times the others' mean magnitude) held 99% of the sample's largest.
  // A floor from the other sampled blocks then lists again, read-only (the update is done): one
  // pass more where the counting path makes three.
  if (candidates < k) {
    std::vector<int64_t> kept;
    int64_t outlying = 0;  // elements of the sampled blocks set aside
    for (int64_t s = 0; s < sampled; ++s) {
      const int64_t b = s * sample.every, length = std::min(n, (b + 1) * kCpuBlock) - b * kCpuBlock;
      if (4 * static_cast<int64_t>(blocks[b].offsets.size()) > reaching) {
        outlying += length;
      } else {
        kept.push_back(b);
      }
    }
    if (outlying == 0 || kept.empty()) return false;
    const int64_t* rest = block_histogram(static_cast<int64_t>(kept.size()), kBins, [&](int64_t s, int64_t* h) {
      const int64_t begin = kept[s] * kCpuBlock, end = std::min(n, begin + kCpuBlock);
      for (int64_t i = begin; i < end; ++i) ++h[Num<float>::key(updated.value(i)) >> kShift];
    });
    const double rest_share = static_cast<double>(sample.size(n) - outlying) / static_cast<double>(n);
    const auto rest_rank = static_cast<int64_t>(std::ceil(2.0 * static_cast<double>(k) * rest_share)) + 64;
    int64_t rest_above = 0;
    const int64_t rest_bin = find_bin(rest, kBins, rest_rank, rest_above);
    if (rest_bin >= bin) return false;  // no lower floor
    const uint32_t lower = static_cast<uint32_t>(rest_bin) << kShift;
    // The set-aside blocks' elements are listed too, all of them at most.
    most = static_cast<int64_t>(4.0 * static_cast<double>(rest_above + rest[rest_bin]) / rest_share) + 1024 + outlying;
    candidates = list_at(lower, most, [&](int64_t) -> const Source<float>& { return updated; });
  }
  if (candidates < k || candidates > most) return false;

  // The k largest among the candidates: each block keeps, in place, those above the k-th and
  // sets aside up to `ties_needed` ties at it, as the counting path's last pass does (without a
  // branch on the pairs: whether a candidate lies above the k-th is as good as random).
  auto each_key = [&](int64_t b, uint32_t, auto&& f) {
    for (const float v : blocks[b].values) f(Num<float>::key(v));
  };
  int64_t above = 0;
  const uint32_t tkey =
      kth_key_by_histograms<float>(nblocks, k, [&](int64_t b, auto&& f) { each_key(b, 0, f); }, each_key, above);
  const int64_t ties_needed = k - above;
  parallel_blocks(nblocks, [&](int64_t b) {
    BlockPairs<float>& p = blocks[b];
    size_t kept = 0;
    for (size_t j = 0; j < p.offsets.size(); ++j) {
      const uint32_t offset = p.offsets[j];
      const float v = p.values[j];
      const uint32_t key = Num<float>::key(v);
      if (key == tkey && static_cast<int64_t>(p.tie_offsets.size()) < ties_needed) {
        p.tie_offsets.push_back(offset);
        p.tie_values.push_back(v);
      }
      p.offsets[kept] = offset;
      p.values[kept] = v;
      kept += key > tkey;
    }
    p.offsets.resize(kept);
    p.values.resize(kept);
    p.nonfinite = block_nonfinite[b];
  });
  stats = emit_topk<float, I>(blocks, nblocks, k, ties_needed, tkey, zero ? src.residual : nullptr, sink);
  return true;
}
#endif

}  // namespace

template <typename T, typename I>
SelectStats select(Source<T> src, int64_t n, uint32_t key, Range range, bool zero, const PairSink& sink) {
  GS_CHECK(n >= 0, ValueError, "select: n must be >= 0, got ", n);
  check_range(range, n, "select");
  check_source(src, n, "select");
  const int64_t nblocks = num_blocks(n);
  auto& blocks = block_workspace<T>(nblocks);
  parallel_blocks(nblocks, [&](int64_t b) { select_block(src, n, b, range, key, zero, blocks[b]); });
  return emit_blocks<T, I>(blocks, nblocks, {}, /*residual=*/nullptr, sink);
}

template <typename T, typename I>
SelectStats select_threshold(T* residual, const T* grad, int64_t n, double threshold, const PairSink& sink) {
  check_threshold(threshold, "select_threshold");
  return select<T, I>(Source<T>{residual, grad, true}, n, key_at_least<T>(threshold), Range{0, n}, true, sink);
}

template <typename T>
void collect(Source<T> src, int64_t n, Range range, uint32_t key, HostBuffer<int64_t>& index,
             HostBuffer<float>& value) {
  GS_CHECK(!src.update, ValueError, "collect reads values only; apply the error-feedback update first");
  check_range(range, n, "collect");
  const int64_t nblocks = num_blocks(n);
  auto& blocks = block_workspace<T>(nblocks);
  parallel_blocks(nblocks, [&](int64_t b) {
    BlockPairs<T>& p = blocks[b];
    p.clear();
    const int64_t lo = std::max(range.begin, b * kCpuBlock), hi = std::min(range.end, (b + 1) * kCpuBlock);
#if GS_HAVE_AVX2_PATHS
    if constexpr (std::is_same_v<T, float>) {
      if (src.residual != nullptr && use_avx2()) {
        const float* r = src.residual;
        scan_keys_avx2(r, lo, hi, key, [&](int64_t i) {
          p.offsets.push_back(static_cast<uint32_t>(i - b * kCpuBlock));
          p.values.push_back(r[i]);
        });
        return;
      }
    }
#endif
    for (int64_t i = lo; i < hi; ++i) {
      const T v = src.value(i);
      if (Num<T>::key(v) >= key) {
        p.offsets.push_back(static_cast<uint32_t>(i - b * kCpuBlock));
        p.values.push_back(v);
      }
    }
  });
  index.clear();
  value.clear();
  size_t total = 0;
  for (int64_t b = 0; b < nblocks; ++b) total += blocks[b].offsets.size();
  index.reserve(total);  // one allocation each, not one per doubling
  value.reserve(total);
  for (int64_t b = 0; b < nblocks; ++b) {
    for (size_t j = 0; j < blocks[b].offsets.size(); ++j) {
      index.push_back(b * kCpuBlock + blocks[b].offsets[j]);
      value.push_back(Num<T>::to_float(blocks[b].values[j]));
    }
  }
}

template <typename T, typename I>
SelectStats select_topk(T* residual, const T* grad, int64_t n, int64_t k, const PairSink& sink) {
  return select_topk<T, I>(Source<T>{residual, grad, true}, n, k, /*zero=*/true, sink);
}

namespace {

/// select_topk by counting: a histogram of the keys' high 16 bits (with the update), one of the
/// low bits of the k-th's bin, then the pairs (three reads of the bucket; 0 <= k <= n).
template <typename T, typename I>
SelectStats select_topk_counted(Source<T> src, int64_t n, int64_t k, bool zero, const PairSink& sink) {
  const int64_t nblocks = num_blocks(n);
  auto& blocks = block_workspace<T>(nblocks);

  // After pass 1 the selection value of element i can be re-read: passes 2 and 3 see exactly
  // what pass 1 counted.
  T* residual = src.residual;
  auto value_at = [&](int64_t i) -> T { return src.value(i); };
  auto key_at = [&](int64_t i) -> uint32_t { return Num<T>::key(value_at(i)); };
  // Calls f(i) for every i in [begin, end) whose key_at(i) is `key` or more, and maybe for others
  // (f checks): float32 on the AVX2 paths compares the stored keys 32 at a time (a non-finite
  // gradient, read as zero, is among them), elsewhere every element.
  auto from_key = [&](int64_t begin, int64_t end, [[maybe_unused]] uint32_t key, auto&& f) {
#if GS_HAVE_AVX2_PATHS
    if constexpr (std::is_same_v<T, float>) {
      if (use_avx2()) {
        scan_keys_avx2(residual != nullptr ? residual : src.grad, begin, end, key, f);
        return;
      }
    }
#endif
    for (int64_t i = begin; i < end; ++i) f(i);
  };

  // Passes 1 and 2: error feedback and the histogram of the keys' high bits, then of the low bits
  // of those in the k-th's bin.
  std::vector<int64_t> nonfinite(nblocks, 0);
  int64_t above = 0;
  const uint32_t tkey = kth_key_by_histograms<T>(
      nblocks, k,
      [&](int64_t b, auto&& f) {
        const int64_t begin = b * kCpuBlock, end = std::min(n, begin + kCpuBlock);
        visit_block(src, begin, end, nonfinite[b], [&](int64_t, T v) { f(Num<T>::key(v)); });
      },
      [&](int64_t b, uint32_t from, auto&& f) {
        const int64_t begin = b * kCpuBlock, end = std::min(n, begin + kCpuBlock);
        from_key(begin, end, from, [&](int64_t i) { f(key_at(i)); });
      },
      above);
  const int64_t ties_needed = k - above;  // elements with key == tkey that must be taken

  // Pass 3: collect keys above the k-th, and up to `ties_needed` ties per block.
  parallel_blocks(nblocks, [&](int64_t b) {
    BlockPairs<T>& p = blocks[b];
    p.clear();
    p.nonfinite = nonfinite[b];
    if (k == 0) return;
    const int64_t begin = b * kCpuBlock, end = std::min(n, begin + kCpuBlock);
    from_key(begin, end, tkey, [&](int64_t i) {
      const uint32_t key = key_at(i);
      if (key > tkey) {
        p.offsets.push_back(static_cast<uint32_t>(i - begin));
        p.values.push_back(value_at(i));
      } else if (key == tkey && static_cast<int64_t>(p.tie_offsets.size()) < ties_needed) {
        p.tie_offsets.push_back(static_cast<uint32_t>(i - begin));
        p.tie_values.push_back(value_at(i));
      }
    });
  });
  return emit_topk<T, I>(blocks, nblocks, k, ties_needed, tkey, zero ? residual : nullptr, sink);
}

}  // namespace

template <typename T, typename I>
SelectStats select_topk(Source<T> src, int64_t n, int64_t k, bool zero, const PairSink& sink) {
  GS_CHECK(n >= 0, ValueError, "select_topk: n must be >= 0, got ", n);
  GS_CHECK(k >= 0, ValueError, "select_topk: k must be >= 0, got ", k);
  check_source(src, n, "select_topk");
  k = std::min(k, n);
#if GS_HAVE_AVX2_PATHS
  if constexpr (std::is_same_v<T, float>) {
    if (k > 0 && num_blocks(n) >= 4 * kTopKSample && use_avx2()) {
      SelectStats stats;
      int64_t nonfinite = 0;
      if (select_topk_listed<I>(src, n, k, zero, sink, stats, nonfinite)) return stats;
      // The update is done: the counting path reads the residual (or the gradient) as it is.
      stats = select_topk_counted<T, I>(Source<T>{src.residual, src.grad, false}, n, k, zero, sink);
      stats.nonfinite += nonfinite;
      return stats;
    }
  }
#endif
  return select_topk_counted<T, I>(src, n, k, zero, sink);
}

#define GS_INSTANTIATE_SELECT(T, I)                                                              \
  template SelectStats select<T, I>(Source<T>, int64_t, uint32_t, Range, bool, const PairSink&); \
  template SelectStats select_threshold<T, I>(T*, const T*, int64_t, double, const PairSink&);   \
  template SelectStats select_topk<T, I>(Source<T>, int64_t, int64_t, bool, const PairSink&);    \
  template SelectStats select_topk<T, I>(T*, const T*, int64_t, int64_t, const PairSink&);
#define GS_INSTANTIATE_TYPE(T)       \
  GS_INSTANTIATE_SELECT(T, uint32_t) \
  GS_INSTANTIATE_SELECT(T, uint64_t) \
  GS_INSTANTIATE_SELECT(T, int64_t)  \
  template void collect<T>(Source<T>, int64_t, Range, uint32_t, HostBuffer<int64_t>&, HostBuffer<float>&);

GS_INSTANTIATE_TYPE(float)
GS_INSTANTIATE_TYPE(Half)
GS_INSTANTIATE_TYPE(BFloat16)

}  // namespace cpu
}  // namespace gradsparse
