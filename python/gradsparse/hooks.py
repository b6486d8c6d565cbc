"""The DDP communication hook of gradsparse.

No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from gradsparse.state import State

__all__ = ["hook", "register"]


def hook(state: State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sparsify, exchange and average one DDP bucket with the method of ``state``.

    1. The bucket goes to the state's engine thread and a future comes back at once, so the
       exchange overlaps the rest of the backward pass.
    2. On the engine thread: residual += gradient and selection in one fused pass, then the
       exchange moves every rank's (index, value) pairs and writes their average into the bucket.
    3. The future completes with the bucket itself (decompressed in place); DDP copies it into
       the gradients.

    Args:
        state: a gradsparse state (:class:`gradsparse.TopK`, ...), one per model.
        bucket: the bucket DDP hands to the hook.

    Returns:
        A future holding the averaged bucket.

    Example::

        >>> state = gradsparse.TopK(density=0.01)
        >>> ddp_model.register_comm_hook(state, gradsparse.hook)
    """
    if not isinstance(state, State):
        raise TypeError(
            f"gradsparse.hook: state must be a gradsparse state such as gradsparse.TopK(density=0.01), "
            f"got {type(state).__name__}"
        )
    return state._reduce(bucket)


def register(model: nn.Module, state: State, *, hook: Callable = hook) -> State:
    """Registers ``state`` as the communication hook of the DistributedDataParallel at or inside
    ``model`` (DDP itself, ``torch.compile(DDP(m))``, a Fabric module); call it on every rank.

    Unlike ``model.register_comm_hook(state, gradsparse.hook)``, which also works, it teaches the
    state the model's parameter names (those of the innermost module, without wrapper prefixes),
    so that its residuals can be checkpointed and restored by name; it checks that the state and
    the model use one process group and that the state serves only this model; and it runs the
    state's collective set-up now (see :meth:`State.setup`) rather than in the first backward.

    ``hook`` (default :func:`gradsparse.hook`) registers another hook that calls
    ``gradsparse.hook(state, bucket)`` itself, for example one that records or times buckets.

    Returns the state.

    Example::

        >>> state = gradsparse.register(ddp_model, gradsparse.TopK(density=0.01))
    """
    if not isinstance(state, State):
        raise TypeError(
            f"gradsparse.register: state must be a gradsparse state such as gradsparse.TopK(density=0.01), "
            f"got {type(state).__name__}"
        )
    # A registration that fails leaves the state as it was: bind() may have raised after taking
    # the model (a loaded state dict whose names do not fit, another process group), and a state
    # left bound there would refuse the retry as a second registration, without a hook.
    before = state._binding.saved()
    try:
        state._bind(model)
        state.setup()
        ddp = state._binding.model()
        try:
            ddp.register_comm_hook(state, hook)
        except RuntimeError as e:
            if "only be called once" not in str(e):
                raise
            raise ValueError(
                "gradsparse.register: this DistributedDataParallel already has a communication hook "
                "(model.register_comm_hook or register_builtin_comm_hook was called on it), and DDP takes one: "
                "register gradsparse on a model that has none, for example one wrapped anew with "
                "DistributedDataParallel(module)"
            ) from e
    except BaseException:
        state._binding.restore(before)
        raise
    return state
