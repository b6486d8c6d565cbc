// CUDA pieces of the adapter (compiled only in CUDA builds): a core CudaDevice that allocates
// through PyTorch's caching allocator on a given stream.
#pragma once

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>

#include "gradsparse/cuda_device.h"

namespace gradsparse::torch_adapter {

inline CudaDevice torch_cuda_device(const c10::cuda::CUDAStream& stream) {
  return CudaDevice(stream.device_index(), stream.stream(), [](size_t bytes, cudaStream_t s) {
    void* p = c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(bytes, s);
    return Buffer(p, bytes, [](void* q) { c10::cuda::CUDACachingAllocator::raw_delete(q); });
  });
}

}  // namespace gradsparse::torch_adapter
