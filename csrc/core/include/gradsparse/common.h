// Shared basics of the torch-free core: the host/device qualifier, the element types a bucket can
// hold, and the error types that cross the core's boundary.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#if defined(__CUDACC__)
#define GS_HD __host__ __device__
#else
#define GS_HD
#endif

namespace gradsparse {

/// std::allocator, except that a vector's resize() leaves new elements of a trivial type
/// uninitialised instead of zeroing them: for host buffers whose every element is written next
/// (the candidates of a scan and their keys: 7 MB a step at density 0.01 and 25M elements, whose
/// zeroing in one thread cost about 3% of the selection step; docs/benchmarks.md, 2026-12-01,
/// third).
template <typename T>
struct Uninitialized : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = Uninitialized<U>;
  };
  Uninitialized() noexcept = default;
  template <typename U>
  Uninitialized(const Uninitialized<U>&) noexcept {}
  template <typename U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <typename U, typename... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};

/// A host vector whose resize() does not zero (Uninitialized).
template <typename T>
using HostBuffer = std::vector<T, Uninitialized<T>>;

/// Positions into a host array (positions_where, parallel.h): a buffer whose resize writes
/// nothing, since every position is written after it (a zero-filled vector cost 0.1 of
/// positions_where's 0.36 ms over 445 thousand candidates, 250 thousand kept).
using Positions = HostBuffer<size_t>;

/// Element type of a buffer. Buckets are float32, float16 or bfloat16 (the numeric values of
/// those three are part of the message format); float64 and int64 carry the small agreement
/// payloads of some methods.
enum class DType : uint8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat64 = 3, kInt64 = 4 };

inline size_t dtype_size(DType d) {
  switch (d) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat16:
    case DType::kBFloat16:
      return 2;
    case DType::kFloat64:
    case DType::kInt64:
      return 8;
  }
  return 0;
}

/// The least positive value of a dtype (its smallest subnormal; 1 for int64).
inline double smallest_positive(DType d) {
  switch (d) {
    case DType::kFloat32:
      return 0x1p-149;
    case DType::kFloat16:
      return 0x1p-24;
    case DType::kBFloat16:
      return 0x1p-133;
    case DType::kFloat64:
      return 0x1p-1074;
    case DType::kInt64:
      return 1.0;
  }
  return 0.0;
}

inline bool is_bucket_dtype(DType d) { return d == DType::kFloat32 || d == DType::kFloat16 || d == DType::kBFloat16; }

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat64:
      return "float64";
    case DType::kInt64:
      return "int64";
  }
  return "unknown";
}

/// A user-facing mistake: a bad argument or configuration. Maps to Python's ValueError.
struct ValueError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

/// A malformed or out-of-range sparse message. Maps to Python's IndexError.
struct CorruptMessageError : std::out_of_range {
  using std::out_of_range::out_of_range;
};

/// A NaN or Inf in a bucket, seen by some rank (docs/method-spec.md, ruling 5).
struct NonFiniteError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// A collective failed: a peer left, a timeout expired, or the group was aborted.
struct CommError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

namespace detail {
inline void append(std::ostringstream&) {}
template <typename T, typename... Rest>
void append(std::ostringstream& os, const T& v, const Rest&... rest) {
  os << v;
  append(os, rest...);
}
}  // namespace detail

/// Concatenates its arguments with operator<<, for error messages.
template <typename... Args>
std::string str(const Args&... args) {
  std::ostringstream os;
  detail::append(os, args...);
  return os.str();
}

}  // namespace gradsparse

/// Checks a condition on user input; throws `kind` (a gradsparse error type) with the message.
#define GS_CHECK(cond, kind, ...)                            \
  do {                                                       \
    if (!(cond)) throw kind(::gradsparse::str(__VA_ARGS__)); \
  } while (0)

/// Checks an internal invariant; a failure is a bug in gradsparse, not in the caller.
#define GS_ASSERT(cond)                                                                                     \
  do {                                                                                                      \
    if (!(cond))                                                                                            \
      throw std::logic_error(                                                                               \
          ::gradsparse::str("gradsparse internal error: ", #cond, " failed at ", __FILE__, ":", __LINE__)); \
  } while (0)
