"""Drive selection methods over several ranks in one process: every rank is a Python thread that
calls the C++ reduce_bucket through a ThreadTransport. Used by the method tests and the density
benchmark to run the library side by side with plain re-statements.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from gradsparse import _C


@dataclass
class RankStep:
    """What one rank saw in one step."""

    indices: torch.Tensor  # this rank's selection (int64, ascending)
    threshold: float  # the method's reported threshold (NaN if none)
    imbalance: float  # partitioned methods: max count * P / total - 1
    output: torch.Tensor  # the averaged bucket this rank received
    residual: torch.Tensor | None  # the residual after the step (None without error feedback)
    velocity: torch.Tensor | None  # momentum correction's velocity after the step (None without)
    selected_all: int  # pairs sent by all ranks together
    counts: list[int]  # pairs each rank sent (SparDL: each block's final list)
    union_size: int  # elements the exchange wrote
    bytes_sent: int
    collectives: int
    state: dict  # the method's checkpointable state after the step ({} for dense)


def _run_ranks(
    group, methods, buffers, residuals, velocities, momentum: float, nonfinite: str, shard_only: bool, t: int
) -> list:
    """One step: every rank reduces its buffer on its own thread; re-raises a rank's error."""
    world_size = len(methods)
    reports: list = [None] * world_size
    errors: list = [None] * world_size

    def work(r: int) -> None:
        try:
            reports[r] = group.reduce(
                r,
                buffers[r],
                residuals[r],
                methods[r],
                nonfinite=nonfinite,
                shard_only=shard_only,
                velocity=velocities[r],
                momentum=momentum,
                momentum_masking=t > 0,  # every step is sparse: from the second on, the masking applies
            )
        except BaseException as e:  # re-raised below, with the rank
            errors[r] = e
            group.abort(f"rank {r} failed: {e}")

    threads = [threading.Thread(target=work, args=(r,)) for r in range(world_size)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for r, e in enumerate(errors):
        if e is not None:
            raise RuntimeError(f"step {t}, rank {r}: {type(e).__name__}: {e}") from e
    return reports


def run_steps(
    world_size: int,
    make_method: Callable[[int], _C.Method],
    grads: Sequence[Sequence[torch.Tensor]],
    *,
    error_feedback: bool = True,
    nonfinite: str = "raise",
    shard_only: bool = False,
    momentum: float = 0.0,
    before_step: Callable[[int, int, torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None,
    timeout: float = 60.0,
) -> list[list[RankStep]]:
    """Runs ``len(grads)`` steps of one bucket on ``world_size`` thread ranks.

    ``grads[t][r]`` is rank r's gradient at step t (1-D CPU tensor; not modified).
    ``make_method(r)`` builds rank r's method object (None: dense all-reduce). With ``shard_only``
    the bucket is P equal shards and only rank r's shard r of the output is the result (FSDP's
    reduce-scatter). With ``momentum`` every rank keeps a velocity (momentum correction, masked
    from the second step on). ``before_step(t, r, grad, residual)``, when given, returns the buffer
    that rank r reduces at step t (a test's own treatment of the gradient). Returns ``steps[t][r]``.
    """
    group = _C.ThreadGroup(world_size, timeout)
    methods = [make_method(r) for r in range(world_size)]
    n = grads[0][0].numel()
    dtype = grads[0][0].dtype
    residuals = [torch.zeros(n, dtype=dtype) if error_feedback else None for _ in range(world_size)]
    velocities = [torch.zeros(n, dtype=dtype) if momentum else None for _ in range(world_size)]
    steps: list[list[RankStep]] = []
    for t, step_grads in enumerate(grads):
        if before_step is None:
            buffers = [g.clone() for g in step_grads]
        else:
            buffers = [before_step(t, r, g.clone(), residuals[r]) for r, g in enumerate(step_grads)]
        reports = _run_ranks(group, methods, buffers, residuals, velocities, momentum, nonfinite, shard_only, t)
        steps.append(
            [
                RankStep(
                    indices=torch.tensor(indices, dtype=torch.int64),
                    threshold=rep.threshold,
                    imbalance=rep.imbalance,
                    output=buffers[r],
                    residual=None if residuals[r] is None else residuals[r].clone(),
                    velocity=None if velocities[r] is None else velocities[r].clone(),
                    selected_all=rep.selected_all,
                    counts=list(rep.counts),
                    union_size=rep.union_size,
                    bytes_sent=rep.bytes_sent,
                    collectives=rep.collectives,
                    state={} if methods[r] is None else methods[r].state(),
                )
                for r, (rep, indices) in enumerate(reports)
            ]
        )
    return steps
