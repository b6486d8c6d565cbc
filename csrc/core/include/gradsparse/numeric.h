// Per-element logic shared by the CPU and the CUDA kernels (`GS_HD`): 16-bit float storage types,
// conversions with round-to-nearest-even (bit-identical to PyTorch's), keys that order finite
// values by |x| as unsigned integers, and the error-feedback update.
#pragma once

#include <cstdint>
#include <cstring>

#include "gradsparse/common.h"

namespace gradsparse {

/// IEEE binary16 storage; same layout as at::Half and __half.
struct Half {
  uint16_t bits;
};
/// bfloat16 storage; same layout as at::BFloat16 and __nv_bfloat16.
struct BFloat16 {
  uint16_t bits;
};

GS_HD inline uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

GS_HD inline float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

/// binary16 -> binary32 (exact).
GS_HD inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exponent = (h >> 10) & 0x1fu;
  uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0x1fu) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {
    if (mantissa == 0) return bits_float(sign);
    // Subnormal: renormalise so the implicit bit is explicit.
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    return bits_float(sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13));
  }
  return bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

/// binary32 -> binary16, round to nearest even; NaN stays NaN (quiet), overflow gives Inf.
GS_HD inline uint16_t float_to_half(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (ax < 0x38800000u) {                                               // below 2^-14: subnormal or zero
    if (ax < 0x33000000u) return static_cast<uint16_t>(sign);           // below 2^-25: zero
    const uint32_t e = ax >> 23;
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // value * 2^24 = m * 2^-(shift)
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = (ax - 0x38000000u) >> 13;  // rebias the exponent from 127 to 15
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;  // a carry may round up into the exponent
  return static_cast<uint16_t>(sign | r);
}

GS_HD inline float bfloat16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

/// binary32 -> bfloat16, round to nearest even; NaN stays NaN (quiet).
GS_HD inline uint16_t float_to_bfloat16(float f) {
  const uint32_t x = float_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/// Arithmetic view of each storage type: everything is computed in float32 and rounded once.
template <typename T>
struct Num;

template <>
struct Num<float> {
  using Key = uint32_t;
  static constexpr int kKeyBits = 31;  // |x| as an unsigned integer: bits without the sign
  static constexpr uint32_t kInfKey = 0x7f800000u;
  static constexpr float kMaxFinite = 3.40282347e38f;
  GS_HD static float to_float(float v) { return v; }
  GS_HD static float from_float(float v) { return v; }
  GS_HD static uint32_t key(float v) { return float_bits(v) & 0x7fffffffu; }
  GS_HD static float zero() { return 0.0f; }
};

template <>
struct Num<Half> {
  using Key = uint32_t;
  static constexpr int kKeyBits = 15;
  static constexpr uint32_t kInfKey = 0x7c00u;
  static constexpr float kMaxFinite = 65504.0f;
  GS_HD static float to_float(Half v) { return half_to_float(v.bits); }
  GS_HD static Half from_float(float v) { return Half{float_to_half(v)}; }
  GS_HD static uint32_t key(Half v) { return v.bits & 0x7fffu; }
  GS_HD static Half zero() { return Half{0}; }
};

template <>
struct Num<BFloat16> {
  using Key = uint32_t;
  static constexpr int kKeyBits = 15;
  static constexpr uint32_t kInfKey = 0x7f80u;
  static constexpr float kMaxFinite = 3.38953139e38f;
  GS_HD static float to_float(BFloat16 v) { return bfloat16_to_float(v.bits); }
  GS_HD static BFloat16 from_float(float v) { return BFloat16{float_to_bfloat16(v)}; }
  GS_HD static uint32_t key(BFloat16 v) { return v.bits & 0x7fffu; }
  GS_HD static BFloat16 zero() { return BFloat16{0}; }
};

template <typename T>
GS_HD inline bool is_finite(T v) {
  return Num<T>::key(v) < Num<T>::kInfKey;
}

/// The finite nonzero `v` one step closer to zero: its magnitude bits less one (every storage
/// type keeps sign and magnitude apart, and orders magnitudes as integers).
template <typename T>
GS_HD inline T one_step_toward_zero(T v) {
  if constexpr (sizeof(T) == 4) {
    return bits_float(float_bits(v) - 1u);
  } else {
    return T{static_cast<uint16_t>(v.bits - 1u)};
  }
}

/// v / divisor, rounded to nearest, except where the nearest quotient times `divisor` would pass
/// the type's largest finite value: there it is the quotient one step closer to zero. So P
/// quotients of values that are finite divided by P sum, in exact arithmetic, to no more than
/// that largest value: an average taken by dividing first (float16 all-reduces, as DDP's) cannot
/// overflow where every dividend was finite. (Rounded to nearest, 65504 / 3 in float16 is
/// 21840, and three of them sum to 65520, which float16 rounds to Inf.)
template <typename T>
GS_HD inline T quotient(T v, float divisor) {
  const float exact = Num<T>::to_float(v) / divisor;
  const T rounded = Num<T>::from_float(exact);
  const float got = Num<T>::to_float(rounded);
  const float magnitude = got < 0.0f ? -got : got, bound = exact < 0.0f ? -exact : exact;
  const float d = divisor < 0.0f ? -divisor : divisor;
  if (is_finite(rounded) && magnitude > bound && magnitude * d > Num<T>::kMaxFinite)
    return one_step_toward_zero(rounded);
  return rounded;
}

/// A threshold as the selection compares it: rounded to the bucket's dtype, as PyTorch rounds a
/// Python float that meets a tensor (docs/method-spec.md, ruling 8), then returned as a key.
template <typename T>
inline uint32_t threshold_key(double threshold) {
  const T t = Num<T>::from_float(static_cast<float>(threshold));
  return Num<T>::key(t);
}

/// One element of the fused error-feedback update: a = residual + grad, rounded to T. When `a` is
/// finite the residual takes it; when it is not (NaN/Inf in the gradient, or overflow) the residual
/// keeps its old value and `finite` is false.
template <typename T>
GS_HD inline void ef_accumulate(T& residual, T grad, bool& finite) {
  const T a = Num<T>::from_float(Num<T>::to_float(residual) + Num<T>::to_float(grad));
  finite = is_finite(a);
  if (finite) residual = a;
}

/// factor * u + g in float, each operation rounded on its own: no fused multiply-add, so that the
/// CPU and the GPU (where nvcc would contract the expression) compute the same bits.
GS_HD inline float scale_add(float factor, float u, float g) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(__fmul_rn(factor, u), g);
#else
  return factor * u + g;  // host code is built with -ffp-contract=off
#endif
}

/// Momentum correction of one element (docs/method-spec.md section 1): the velocity, emptied first
/// when `emptied` (momentum factor masking: the previous step emptied the residual there), decays
/// by `factor` and takes the gradient, rounded to T. Returns the result, which error feedback adds
/// to the residual; when it is not finite the velocity keeps its old value, and the result carries
/// the non-finite value on, so that the step's non-finite policy sees it.
template <typename T>
GS_HD inline T momentum_value(T grad, T& velocity, bool emptied, float factor) {
  const float u = emptied ? 0.0f : Num<T>::to_float(velocity);
  const T a = Num<T>::from_float(scale_add(factor, u, Num<T>::to_float(grad)));
  if (is_finite(a)) velocity = a;
  return a;
}

/// Whether momentum factor masking restarts the velocity of an element whose residual is `r`:
/// with `masking`, where the residual is exactly zero (either sign).
template <typename T>
GS_HD inline bool momentum_emptied(bool masking, T r) {
  return masking && Num<T>::key(r) == 0;
}

/// Momentum correction of element i as a pass of its own (dense steps): the bucket then holds the
/// velocity. `residual` may be null (no masking then).
template <typename T>
GS_HD inline void momentum_step(T* grad, T* velocity, const T* residual, int64_t i, float factor, bool masking) {
  grad[i] = momentum_value(grad[i], velocity[i], residual != nullptr && momentum_emptied(masking, residual[i]), factor);
}

/// The residual `r` after the error-feedback update by gradient `g`, with momentum correction from
/// velocity `u` where it is given (its factor and masking as momentum_value takes them), computed
/// on copies as the kernels compute it: nothing is written (not the velocity either). Where the
/// sum is not finite, `r`.
template <typename T>
GS_HD inline T updated_value(T r, T g, const T* u, float factor, bool masking) {
  if (u != nullptr) {
    T velocity = *u;  // momentum_value writes the new velocity to its argument
    g = momentum_value(g, velocity, momentum_emptied(masking, r), factor);
  }
  bool finite;
  ef_accumulate(r, g, finite);
  return r;
}

/// The value a selection sees for element i once the update is done: the residual (error
/// feedback) or, without a residual, the gradient with non-finite values read as zero. It is
/// always finite, and reading it again gives the same value, so multi-pass kernels agree.
template <typename T>
GS_HD inline T selection_value(const T* residual, const T* grad, int64_t i) {
  if (residual != nullptr) return residual[i];
  return is_finite(grad[i]) ? grad[i] : Num<T>::zero();
}

/// The error-feedback update of element i (when there is a residual) followed by its selection value.
template <typename T>
GS_HD inline T ef_step(T* residual, const T* grad, int64_t i, bool& finite) {
  if (residual != nullptr) {
    ef_accumulate(residual[i], grad[i], finite);
  } else {
    finite = is_finite(grad[i]);
  }
  return selection_value(residual, grad, i);
}

/// The selection rule of every threshold method: |a| >= threshold, compared in the bucket's dtype.
GS_HD inline bool passes_threshold(uint32_t key, uint32_t threshold_key) { return key >= threshold_key; }

}  // namespace gradsparse
