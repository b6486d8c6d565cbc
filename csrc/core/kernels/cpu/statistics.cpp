// CPU statistics kernels: the moments, counts and sums that threshold estimators need, each one
// pass over memory (the first one fused with the error-feedback update). Sums are float64 (a
// float32 block's moments over float32 runs: MomentLanes) and block-ordered, so results do not
// depend on the thread count.
//
// float32 buckets take AVX2 or AVX-512 paths when the CPU has them (simd.h): 8 or 16 elements at
// a time, elements at or above a key found with vector comparisons. They add in exactly the
// portable code's order (moments: MomentLanes; exceedance: ExceedanceLanes), so every path gives
// the same bits.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "gradsparse/kernels.h"
#include "gradsparse/key_bins.h"
#include "gradsparse/parallel.h"
#include "simd.h"

namespace gradsparse {
namespace cpu {
namespace {

/// Runs f(begin, end) over the blocks of [0, n) that `sample` holds and returns their results in
/// block order.
template <typename R, typename F>
std::vector<R> per_block(int64_t n, BlockSample sample, F&& f) {
  const int64_t every = sample.every;
  std::vector<R> out(static_cast<size_t>((num_blocks(n) + every - 1) / every));
  parallel_blocks(static_cast<int64_t>(out.size()), [&](int64_t j) {
    const int64_t b = j * every;
    out[j] = f(b * kCpuBlock, std::min(n, (b + 1) * kCpuBlock));
  });
  return out;
}

/// per_block over every block of [0, n).
template <typename R, typename F>
std::vector<R> per_block(int64_t n, F&& f) {
  return per_block<R>(n, BlockSample{}, std::forward<F>(f));
}

void check_read_only(bool update, const char* what) {
  GS_CHECK(!update, ValueError, what, " reads values only; apply the error-feedback update first");
}

// ---- float32 moments in a fixed order -----------------------------------------------------------

/// float32 moments of one block of residual values in a fixed order, written out so that the
/// portable, AVX2 and AVX-512 paths all add in exactly that order and give the same bits:
/// - the body, the block's first (end - begin) / 16 * 16 elements, in 16 lanes: element i in lane
///   (i - begin) % 16;
/// - each lane adds its elements' v, |v| and v * v in float32 (one rounding each) in runs of kRows
///   of its elements (the body's last run possibly shorter), and each run's three float32 sums
///   to its float64 sums, in order;
/// - the block's last (end - begin) % 16 elements go to lane 0 in float64, in index order;
/// - the lanes add in lane order; the largest |v| is exact in any order.
/// Short float32 runs cost a conversion to float64 per kRows elements instead of one per element
/// (the pass with its sums measured 1.4 adds with every element in float64; docs/benchmarks.md)
/// and keep about float32's precision (a relative 1e-7) in what is an estimate anyway. A block
/// whose largest |v| is not in [kSmallest, kLargest] (or not finite), where float32 squares could
/// overflow or lose bits as subnormals, adds every element in float64 in the same lanes instead
/// (moments_f32_wide).
struct MomentLanes {
  static constexpr int kLanes = 16;
  static constexpr int kRows = 8;
  static constexpr float kSmallest = 0x1p-40f;
  static constexpr float kLargest = 0x1p60f;
  alignas(64) double sum[kLanes] = {};
  alignas(64) double sum_abs[kLanes] = {};
  alignas(64) double sum_sq[kLanes] = {};
  alignas(64) float run[3][kLanes] = {};  ///< the current run's float32 sums: v, |v|, v * v
  int rows = 0;
  float max_abs = 0.0f;

  /// The next 16 elements of the body: v[l] to lane l.
  void add16(const float* v) {
    for (int l = 0; l < kLanes; ++l) {
      const float a = std::fabs(v[l]);
      run[0][l] += v[l];
      run[1][l] += a;
      run[2][l] += v[l] * v[l];
      max_abs = a > max_abs ? a : max_abs;  // as the vector paths' max(a, max_abs): a NaN keeps max_abs
    }
    if (++rows == kRows) end_run();
  }
  /// Adds the current run's float32 sums to the float64 ones.
  void end_run() {
    if (rows == 0) return;
    for (int l = 0; l < kLanes; ++l) {
      sum[l] += static_cast<double>(run[0][l]);
      sum_abs[l] += static_cast<double>(run[1][l]);
      sum_sq[l] += static_cast<double>(run[2][l]);
      run[0][l] = run[1][l] = run[2][l] = 0.0f;
    }
    rows = 0;
  }
  /// An element added in float64 to `lane`.
  void add_wide(int lane, float v) {
    const double d = v, a = std::fabs(d);
    sum[lane] += d;
    sum_abs[lane] += a;
    sum_sq[lane] += d * d;
    const float f = static_cast<float>(a);  // |v| exactly
    max_abs = f > max_abs ? f : max_abs;
  }
  /// The block's last elements (count < 16): all to lane 0 in float64.
  void add_rest(const float* v, int count) {
    end_run();
    for (int j = 0; j < count; ++j) add_wide(0, v[j]);
  }
  /// Whether the block must add in float64 throughout (moments_f32_wide).
  bool needs_wide() const { return !(max_abs >= kSmallest && max_abs <= kLargest) && max_abs != 0.0f; }
  Moments total() {
    end_run();
    Moments m;
    for (int l = 0; l < kLanes; ++l) {
      m.sum += sum[l];
      m.sum_abs += sum_abs[l];
      m.sum_sq += sum_sq[l];
    }
    m.max_abs = max_abs;
    return m;
  }
};

/// MomentLanes' sums of the values r[begin, end) with every element in float64 (body element i
/// in lane (i - begin) % 16, the last (end - begin) % 16 in lane 0): a block whose magnitudes
/// float32 squares cannot hold.
Moments moments_f32_wide(const float* r, int64_t begin, int64_t end) {
  MomentLanes lanes;
  const int64_t body = begin + (end - begin) / MomentLanes::kLanes * MomentLanes::kLanes;
  for (int64_t i = begin; i < end; ++i)
    lanes.add_wide(i < body ? static_cast<int>((i - begin) % MomentLanes::kLanes) : 0, r[i]);
  return lanes.total();
}

/// The block's moments from its lanes, or in float64 throughout when its magnitudes need it.
Moments finish_moments(MomentLanes& lanes, const float* r, int64_t begin, int64_t end) {
  return lanes.needs_wide() ? moments_f32_wide(r, begin, end) : lanes.total();
}

/// Portable float32 moments of the residual values of [begin, end) (already updated), in
/// MomentLanes' order.
Moments moments_f32_portable(Source<float> src, int64_t begin, int64_t end) {
  MomentLanes lanes;
  float v[MomentLanes::kLanes];
  int64_t i = begin;
  for (; i + MomentLanes::kLanes <= end; i += MomentLanes::kLanes) {
    for (int l = 0; l < MomentLanes::kLanes; ++l) v[l] = src.value(i + l);
    lanes.add16(v);
  }
  const int rest = static_cast<int>(end - i);
  for (int l = 0; l < rest; ++l) v[l] = src.value(i + l);
  lanes.add_rest(v, rest);
  return finish_moments(lanes, src.residual, begin, end);
}

// ---- AVX2 paths (float32) -----------------------------------------------------------------------

/// How an AVX2 pass reads its values: with the fused update, from the residual, (no residual)
/// from the gradient with non-finite values read as zero, or as the update would leave them,
/// computed without writing (a read-only look before the pass that updates).
enum class Read { kUpdate, kResidual, kGrad, kPeek };

/// How far ahead of its reads a read-only float32 pass over a sample of blocks (SIDCo's
/// exceedances and sum of logs) asks for the lines it will read: each sampled block starts cold,
/// and with the hardware prefetcher alone these passes waited on memory (docs/benchmarks.md,
/// 2026-12-02, fourth). The scan's update asks for nothing: with the moments' sums it gained by
/// asking 256 elements ahead on the host of that day, and lost 0.1 to 0.25 of an add by it on the
/// AVX-512 host of 2026-12-04, on both paths; without sums no host gained (same page, 2026-12-04).
constexpr int64_t kReadAhead = 1024;

/// Asks for the lines of [j, j + count) of the array a read-only pass reads.
template <Read kRead>
inline void fetch_ahead(const Source<float>& src, int64_t j, int64_t count) {
  static_assert(kRead != Read::kUpdate, "read-only passes");
  for (int64_t at = j; at < j + count; at += 16)
    __builtin_prefetch((kRead == Read::kGrad ? src.grad : src.residual) + at, 0, 3);
}

/// The selection value of element j, read as `kRead` says (scalar; the AVX2 passes' last few
/// elements); counts a non-finite sum (or gradient) into `bad`.
template <Read kRead>
float value1(const Source<float>& src, int64_t j, int64_t& bad) {
  if constexpr (kRead == Read::kUpdate) {
    bool finite;
    src.update_element(j, finite);
    bad += !finite;
    return src.residual[j];
  } else if constexpr (kRead == Read::kPeek) {
    return src.peek(j);
  } else if constexpr (kRead == Read::kResidual) {
    return src.residual[j];
  } else {
    bad += !is_finite(src.grad[j]);
    return src.value(j);
  }
}

#if GS_HAVE_AVX2_PATHS

/// The selection values of elements j..j+7; counts non-finite sums (or gradients) into `bad` as
/// -1 lanes. kVelocity: whether an update has a velocity.
template <Read kRead, bool kVelocity>
GS_TARGET_AVX2 inline __m256 values8(const Source<float>& src, int64_t j, __m256i& bad) {
  if constexpr (kRead == Read::kResidual) {
    (void)bad;
    return _mm256_loadu_ps(src.residual + j);
  } else if constexpr (kRead == Read::kUpdate || kRead == Read::kPeek) {
    __m256i nonfinite;
    const __m256 v = update8_avx2<kVelocity, kRead == Read::kUpdate>(src, j, nonfinite);
    bad = _mm256_add_epi32(bad, nonfinite);
    return v;
  } else {
    const __m256 x = _mm256_loadu_ps(src.grad + j);
    const __m256i nonfinite = not_finite8_avx2(x);
    bad = _mm256_add_epi32(bad, nonfinite);
    return _mm256_andnot_ps(_mm256_castsi256_ps(nonfinite), x);
  }
}

GS_TARGET_AVX2 inline int64_t count_lanes(__m256i bad) {  // bad holds -1 per counted lane
  alignas(32) int32_t t[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), bad);
  int64_t c = 0;
  for (int32_t x : t) c -= x;
  return c;
}

/// An (unsigned) key threshold as the signed comparand of `key > below`: keys of finite values
/// are below 2^31, and a threshold above every such key matches nothing.
inline int below_key(uint32_t key) { return key > 0x7fffffffu ? 0x7fffffff : static_cast<int>(key) - 1; }

/// count_keys() with at most kFewKeys keys: every element of [lo, hi) is compared with every key,
/// 8 elements at a time and with no branch per element (the hit-by-hit path costs a branch and a
/// table look-up per element at or above the lowest key, which can be most of them);
/// at_least[j] gets the number of elements whose key is >= keys[j]. kKeys (>= m) comparisons per
/// element: count_few_keys_avx2 picks the fewest of 1, 2, 4 or 8.
constexpr int kFewKeys = 8;

template <int kKeys>
GS_TARGET_AVX2 void count_keys_avx2(const float* v, int64_t lo, int64_t hi, const uint32_t* keys, int m,
                                    int64_t* at_least) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  __m256i below[kKeys], acc[kKeys];
  for (int j = 0; j < kKeys; ++j) {
    below[j] = _mm256_set1_epi32(below_key(j < m ? keys[j] : kNoKey));  // unused keys match nothing
    acc[j] = _mm256_setzero_si256();
  }
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8) {  // at most kCpuBlock / 8 steps: the int32 lanes cannot overflow
    const __m256i key = _mm256_and_si256(_mm256_castps_si256(_mm256_loadu_ps(v + i)), magnitude);
    for (int j = 0; j < kKeys; ++j) acc[j] = _mm256_add_epi32(acc[j], _mm256_cmpgt_epi32(key, below[j]));
  }
  for (int j = 0; j < m; ++j) {
    int64_t c = count_lanes(acc[j]);
    for (int64_t t = i; t < hi; ++t) c += Num<float>::key(v[t]) >= keys[j];
    at_least[j] = c;
  }
}

void count_few_keys_avx2(const float* v, int64_t lo, int64_t hi, const uint32_t* keys, int m, int64_t* at_least) {
  GS_ASSERT(m <= kFewKeys);
  if (m <= 1) return count_keys_avx2<1>(v, lo, hi, keys, m, at_least);
  if (m <= 2) return count_keys_avx2<2>(v, lo, hi, keys, m, at_least);
  if (m <= 4) return count_keys_avx2<4>(v, lo, hi, keys, m, at_least);
  count_keys_avx2<kFewKeys>(v, lo, hi, keys, m, at_least);
}

/// The block's last elements after a vector body (fewer than 16, from `tail`, a multiple of 8 past
/// `begin`): read one by one (with the update), marked in `mask` when there is one, and added to
/// `lanes` (in float64, MomentLanes::add_rest) when there are any. Returns the marks (bit t: element
/// tail + t has key >= `key`) and the values in `rest`.
template <Read kRead>
uint32_t moments_tail(const Source<float>& src, int64_t begin, int64_t tail, int64_t end, uint32_t key, uint8_t* mask,
                      int64_t& nonfinite, MomentLanes* lanes, float* rest) {
  const int count = static_cast<int>(end - tail);
  uint32_t bits = 0;
  for (int t = 0; t < count; ++t) {
    rest[t] = value1<kRead>(src, tail + t, nonfinite);
    bits |= static_cast<uint32_t>(Num<float>::key(rest[t]) >= key) << t;
  }
  if (mask != nullptr) {
    for (int b = 0; b < (count + 7) / 8; ++b) mask[(tail - begin) / 8 + b] = static_cast<uint8_t>(bits >> (8 * b));
  }
  if (lanes != nullptr) lanes->add_rest(rest, count);
  return bits;
}

/// Adds 8 lanes' float32 run sums `x` to their float64 sums `to[0..8)`, and clears `x`.
GS_TARGET_AVX2 inline void end_run8_avx2(double* to, __m256& x) {
  _mm256_store_pd(to, _mm256_add_pd(_mm256_load_pd(to), _mm256_cvtps_pd(_mm256_castps256_ps128(x))));
  _mm256_store_pd(to + 4, _mm256_add_pd(_mm256_load_pd(to + 4), _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))));
  x = _mm256_setzero_ps();
}

/// Adds the run sums of 16 lanes (`s`, `a`, `q`: two vectors of 8 each) to `lanes`, and clears them.
GS_TARGET_AVX2 inline void end_run16_avx2(MomentLanes& lanes, __m256* s, __m256* a, __m256* q) {
  for (int h = 0; h < 2; ++h) {
    end_run8_avx2(lanes.sum + 8 * h, s[h]);
    end_run8_avx2(lanes.sum_abs + 8 * h, a[h]);
    end_run8_avx2(lanes.sum_sq + 8 * h, q[h]);
  }
}

/// The largest of a vector's lanes (none of them NaN).
GS_TARGET_AVX2 inline float max8_avx2(__m256 x) {
  alignas(32) float t[8];
  _mm256_store_ps(t, x);
  return *std::max_element(t, t + 8);
}

/// For each 8-bit mask, the lanes that are set, in order (then zeros): a permutation that packs
/// the selected lanes of a vector at its front.
struct PackTable {
  alignas(32) int32_t lanes[256][8];
  PackTable() {
    for (int mask = 0; mask < 256; ++mask) {
      int o = 0;
      for (int l = 0; l < 8; ++l)
        if ((mask >> l) & 1) lanes[mask][o++] = l;
      for (; o < 8; ++o) lanes[mask][o] = 0;
    }
  }
};

/// The one PackTable (built at its first use).
inline const PackTable& pack_table() {
  static const PackTable table;
  return table;
}

/// The last elements of a block after its vector rows (fewer than 16, from `tail`; `bits` and
/// `rest` as moments_tail returns them) onto a CandidateList, without a branch, as the rows.
inline void list_tail(uint32_t bits, const float* rest, int64_t tail, int64_t end, CandidateList& list) {
  for (int64_t t = 0; tail + t < end; ++t, bits >>= 1) {
    list.offset[list.size] = static_cast<uint32_t>(tail + t - list.origin);
    list.value[list.size] = rest[t];
    list.size += bits & 1;
  }
}

/// Lists the lanes of v (elements j..j+7) set in `hit` (CandidateList): PackTable's permutation
/// moves them to the front of a vector, and whole vectors are stored, without a branch.
GS_TARGET_AVX2 inline void list8_avx2(__m256 v, unsigned hit, int64_t j, const PackTable& pack, CandidateList& list) {
  const __m256i lanes = _mm256_load_si256(reinterpret_cast<const __m256i*>(pack.lanes[hit]));
  const __m256i at = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(j - list.origin)),
                                      _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(list.offset + list.size), _mm256_permutevar8x32_epi32(at, lanes));
  _mm256_storeu_ps(list.value + list.size, _mm256_permutevar8x32_ps(v, lanes));
  list.size += __builtin_popcount(hit);
}

/// A run's float32 sums of v, |v| and v * v over 16 lanes (two vectors of 8 each), and the
/// largest |v| over 8.
struct Run8x2 {
  __m256 s[2], a[2], q[2], mx;
};

/// One row of moments_f32_avx2 (elements j..j+15): with kMask marks their candidates in `mask`
/// (two bytes), with kList lists them (list8_avx2), with kSums adds them to the run.
template <Read kRead, bool kSums, bool kVelocity, bool kMask, bool kList>
GS_TARGET_AVX2 inline void take16_avx2(const Source<float>& src, int64_t j, __m256i below, uint8_t* mask,
                                       const PackTable& pack, CandidateList& list, __m256i& bad, Run8x2& run) {
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  for (int h = 0; h < 2; ++h) {
    const __m256 v = values8<kRead, kVelocity>(src, j + 8 * h, bad);
    if constexpr (kMask || kList) {
      const __m256i hit = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), magnitude), below);
      const auto bits = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(hit)));
      if constexpr (kMask) {
        mask[h] = static_cast<uint8_t>(bits);
      } else {
        list8_avx2(v, bits, j + 8 * h, pack, list);
      }
    }
    if constexpr (kSums) {
      const __m256 av = _mm256_and_ps(v, _mm256_castsi256_ps(magnitude));
      run.s[h] = _mm256_add_ps(run.s[h], v);
      run.a[h] = _mm256_add_ps(run.a[h], av);
      run.q[h] = _mm256_add_ps(run.q[h], _mm256_mul_ps(v, v));
      run.mx = _mm256_max_ps(av, run.mx);  // a NaN keeps mx, as MomentLanes does
    }
  }
}

/// moments() of a float32 block, 16 elements a row as two vectors of 8 lanes, in MomentLanes'
/// order to the bit. With a `mask` (room for (end - begin + 7) / 8 bytes), bit t of it is set
/// when element begin + t has key >= `key`: the block's candidates, marked while its values are
/// in registers, so that scan() lists them without reading the block again. Without kSums only
/// `nonfinite` is counted (the sums stay zero). The loop takes whole runs of MomentLanes::kRows
/// rows unrolled, from a local copy of the source, in a version for each case of velocity and
/// mask instead of a test per row: fewer instructions per row keep more of the rows' loads in
/// flight (docs/benchmarks.md, 2026-12-01, second).
template <Read kRead, bool kSums, bool kVelocity, bool kMask, bool kList>
GS_TARGET_AVX2 Moments moments_f32_avx2_loop(const Source<float>& source, int64_t begin, int64_t end, uint32_t key,
                                             uint8_t* mask, CandidateList* into) {
  const Source<float> src = source;  // the mask's and the list's stores cannot change it
  CandidateList list = kList ? *into : CandidateList{nullptr, nullptr, 0};  // in registers
  const PackTable& pack = pack_table();
  const __m256i below = _mm256_set1_epi32(below_key(key));
  const __m256 zero = _mm256_setzero_ps();
  MomentLanes lanes;
  Run8x2 run{{zero, zero}, {zero, zero}, {zero, zero}, zero};
  __m256i bad = _mm256_setzero_si256();
  auto at = [&](int64_t j) { return kMask ? mask + (j - begin) / 8 : nullptr; };  // row j's bytes of the mask
  constexpr int64_t kRun = 16 * MomentLanes::kRows;
  int64_t j = begin;
  for (; j + kRun <= end; j += kRun) {
#pragma GCC unroll 8
    for (int r = 0; r < MomentLanes::kRows; ++r)
      take16_avx2<kRead, kSums, kVelocity, kMask, kList>(src, j + 16 * r, below, at(j + 16 * r), pack, list, bad, run);
    if constexpr (kSums) end_run16_avx2(lanes, run.s, run.a, run.q);
  }
  if (j + 16 <= end) {  // a last, shorter run
    for (; j + 16 <= end; j += 16)
      take16_avx2<kRead, kSums, kVelocity, kMask, kList>(src, j, below, at(j), pack, list, bad, run);
    if constexpr (kSums) end_run16_avx2(lanes, run.s, run.a, run.q);
  }
  int64_t nonfinite = count_lanes(bad);
  Moments m;
  float rest[MomentLanes::kLanes];
  uint32_t bits;
  if constexpr (kSums) {
    lanes.max_abs = max8_avx2(run.mx);
    bits = moments_tail<kRead>(src, begin, j, end, key, mask, nonfinite, &lanes, rest);
    m = finish_moments(lanes, src.residual, begin, end);
  } else {
    bits = moments_tail<kRead>(src, begin, j, end, key, mask, nonfinite, nullptr, rest);
  }
  if constexpr (kList) {
    list_tail(bits, rest, j, end, list);
    into->size = list.size;
  }
  m.nonfinite = nonfinite;
  return m;
}

/// f(velocity, marks, listing), each a std::bool_constant: a pass's loop in its version for this
/// source (an update with a velocity or not) and its candidates (listed where there is a `list`,
/// else marked where there is a `mask`, or neither).
template <Read kRead, typename F>
Moments by_velocity_and_marks(const Source<float>& src, const uint8_t* mask, const CandidateList* list, F&& f) {
  auto marking = [&](auto velocity) {
    if (list != nullptr) return f(velocity, std::false_type{}, std::true_type{});
    return mask != nullptr ? f(velocity, std::true_type{}, std::false_type{})
                           : f(velocity, std::false_type{}, std::false_type{});
  };
  return kRead == Read::kUpdate && src.velocity != nullptr ? marking(std::true_type{}) : marking(std::false_type{});
}

/// moments_f32_avx2_loop in its version for this source and its candidates.
template <Read kRead, bool kSums = true>
Moments moments_f32_avx2(const Source<float>& src, int64_t begin, int64_t end, uint32_t key = kNoKey,
                         uint8_t* mask = nullptr, CandidateList* list = nullptr) {
  return by_velocity_and_marks<kRead>(src, mask, list, [&](auto velocity, auto marks, auto listing) {
    return moments_f32_avx2_loop<kRead, kSums, decltype(velocity)::value, decltype(marks)::value,
                                 decltype(listing)::value>(src, begin, end, key, mask, list);
  });
}

GS_AVX512_INTRINSICS_BEGIN

/// Adds 16 lanes' float32 run sums `x` to their float64 sums (`to`: lanes 0-7, 8-15), and clears `x`.
GS_TARGET_AVX512 inline void end_run16_avx512(__m512d* to, __m512& x) {
  to[0] = _mm512_add_pd(to[0], _mm512_cvtps_pd(_mm512_castps512_ps256(x)));
  to[1] = _mm512_add_pd(to[1], _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1))));
  x = _mm512_setzero_ps();
}

/// end_run16_avx512 for the three sums (v, |v|, v * v) of a run.
GS_TARGET_AVX512 inline void end_runs_avx512(__m512d* sum, __m512d* sum_abs, __m512d* sum_sq, __m512& s, __m512& a,
                                             __m512& q) {
  end_run16_avx512(sum, s);
  end_run16_avx512(sum_abs, a);
  end_run16_avx512(sum_sq, q);
}

/// The selection values of elements j..j+15, read as `kRead` says; counts the non-finite sums
/// (or gradients) into `nonfinite`.
template <Read kRead, bool kVelocity>
GS_TARGET_AVX512 inline __m512 values16_avx512(const Source<float>& src, int64_t j, int64_t& nonfinite) {
  if constexpr (kRead == Read::kUpdate) {
    __mmask16 bad;
    const __m512 v = update16_avx512<kVelocity>(src, j, bad);
    if (__builtin_expect(bad != 0, 0)) nonfinite += __builtin_popcount(bad);
    return v;
  } else if constexpr (kRead == Read::kResidual) {
    return _mm512_loadu_ps(src.residual + j);
  } else {
    const __m512 x = _mm512_loadu_ps(src.grad + j);
    const __mmask16 bad = not_finite16_avx512(x);
    nonfinite += __builtin_popcount(bad);
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~bad), x);
  }
}

/// A run's float32 sums of v, |v| and v * v, and the largest |v|, over 16 lanes.
struct Run16 {
  __m512 s, a, q, mx;
};

/// Lists the lanes of v (elements j..j+15) set in `hit` (CandidateList): the lanes set are packed
/// to the front of a vector (a compress in registers: from memory it is slow on some CPUs), and
/// whole vectors are stored, without a branch.
GS_TARGET_AVX512 inline void list16_avx512(__m512 v, __mmask16 hit, int64_t j, CandidateList& list) {
  const __m512i at = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(j - list.origin)),
                                      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  _mm512_storeu_si512(list.offset + list.size, _mm512_maskz_compress_epi32(hit, at));
  _mm512_storeu_ps(list.value + list.size, _mm512_maskz_compress_ps(hit, v));
  list.size += __builtin_popcount(hit);
}

/// One row of moments_f32_avx512 (elements j..j+15): with kMask marks v's candidates in `mask`
/// (two bytes), with a list (kList) lists them, with kSums adds v to the run.
template <bool kSums, bool kMask, bool kList>
GS_TARGET_AVX512 inline void take16_avx512(__m512 v, __m512i below, uint8_t* mask, int64_t j, CandidateList& list,
                                           Run16& run) {
  const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
  if constexpr (kMask || kList) {
    const __mmask16 hit = _mm512_cmpgt_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), magnitude), below);
    if constexpr (kMask) {
      const auto bits = static_cast<uint16_t>(hit);
      std::memcpy(mask, &bits, sizeof(bits));
    } else {
      list16_avx512(v, hit, j, list);
    }
  }
  if constexpr (kSums) {
    const __m512 av = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), magnitude));
    run.s = _mm512_add_ps(run.s, v);
    run.a = _mm512_add_ps(run.a, av);
    run.q = _mm512_add_ps(run.q, _mm512_mul_ps(v, v));
    run.mx = _mm512_max_ps(av, run.mx);  // a NaN keeps mx, as MomentLanes does
  }
}

/// moments_f32_avx2 in 16 lanes of 512 bits, in MomentLanes' order to the bit: the non-finite
/// count and the candidates (marked in the mask, or with kList listed in `into`), with kSums the
/// sums too. Without them this is the whole of Top-k's, SAGE's, MiCRO's and ExDyna's scan. Built
/// as moments_f32_avx2_loop is.
template <Read kRead, bool kSums, bool kVelocity, bool kMask, bool kList>
GS_TARGET_AVX512 Moments moments_f32_avx512_loop(const Source<float>& source, int64_t begin, int64_t end, uint32_t key,
                                                 uint8_t* mask, CandidateList* into) {
  const Source<float> src = source;  // the mask's and the list's stores cannot change it
  CandidateList list = kList ? *into : CandidateList{nullptr, nullptr, 0};  // in registers
  const __m512i below = _mm512_set1_epi32(below_key(key));
  const __m512d zero_d = _mm512_setzero_pd();
  const __m512 zero = _mm512_setzero_ps();
  Run16 run{zero, zero, zero, zero};
  __m512d sum[2] = {zero_d, zero_d}, sum_abs[2] = {zero_d, zero_d}, sum_sq[2] = {zero_d, zero_d};
  int64_t nonfinite = 0;
  auto row = [&](int64_t j) GS_TARGET_AVX512 {
    take16_avx512<kSums, kMask, kList>(values16_avx512<kRead, kVelocity>(src, j, nonfinite), below,
                                       kMask ? mask + (j - begin) / 8 : nullptr, j, list, run);
  };
  constexpr int64_t kRun = 16 * MomentLanes::kRows;
  int64_t j = begin;
  for (; j + kRun <= end; j += kRun) {
#pragma GCC unroll 8
    for (int r = 0; r < MomentLanes::kRows; ++r) row(j + 16 * r);
    if constexpr (kSums) end_runs_avx512(sum, sum_abs, sum_sq, run.s, run.a, run.q);
  }
  if (j + 16 <= end) {  // a last, shorter run
    for (; j + 16 <= end; j += 16) row(j);
    if constexpr (kSums) end_runs_avx512(sum, sum_abs, sum_sq, run.s, run.a, run.q);
  }
  Moments m;
  float rest[MomentLanes::kLanes];
  uint32_t bits;
  if constexpr (kSums) {
    MomentLanes lanes;
    for (int h = 0; h < 2; ++h) {
      _mm512_store_pd(lanes.sum + 8 * h, sum[h]);
      _mm512_store_pd(lanes.sum_abs + 8 * h, sum_abs[h]);
      _mm512_store_pd(lanes.sum_sq + 8 * h, sum_sq[h]);
    }
    lanes.max_abs = _mm512_reduce_max_ps(run.mx);
    bits = moments_tail<kRead>(src, begin, j, end, key, mask, nonfinite, &lanes, rest);
    m = finish_moments(lanes, src.residual, begin, end);
  } else {
    bits = moments_tail<kRead>(src, begin, j, end, key, mask, nonfinite, nullptr, rest);
  }
  if constexpr (kList) {
    list_tail(bits, rest, j, end, list);
    into->size = list.size;
  }
  m.nonfinite = nonfinite;
  return m;
}

/// moments_f32_avx512_loop in its version for this source and its candidates.
template <Read kRead, bool kSums>
Moments moments_f32_avx512(const Source<float>& src, int64_t begin, int64_t end, uint32_t key, uint8_t* mask,
                           CandidateList* list) {
  return by_velocity_and_marks<kRead>(src, mask, list, [&](auto velocity, auto marks, auto listing) {
    return moments_f32_avx512_loop<kRead, kSums, decltype(velocity)::value, decltype(marks)::value,
                                   decltype(listing)::value>(src, begin, end, key, mask, list);
  });
}

GS_AVX512_INTRINSICS_END

/// Adds |x| * scale of buffer[0, n / 4 * 4) to four float64 lanes (buffer[t] to lane t % 4):
/// acc[0] the sums, acc[1] the sums of squares, acc[2] the minima; moves the last n % 4 values to
/// the front of the buffer and returns how many it added.
GS_TARGET_AVX2 inline int add_exceedances4(float* buffer, int n, double scale, __m256d* acc) {
  const __m256d abs_mask = _mm256_castsi256_pd(_mm256_set1_epi64x(0x7fffffffffffffffLL));
  const __m256d by = _mm256_set1_pd(scale);
  const int added = n & ~3;
  for (int t = 0; t < added; t += 4) {
    const __m256d y = _mm256_mul_pd(_mm256_and_pd(_mm256_cvtps_pd(_mm_loadu_ps(buffer + t)), abs_mask), by);
    acc[0] = _mm256_add_pd(acc[0], y);
    acc[1] = _mm256_add_pd(acc[1], _mm256_mul_pd(y, y));
    acc[2] = _mm256_min_pd(y, acc[2]);  // y < acc ? y : acc, as std::min(acc, y) (a NaN keeps acc)
  }
  for (int t = added; t < n; ++t) buffer[t - added] = buffer[t];
  return added;
}

/// exceedance() of a float32 block: vector comparisons find the elements at or above the key and
/// pack them into a buffer, whose values are then added four at a time in ExceedanceLanes' order
/// (no branch per element: a quarter of the elements can be hits; and no chain of one addition
/// after another: the four lanes add at once).
template <Read kRead>
GS_TARGET_AVX2 Exceedance exceedance_f32_avx2(const Source<float>& src, int64_t begin, int64_t end, uint32_t key,
                                              double scale) {
  static_assert(kRead != Read::kUpdate, "exceedance passes are read-only");
  ExceedanceLanes lanes;
  if (key > 0x7fffffffu) return lanes.total();
  const PackTable& pack = pack_table();
  constexpr int kBuffer = 1024;
  float buffer[kBuffer + 8];
  int buffered = 0;
  __m256d acc[3] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_set1_pd(lanes.min)};
  int64_t taken = 0;  // by the vector lanes: a multiple of 4, so buffer[t] goes to lane t % 4
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256i below = _mm256_set1_epi32(below_key(key));
  __m256i unused = _mm256_setzero_si256();
  int64_t j = begin;
  for (; j + 8 <= end; j += 8) {
    fetch_ahead<kRead>(src, j + kReadAhead, 8);
    const __m256 v = values8<kRead, false>(src, j, unused);
    const __m256i hit = _mm256_cmpgt_epi32(_mm256_and_si256(_mm256_castps_si256(v), magnitude), below);
    const int bits = _mm256_movemask_ps(_mm256_castsi256_ps(hit));
    if (bits == 0) continue;
    const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(pack.lanes[bits]));
    _mm256_storeu_ps(buffer + buffered, _mm256_permutevar8x32_ps(v, order));
    buffered += __builtin_popcount(static_cast<unsigned>(bits));
    if (buffered > kBuffer - 8) {
      taken += add_exceedances4(buffer, buffered, scale, acc);
      buffered &= 3;
    }
  }
  taken += add_exceedances4(buffer, buffered, scale, acc);
  buffered &= 3;
  _mm256_storeu_pd(lanes.sum, acc[0]);
  _mm256_storeu_pd(lanes.sum_sq, acc[1]);
  alignas(32) double m[4];
  _mm256_store_pd(m, acc[2]);
  lanes.min = std::min(std::min(m[0], m[1]), std::min(m[2], m[3]));
  lanes.count = taken;
  for (int t = 0; t < buffered; ++t) lanes.take(std::fabs(static_cast<double>(buffer[t])) * scale);
  int64_t ignored = 0;
  for (; j < end; ++j) {
    const float v = value1<kRead>(src, j, ignored);
    if (Num<float>::key(v) >= key) lanes.take(std::fabs(static_cast<double>(v)) * scale);
  }
  return lanes.total();
}

/// sample_keys() of a float32 block [begin, end): the keys that reach `key`, packed into `out`
/// (room for end - begin + 8) eight values at a time, in index order; returns how many.
template <Read kRead, bool kVelocity>
GS_TARGET_AVX2 int64_t block_keys_avx2(const Source<float>& src, int64_t begin, int64_t end, uint32_t key,
                                       uint32_t* out) {
  const PackTable& pack = pack_table();
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256i below = _mm256_set1_epi32(below_key(key));
  __m256i unused = _mm256_setzero_si256();
  int64_t found = 0, j = begin;
  for (; j + 8 <= end; j += 8) {
    const __m256i k = _mm256_and_si256(_mm256_castps_si256(values8<kRead, kVelocity>(src, j, unused)), magnitude);
    const int bits = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(k, below)));
    if (bits == 0) continue;  // most rows: the keys sought are a few in a hundred
    const __m256i order = _mm256_load_si256(reinterpret_cast<const __m256i*>(pack.lanes[bits]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + found), _mm256_permutevar8x32_epi32(k, order));
    found += __builtin_popcount(static_cast<unsigned>(bits));
  }
  int64_t ignored = 0;
  for (; j < end; ++j) {
    const uint32_t k = Num<float>::key(value1<kRead>(src, j, ignored));
    if (k >= key) out[found++] = k;
  }
  return found;
}

#else   // only named by code that never runs without AVX2 paths
template <Read kRead, bool kSums = true>
Moments moments_f32_avx2(const Source<float>& src, int64_t begin, int64_t end, uint32_t key = kNoKey,
                         uint8_t* mask = nullptr, CandidateList* list = nullptr);
template <Read kRead, bool kSums>
Moments moments_f32_avx512(const Source<float>& src, int64_t begin, int64_t end, uint32_t key, uint8_t* mask,
                           CandidateList* list);
template <Read kRead>
Exceedance exceedance_f32_avx2(const Source<float>& src, int64_t begin, int64_t end, uint32_t key, double scale);
template <Read kRead, bool kVelocity>
int64_t block_keys_avx2(const Source<float>& src, int64_t begin, int64_t end, uint32_t key, uint32_t* out);
#endif  // GS_HAVE_AVX2_PATHS

// ---- 16-bit storage (float16, bfloat16) ---------------------------------------------------------

#if GS_HAVE_AVX2_PATHS
// Where use_avx2(): every x86 CPU with AVX2 has F16C, which came before it (Ivy Bridge, Piledriver).
#define GS_TARGET_AVX2_F16C __attribute__((target("avx2,f16c")))

/// Eight 16-bit values (their bits) widened to float32: float16 by F16C's conversion (exact, as
/// half_to_float, but for a NaN's payload, which no result keeps: a non-finite sum is never
/// stored), bfloat16 by a shift.
template <typename T>
GS_TARGET_AVX2_F16C inline __m256 widen8_avx2(__m128i bits) {
  if constexpr (std::is_same_v<T, Half>) {
    return _mm256_cvtph_ps(bits);
  } else {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
  }
}

template <typename T>
GS_TARGET_AVX2_F16C inline __m128i load8(const T* v) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
}

/// Eight float32 values rounded to T to nearest even, as Num<T>::from_float rounds every finite
/// value; a non-finite one stays non-finite (a bfloat16 NaN may come out as an infinity), which
/// is all the update asks of it: it stores no such sum.
template <typename T>
GS_TARGET_AVX2_F16C inline __m128i narrow8_avx2(__m256 x) {
  if constexpr (std::is_same_v<T, Half>) {
    return _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  } else {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), odd), 16);
    // 32 -> 16 bits: packus works within 128-bit halves, so the halves are put in order after.
    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0x08));
  }
}

/// update_16 of the elements [begin, end), end - begin a multiple of 8, with momentum correction
/// where the source has a velocity (numeric.h momentum_value, in the same float32 operations).
template <typename T>
GS_TARGET_AVX2_F16C int64_t update_16_avx2(const Source<T>& src, int64_t begin, int64_t end) {
  const __m128i magnitude = _mm_set1_epi16(0x7fff), inf = _mm_set1_epi16(static_cast<int16_t>(Num<T>::kInfKey));
  const __m256 factor = _mm256_set1_ps(src.momentum);
  int64_t nonfinite = 0;
  for (int64_t i = begin; i < end; i += 8) {
    T* r = src.residual + i;
    const __m128i old = load8(r);
    __m256 addend = widen8_avx2<T>(load8(src.grad + i));
    if (src.velocity != nullptr) {  // the new velocity, stored where finite, is what the residual takes
      T* u = src.velocity + i;
      const __m128i velocity = load8(u);
      const __m128i emptied =
          src.masking ? _mm_cmpeq_epi16(_mm_and_si128(old, magnitude), _mm_setzero_si128()) : _mm_setzero_si128();
      const __m256 kept =
          _mm256_andnot_ps(_mm256_castsi256_ps(_mm256_cvtepi16_epi32(emptied)), widen8_avx2<T>(velocity));
      const __m128i a = narrow8_avx2<T>(_mm256_add_ps(_mm256_mul_ps(factor, kept), addend));
      const __m128i finite = _mm_cmpgt_epi16(inf, _mm_and_si128(a, magnitude));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(u), _mm_blendv_epi8(velocity, a, finite));
      addend = widen8_avx2<T>(a);
    }
    const __m128i sum = narrow8_avx2<T>(_mm256_add_ps(widen8_avx2<T>(old), addend));
    const __m128i finite = _mm_cmpgt_epi16(inf, _mm_and_si128(sum, magnitude));  // keys compare as signed
    _mm_storeu_si128(reinterpret_cast<__m128i*>(r), _mm_blendv_epi8(old, sum, finite));
    nonfinite += 8 - _mm_popcnt_u32(static_cast<unsigned>(_mm_movemask_epi8(finite))) / 2;
  }
  return nonfinite;
}

/// widen of [0, n), n a multiple of 8.
template <typename T>
GS_TARGET_AVX2_F16C void widen_avx2(const T* v, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 8) _mm256_storeu_ps(out + i, widen8_avx2<T>(load8(v + i)));
}

#endif  // GS_HAVE_AVX2_PATHS

/// A 16-bit type's values widened to float32 (exact).
template <typename T>
void widen(const T* v, int64_t n, float* out) {
  int64_t i = 0;
#if GS_HAVE_AVX2_PATHS
  if (use_avx2()) widen_avx2(v, i = n / 8 * 8, out);
#endif
  for (; i < n; ++i) out[i] = Num<T>::to_float(v[i]);
}

/// The error-feedback update of the elements [begin, end) one by one (with momentum correction
/// where the source has a velocity): returns the count of non-finite sums.
template <typename T>
int64_t update_elements(const Source<T>& src, int64_t begin, int64_t end) {
  int64_t nonfinite = 0;
  for (int64_t i = begin; i < end; ++i) {
    bool finite;
    src.update_element(i, finite);
    nonfinite += !finite;
  }
  return nonfinite;
}

}  // namespace

template <typename T>
int64_t update_16(const Source<T>& src, int64_t begin, int64_t end) {
  int64_t nonfinite = 0, i = begin;
#if GS_HAVE_AVX2_PATHS
  if (use_avx2()) nonfinite = update_16_avx2(src, begin, i = begin + (end - begin) / 8 * 8);
#endif
  return nonfinite + update_elements(src, i, end);
}
template int64_t update_16<Half>(const Source<Half>&, int64_t, int64_t);
template int64_t update_16<BFloat16>(const Source<BFloat16>&, int64_t, int64_t);

namespace {

/// Runs the AVX2 version of a float32 pass when it applies: f(std::integral_constant<Read, ...>)
/// with the source's read mode; returns false (nothing run) otherwise. Read-only passes
/// (kUpdate false) have checked that the source does not ask for the update.
template <bool kUpdate = false, typename T, typename F>
bool avx2_f32(Source<T> src, F&& f) {
#if GS_HAVE_AVX2_PATHS
  if constexpr (std::is_same_v<T, float>) {
    if (!use_avx2()) return false;
    if (src.residual != nullptr && src.update) {
      if constexpr (!kUpdate) {
        return false;
      } else {
        f(std::integral_constant<Read, Read::kUpdate>{});
      }
    } else if (src.residual != nullptr) {
      f(std::integral_constant<Read, Read::kResidual>{});
    } else {
      f(std::integral_constant<Read, Read::kGrad>{});
    }
    return true;
  }
#endif
  (void)src;
  (void)f;
  return false;
}

/// moments() of the block [begin, end) (with `src.update`: fused with the update of the block);
/// without `sums` only their `nonfinite`. With a `mask` (float32 on the AVX2 paths only, where
/// it returns true in `marked`), the block's candidates at `key` too (moments_f32_avx2); with a
/// `list` they are listed there instead (CandidateList; on the same paths, so also where `marked`).
template <typename T>
Moments block_moments(Source<T> src, int64_t begin, int64_t end, bool sums = true, uint32_t key = kNoKey,
                      uint8_t* mask = nullptr, bool* marked = nullptr, CandidateList* list = nullptr) {
  Moments m;
  // AVX2 and MomentLanes for a residual only: without one, the sums stay sequential (below).
  if (src.residual != nullptr && avx2_f32<true>(src, [&](auto read) {
        constexpr Read kRead = decltype(read)::value;
        if (use_avx512())
          m = sums ? moments_f32_avx512<kRead, true>(as_f32(src), begin, end, key, mask, list)
                   : moments_f32_avx512<kRead, false>(as_f32(src), begin, end, key, mask, list);
        else
          m = sums ? moments_f32_avx2<kRead>(as_f32(src), begin, end, key, mask, list)
                   : moments_f32_avx2<kRead, false>(as_f32(src), begin, end, key, mask, list);
      })) {
    if (marked != nullptr) *marked = true;
    return m;
  }
  if constexpr (!std::is_same_v<T, float>) {  // 16-bit values with a residual
    if (src.residual != nullptr) {
      if (src.update) m.nonfinite = update_16(src, begin, end);
      if (!sums) return m;
      // widened to float32 (exact) and summed as a float32 block is, in MomentLanes' order
      thread_local std::vector<float> wide(static_cast<size_t>(kCpuBlock));
      widen(src.residual + begin, end - begin, wide.data());
      const int64_t nonfinite = m.nonfinite;
      m = block_moments(Source<float>{wide.data(), nullptr, false}, 0, end - begin);
      m.nonfinite = nonfinite;
      return m;
    }
  }
  if (src.update && src.residual != nullptr) {
    m.nonfinite = update_elements(src, begin, end);
  } else if (src.residual == nullptr) {
    for (int64_t i = begin; i < end; ++i) m.nonfinite += !is_finite(src.grad[i]);
  }
  if (!sums) return m;
  if constexpr (std::is_same_v<T, float>) {
    if (src.residual != nullptr) {
      const int64_t nonfinite = m.nonfinite;
      m = moments_f32_portable(src, begin, end);
      m.nonfinite = nonfinite;
      return m;
    }
  }
  double sum_abs = 0.0, sum = 0.0, sum_sq = 0.0, max_abs = 0.0;
#pragma omp simd reduction(+ : sum_abs, sum, sum_sq) reduction(max : max_abs)
  for (int64_t i = begin; i < end; ++i) {
    const double v = Num<T>::to_float(src.value(i));
    const double a = std::fabs(v);
    sum_abs += a;
    sum += v;
    sum_sq += v * v;
    max_abs = std::max(max_abs, a);
  }
  m.sum_abs = sum_abs;
  m.sum = sum;
  m.sum_sq = sum_sq;
  m.max_abs = max_abs;
  return m;
}

}  // namespace

int64_t mark_block_f32(const Source<float>& src, int64_t begin, int64_t end, uint32_t key, uint8_t* mask,
                       CandidateList* list) {
  GS_ASSERT(use_avx2());
  bool marked = false;
  const Moments m = block_moments(src, begin, end, /*sums=*/false, key, mask, &marked, list);
  GS_ASSERT(marked);
  return m.nonfinite;
}

namespace {

/// The moments of a pass made in blocks: the blocks' figures added in block order.
Moments combine_moments(const std::vector<Moments>& blocks) {
  Moments total;
  for (const Moments& m : blocks) {
    total.sum_abs += m.sum_abs;
    total.sum += m.sum;
    total.sum_sq += m.sum_sq;
    total.max_abs = std::max(total.max_abs, m.max_abs);
    total.nonfinite += m.nonfinite;
  }
  return total;
}

/// One worker thread's candidates in scan(): its blocks' positions and values in block order.
/// Kept from call to call (per calling thread), so steady steps allocate nothing.
struct ScanList {
  std::vector<int64_t> index;  ///< the first `size` entries are candidates, the rest room
  std::vector<float> value;
  int64_t size = 0;
  int64_t above = 0;  ///< candidates of its blocks, listed or not
  int64_t first_block = -1, blocks = 0;
  int writes = 2;  ///< list_marked's writes without a branch, from the last block's candidates
  void clear() { size = above = blocks = 0, first_block = -1, writes = 2; }
  /// Room for m more entries after the listed ones.
  void room(int64_t m) {
    if (size + m > static_cast<int64_t>(index.size())) {
      index.resize(static_cast<size_t>(std::max<int64_t>(size + m, 2 * static_cast<int64_t>(index.size()))));
      value.resize(index.size());
    }
  }
};

}  // namespace

template <typename T>
Moments moments(Source<T> src, int64_t n) {
  return combine_moments(
      per_block<Moments>(n, [&](int64_t begin, int64_t end) { return block_moments(src, begin, end); }));
}

template <typename T>
Moments scan(Source<T> src, int64_t n, Range range, uint32_t key, int64_t capacity, bool sums, int64_t& above,
             HostBuffer<int64_t>& index, HostBuffer<float>& value, uint32_t zero_key) {
  GS_CHECK(n >= 0, ValueError, "scan: n must be >= 0, got ", n);
  check_range(range, n, "scan");
  GS_ASSERT(zero_key == kNoKey || src.residual != nullptr);
  const int64_t nblocks = num_blocks(n);
  const int threads = cpu_threads();
  thread_local std::vector<ScanList> per_thread;  // the calling thread's; workers use it by reference
  std::vector<ScanList>& lists = per_thread;
  if (static_cast<int>(lists.size()) < threads) lists.resize(static_cast<size_t>(threads));
  for (ScanList& list : lists) list.clear();
  std::vector<Moments> moments(static_cast<size_t>(nblocks));
  std::atomic<int64_t> stored{0};  // candidates found by the finished blocks
  Source<T> read = src;            // the block's second look, from cache, sees the updated values
  read.update = false;
  // schedule(static): each thread takes one contiguous run of blocks, in ascending order, so the
  // threads' lists joined in the order of their first blocks list the candidates in index order.
  parallel_blocks(nblocks, threads, [&](int64_t b, int thread) {
    const int64_t begin = b * kCpuBlock, end = std::min(n, begin + kCpuBlock);
    ScanList& p = lists[static_cast<size_t>(thread)];
    if (p.blocks++ == 0) p.first_block = b;
    const int64_t lo = std::clamp(range.begin, begin, end), hi = std::clamp(range.end, begin, end);
    // A block lists its candidates while the blocks finished before it have found no more than
    // the capacity, so at most the capacity and one block per thread are ever listed.
    const bool listing = capacity < 0 || stored.load(std::memory_order_relaxed) <= capacity;
    int64_t found = 0;
    if (listing) p.room(hi - lo + 16);
    uint8_t mask[kCpuBlock / 8 + 8] = {};  // the block's candidates, where the pass marks them
    bool marked = false;
    // a block inside the range is listed by the pass itself (CandidateList), its offsets then
    // made positions
    const bool whole = listing && lo == begin && hi == end;
    thread_local std::vector<uint32_t> offsets(static_cast<size_t>(kCpuBlock + 16));
    CandidateList list{offsets.data(), p.value.data() + p.size, begin};
    moments[b] = block_moments(src, begin, end, sums, key, mask, &marked, whole ? &list : nullptr);
    if constexpr (std::is_same_v<T, float>) {  // marked: on the AVX paths, the candidates listed or in the mask
      if (marked) {
        if (listing) {
          if (whole) {
            found = list.size;
            int64_t* index = p.index.data() + p.size;
            for (int64_t j = 0; j < found; ++j) index[j] = begin + offsets[static_cast<size_t>(j)];
          } else {
            found = list_marked(src.residual, mask, begin, lo, hi, p.index.data() + p.size, p.value.data() + p.size,
                                p.writes);
          }
          if (zero_key != kNoKey) {
            // Each listed one written again, from cache: zero, or itself by a mask of its bits
            // (whether it is zeroed is as good as random, and a branch on it mispredicts).
            for (int64_t j = p.size; j < p.size + found; ++j) {
              const uint32_t bits = float_bits(p.value[static_cast<size_t>(j)]);
              const uint32_t keep = 0u - static_cast<uint32_t>((bits & 0x7fffffffu) < zero_key);
              src.residual[p.index[static_cast<size_t>(j)]] = bits_float(bits & keep);
            }
          }
          p.size += found;
          p.writes = unmarked_writes(found, hi - lo);
        } else {
          found = count_marked(mask, begin, lo, hi);
        }
        p.above += found;
        stored.fetch_add(found, std::memory_order_relaxed);
        return;
      }
    }
    auto hit = [&](int64_t i) {  // elsewhere a second look at the block, from cache
      const T v = read.value(i);
      ++found;
      if (listing) {
        p.index[static_cast<size_t>(p.size)] = i;
        p.value[static_cast<size_t>(p.size++)] = Num<T>::to_float(v);
        if (Num<T>::key(v) >= zero_key) src.residual[i] = Num<T>::zero();  // (no key reaches kNoKey)
      }
    };
    int64_t from = lo;  // where the look element by element starts
#if GS_HAVE_AVX2_PATHS
    if constexpr (sizeof(T) == 2) {  // 16-bit values: their keys compared 32 at a time
      if (use_avx2() && src.residual != nullptr) {
        scan_keys16_avx2(reinterpret_cast<const uint16_t*>(src.residual), lo, hi, key, hit);
        from = hi;
      }
    }
#endif
    for (int64_t i = from; i < hi; ++i)
      if (Num<T>::key(read.value(i)) >= key) hit(i);
    p.above += found;
    stored.fetch_add(found, std::memory_order_relaxed);
  });
  std::vector<const ScanList*> order;  // the threads that took blocks, by their first block
  above = 0;
  for (const ScanList& list : lists) {
    if (list.blocks == 0) continue;
    order.push_back(&list);
    above += list.above;
  }
  std::sort(order.begin(), order.end(),
            [](const ScanList* x, const ScanList* y) { return x->first_block < y->first_block; });
  for (size_t t = 0; t + 1 < order.size(); ++t)
    GS_CHECK(order[t]->first_block + order[t]->blocks == order[t + 1]->first_block, std::logic_error,
             "scan: the threads' blocks are not contiguous runs (an OpenMP runtime without schedule(static)'s "
             "order); run with GRADSPARSE_NUM_THREADS=1");
  index.clear();
  value.clear();
  if (capacity >= 0 && above > capacity) {  // not listed after all: what the blocks zeroed is written back
    if (zero_key != kNoKey) {
      parallel_blocks(static_cast<int64_t>(order.size()), [&](int64_t t) {
        const ScanList& list = *order[static_cast<size_t>(t)];
        for (int64_t j = 0; j < list.size; ++j) {
          const T v = Num<T>::from_float(list.value[static_cast<size_t>(j)]);
          if (Num<T>::key(v) >= zero_key) src.residual[list.index[static_cast<size_t>(j)]] = v;
        }
      });
    }
  } else {
    std::vector<int64_t> at(order.size() + 1, 0);  // where each thread's candidates go
    for (size_t t = 0; t < order.size(); ++t) at[t + 1] = at[t] + order[t]->size;
    index.resize(static_cast<size_t>(above));
    value.resize(static_cast<size_t>(above));
    parallel_blocks(static_cast<int64_t>(order.size()), [&](int64_t t) {
      const ScanList& list = *order[static_cast<size_t>(t)];
      std::copy_n(list.index.begin(), list.size, index.begin() + at[t]);
      std::copy_n(list.value.begin(), list.size, value.begin() + at[t]);
    });
  }
  return combine_moments(moments);
}

template <typename T>
void count_keys(Source<T> src, int64_t n, Range range, const uint32_t* keys, int m, int64_t* counts) {
  check_read_only(src.update, "count_keys");
  GS_CHECK(m >= 0 && std::is_sorted(keys, keys + m), ValueError, "count_keys: keys must be ascending");
  check_range(range, n, "count_keys");
  std::fill(counts, counts + m, 0);
  if (m == 0) return;
  const KeyBins key_bins(keys, m);
  const auto blocks = per_block<std::vector<int64_t>>(n, [&](int64_t begin, int64_t end) {
    const KeyBins::Lookup table = key_bins.lookup();       // a local copy (KeyBins::Lookup)
    std::vector<int64_t> bins(static_cast<size_t>(m), 0);  // bins[j]: keys in [keys[j], keys[j+1])
    const int64_t lo = std::max(begin, range.begin), hi = std::min(end, range.end);
    if (lo >= hi) return bins;
#if GS_HAVE_AVX2_PATHS
    if constexpr (std::is_same_v<T, float>) {
      if (use_avx2() && src.residual != nullptr) {
        const float* v = src.residual;
        if (m <= kFewKeys) {
          int64_t at_least[kFewKeys];
          count_few_keys_avx2(v, lo, hi, keys, m, at_least);
          for (int j = 0; j < m; ++j) bins[static_cast<size_t>(j)] = at_least[j] - (j + 1 < m ? at_least[j + 1] : 0);
          return bins;
        }
        scan_keys_avx2(v, lo, hi, keys[0],
                       [&](int64_t i) { ++bins[static_cast<size_t>(table.bin(Num<float>::key(v[i])))]; });
        return bins;
      }
    } else if constexpr (sizeof(T) == 2) {
      if (use_avx2() && src.residual != nullptr) {
        const T* v = src.residual;
        scan_keys16_avx2(reinterpret_cast<const uint16_t*>(v), lo, hi, keys[0],
                         [&](int64_t i) { ++bins[static_cast<size_t>(table.bin(Num<T>::key(v[i])))]; });
        return bins;
      }
    }
#endif
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t key = Num<T>::key(src.value(i));
      if (key < keys[0]) continue;  // most elements: one comparison
      ++bins[static_cast<size_t>(table.bin(key))];
    }
    return bins;
  });
  for (const auto& bins : blocks)
    for (int j = 0; j < m; ++j) counts[j] += bins[static_cast<size_t>(j)];
  for (int j = m - 2; j >= 0; --j) counts[j] += counts[j + 1];  // at least keys[j]
}

template <typename T>
Exceedance exceedance(Source<T> src, int64_t n, uint32_t key, double scale, BlockSample sample) {
  check_read_only(src.update, "exceedance");
  const auto blocks = per_block<Exceedance>(n, sample, [&](int64_t begin, int64_t end) {
    Exceedance e;
    if (avx2_f32(src, [&](auto read) {
          e = exceedance_f32_avx2<decltype(read)::value>(as_f32(src), begin, end, key, scale);
        }))
      return e;
    ExceedanceLanes lanes;
    for (int64_t i = begin; i < end; ++i) {
      const T v = src.value(i);
      if (Num<T>::key(v) >= key) lanes.take(std::fabs(static_cast<double>(Num<T>::to_float(v))) * scale);
    }
    return lanes.total();
  });
  return Exceedance::combine(blocks);
}

template <typename T>
void sample_keys(Source<T> src, int64_t n, uint32_t key, BlockSample sample, std::vector<uint32_t>& keys) {
  const bool peek = src.update && src.residual != nullptr;
  const auto blocks = per_block<HostBuffer<uint32_t>>(n, sample, [&](int64_t begin, int64_t end) {
    HostBuffer<uint32_t> out(static_cast<size_t>(end - begin + 8));  // not zeroed: few are written
    int64_t found = 0;
    if (!avx2_f32<true>(src, [&](auto read) {
          constexpr Read kRead = decltype(read)::value == Read::kUpdate ? Read::kPeek : decltype(read)::value;
          const Source<float> f = as_f32(src);
          found = kRead == Read::kPeek && f.velocity != nullptr
                      ? block_keys_avx2<kRead, true>(f, begin, end, key, out.data())
                      : block_keys_avx2<kRead, false>(f, begin, end, key, out.data());
        })) {
      for (int64_t i = begin; i < end; ++i) {
        const uint32_t k = Num<T>::key(peek ? src.peek(i) : src.value(i));
        if (k >= key) out[static_cast<size_t>(found++)] = k;
      }
    }
    out.resize(static_cast<size_t>(found));
    return out;
  });
  keys.clear();
  for (const auto& part : blocks) keys.insert(keys.end(), part.begin(), part.end());
}

namespace {

// log_sum()'s running products: kLogLanes independent products (so that they vectorise), each
// brought back into [1, 2) after every kLogRounds factors with its binary exponent counted apart.
constexpr int64_t kLogLanes = 8, kLogRounds = 8, kLogGroup = kLogLanes * kLogRounds;
constexpr uint64_t kMantissa = (uint64_t{1} << 52) - 1, kOne = uint64_t{1023} << 52;

/// The products over [i, end) in whole groups of kLogGroup factors y(j), i advanced past them.
/// False (the products then unusable) when a product leaves the positive normal numbers.
template <typename Y>
bool log_products(const Y& y, int64_t& i, int64_t end, double* product, int64_t& exponent) {
  for (; i + kLogGroup <= end; i += kLogGroup) {
    for (int64_t r = 0; r < kLogRounds; ++r)
      for (int64_t l = 0; l < kLogLanes; ++l) product[l] *= y(i + r * kLogLanes + l);
    for (int64_t l = 0; l < kLogLanes; ++l) {
      uint64_t bits;
      std::memcpy(&bits, &product[l], sizeof bits);
      const int64_t e = static_cast<int64_t>(bits >> 52);  // with the sign bit: 0 for zero and subnormals
      if (e == 0 || e >= 0x7ff) return false;              // not a positive normal number
      exponent += e - 1023;
      bits = (bits & kMantissa) | kOne;
      std::memcpy(&product[l], &bits, sizeof bits);
    }
  }
  return true;
}

#if GS_HAVE_AVX2_PATHS
/// log_products() of a float32 block, four lanes to a vector: the same factors, rounded the same
/// way (a product, then a sum) and multiplied in the same order, so the same bits. Over SIDCo's
/// sample of a 25M-element bucket (2.3M elements, 2 threads) 0.28 ms against the portable loop's
/// 0.93 (compiled for SSE2, with a selection value read per element).
template <Read kRead>
GS_TARGET_AVX2 bool log_products_f32_avx2(const Source<float>& src, int64_t& i, int64_t end, double scale, double eps,
                                          double* product, int64_t& exponent) {
  static_assert(kRead != Read::kUpdate && kLogLanes == 8, "read-only passes; two vectors of four lanes");
  const __m256d s = _mm256_set1_pd(scale), e = _mm256_set1_pd(eps), sign = _mm256_set1_pd(-0.0);
  const __m256i mantissa = _mm256_set1_epi64x(static_cast<int64_t>(kMantissa)),
                one = _mm256_set1_epi64x(static_cast<int64_t>(kOne)), bias = _mm256_set1_epi64x(1023),
                largest = _mm256_set1_epi64x(0x7fe), zero = _mm256_setzero_si256();
  __m256d p[2] = {_mm256_loadu_pd(product), _mm256_loadu_pd(product + 4)};
  __m256i exponents = zero, unused = zero;
  bool normal = true;
  for (; i + kLogGroup <= end; i += kLogGroup) {
    for (int64_t r = 0; r < kLogRounds; ++r) {
      fetch_ahead<kRead>(src, i + r * kLogLanes + kReadAhead, kLogLanes);
      const __m256 v = values8<kRead, false>(src, i + r * kLogLanes, unused);
      const __m256d y[2] = {_mm256_cvtps_pd(_mm256_castps256_ps128(v)), _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1))};
      for (int h = 0; h < 2; ++h)
        p[h] = _mm256_mul_pd(p[h], _mm256_add_pd(_mm256_mul_pd(_mm256_andnot_pd(sign, y[h]), s), e));
    }
    __m256i bad = zero;
    for (__m256d& q : p) {
      const __m256i bits = _mm256_castpd_si256(q);
      const __m256i ex = _mm256_srli_epi64(bits, 52);  // with the sign bit, as in log_products
      bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_cmpeq_epi64(ex, zero), _mm256_cmpgt_epi64(ex, largest)));
      exponents = _mm256_add_epi64(exponents, _mm256_sub_epi64(ex, bias));
      q = _mm256_castsi256_pd(_mm256_or_si256(_mm256_and_si256(bits, mantissa), one));
    }
    if (!_mm256_testz_si256(bad, bad)) {
      normal = false;
      break;
    }
  }
  _mm256_storeu_pd(product, p[0]);
  _mm256_storeu_pd(product + 4, p[1]);
  alignas(32) int64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), exponents);
  exponent += lanes[0] + lanes[1] + lanes[2] + lanes[3];
  return normal;
}

#else   // only named by code that never runs without AVX2 paths
template <Read kRead>
bool log_products_f32_avx2(const Source<float>& src, int64_t& i, int64_t end, double scale, double eps, double* product,
                           int64_t& exponent);
#endif  // GS_HAVE_AVX2_PATHS

}  // namespace

template <typename T>
double log_sum(Source<T> src, int64_t n, double scale, double eps, BlockSample sample) {
  check_read_only(src.update, "log_sum");
  auto y = [&](int64_t i) { return std::fabs(static_cast<double>(Num<T>::to_float(src.value(i)))) * scale + eps; };
  // A log per element would cost ten times the read. The sum of logs is the log of a product
  // instead (log_products), and one log per lane and block. A block whose products leave the
  // positive normal numbers (a factor that is not finite, not positive, or so small or large that
  // kLogRounds of them underflow or overflow) adds its logs one by one instead. Both ways agree to
  // rounding (a few units in the last place of each product against one per log).
  const auto blocks = per_block<double>(n, sample, [&](int64_t begin, int64_t end) {
    double product[kLogLanes];
    std::fill(product, product + kLogLanes, 1.0);
    int64_t exponent = 0, i = begin;
    bool normal = true;
    if (!avx2_f32(src, [&](auto read) {
          normal = log_products_f32_avx2<decltype(read)::value>(as_f32(src), i, end, scale, eps, product, exponent);
        }))
      normal = log_products(y, i, end, product, exponent);
    if (!normal) {
      double s = 0.0;
      for (int64_t j = begin; j < end; ++j) s += std::log(y(j));
      return s;
    }
    double s = static_cast<double>(exponent) * std::log(2.0);
    for (double p : product) s += std::log(p);
    for (; i < end; ++i) s += std::log(y(i));
    return s;
  });
  double total = 0.0;
  for (double s : blocks) total += s;
  return total;
}

template <typename T>
double sample_abs_sum(Source<T> src, const int64_t* positions, int64_t count) {
  check_read_only(src.update, "sample_abs_sum");
  double s = 0.0;
  for (int64_t i = 0; i < count; ++i) s += std::fabs(static_cast<double>(Num<T>::to_float(src.value(positions[i]))));
  return s;
}

template <typename T>
int64_t count_nonfinite(const T* data, int64_t n) {
  const auto blocks = per_block<int64_t>(n, [&](int64_t begin, int64_t end) {
    int64_t c = 0;
    for (int64_t i = begin; i < end; ++i) c += !is_finite(data[i]);
    return c;
  });
  int64_t total = 0;
  for (int64_t c : blocks) total += c;
  return total;
}

#define GS_INSTANTIATE_STATISTICS(T)                                                                           \
  template Moments moments<T>(Source<T>, int64_t);                                                             \
  template Moments scan<T>(Source<T>, int64_t, Range, uint32_t, int64_t, bool, int64_t&, HostBuffer<int64_t>&, \
                           HostBuffer<float>&, uint32_t);                                                      \
  template void count_keys<T>(Source<T>, int64_t, Range, const uint32_t*, int, int64_t*);                      \
  template Exceedance exceedance<T>(Source<T>, int64_t, uint32_t, double, BlockSample);                        \
  template double log_sum<T>(Source<T>, int64_t, double, double, BlockSample);                                 \
  template double sample_abs_sum<T>(Source<T>, const int64_t*, int64_t);                                       \
  template void sample_keys<T>(Source<T>, int64_t, uint32_t, BlockSample, std::vector<uint32_t>&);             \
  template int64_t count_nonfinite<T>(const T*, int64_t);

GS_INSTANTIATE_STATISTICS(float)
GS_INSTANTIATE_STATISTICS(Half)
GS_INSTANTIATE_STATISTICS(BFloat16)

}  // namespace cpu
}  // namespace gradsparse
