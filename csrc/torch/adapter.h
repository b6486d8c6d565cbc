// Helpers of the PyTorch adapter: tensor <-> core conversions, argument checks that name the
// argument, and translation of core errors into PyTorch's error types.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <c10/util/env.h>

#include <exception>

#include "gradsparse/common.h"
#include "gradsparse/device.h"

namespace gradsparse::torch_adapter {

/// The core dtype of a bucket tensor; TypeError naming `arg` for anything but float32/16, bfloat16.
inline DType core_dtype(const at::Tensor& t, const char* arg) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK_TYPE(false, "gradsparse: ", arg, " must be float32, float16 or bfloat16, got ", t.scalar_type(),
                       "; sparsification applies to floating-point gradients only");
  }
}

inline at::ScalarType scalar_type(DType d) {
  switch (d) {
    case DType::kFloat32:
      return at::kFloat;
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat64:
      return at::kDouble;
    case DType::kInt64:
      return at::kLong;
  }
  TORCH_CHECK(false, "gradsparse: unknown dtype code ", int(d));
}

/// A contiguous 1-D view of a tensor the kernels may read or write in place. The fix names the
/// copy .contiguous() makes: where the call writes the tensor, the writes go to that copy.
inline void check_flat(const at::Tensor& t, const char* arg) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "gradsparse: ", arg, " must be contiguous, got strides ", t.strides(),
                    "; pass a contiguous ", arg, " (", arg, ".contiguous() is a copy: where the call writes ", arg,
                    ", copy_ that copy back into ", arg, " after it)");
}

inline void check_same(const at::Tensor& a, const char* a_name, const at::Tensor& b, const char* b_name) {
  TORCH_CHECK_VALUE(a.device() == b.device(), "gradsparse: ", a_name, " is on ", a.device(), " but ", b_name, " is on ",
                    b.device(), "; move them to the same device");
  TORCH_CHECK_TYPE(a.scalar_type() == b.scalar_type(), "gradsparse: ", a_name, " is ", a.scalar_type(), " but ", b_name,
                   " is ", b.scalar_type(), "; they must have the same dtype");
  TORCH_CHECK_VALUE(a.numel() == b.numel(), "gradsparse: ", a_name, " has ", a.numel(), " elements but ", b_name,
                    " has ", b.numel(), "; they must have the same number of elements");
}

/// An exception's message, to be carried on in another error's. PyTorch's errors (c10::Error) add
/// the C++ stack trace where they were raised to what(); it is left out, as PyTorch leaves it out
/// of its own Python errors, unless TORCH_SHOW_CPP_STACKTRACES=1 asks for it.
inline const char* error_text(const std::exception& e) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  if (torch_error == nullptr || c10::utils::check_env("TORCH_SHOW_CPP_STACKTRACES") == true) return e.what();
  return torch_error->what_without_backtrace();
}

/// Runs `f`, turning core errors into the matching PyTorch errors (ValueError, IndexError, ...).
template <typename F>
decltype(auto) translate_errors(F&& f) {
  try {
    return f();
  } catch (const ValueError& e) {
    TORCH_CHECK_VALUE(false, e.what());
    throw;
  } catch (const CorruptMessageError& e) {
    TORCH_CHECK_INDEX(false, e.what());
    throw;
  }
}

/// Runs an op's kernel `f` (translate_errors), so that every error it raises names the op:
/// "gradsparse.<op>: ..." where the message said "gradsparse: ..." (the shared argument checks) or
/// came from the core without a name (a corrupt message's, an index outside the bucket).
template <typename F>
decltype(auto) named_errors(const char* op, F&& f) {
  auto named = [op](const c10::Error& e) {
    std::string text = e.what_without_backtrace();
    const std::string generic = "gradsparse: ";
    if (text.rfind("gradsparse.", 0) == 0) return text;
    if (text.rfind(generic, 0) == 0) text.erase(0, generic.size());
    return str("gradsparse.", op, ": ", text);
  };
  try {
    return translate_errors(std::forward<F>(f));
  } catch (const c10::IndexError& e) {
    TORCH_CHECK_INDEX(false, named(e));
    throw;
  } catch (const c10::ValueError& e) {
    TORCH_CHECK_VALUE(false, named(e));
    throw;
  } catch (const c10::TypeError& e) {
    TORCH_CHECK_TYPE(false, named(e));
    throw;
  }
}

}  // namespace gradsparse::torch_adapter
