"""Hugging Face Transformers: gradient sparsification for a ``transformers.Trainer``.

>>> import gradsparse as gs
>>> trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
>>> gs.transformers.sparsify(trainer, gs.TopK(density=0.01))
>>> trainer.train()  # or trainer.train(resume_from_checkpoint=True)

When training starts, the state is registered on the DistributedDataParallel that the Trainer
builds (through Accelerate; launch with torchrun, as for any multi-process Trainer). Every
checkpoint the Trainer writes holds every rank's residuals (``gradsparse.pt`` in the checkpoint's
folder, written where the model is: by rank 0, or under ``save_on_each_node=True`` by every node's
first process), and ``train(resume_from_checkpoint=...)`` gives each rank its own back.
Each of the Trainer's training logs (every ``logging_steps``; not an evaluation's) carries
``gradsparse/achieved_density``, ``bytes_sent``, ``bytes_ratio``, ``select_seconds`` and
``exchange_seconds``, per step since the last log (read with ``state.stats(reset=True)``:
``state.stats()`` then covers those steps only).

Needs ``transformers`` (``pip install gradsparse[transformers]``).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from gradsparse.checkpoint import AllRanks
from gradsparse.hooks import _check_state, register, register_under_scaler
from gradsparse.metrics import logged_figures
from gradsparse.state import State
from gradsparse.wrappers import find_ddp

__all__ = ["CHECKPOINT_FILE", "sparsify"]

#: The file that holds every rank's residuals in each checkpoint folder of the Trainer.
CHECKPOINT_FILE = "gradsparse.pt"


def sparsify(trainer: Trainer, state: State) -> State:
    """Makes ``trainer`` reduce its gradients with ``state``'s method and keep every rank's
    residuals in its checkpoints. Call it on every rank, before ``trainer.train()``. Returns the
    state.

    Under float16 loss scaling (``TrainingArguments(fp16=True)`` on CUDA) the state follows the
    Trainer's GradScaler (``State.set_scaler``), and must then be made with
    ``nonfinite="propagate"``. A Trainer made with ``model_init`` (as ``hyperparameter_search``
    uses) builds a new model at every ``train()``: each such model gets a new state of the same
    method and options (the residuals of another model mean nothing to it), and the state
    returned here is the first one's; the callback's ``state`` is the current one.

    Example::

        >>> trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        >>> state = gradsparse.transformers.sparsify(trainer, gradsparse.ExDyna(density=0.01))
        >>> trainer.train()
    """
    _check_state("gradsparse.transformers.sparsify", state, trainer, "gradsparse.transformers.sparsify(trainer, state)")
    if not isinstance(trainer, Trainer):
        raise TypeError(
            f"gradsparse.transformers.sparsify: trainer must be a transformers.Trainer (or a subclass), got "
            f"{type(trainer).__name__}; for a training loop of your own, use gradsparse.register(ddp_model, state)"
        )
    if any(isinstance(c, _Sparsify) for c in trainer.callback_handler.callbacks):
        raise ValueError(
            "gradsparse.transformers.sparsify: this Trainer is sparsified already; call sparsify once per Trainer"
        )
    callback = _Sparsify(trainer, state)
    trainer.add_callback(callback)
    train = trainer.train

    # The Trainer tells no callback which checkpoint it resumes from: the call does.
    @functools.wraps(train)
    def train_with_residuals(resume_from_checkpoint=None, *args, **kwargs):
        resume = resume_from_checkpoint
        if isinstance(resume, bool):  # True: the Trainer's last checkpoint, as it finds it
            resume = get_last_checkpoint(trainer.args.output_dir) if resume else None
        callback.resume_from = resume
        return train(resume_from_checkpoint, *args, **kwargs)

    trainer.train = train_with_residuals
    log, evaluate = trainer.log, trainer.evaluate

    # The figures join the Trainer's own training logs (its reporters, and trainer.state.log_history),
    # which no callback can add to before the reporters read them. An evaluation's log (during
    # training or after it) gets none: the steps since the last training log stay for the next.
    @functools.wraps(log)
    def log_with_figures(logs, *args, **kwargs):
        if not callback.evaluating:
            logs = {**logs, **logged_figures(callback.state.stats(reset=True)["total"], "gradsparse/")}
        return log(logs, *args, **kwargs)

    @functools.wraps(evaluate)
    def evaluate_without_figures(*args, **kwargs):
        callback.evaluating = True
        try:
            return evaluate(*args, **kwargs)
        finally:
            callback.evaluating = False

    trainer.log, trainer.evaluate = log_with_figures, evaluate_without_figures
    return state


class _Sparsify(TrainerCallback):
    """Registers the state when training starts, loads its residuals on resume, and saves them
    with every checkpoint."""

    def __init__(self, trainer: Trainer, state: State) -> None:
        self.trainer = trainer
        self.state = state
        self.resume_from: str | None = None
        self.evaluating = False  # inside trainer.evaluate(), whose log takes no figures
        self.saver: AllRanks | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        model = self.trainer.model_wrapped
        ddp = find_ddp(model)
        if ddp is None:
            raise TypeError(
                f"gradsparse.transformers.sparsify: the Trainer trains a {type(model).__name__}, not a "
                "DistributedDataParallel, so no gradient is exchanged to sparsify: launch it on several processes "
                "(torchrun --nproc-per-node=N train.py; on CPUs with TrainingArguments(use_cpu=True)). Under FSDP, "
                "use gradsparse.fsdp.sparsify in a training loop of your own; DeepSpeed is not supported"
            )
        if self.trainer.model_init is not None and self.state._binding.binds_another_module(ddp):
            # a new model from model_init (hyperparameter_search: every trial): a new state for it
            self.state.close()
            self.state = type(self.state)(**self.state.config(), process_group=self.state._group_option)
            self.saver = None
        register_under_scaler(
            self.state,
            getattr(self.trainer.accelerator, "scaler", None),  # TrainingArguments(fp16=True) on CUDA
            (
                "gradsparse.transformers.sparsify: the Trainer scales the loss with a GradScaler "
                "(TrainingArguments(fp16=True))",
                "or train with bf16=True, which needs no loss scaling",
            ),
            # a later train() may wrap the model anew
            lambda: register(model, self.state) if ddp is not self.state._binding.model() else None,
        )
        if self.resume_from is not None:
            path = os.path.join(self.resume_from, CHECKPOINT_FILE)
            if not os.path.isfile(path):
                raise FileNotFoundError(
                    f"gradsparse.transformers.sparsify: the checkpoint {self.resume_from} holds no residuals "
                    f"({CHECKPOINT_FILE}): it was written by a Trainer without gradsparse.transformers.sparsify, or "
                    "the process that saves stopped before writing them. Resume from a checkpoint written with "
                    "sparsify (the Trainer's earlier ones), or resume that one without sparsify"
                )
            AllRanks(self.state).load_state_dict(torch.load(path))
            self.resume_from = None  # a later train() without resume_from_checkpoint starts from this state

    def on_save(self, args, state, control, **kwargs):
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if self.saver is None:  # one, whose group of the nodes' first processes is made once
            self.saver = AllRanks(self.state, each_node=args.save_on_each_node)
        saved = self.saver.state_dict()  # collective: every rank gives its own
        if saved["ranks"] is not None:  # rank 0, and under save_on_each_node each node's first process
            torch.save(saved, os.path.join(folder, CHECKPOINT_FILE))
        dist.barrier(group=self.state.process_group)  # a resume in this run reads the file on every rank
