// CUDA scatter-add (validated first, all-or-nothing), elementwise division, and rounding float32
// sums to a 16-bit dtype.
#include <climits>
#include <cstdint>

#include "gradsparse/cuda_device.h"
#include "gradsparse/numeric.h"

namespace gradsparse {
namespace cuda {
namespace {

constexpr int kThreads = 256;

unsigned int grid_for(int64_t items) { return static_cast<unsigned int>((items + kThreads - 1) / kThreads); }

/// Records the lowest position whose index is out of range (or not strictly ascending).
template <typename I>
__global__ void validate_kernel(const I* indices, int64_t count, int64_t n, bool strictly_ascending,
                                unsigned long long* first_bad) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  const bool ordered = !strictly_ascending || i == 0 || indices[i - 1] < indices[i];
  if (!index_in_range(indices[i], n) || !ordered) atomicMin(first_bad, static_cast<unsigned long long>(i));
}

/// Indices are distinct: every element is written by one thread, deterministically.
template <typename T, typename I, typename O>
__global__ void add_distinct_kernel(O* out, const I* indices, const T* values, int64_t count, float divisor) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  O& o = out[indices[i]];
  o = Num<O>::from_float(Num<O>::to_float(o) + Num<T>::to_float(values[i]) / divisor);
}

__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
/// *p = *p + v in float32, rounded once to T (the CPU's add), by a compare-and-swap on the aligned
/// 32-bit word that holds the element. A 16-bit atomicAdd rounds v to T first and the sum again:
/// float16 2.296875 + 869 / 5 gave 176.0 where the CPU gives 176.125.
template <typename T>
__device__ __forceinline__ void atomic_add_16(T* p, float v) {
  static_assert(sizeof(T) == 2);
  const auto address = reinterpret_cast<uintptr_t>(p);
  auto* word = reinterpret_cast<unsigned int*>(address & ~uintptr_t{3});
  const unsigned int shift = (address & 2u) * 8u;  // little-endian: the element's half of the word
  unsigned int old = *word, assumed;
  do {
    assumed = old;
    const T sum = Num<T>::from_float(Num<T>::to_float(T{static_cast<uint16_t>(assumed >> shift)}) + v);
    const unsigned int next = (assumed & ~(0xffffu << shift)) | (static_cast<unsigned int>(sum.bits) << shift);
    old = atomicCAS(word, assumed, next);
  } while (old != assumed);
}
__device__ __forceinline__ void atomic_add(Half* p, float v) { atomic_add_16(p, v); }
__device__ __forceinline__ void atomic_add(BFloat16* p, float v) { atomic_add_16(p, v); }

/// Indices may repeat: accumulate with atomics.
template <typename T, typename I, typename O>
__global__ void add_atomic_kernel(O* out, const I* indices, const T* values, int64_t count, float divisor) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= count) return;
  atomic_add(out + indices[i], Num<T>::to_float(values[i]) / divisor);
}

template <typename T, typename I>
__global__ void gather_kernel(Source<T> src, const I* indices, int64_t count, T* out) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j < count) out[j] = src.value(static_cast<int64_t>(indices[j]));
}

template <typename T, typename I>
__global__ void zero_at_kernel(T* residual, const I* indices, int64_t count) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (j < count) residual[indices[j]] = Num<T>::zero();
}

template <typename T>
__global__ void divide_kernel(T* data, int64_t n, float divisor) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    data[i] = quotient(data[i], divisor);
}

template <typename T>
__global__ void round_to_kernel(const float* in, T* out, int64_t n) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    out[i] = Num<T>::from_float(in[i]);
}

template <typename T>
__global__ void momentum_kernel(T* grad, T* velocity, const T* residual, int64_t n, float factor, bool masking) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * kThreads)
    momentum_step(grad, velocity, residual, i, factor, masking);
}

}  // namespace

/// Checks every index on the device (in range; strictly ascending when asked); throws
/// CorruptMessageError naming the first bad position before anything is written.
template <typename I>
void validate(CudaDevice& device, const I* indices, int64_t count, int64_t n, bool strictly_ascending) {
  cudaStream_t stream = device.stream();
  Buffer flag = device.allocate(sizeof(unsigned long long));
  GS_CUDA_CHECK(cudaMemsetAsync(flag.data(), 0xff, sizeof(unsigned long long), stream));
  validate_kernel<I>
      <<<grid_for(count), kThreads, 0, stream>>>(indices, count, n, strictly_ascending, flag.as<unsigned long long>());
  GS_CUDA_CHECK(cudaGetLastError());
  unsigned long long first_bad = 0;
  device.copy_to_host(&first_bad, flag.data(), sizeof(first_bad));
  if (first_bad == ULLONG_MAX) return;
  I pair[2] = {};
  const int64_t at = static_cast<int64_t>(first_bad);
  device.copy_to_host(pair, indices + (at > 0 ? at - 1 : 0), sizeof(I) * (at > 0 ? 2 : 1));
  const I bad = at > 0 ? pair[1] : pair[0];
  GS_CHECK(index_in_range(bad, n), CorruptMessageError, "sparse index ", static_cast<long long>(bad), " at position ",
           at, " is outside [0, ", n,
           "), the elements of the tensor it adds into: the pairs are corrupt "
           "or were made for a tensor of another size");
  throw CorruptMessageError(str("sparse indices are not strictly ascending at position ", at, " (",
                                static_cast<long long>(pair[0]), " then ", static_cast<long long>(pair[1]),
                                "); the message is corrupt"));
}

template <typename T, typename I>
__global__ void assign_kernel(T* out, const I* indices, const T* values, int64_t count) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < count) out[indices[i]] = values[i];
}

template <typename T, typename I, typename O>
void scatter_add(CudaDevice& device, O* out, int64_t n, const I* indices, const T* values, int64_t count, float divisor,
                 bool strictly_ascending) {
  GS_CHECK(count >= 0, ValueError, "scatter_add: count must be >= 0, got ", count);
  check_divisor(divisor, "scatter_add");
  if (count == 0) return;
  validate(device, indices, count, n, strictly_ascending);
  cudaStream_t stream = device.stream();
  if (strictly_ascending) {
    add_distinct_kernel<T, I, O><<<grid_for(count), kThreads, 0, stream>>>(out, indices, values, count, divisor);
  } else {
    add_atomic_kernel<T, I, O><<<grid_for(count), kThreads, 0, stream>>>(out, indices, values, count, divisor);
  }
  GS_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename I>
void assign(CudaDevice& device, T* out, int64_t n, const I* indices, const T* values, int64_t count) {
  GS_CHECK(count >= 0, ValueError, "assign: count must be >= 0, got ", count);
  if (count == 0) return;
  validate(device, indices, count, n, /*strictly_ascending=*/true);
  assign_kernel<T, I><<<grid_for(count), kThreads, 0, device.stream()>>>(out, indices, values, count);
  GS_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename I>
void gather(CudaDevice& device, Source<T> src, const I* indices, int64_t count, T* out) {
  if (count == 0) return;
  gather_kernel<T, I><<<grid_for(count), kThreads, 0, device.stream()>>>(src, indices, count, out);
  GS_CUDA_CHECK(cudaGetLastError());
}

template <typename T, typename I>
void zero_at(CudaDevice& device, T* residual, const I* indices, int64_t count) {
  if (count == 0) return;
  zero_at_kernel<T, I><<<grid_for(count), kThreads, 0, device.stream()>>>(residual, indices, count);
  GS_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void divide(CudaDevice& device, T* data, int64_t n, float divisor) {
  check_divisor(divisor, "divide");
  if (n == 0) return;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  divide_kernel<T>
      <<<static_cast<unsigned int>(blocks < 65535 ? blocks : 65535), kThreads, 0, device.stream()>>>(data, n, divisor);
  GS_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void round_to(CudaDevice& device, const float* in, T* out, int64_t n) {
  if (n == 0) return;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  round_to_kernel<T>
      <<<static_cast<unsigned int>(blocks < 65535 ? blocks : 65535), kThreads, 0, device.stream()>>>(in, out, n);
  GS_CUDA_CHECK(cudaGetLastError());
}

template <typename T>
void momentum(CudaDevice& device, T* grad, T* velocity, const T* residual, int64_t n, float factor, bool masking) {
  if (n == 0) return;
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  momentum_kernel<T><<<static_cast<unsigned int>(blocks < 65535 ? blocks : 65535), kThreads, 0, device.stream()>>>(
      grad, velocity, residual, n, factor, masking);
  GS_CUDA_CHECK(cudaGetLastError());
}

#define GS_INSTANTIATE_CUDA_SCATTER(T, I)                                                                 \
  template void scatter_add<T, I, T>(CudaDevice&, T*, int64_t, const I*, const T*, int64_t, float, bool); \
  template void gather<T, I>(CudaDevice&, Source<T>, const I*, int64_t, T*);                              \
  template void zero_at<T, I>(CudaDevice&, T*, const I*, int64_t);                                        \
  template void assign<T, I>(CudaDevice&, T*, int64_t, const I*, const T*, int64_t);
#define GS_INSTANTIATE_CUDA_SCATTER_TYPE(T)                          \
  GS_INSTANTIATE_CUDA_SCATTER(T, uint32_t)                           \
  GS_INSTANTIATE_CUDA_SCATTER(T, uint64_t)                           \
  GS_INSTANTIATE_CUDA_SCATTER(T, int32_t)                            \
  GS_INSTANTIATE_CUDA_SCATTER(T, int64_t)                            \
  template void divide<T>(CudaDevice&, T*, int64_t, float);          \
  template void round_to<T>(CudaDevice&, const float*, T*, int64_t); \
  template void momentum<T>(CudaDevice&, T*, T*, const T*, int64_t, float, bool);
// A 16-bit message added into float32 sums (float32's is the instantiation above).
#define GS_INSTANTIATE_CUDA_SCATTER_INTO_FLOAT32(T, I) \
  template void scatter_add<T, I, float>(CudaDevice&, float*, int64_t, const I*, const T*, int64_t, float, bool);
#define GS_INSTANTIATE_CUDA_SCATTER_16BIT(T)            \
  GS_INSTANTIATE_CUDA_SCATTER_TYPE(T)                   \
  GS_INSTANTIATE_CUDA_SCATTER_INTO_FLOAT32(T, uint32_t) \
  GS_INSTANTIATE_CUDA_SCATTER_INTO_FLOAT32(T, uint64_t) \
  GS_INSTANTIATE_CUDA_SCATTER_INTO_FLOAT32(T, int32_t)  \
  GS_INSTANTIATE_CUDA_SCATTER_INTO_FLOAT32(T, int64_t)

GS_INSTANTIATE_CUDA_SCATTER_TYPE(float)
GS_INSTANTIATE_CUDA_SCATTER_16BIT(Half)
GS_INSTANTIATE_CUDA_SCATTER_16BIT(BFloat16)

}  // namespace cuda
}  // namespace gradsparse
