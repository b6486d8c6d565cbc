// Naive reference implementations the GoogleTest suites compare the kernels against: plain loops,
// no blocks, no threads, no histograms.
#pragma once

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <random>
#include <vector>

#include "gradsparse/kernels.h"
#include "gradsparse/numeric.h"

namespace gradsparse::reference {

template <typename T>
struct Pairs {
  std::vector<int64_t> indices;
  std::vector<T> values;
  int64_t nonfinite = 0;
};

template <typename T>
T from_float(float v) {
  return Num<T>::from_float(v);
}
template <typename T>
float to_float(T v) {
  return Num<T>::to_float(v);
}

/// a = residual + grad elementwise (residual updated where finite); returns the values the
/// selection sees (the residual, or without one the gradient with non-finite values as zero) and
/// marks non-finite elements.
template <typename T>
std::vector<T> accumulate(std::vector<T>* residual, const std::vector<T>& grad, std::vector<bool>& finite) {
  std::vector<T> a(grad.size());
  finite.assign(grad.size(), true);
  for (size_t i = 0; i < grad.size(); ++i) {
    if (residual == nullptr) {
      a[i] = grad[i];
      finite[i] = std::isfinite(to_float(grad[i]));
      if (!finite[i]) a[i] = Num<T>::zero();
      continue;
    }
    const T sum = from_float<T>(to_float((*residual)[i]) + to_float(grad[i]));
    finite[i] = std::isfinite(to_float(sum));
    if (finite[i]) (*residual)[i] = sum;
    a[i] = (*residual)[i];
  }
  return a;
}

template <typename T>
Pairs<T> threshold(std::vector<T>* residual, const std::vector<T>& grad, double thr) {
  std::vector<bool> finite;
  const std::vector<T> a = accumulate(residual, grad, finite);
  const float t = to_float(from_float<T>(static_cast<float>(thr)));
  Pairs<T> out;
  for (size_t i = 0; i < a.size(); ++i) {
    out.nonfinite += !finite[i];
    if (std::fabs(to_float(a[i])) >= t) {
      out.indices.push_back(static_cast<int64_t>(i));
      out.values.push_back(a[i]);
      if (residual != nullptr) (*residual)[i] = Num<T>::zero();
    }
  }
  return out;
}

/// Exact top-k: order by |a| descending, then by index ascending.
template <typename T>
Pairs<T> topk(std::vector<T>* residual, const std::vector<T>& grad, int64_t k) {
  std::vector<bool> finite;
  const std::vector<T> a = accumulate(residual, grad, finite);
  Pairs<T> out;
  for (size_t i = 0; i < a.size(); ++i) out.nonfinite += !finite[i];
  std::vector<float> magnitude(a.size());
  for (size_t i = 0; i < a.size(); ++i) magnitude[i] = std::fabs(to_float(a[i]));
  std::vector<int64_t> order(a.size());
  std::iota(order.begin(), order.end(), 0);
  k = std::min<int64_t>(k, static_cast<int64_t>(a.size()));
  // The k first of that order (a total one: the k-th element has one place in it).
  std::nth_element(order.begin(), order.begin() + k, order.end(), [&](int64_t x, int64_t y) {
    return magnitude[x] > magnitude[y] || (magnitude[x] == magnitude[y] && x < y);
  });
  std::vector<int64_t> chosen(order.begin(), order.begin() + k);
  std::sort(chosen.begin(), chosen.end());
  for (int64_t i : chosen) {
    out.indices.push_back(i);
    out.values.push_back(a[i]);
    if (residual != nullptr) (*residual)[i] = Num<T>::zero();
  }
  return out;
}

/// A random gradient: normal values with a few large ones, rounded to T.
template <typename T>
std::vector<T> random_vector(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<T> v(n);
  for (auto& x : v) x = from_float<T>(normal(rng));
  return v;
}

template <typename T>
bool same_bits(T a, T b) {
  return std::memcmp(&a, &b, sizeof(T)) == 0;
}

}  // namespace gradsparse::reference

namespace gradsparse {

/// A HostBuffer (a scan's candidates) against the std::vector a test expects (found by ADL).
template <typename T>
bool operator==(const HostBuffer<T>& a, const std::vector<T>& b) {
  return std::equal(a.begin(), a.end(), b.begin(), b.end());
}

}  // namespace gradsparse
