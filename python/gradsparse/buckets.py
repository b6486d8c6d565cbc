"""The bucket table of a state: the parameters each DDP bucket (or FSDP module) holds, its C++
method object and its per-element state (the error-feedback residual, and the velocity of
momentum correction), with every such tensor addressable by parameter name.

DDP rebuilds its buckets after the first step, and a rebuilt bucket can hold the same parameters
in another order; a checkpoint names residuals and velocities by parameter. So whatever is not in
a bucket is kept by parameter name: when DDP rebuilds its buckets, and when a checkpoint is
loaded, the pieces and method states are *parked* (pieces under their parameter's name, method
states under the names of the parameters their bucket held), and a new bucket assembles its
residual and velocity from the pieces of its parameters and takes the method state parked for
the same parameters.

Under float16 loss scaling (a torch.amp.GradScaler) the gradients are the loss scale times the true
ones, and so is everything the table holds: its residuals, velocities and the numbers methods
carry in gradient units. ``scale`` is the loss scale they are in; :meth:`BucketTable.rescale`
moves all of them to another.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["KINDS", "Bucket", "BucketTable", "Strides", "memory_order", "reorder"]

#: A bucket's per-element state, by kind: a tensor of the bucket's shape each, or None.
KINDS = ("residual", "velocity")

#: A parameter's memory order: its strides, or None for row-major (contiguous). DDP's bucket views
#: follow a parameter's strides, so its residual and velocity hold its elements in that order.
Strides = list[int] | None


def memory_order(param: torch.Tensor) -> Strides:
    """``param``'s memory order (a channels_last convolution's weight is not row-major). DDP's
    bucket view of a parameter whose elements are not dense in memory (a slice with gaps) is
    row-major, whatever its strides."""
    if param.is_contiguous():
        return None
    span = 1  # the elements that the dimensions so far, by increasing stride, cover without a gap
    for stride, size in sorted((s, n) for s, n in zip(param.stride(), param.shape, strict=True) if n != 1):
        if stride != span:
            return None
        span *= size
    return list(param.stride())


def _row_major(shape: list[int]) -> list[int]:
    strides = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        strides[i] = strides[i + 1] * max(shape[i + 1], 1)
    return strides


def reorder(piece: torch.Tensor, shape: list[int], then: Strides, now: Strides) -> torch.Tensor:
    """``piece``, a parameter's elements in memory order ``then``, in memory order ``now``."""
    if then == now:
        return piece
    moved = torch.empty_strided(shape, now or _row_major(shape), dtype=piece.dtype, device=piece.device)
    moved.copy_(piece.reshape(-1).as_strided(shape, then or _row_major(shape)))
    return moved.as_strided((piece.numel(),), (1,))


class Bucket:
    """One bucket: its parameters' names, sizes and memory orders (in bucket order), the bytes of
    one of its values, its method object (None for a dense state), its residual and its velocity
    (each None until it first holds something)."""

    __slots__ = ("index", "method", "names", "numels", "residual", "strides", "value_bytes", "velocity")

    def __init__(
        self, index: int, names: list[str], numels: list[int], strides: list[Strides], value_bytes: int, method
    ) -> None:
        self.index = index
        self.names = names
        self.numels = numels
        self.strides = strides
        self.value_bytes = value_bytes
        self.method = method
        self.residual: torch.Tensor | None = None
        self.velocity: torch.Tensor | None = None

    def views(self, kind: str) -> dict[str, torch.Tensor]:
        """The residual or the velocity (``kind``) split by parameter (views)."""
        tensor = getattr(self, kind)
        if tensor is None:
            return {}
        return dict(zip(self.names, tensor.split(self.numels), strict=True))


class BucketTable:
    """A state's buckets by index, and what is parked for buckets to come (see the module)."""

    def __init__(self) -> None:
        self.buckets: dict[int, Bucket] = {}
        self.parked: dict[str, dict[str, torch.Tensor]] = {kind: {} for kind in KINDS}  # kind -> name -> piece
        # The memory order each parked piece is in, by name; a name without one (a state dict saved
        # before they were recorded) is taken to be in its parameter's order.
        self.parked_strides: dict[str, Strides] = {}
        # Method states by the names of their bucket's parameters; by bucket index where a loaded
        # checkpoint gave no layout for it. Each with the loss scale it is in.
        self.parked_methods: dict[frozenset[str] | int, tuple[dict[str, float], float]] = {}
        self.scale = 1.0  # the loss scale of everything held here (see the module)

    def get(
        self, index: int, names: list[str], numels: list[int], strides: list[Strides], like: torch.Tensor
    ) -> Bucket | None:
        """Bucket `index` if it still holds exactly these parameters, in this order, of these sizes
        and memory orders, in the dtype and on the device of ``like`` (a model converted, to
        channels_last too, or moved, or a layer replaced by one of another shape under the same
        names, between two DDP wrappers: its bucket is assembled anew, add())."""
        bucket = self.buckets.get(index)
        if bucket is None or bucket.names != names or bucket.numels != numels or bucket.strides != strides:
            return None
        held = [t for t in (bucket.residual, bucket.velocity) if t is not None]
        same = bucket.value_bytes == like.element_size() and all(
            t.dtype == like.dtype and t.device == like.device for t in held
        )
        return bucket if same else None

    def park_from(self, index: int) -> None:
        """DDP rebuilt its buckets, and bucket `index` is the first of this step that changed: it
        and every bucket after it park their residuals, velocities and method states, by parameter,
        for the new buckets. The buckets before it kept their parameters and were already reduced
        in this step, so they stay (parked, their pieces would be left behind at the step's end)."""
        for i in [i for i in self.buckets if i >= index]:
            bucket = self.buckets.pop(i)
            for kind in KINDS:
                self.parked[kind].update(bucket.views(kind))
            self.parked_strides.update(zip(bucket.names, bucket.strides, strict=True))
            if bucket.method is not None:
                self.parked_methods[frozenset(bucket.names)] = (bucket.method.state(), self.scale)

    def park(
        self,
        tensors: dict[str, dict[str, torch.Tensor]],
        methods: Iterable[tuple[frozenset[str] | int, dict, float]],
        scale: float,
        strides: dict[str, list[int]] | None,
    ) -> None:
        """Parks what a checkpoint holds (residuals and velocities by kind and name, in loss scale
        ``scale``, in the memory orders ``strides`` names, the others row-major; None: each in its
        parameter's; method states by their parameters' names, or by bucket index, each with the
        loss scale it is in) in place of everything in the table; the table stays as it was when
        they cannot be read."""
        parked = {kind: {name: t.detach().clone() for name, t in tensors.get(kind, {}).items()} for kind in KINDS}
        parked_methods = {key: (dict(state), float(in_scale)) for key, state, in_scale in methods}
        self.clear()
        self.parked = parked
        if strides is not None:
            self.parked_strides = {name: strides.get(name) for pieces in parked.values() for name in pieces}
        self.parked_methods = parked_methods
        self.scale = scale

    def rename(self, renamed: dict[str, str]) -> None:
        """Moves what the table holds under the names that are keys of ``renamed`` (its buckets'
        parameters, parked pieces and method states) to the names they map to."""
        for bucket in self.buckets.values():
            bucket.names = [renamed.get(name, name) for name in bucket.names]
        for kind in KINDS:
            self.parked[kind] = {renamed.get(name, name): piece for name, piece in self.parked[kind].items()}
        self.parked_strides = {renamed.get(name, name): order for name, order in self.parked_strides.items()}
        self.parked_methods = {
            key if isinstance(key, int) else frozenset(renamed.get(name, name) for name in key): held
            for key, held in self.parked_methods.items()
        }

    def _held_tensors(self):
        """Every residual and velocity of the table: the buckets' and the parked pieces."""
        for bucket in self.buckets.values():
            for kind in KINDS:
                tensor = getattr(bucket, kind)
                if tensor is not None:
                    yield tensor
        for pieces in self.parked.values():
            yield from pieces.values()

    def overflows(self, scale: float) -> bool:
        """Whether moving to loss scale ``scale`` would overflow a 16-bit residual or velocity
        (float16 holds at most 65504): a scale that grows can take a residual that fit past it."""
        if not scale > self.scale:
            return False
        factor = scale / self.scale
        return any(
            t.element_size() == 2 and t.numel() > 0 and float(t.abs().max()) * factor > torch.finfo(t.dtype).max
            for t in self._held_tensors()
        )

    def rescale(self, scale: float) -> None:
        """Moves every residual, velocity and method of the table to loss scale ``scale`` (a
        GradScaler changed its scale: this step's gradients are in the new one). Powers of two,
        as GradScaler's factors are, multiply exactly. Method states parked as dicts move when a
        bucket takes them."""
        if scale == self.scale:
            return
        factor = scale / self.scale
        for tensor in self._held_tensors():
            tensor.mul_(factor)
        for bucket in self.buckets.values():
            if bucket.method is not None:
                bucket.method.rescale(factor)
        self.scale = scale

    def add(
        self,
        index: int,
        names: list[str],
        shapes: list[list[int]],
        strides: list[Strides],
        make_method: Callable[[], Any],
        like: torch.Tensor,
    ) -> Bucket:
        """A new bucket `index` of these parameters (of these shapes and memory orders), its method
        state, residual and velocity taken from what is parked for them, in ``like``'s dtype and on
        its device, and in the parameters' memory orders (missing pieces, and those of another
        size, left by a parameter replaced since, are zeros; no piece at all: none yet)."""
        numels = [math.prod(shape) for shape in shapes]
        bucket = Bucket(index, names, numels, strides, like.element_size(), make_method())
        if bucket.method is not None:
            scale = 1.0  # a new method's numbers are in gradient units
            for key in (frozenset(names), index):
                if key in self.parked_methods:
                    state, scale = self.parked_methods.pop(key)
                    bucket.method.load_state(state)
                    break
            if scale != self.scale:
                bucket.method.rescale(self.scale / scale)
        then = [self.parked_strides.pop(name, now) for name, now in zip(names, strides, strict=True)]
        for kind in KINDS:
            pieces = [self.parked[kind].pop(name, None) for name in names]
            pieces = [
                None if p is None or p.numel() != math.prod(shape) else reorder(p, shape, was, now)
                for p, shape, was, now in zip(pieces, shapes, then, strides, strict=True)
            ]
            if any(piece is not None for piece in pieces):
                whole = torch.cat(
                    [
                        torch.zeros(numel, dtype=like.dtype, device=like.device)
                        if piece is None
                        else piece.to(device=like.device, dtype=like.dtype).reshape(-1)
                        for piece, numel in zip(pieces, numels, strict=True)
                    ]
                )
                setattr(bucket, kind, whole)
        self.buckets[index] = bucket
        return bucket

    def end_step(self) -> None:
        """What no bucket of the step took stays behind: a parameter that left the buckets."""
        for parked in self.parked.values():
            parked.clear()
        self.parked_strides.clear()
        self.parked_methods.clear()

    def clear(self) -> None:
        self.buckets.clear()
        self.end_step()

    def copy(self) -> BucketTable:
        """A table of its own holding what this one holds (the same tensors and method objects):
        what park() and clear() change here leave it as it was."""
        table = BucketTable()
        table.buckets = dict(self.buckets)
        table.parked = {kind: dict(pieces) for kind, pieces in self.parked.items()}
        table.parked_strides = dict(self.parked_strides)
        table.parked_methods = dict(self.parked_methods)
        table.scale = self.scale
        return table

    def tensors(self, kind: str) -> dict[str, torch.Tensor]:
        """Every residual or velocity (``kind``) by parameter name: the buckets' (views) and the
        parked pieces."""
        out: dict[str, torch.Tensor] = {}
        for bucket in self.buckets.values():
            out.update(bucket.views(kind))
        for name, piece in self.parked[kind].items():  # parked by a rebuild that an error interrupted
            out.setdefault(name, piece)
        return out

    def strides(self) -> dict[str, list[int]]:
        """The memory order of every residual and velocity that is not row-major, by name."""
        held = {name: order for b in self.buckets.values() for name, order in zip(b.names, b.strides, strict=True)}
        parked = {name for pieces in self.parked.values() for name in pieces}
        held.update((name, order) for name, order in self.parked_strides.items() if name in parked)
        return {name: order for name, order in held.items() if order is not None}

    def methods(self) -> list[dict[str, float] | None]:
        """Method states by bucket index (None for an index without a bucket or method)."""
        return [
            self.buckets[i].method.state() if i in self.buckets and self.buckets[i].method is not None else None
            for i in range(self._count())
        ]

    def parked_method_states(self) -> list[dict]:
        """The method states parked and not yet taken by a bucket (a rebuild or a load that an
        error interrupted), each with the names of its bucket's parameters (sorted) or its bucket
        index, and the loss scale it is in: ``{"names" or "index": ..., "state": ..., "loss_scale": ...}``."""
        entries = []
        for key, (state, scale) in self.parked_methods.items():
            where = {"index": key} if isinstance(key, int) else {"names": sorted(key)}
            entries.append({**where, "state": dict(state), "loss_scale": scale})
        return entries

    def layout(self) -> list[list[str]]:
        """The parameter names of each bucket, by index."""
        return [list(self.buckets[i].names) if i in self.buckets else [] for i in range(self._count())]

    def holds_state(self) -> bool:
        """Whether anything here would be lost without parameter names."""
        return any(self.parked.values()) or any(
            b.method is not None or any(getattr(b, kind) is not None for kind in KINDS) for b in self.buckets.values()
        )

    def _count(self) -> int:
        return max(self.buckets, default=-1) + 1
