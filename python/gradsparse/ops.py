"""The toolbox: the kernels the hook runs, as PyTorch operators (TORCH_LIBRARY ``gradsparse::*``,
CPU and CUDA) for code that compresses gradients its own way. Typed Python wrappers, with the
ops' fake kernels (so they trace under torch.compile and pass torch.library.opcheck):

- :func:`select_threshold` and :func:`select_topk`: error feedback and selection in one pass;
- :func:`scatter_add_`: adding received pairs into a dense tensor, every index checked;
- :func:`pack` and :func:`unpack`: the sparse message format (docs/architecture.md) and back.
"""

from __future__ import annotations

import numbers

import torch

from gradsparse import _C  # noqa: F401  (loading the library registers the ops)
from gradsparse.config import _describe

__all__ = ["pack", "scatter_add_", "select_threshold", "select_topk", "unpack"]

_ops = torch.ops.gradsparse


def _int(op: str, name: str, value: object, fix: str) -> None:
    """Refuses what the op's int64 argument cannot take (a float, a bool, None, past 64 bits),
    naming it; PyTorch's dispatcher named neither the op's wrapper nor the fix."""
    if isinstance(value, torch.SymInt):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not -(2**63) <= value < 2**63:
        raise TypeError(f"gradsparse.{op}: {name} must be a 64-bit int, got {_describe(value)}; {fix}")


def _one_device(op: str, **tensors: torch.Tensor | None) -> None:
    """Refuses meta tensors mixed with others: the dispatcher then ran the op's fake kernel, which
    returned uninitialised pairs and wrote nothing, instead of the device checks' error."""
    given = {name: t for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len({t.device for t in given.values()}) > 1 and any(t.is_meta for t in given.values()):
        where = ", ".join(f"{name} is on {t.device}" for name, t in given.items())
        raise ValueError(f"gradsparse.{op}: {where}; put them on one device")


def _outside_autograd(op: str, **tensors: torch.Tensor | None) -> None:
    """Refuses, where autograd records, a tensor that requires grad among those the op writes in
    place or adds into what it writes: the ops have no derivative, and autograd kept a rewritten
    residual's old history and dropped values' part of out, without an error (a result's backward
    raises, but these are no results)."""
    if not torch.is_grad_enabled():
        return
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            raise RuntimeError(
                f"gradsparse.{op}: {name} requires grad, but the op writes it (or adds it into what it writes) "
                f"outside autograd, having no derivative: a gradient through it would be wrong without an error. "
                f"Pass {name}.detach(), or call it under torch.no_grad()"
            )


def _real(op: str, name: str, value: object, fix: str) -> None:
    """Refuses what the op's double argument cannot take (a string, a bool, None, an int past
    float's range such as 10**400), naming it; PyTorch's dispatcher refused the last with a
    RuntimeError that named neither the op's wrapper nor the fix."""
    if isinstance(value, (torch.SymFloat, torch.SymInt)):
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"gradsparse.{op}: {name} must be a number, got {_describe(value)}; {fix}")
    try:
        float(value)
    except OverflowError:
        raise ValueError(f"gradsparse.{op}: {name} must be a finite number, got {_describe(value)}; {fix}") from None


def select_threshold(
    grad: torch.Tensor, residual: torch.Tensor | None, threshold: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused error feedback + threshold selection.

    With ``residual``: ``residual += grad``, select every element with ``|residual| >=
    threshold`` (compared in the tensor's dtype), and zero the selected residual entries, in one
    pass. Without: select from ``grad``. Elements whose sum is NaN/Inf keep their old residual.

    Returns:
        ``(indices, values)``: int64 indices in ascending order and the selected values.
    """
    _real("select_threshold", "threshold", threshold, "pass the magnitude to select at, e.g. 1e-3")
    _one_device("select_threshold", grad=grad, residual=residual)
    _outside_autograd("select_threshold", residual=residual)
    return _ops.select_threshold(grad, residual, threshold)


def select_topk(grad: torch.Tensor, residual: torch.Tensor | None, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused error feedback + exact top-k by magnitude (ties: lowest index first).

    Returns:
        ``(indices, values)`` of the ``min(k, numel)`` selected elements, indices ascending.
    """
    _int("select_topk", "k", k, "pass the count to select, e.g. int(density * grad.numel())")
    _one_device("select_topk", grad=grad, residual=residual)
    _outside_autograd("select_topk", residual=residual)
    return _ops.select_topk(grad, residual, k)


def scatter_add_(out: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, divisor: float = 1.0) -> None:
    """``out.view(-1)[indices] += values / divisor`` (indices count ``out``'s elements, whatever
    its shape) with duplicates accumulated; every index is validated first (IndexError, and
    nothing written, when one is outside ``out``)."""
    _real("scatter_add_", "divisor", divisor, "pass the number of ranks to average over, or 1.0")
    _one_device("scatter_add_", out=out, indices=indices, values=values)
    _outside_autograd("scatter_add_", out=out, values=values)
    _ops.scatter_add_(out, indices, values, divisor)


def pack(indices: torch.Tensor, values: torch.Tensor, dense_size: int) -> torch.Tensor:
    """Packs pairs (indices strictly ascending, in ``[0, dense_size)``) into one uint8 message:
    a 32-byte header, the indices (uint32 when they fit) and the values."""
    _int("pack", "dense_size", dense_size, "pass the number of elements of the dense tensor, e.g. grad.numel()")
    _one_device("pack", indices=indices, values=values)
    return _ops.pack(indices, values, dense_size)


def unpack(message: torch.Tensor, dtype: torch.dtype, dense_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Validates a message (header, length, indices) and returns its ``(indices, values)``."""
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"gradsparse.unpack: dtype must be a torch.dtype, got {_describe(dtype)}; e.g. torch.float32")
    _int("unpack", "dense_size", dense_size, "pass the number of elements of the dense tensor, e.g. grad.numel()")
    return _ops.unpack(message, dtype, dense_size)


@torch.library.register_fake("gradsparse::select_threshold")
def _select_threshold_fake(grad, residual, threshold):
    count = torch.library.get_ctx().new_dynamic_size()
    return grad.new_empty(count, dtype=torch.int64), grad.new_empty(count)


@torch.library.register_fake("gradsparse::select_topk")
def _select_topk_fake(grad, residual, k):
    # A negative k gets an empty result here, so that the kernel, which runs at once, refuses it
    # with its own ValueError: an empty of size -1 failed first, with PyTorch's "negative dimension".
    count = torch.sym_max(0, torch.sym_min(k, grad.numel()))
    return grad.new_empty(count, dtype=torch.int64), grad.new_empty(count)


@torch.library.register_fake("gradsparse::scatter_add_")
def _scatter_add_fake(out, indices, values, divisor=1.0):
    return None


@torch.library.register_fake("gradsparse::pack")
def _pack_fake(indices, values, dense_size):
    # The size follows from the arguments (the layout in docs/architecture.md): the 32-byte header,
    # then the indices (uint32 up to 2^32 elements, else int64) and the values, each padded to a
    # multiple of 8 bytes. A dynamic size would make code that reads message.numel() fail to trace.
    count = values.numel()
    index_bytes = 4 if dense_size <= 2**32 else 8
    size = 32 + _pad8(count * index_bytes) + _pad8(count * values.element_size())
    return values.new_empty(size, dtype=torch.uint8)


def _pad8(nbytes):
    return (nbytes + 7) // 8 * 8


@torch.library.register_fake("gradsparse::unpack")
def _unpack_fake(message, dtype, dense_size):
    count = torch.library.get_ctx().new_dynamic_size()
    return message.new_empty(count, dtype=torch.int64), message.new_empty(count, dtype=dtype)
