// Helpers shared by the CUDA kernels (private to kernels/cuda).
#pragma once

#include <cub/cub.cuh>

#include <vector>

#include "gradsparse/cuda_device.h"
#include "gradsparse/numeric.h"

namespace gradsparse::cuda::detail {

constexpr int kThreads = 256;

inline unsigned int blocks_for(int64_t items, int64_t per_block = kThreads) {
  return static_cast<unsigned int>((items + per_block - 1) / per_block);
}

/// A grid-stride launch size: enough blocks to fill the device, never more than the work.
inline unsigned int grid_for(int64_t items) {
  const int64_t b = (items + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(b < 4096 ? (b > 0 ? b : 1) : 4096);
}

/// Device scratch of `count` elements, released at scope exit.
template <typename U>
struct Scratch {
  Buffer buffer;
  Scratch(CudaDevice& device, size_t count) : buffer(device.allocate(count * sizeof(U) + 8)) {}
  U* get() const { return buffer.as<U>(); }
};

template <typename U>
std::vector<U> to_host(CudaDevice& device, const U* src, size_t count) {
  std::vector<U> out(count);
  if (count > 0) device.copy_to_host(out.data(), src, count * sizeof(U));
  return out;
}

template <typename U>
U read_scalar(CudaDevice& device, const U* src) {
  U value;
  device.copy_to_host(&value, src, sizeof(U));
  return value;
}

inline void check_launch() { GS_CUDA_CHECK(cudaGetLastError()); }

}  // namespace gradsparse::cuda::detail
