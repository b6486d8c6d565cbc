"""Checkpoints holding every rank's residuals in one file.

Error-feedback residuals differ from rank to rank, but most frameworks write a checkpoint from
rank 0 only (Lightning's ``Trainer.save_checkpoint``, Accelerate's ``save_state``), from what
``state_dict()`` returned there. :class:`AllRanks` gathers every rank's state dict to rank 0 for
such a file and, on resume, gives each rank its own part back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsparse.state import _STATE_DICT_VERSION, State

__all__ = ["AllRanks"]


class AllRanks:
    """Wraps a state for checkpointers that save from rank 0 only.

    ``state_dict()`` is collective (every rank must call it, as Lightning and Accelerate do):
    rank 0 receives every rank's state dict, with tensors on the CPU; on the other ranks it
    returns a stub that says so. ``load_state_dict(d)`` on every rank loads that rank's part of
    ``d`` (the world size must match). Rank 0 holds every rank's residuals while it saves: for
    large models on many ranks, save each rank's ``state.state_dict()`` to a file of its own instead.

    Example (Accelerate)::

        >>> accelerator.register_for_checkpointing(gradsparse.AllRanks(state))
    """

    def __init__(self, state: State) -> None:
        if not isinstance(state, State):
            raise TypeError(
                f"gradsparse.AllRanks: state must be a gradsparse state such as gradsparse.TopK(density=0.01), "
                f"got {type(state).__name__}"
            )
        self.state = state

    def state_dict(self) -> dict:
        state = self.state
        mine = _to_cpu(state.state_dict())
        group = state.process_group
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        gathered: list | None = [None] * world_size if rank == 0 else None
        dist.gather_object(mine, gathered, dst=dist.get_global_rank(group, 0), group=group)
        return {
            "version": _STATE_DICT_VERSION,
            "all_ranks": True,
            "class": mine["class"],
            "config": mine["config"],
            "world_size": world_size,
            "ranks": gathered,  # None on ranks other than 0: their copy is not the one saved
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if isinstance(state_dict, dict) and state_dict.get("all_ranks") and state_dict.get("ranks") is None:
            raise ValueError(
                "gradsparse.AllRanks.load_state_dict: this state dict was returned on a rank other than 0, which "
                "holds no residuals; load the one rank 0 saved"
            )
        self.state.load_state_dict(state_dict)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
