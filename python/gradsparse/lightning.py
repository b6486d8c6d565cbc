"""PyTorch Lightning: gradient sparsification as a callback.

>>> import lightning.pytorch as pl
>>> import gradsparse as gs
>>> trainer = pl.Trainer(strategy="ddp", callbacks=[gs.lightning.Sparsify(gs.ExDyna(density=0.01))])

The callback registers the state on the DistributedDataParallel that Lightning builds (on CPU and
GPU alike: Lightning's own ``DDPStrategy(ddp_comm_hook=...)`` registers hooks on CUDA devices
only), logs the achieved density, bytes and times through the Trainer's loggers, and keeps every
rank's residuals in the Lightning checkpoint (which rank 0 writes), giving each rank its own back
on resume. Under float16 loss scaling (``precision="16-mixed"`` on CUDA) it hands the Trainer's
GradScaler to the state (``State.set_scaler``), which must then be made with
``nonfinite="propagate"``.

Needs ``lightning`` (``pip install gradsparse[lightning]``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn

from gradsparse.checkpoint import AllRanks
from gradsparse.config import _describe
from gradsparse.hooks import _check_state, register, register_under_scaler
from gradsparse.metrics import logged_figures
from gradsparse.state import State
from gradsparse.wrappers import find_ddp

__all__ = ["Sparsify"]


class Sparsify(Callback):
    """Sparsifies the gradients of a ``strategy="ddp"`` Trainer with ``state``.

    Args:
        state: a gradsparse state, such as ``gradsparse.ExDyna(density=0.01)``; create it
            anywhere (no process group is needed yet).
        prefix: the prefix of the logged metric names (``gradsparse/achieved_density``, ...).

    The callback reads the state's statistics with ``stats(reset=True)`` after every batch, so each
    logged value is that step's; ``state.stats()`` then covers the current step only.
    """

    def __init__(self, state: State, *, prefix: str = "gradsparse/") -> None:
        _check_state("gradsparse.lightning.Sparsify", state)
        if not isinstance(prefix, str):  # else the first batch's log_dict fails, in Python's words
            raise TypeError(
                f"gradsparse.lightning.Sparsify: prefix must be a string, the start of the logged names, got "
                f"{_describe(prefix)}; for example prefix='gradsparse/'"
            )
        self.state = state
        self.prefix = prefix

    @property
    def state_key(self) -> str:
        # One key whatever the method: Lightning hands a callback only the entry under its own key,
        # so a key naming the method (as before 2026-12-01, "...Sparsify[TopK]") let a resume with
        # another method start from zero residuals without a word instead of being refused.
        return "gradsparse.lightning.Sparsify"

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """A checkpoint saved under the earlier keys, which named the method, loads under this one
        (Lightning then calls load_state_dict with it, which refuses another method). fit() from a
        checkpoint that holds no residuals is refused: Lightning calls load_state_dict only with
        an entry, so the run went on from zero residuals without a word."""
        callbacks = checkpoint.get("callbacks") or {}
        earlier = sorted(key for key in callbacks if key.startswith(self.state_key + "["))
        if earlier and self.state_key not in callbacks:
            callbacks[self.state_key] = callbacks.pop(earlier[0])
        if self.state_key not in callbacks and trainer.state.fn == TrainerFn.FITTING:
            raise ValueError(
                "gradsparse.lightning.Sparsify: fit(ckpt_path=...) resumes from a checkpoint that holds no residuals "
                f"(no {self.state_key!r} among its callbacks' states): it was written by a Trainer without Sparsify. "
                "Resume from a checkpoint written with Sparsify, or, to sparsify from that run's weights on, load "
                "them into the module (YourModule.load_from_checkpoint(path)) and fit without ckpt_path"
            )

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        ddp = find_ddp(trainer.strategy.model)
        if ddp is None:
            sharded = isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy))
            raise ValueError(
                f"gradsparse.lightning.Sparsify: the Trainer's strategy {type(trainer.strategy).__name__} does not "
                "train through DistributedDataParallel; use Trainer(strategy='ddp') (or DDPStrategy(...))"
                + (
                    ", or, to shard the model, sparsify FSDP2 without this callback: "
                    "gradsparse.fsdp.sparsify(model, state) after fully_shard (in configure_model, under "
                    "ModelParallelStrategy)"
                    if sharded
                    else ""
                )
            )
        precision = str(trainer.precision)
        if precision.startswith("64"):  # else the first backward fails, advising model.float(), which Lightning undoes
            raise ValueError(
                f"gradsparse.lightning.Sparsify: the Trainer's precision is {precision!r}, so DDP's buckets hold float64 "
                "gradients, and gradsparse sparsifies float32, float16 and bfloat16 ones only: use "
                "Trainer(precision='32-true') (or 'bf16-mixed', 'bf16-true')"
            )
        register_under_scaler(
            self.state,
            getattr(trainer.precision_plugin, "scaler", None),  # precision="16-mixed" on CUDA
            (
                f"gradsparse.lightning.Sparsify: the Trainer's precision {precision!r} scales the loss with a GradScaler",
                "or train with precision='bf16-mixed', which needs no loss scaling",
            ),
            lambda: register(ddp, self.state),  # a second fit() wraps the module in a new DDP: the state moves to it
        )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        figures = logged_figures(self.state.stats(reset=True)["total"], self.prefix)
        if figures:  # none after a batch Lightning accumulated under no_sync: nothing was reduced
            pl_module.log_dict(figures, on_step=True, on_epoch=False, sync_dist=False, rank_zero_only=True)

    def state_dict(self) -> dict[str, Any]:
        if (
            not dist.is_initialized()
        ):  # AllRanks failed in torch's words, "Default process group has not been initialized"
            raise RuntimeError(
                "gradsparse.lightning.Sparsify: trainer.save_checkpoint was called in a process without a process "
                "group, which holds no residuals: under strategy='ddp_spawn', 'ddp_fork' or 'ddp_notebook' the training "
                "and its residuals stay in the processes Lightning started for fit() and end with them. Save "
                "checkpoints during fit() (a ModelCheckpoint callback, or trainer.save_checkpoint in a hook), or "
                "launch with strategy='ddp'"
            )
        return AllRanks(self.state).state_dict()  # collective: Lightning calls it on every rank

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("world_size") if isinstance(state_dict, dict) else None
        group = self.state._group_option
        now = dist.get_world_size(group) if dist.is_initialized() else None
        if isinstance(saved, int) and now is not None and saved != now:
            # The state's own refusal names gradsparse.reshard but not where Lightning keeps the entry.
            raise ValueError(
                f"gradsparse.lightning.Sparsify: the checkpoint's residuals were saved by {saved} ranks, this Trainer "
                f"has {now}; resume with {saved}, or reshard them in the checkpoint once (each rank then starts from "
                "the mean of the saved residuals, which conserves the pending gradient mass; method states restart): "
                "checkpoint = torch.load(path, weights_only=False); "
                f"checkpoint['callbacks']['{self.state_key}'] = gradsparse.reshard("
                f"checkpoint['callbacks']['{self.state_key}'], {now}); torch.save(checkpoint, path)"
            )
        AllRanks(self.state).load_state_dict(state_dict)
