// CpuDevice: host memory and the OpenMP kernels of kernels/cpu.
#pragma once

#include <vector>

#include "gradsparse/kernel_device.h"
#include "gradsparse/kernels.h"

namespace gradsparse {

class CpuDevice final : public KernelDevice<CpuDevice> {
 public:
  DeviceKind kind() const override { return DeviceKind::kCPU; }
  Buffer allocate(size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void fill_zero(void* dst, size_t bytes) override;
  void synchronize() override {}

  /// One fused pass (cpu::scan).
  Scan scan(const BucketView& bucket, bool update, Range range, double lower, int64_t capacity, bool sums,
            double zero_from = HUGE_VAL) override;

  /// cpu::sample_keys.
  std::vector<uint32_t> sample_keys(const BucketView& bucket, bool update, BlockSample sample, double floor) override;

  // Typed kernels used by KernelDevice.
  template <typename T, typename I>
  SelectStats k_select(Source<T> src, int64_t n, uint32_t key, Range range, bool zero, const PairSink& sink) {
    return cpu::select<T, I>(src, n, key, range, zero, sink);
  }
  template <typename T, typename I>
  SelectStats k_topk(Source<T> src, int64_t n, int64_t k, bool zero, const PairSink& sink) {
    return cpu::select_topk<T, I>(src, n, k, zero, sink);
  }
  template <typename T>
  Moments k_moments(Source<T> src, int64_t n) {
    return cpu::moments<T>(src, n);
  }
  template <typename T>
  void k_count(Source<T> src, int64_t n, Range range, const std::vector<uint32_t>& keys, std::vector<int64_t>& counts) {
    cpu::count_keys<T>(src, n, range, keys.data(), static_cast<int>(keys.size()), counts.data());
  }
  template <typename T>
  Exceedance k_exceedance(Source<T> src, int64_t n, uint32_t key, double scale, BlockSample sample) {
    return cpu::exceedance<T>(src, n, key, scale, sample);
  }
  template <typename T>
  double k_log_sum(Source<T> src, int64_t n, double scale, double eps, BlockSample sample) {
    return cpu::log_sum<T>(src, n, scale, eps, sample);
  }
  template <typename T>
  void k_collect(Source<T> src, int64_t n, Range range, uint32_t key, HostBuffer<int64_t>& index,
                 HostBuffer<float>& value) {
    cpu::collect<T>(src, n, range, key, index, value);
  }
  template <typename T>
  double k_sample_abs_sum(Source<T> src, const std::vector<int64_t>& positions) {
    return cpu::sample_abs_sum<T>(src, positions.data(), static_cast<int64_t>(positions.size()));
  }
  template <typename T, typename I>
  void k_gather(Source<T> src, const I* indices, int64_t count, T* out) {
    cpu::gather<T, I>(src, indices, count, out);
  }
  template <typename T, typename I>
  void k_zero_at(T* residual, const I* indices, int64_t count) {
    cpu::zero_at<T, I>(residual, indices, count);
  }
  template <typename T, typename I, typename O>
  void k_scatter_add(O* out, int64_t n, const I* indices, const T* values, int64_t count, float divisor,
                     bool ascending) {
    cpu::scatter_add<T, I, O>(out, n, indices, values, count, divisor, ascending);
  }
  template <typename T, typename I>
  void k_assign(T* out, int64_t n, const I* indices, const T* values, int64_t count) {
    cpu::assign<T, I>(out, n, indices, values, count);
  }
  template <typename T>
  void k_divide(T* data, int64_t n, float divisor) {
    cpu::divide<T>(data, n, divisor);
  }
  template <typename T>
  void k_round_to(const float* in, T* out, int64_t n) {
    cpu::round_to<T>(in, out, n);
  }
  template <typename T>
  void k_momentum(T* grad, T* velocity, const T* residual, int64_t n, float factor, bool masking) {
    cpu::momentum<T>(grad, velocity, residual, n, factor, masking);
  }
};

}  // namespace gradsparse
