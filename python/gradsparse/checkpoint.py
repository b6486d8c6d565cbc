"""Checkpoints holding every rank's residuals in one file.

Error-feedback residuals differ from rank to rank, but most frameworks write a checkpoint from
rank 0 only (Lightning's ``Trainer.save_checkpoint``, Accelerate's ``save_state``), from what
``state_dict()`` returned there. :class:`AllRanks` gathers every rank's state dict to rank 0 for
such a file and, on resume, gives each rank its own part back.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradsparse.state import _STATE_DICT_VERSION, State, _checksum

__all__ = ["AllRanks", "reshard"]


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


def reshard(state_dict: dict, world_size: int) -> dict:
    """An :class:`AllRanks` state dict made for ``world_size`` ranks from one saved at another.

    Every new rank takes the mean of the saved ranks' residuals. The exchanges average over the
    ranks, so the gradient mass still to be applied, (1/P) sum_r e_r, is conserved:
    (1/P') sum_r' e'_r' = (1/P) sum_r e_r. Method states depend on the number of ranks (MiCRO's
    and ExDyna's partitions, SparDL's blocks) and restart, as in a fresh run; the step and rank
    0's statistics are kept.

    Example::

        >>> saved = torch.load("gradsparse-all-ranks.pt")              # AllRanks(state).state_dict(), at 4 ranks
        >>> state.load_state_dict(gradsparse.reshard(saved, dist.get_world_size()))   # on each of 8 ranks
    """
    if not (isinstance(state_dict, dict) and state_dict.get("all_ranks") and state_dict.get("ranks")):
        raise ValueError(
            "gradsparse.reshard: state_dict must hold every rank's residuals, as gradsparse.AllRanks(state)."
            "state_dict() returns on rank 0; one rank's state dict cannot be resharded"
        )
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"gradsparse.reshard: world_size must be an integer >= 1, got {world_size!r}")
    ranks = state_dict["ranks"]
    names = sorted({name for saved in ranks for name in saved["residuals"]})
    residuals = {}
    for name in names:
        parts = [saved["residuals"][name] for saved in ranks if name in saved["residuals"]]
        total = torch.stack([p.double() for p in parts]).sum(0)  # a rank without it holds zeros
        residuals[name] = (total / len(ranks)).to(parts[0].dtype)
    checksums = {name: _checksum(t) for name, t in residuals.items()}
    # Every rank gets the same tensors (load_state_dict copies them; torch.save stores them once).
    new = [
        dict(
            ranks[0], rank=rank, world_size=world_size, residuals=residuals, checksums=checksums, methods=[], layout=[]
        )
        for rank in range(world_size)
    ]
    return dict(state_dict, world_size=world_size, ranks=new)


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_cpu(v) for v in value]
    return value
