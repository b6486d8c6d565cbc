"""The DDP communication hook of gradsparse.

No `from __future__ import annotations` here: DDP checks the hook's annotations as objects.
"""

import torch
import torch.distributed as dist

from gradsparse.state import State

__all__ = ["hook"]


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
