// CPU selection kernels: selection by key (fused with error feedback), exact top-k, and
// candidate collection.
//
// Both work on fixed blocks of kCpuBlock elements. Each block collects its pairs into a buffer of
// its own (thread-local workspace, reused across calls), then the blocks are concatenated in order,
// so the output is ascending and independent of the thread count.
#include <algorithm>
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
  const PairSpan span = sink(stats.count);
  GS_ASSERT(stats.count == 0 || (span.indices != nullptr && span.values != nullptr));
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

/// float32 with error feedback on the AVX2 and AVX-512 paths, the hot path: the scan's pass
/// (mark_block_f32) updates the block's residual (and velocity, with momentum correction) and
/// marks the elements whose new residual reaches `key`; list_marked lists those in [lo, hi) from
/// the mask, while the block is in cache, and zeroes them there when `zero`.
void update_select_f32_marked(const Source<float>& src, int64_t begin, int64_t end, int64_t lo, int64_t hi,
                              uint32_t key, bool zero, BlockPairs<float>& p) {
  uint8_t mask[kCpuBlock / 8 + 8] = {};
  p.nonfinite += mark_block_f32(src, begin, end, key, mask);  // marks outside [lo, hi) are not listed
  p.offsets.resize(static_cast<size_t>(hi - lo + 2));
  p.values.resize(p.offsets.size());
  const int64_t found =
      list_marked(src.residual, mask, begin, lo, hi, p.offsets.data(), p.values.data(), p.writes, begin);
  p.offsets.resize(static_cast<size_t>(found));
  p.values.resize(static_cast<size_t>(found));
  p.writes = unmarked_writes(found, hi - lo);
  if (zero)
    for (const uint32_t off : p.offsets) src.residual[begin + off] = 0.0f;
}

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

}  // namespace

template <typename T, typename I>
SelectStats select(Source<T> src, int64_t n, uint32_t key, Range range, bool zero, const PairSink& sink) {
  GS_CHECK(n >= 0, ValueError, "select: n must be >= 0, got ", n);
  check_range(range, n, "select");
  const int64_t nblocks = num_blocks(n);
  auto& blocks = block_workspace<T>(nblocks);
  parallel_blocks(nblocks, [&](int64_t b) {
    BlockPairs<T>& p = blocks[b];
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
    visit_block(src, begin, end, p.nonfinite, [&](int64_t i, T v) {
      if (i >= lo && i < hi && Num<T>::key(v) >= key) take(i, v);
    });
  });
  return emit_blocks<T, I>(blocks, nblocks, {}, /*residual=*/nullptr, sink);
}

template <typename T, typename I>
SelectStats select_threshold(T* residual, const T* grad, int64_t n, double threshold, const PairSink& sink) {
  GS_CHECK(threshold >= 0.0, ValueError, "select_threshold: threshold must be >= 0, got ", threshold);
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

template <typename T, typename I>
SelectStats select_topk(Source<T> src, int64_t n, int64_t k, bool zero, const PairSink& sink) {
  GS_CHECK(n >= 0, ValueError, "select_topk: n must be >= 0, got ", n);
  GS_CHECK(k >= 0, ValueError, "select_topk: k must be >= 0, got ", k);
  k = std::min(k, n);
  const int64_t nblocks = num_blocks(n);
  auto& blocks = block_workspace<T>(nblocks);
  const int threads = cpu_threads();

  // After pass 1 the selection value of element i can be re-read: passes 2 and 3 see exactly
  // what pass 1 counted.
  T* residual = src.residual;
  auto value_at = [&](int64_t i) -> T { return src.value(i); };
  auto key_at = [&](int64_t i) -> uint32_t { return Num<T>::key(value_at(i)); };
  // Calls f(i) for every i in [begin, end) whose key_at(i) is `key` or more, and maybe for others
  // (f checks): float32 on the AVX2 paths compares the stored keys 32 at a time (a non-finite
  // gradient, read as zero, is among them), elsewhere every element.
  auto from_key = [&](int64_t begin, int64_t end, uint32_t key, auto&& f) {
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

  // Pass 1: error feedback, and a histogram of the key's high bits (all bits for 16-bit types).
  constexpr int kKeyBits = Num<T>::kKeyBits;
  constexpr int kHighShift = kKeyBits > 16 ? kKeyBits - 16 : 0;
  constexpr int64_t kHighBins = int64_t{1} << (kKeyBits - kHighShift);
  std::vector<int64_t> hist(static_cast<size_t>(threads) * kHighBins, 0);
  std::vector<int64_t> nonfinite(nblocks, 0);
  parallel_blocks(nblocks, threads, [&](int64_t b, int t) {
    int64_t* h = hist.data() + static_cast<size_t>(t) * kHighBins;
    const int64_t begin = b * kCpuBlock, end = std::min(n, begin + kCpuBlock);
    visit_block(src, begin, end, nonfinite[b], [&](int64_t, T v) { ++h[Num<T>::key(v) >> kHighShift]; });
  });
  for (int t = 1; t < threads; ++t)
    for (int64_t i = 0; i < kHighBins; ++i) hist[i] += hist[static_cast<size_t>(t) * kHighBins + i];

  // Find the bin holding the k-th largest key; `above` counts keys in higher bins.
  auto find_bin = [](const int64_t* h, int64_t bins, int64_t need, int64_t& above) {
    above = 0;
    for (int64_t bin = bins - 1; bin > 0; --bin) {
      if (above + h[bin] >= need) return bin;
      above += h[bin];
    }
    return int64_t{0};
  };
  uint32_t tkey = 0;
  int64_t above = 0;
  if (k > 0) {
    const int64_t high = find_bin(hist.data(), kHighBins, k, above);
    tkey = static_cast<uint32_t>(high) << kHighShift;
    if constexpr (kHighShift > 0) {
      // Pass 2 (float32): histogram of the low bits among keys in that bin.
      constexpr int64_t kLowBins = int64_t{1} << kHighShift;
      std::vector<int64_t> low(static_cast<size_t>(threads) * kLowBins, 0);
      parallel_blocks(nblocks, threads, [&](int64_t b, int t) {
        int64_t* h = low.data() + static_cast<size_t>(t) * kLowBins;
        const int64_t begin = b * kCpuBlock, end = std::min(n, begin + kCpuBlock);
        from_key(begin, end, static_cast<uint32_t>(high) << kHighShift, [&](int64_t i) {
          const uint32_t key = key_at(i);
          if ((key >> kHighShift) == static_cast<uint32_t>(high)) ++h[key & (kLowBins - 1)];
        });
      });
      for (int t = 1; t < threads; ++t)
        for (int64_t i = 0; i < kLowBins; ++i) low[i] += low[static_cast<size_t>(t) * kLowBins + i];
      int64_t above_low = 0;
      tkey |= static_cast<uint32_t>(find_bin(low.data(), kLowBins, k - above, above_low));
      above += above_low;
    }
  }
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
  // The lowest-index ties win: hand out the tie quota in block order.
  std::vector<int64_t> ties_taken(nblocks, 0);
  int64_t quota = ties_needed;
  for (int64_t b = 0; b < nblocks && quota > 0; ++b) {
    ties_taken[b] = std::min<int64_t>(quota, static_cast<int64_t>(blocks[b].tie_offsets.size()));
    quota -= ties_taken[b];
  }
  GS_ASSERT(quota == 0);
  SelectStats stats = emit_blocks<T, I>(blocks, nblocks, ties_taken, zero ? residual : nullptr, sink);
  GS_ASSERT(stats.count == k);
  stats.kth_key = tkey;
  return stats;
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
