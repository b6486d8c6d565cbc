"""The training driver shared by the examples (cnn, lstm, ncf).

It owns everything that is not the task: the process group (from torchrun's, OpenMPI's or
SLURM's variables through gradsparse.launch), DDP (or FSDP2 with --fsdp), the chosen method,
the optimizer's learning-rate schedule with warm-up, checkpoints and exact resume, per-step and
per-epoch metrics (CSV and TensorBoard) and the progress bar. A task module supplies a
:class:`Task` and its own arguments; see examples/cnn/__main__.py for the smallest one.

Every run writes to ``--out`` (one folder per method when several are given):

    config.json             the arguments
    steps.csv, epochs.csv   metrics per step and per epoch
    tb/                     TensorBoard event files (when tensorboard is installed)
    checkpoint-rank<r>.pt   model, optimizer, schedule, gradsparse state (residuals), RNG states
    checkpoint-rank<r>.pt.previous   the one before it, which a resume takes where a process
                            stopped while the ranks saved (their latest a save apart)

A run whose folder holds checkpoints resumes from them (``--fresh`` starts over), with the options
it was saved with: changing one that shapes the training (all but :data:`RESUMABLE`) is refused.

``--synthetic-data`` replaces the dataset with random inputs of its shapes and sizes, so that the
seeds' models can be measured at their real sizes where their data cannot be downloaded: such a
run neither evaluates (the quality of random data means nothing) nor checkpoints, and its summary
gives each method's step time and traffic against the first method's.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import csv
import gc
import glob
import itertools
import json
import logging
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsparse as gs

try:  # optional: the progress bar
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None

# ----------------------------------------------------------------------------------------------
# Tasks
# ----------------------------------------------------------------------------------------------


class Task:
    """What a task module hands to the driver. Subclasses set ``name`` and ``metric`` and
    implement the methods that raise NotImplementedError."""

    name = "task"
    metric = "accuracy"  # the main quality figure evaluate() returns
    metric_fields: tuple[str, ...] = ("accuracy",)  # every key evaluate() returns
    higher_is_better = True
    samples_per_batch = 1  # for throughput: examples (or tokens) per batch per rank
    # The class make_optimizer builds, known before the task loads its data: --momentum-correction,
    # which moves SGD's momentum into the method, is refused up front for another optimizer.
    optimizer_class: type[torch.optim.Optimizer] = torch.optim.SGD

    def target(self, final: float) -> tuple[float, str]:
        """The quality a run must reach to count as "the same" as a reference run that ended at
        ``final``, and how it was set: 1 point below for a score (accuracy, HR@10), 5% above
        for a perplexity."""
        if self.higher_is_better:
            return final - 0.01, f"{final:.4f} - 0.01"
        return final * 1.05, f"{final:.4f} x 1.05"

    def reached(self, value: float, target: float) -> bool:
        """Whether ``value`` meets ``target``, to 12 digits: a target set by subtraction (0.5006 -
        0.01) lands a hair above the same quality counted as correct / total (0.4906)."""
        slack = 1e-12 * max(1.0, abs(target))
        return value >= target - slack if self.higher_is_better else value <= target + slack

    def build_model(self) -> nn.Module:
        raise NotImplementedError

    def steps_per_epoch(self, world_size: int) -> int:
        raise NotImplementedError

    def batches(self, epoch: int, rank: int, world_size: int) -> Iterator[Any]:
        """This rank's batches of an epoch, deterministic in (seed, epoch): resuming skips the
        ones already trained."""
        raise NotImplementedError

    def train_step(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Forward pass and loss of one batch (the driver runs backward and the optimizer)."""
        raise NotImplementedError

    def evaluate(self, model: nn.Module, rank: int, world_size: int) -> dict[str, float]:
        """Metrics on the held-out data, the same on every rank (all-reduce inside)."""
        raise NotImplementedError

    def make_optimizer(self, params, args: argparse.Namespace) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)

    def start_epoch(self, epoch: int) -> None:
        """Called before each epoch's first batch (for example to reset a recurrent state)."""

    def state_dict(self) -> dict:
        """Task state that a checkpoint must carry (for example a recurrent hidden state)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def dataset_label(args: argparse.Namespace) -> str:
    """The dataset as a task's name shows it: "cifar10", or "synthetic cifar10" (--synthetic-data)."""
    return f"synthetic {args.dataset}" if args.synthetic_data else args.dataset


# ----------------------------------------------------------------------------------------------
# Methods: dense (gradsparse's Dense), torch's built-in hooks, every gradsparse method
# ----------------------------------------------------------------------------------------------

TORCH_HOOKS = ("powersgd", "fp16")
METHODS = ("dense", *TORCH_HOOKS, *[m for m in gs.METHODS if m != "dense"])


#: Method options the driver sets from its own flags: --density and --threshold (with the
#: driver's defaults), and --seed (the training seed) is not passed on.
DRIVER_OPTIONS = ("density", "threshold", "seed")


def method_flags() -> dict[str, tuple[dict, str]]:
    """Every other option of every gradsparse method, by name: the argparse keywords of its
    flag and its help (each method's documentation of it). Methods that share an option name
    share its flag (with every method's choices: a method given a choice it does not take says
    so when it is built)."""
    flags: dict[str, tuple[dict, dict[str, list[str]]]] = {}
    for method, cls in gs.METHODS.items():
        for option in cls.OPTIONS:
            if option.name in DRIVER_OPTIONS:
                continue
            flag, docs = flags.setdefault(option.name, (dict(option.flag), {}))
            if "choices" in flag and "choices" in option.flag:  # the methods' choices together; each checks its own
                flag["choices"] = (*flag["choices"], *(c for c in option.flag["choices"] if c not in flag["choices"]))
            assert flag.keys() == option.flag.keys() and all(
                flag[key] == option.flag[key] for key in flag if key != "choices"
            ), f"--{option.name}: {method} declares it unlike {list(docs.values())}"
            doc = option.doc if option.default is None else f"{option.doc} (default {option.default!r})"
            docs.setdefault(doc, []).append(method)
    return {
        name: (flag, "; ".join(f"{', '.join(methods)}: {doc}" for doc, methods in docs.items()).replace("%", "%%"))
        for name, (flag, docs) in flags.items()
    }


def method_options(method: str) -> set[str]:
    """The method options a method reads from the command line (by argparse name): a gradsparse
    method's own (--density, --threshold and the flags of method_flags(); not --seed, the training
    seed of every method), powersgd's --powersgd-rank; none for fp16. Threshold reads --density
    where --threshold is not given (gradsparse_options)."""
    if method == "powersgd":
        return {"powersgd_rank"}
    if method not in gs.METHODS:
        return set()
    return {option.name for option in gs.METHODS[method].OPTIONS} - {"seed"}


#: Every method's options (method_options), by argparse name.
METHOD_OPTIONS = frozenset().union(*(method_options(method) for method in METHODS))


def gradsparse_options(method: str, args: argparse.Namespace) -> dict[str, Any]:
    """The gradsparse constructor arguments a method takes from the command line."""
    options: dict[str, Any] = {
        "warmup_steps": args.sparse_warmup_steps,
        "reference": args.reference,
        "transport": args.transport,
    }
    if args.momentum_correction:
        options["momentum"] = args.momentum
    if args.amp == "fp16":  # a step that overflowed reaches the GradScaler as NaN (State.set_scaler)
        options["nonfinite"] = "propagate"
    if method == "threshold" and args.threshold is not None:
        options["threshold"] = args.threshold
    elif method != "dense":  # threshold without --threshold: Threshold(density=...) (check_arguments)
        options["density"] = args.density
    for option in gs.METHODS[method].OPTIONS:
        value = getattr(args, option.name, None)
        if option.name not in DRIVER_OPTIONS and value is not None:
            options[option.name] = value
    return options


def uses_gradsparse(method: str, args: argparse.Namespace) -> bool:
    """Whether the run's gradients go through a gradsparse state: every gradsparse method, except
    dense with --fsdp (FSDP's own reduce-scatter)."""
    return method in gs.METHODS and not (args.fsdp and method == "dense")


def momentum_correction_refusal(optimizer_class: type[torch.optim.Optimizer]) -> str:
    return (
        f"--momentum-correction moves SGD's momentum into the method, but this task trains with "
        f"{optimizer_class.__name__}; drop the flag"
    )


def optimizer_args(method: str, args: argparse.Namespace) -> argparse.Namespace:
    """The arguments the optimizer is built from: with --momentum-correction a gradsparse method
    applies the momentum (gradsparse_options), so the optimizer's is 0; dense with --fsdp has no
    gradsparse state, so its optimizer keeps the momentum."""
    if args.momentum_correction and uses_gradsparse(method, args):
        return argparse.Namespace(**{**vars(args), "momentum": 0.0})
    return args


class Communication:
    """The gradient communication of one run (DDP's hook, or FSDP's reduce-scatter with --fsdp):
    installs the method and reports density and traffic."""

    def __init__(self, method: str, parallel: nn.Module, args: argparse.Namespace, world_size: int):
        self.method = method
        self.state: gs.State | None = None
        self.torch_state = None
        self.exchanges = ""  # the exchanges of the buckets, as last reported
        module = parallel if args.fsdp else parallel.module
        numel = sum(p.numel() for p in module.parameters())
        # Bytes sent per byte reduced: a ring all-reduce's 2 (P - 1) / P (gradsparse's rule), or
        # FSDP's reduce-scatter's (P - 1) / P.
        ring = (1 if args.fsdp else 2) * (world_size - 1) / world_size
        self.dense_bytes = int(ring * numel * 4)
        self.bytes_per_step = self.dense_bytes
        if args.fsdp and method in ("fp16", "powersgd"):
            raise SystemExit(
                f"--method {method} is a DDP hook of torch's; with --fsdp use dense or a gradsparse method"
            )
        if uses_gradsparse(method, args):  # dense FSDP: its own reduce-scatter
            state = gs.METHODS[method](**gradsparse_options(method, args))
            try:  # refused on every rank alike (--transport mpi under torchrun, say): no traceback
                self.state = gs.fsdp.sparsify(parallel, state) if args.fsdp else gs.register(parallel, state)
            except (TypeError, ValueError) as e:
                exit_on_every_rank(f"--method {method}: {e}")
        elif method == "fp16":
            parallel.register_comm_hook(None, default_hooks.fp16_compress_hook)
            self.bytes_per_step = int(ring * numel * 2)
        elif method == "powersgd":
            self.torch_state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=args.powersgd_rank,
                start_powerSGD_iter=2,
                random_seed=args.seed,
            )
            parallel.register_comm_hook(self.torch_state, powerSGD_hook.powerSGD_hook)
            self.bytes_per_step = int(ring * 4 * _powersgd_elements(parallel.module, args.powersgd_rank))

    def step_figures(self) -> dict[str, float]:
        """Achieved density, bytes sent by this rank, selection and exchange seconds since the
        last call."""
        if self.state is None:
            sent = self.bytes_per_step
            # PowerSGD all-reduces the whole gradient until start_powerSGD_iter (its hook counts a
            # step at the step's last bucket: after step s, iter is s + 1)
            if self.torch_state is not None and self.torch_state.iter <= self.torch_state.start_powerSGD_iter:
                sent = self.dense_bytes
            return {
                "density": sent / self.dense_bytes if self.dense_bytes else 1.0,
                "bytes_sent": sent,
                "select_seconds": 0.0,
                "exchange_seconds": 0.0,
            }
        stats = self.state.stats(reset=True)
        # The exchanges, whenever they change (DDP's first rebuild of its buckets included): what
        # exchange="auto" chose, for one. At several ranks it alternates its two exchanges while
        # it times them (gradsparse.exchange_trial), and is reported once it has decided.
        trial = stats.get("exchange_trial")
        if dist.get_rank() == 0 and not ("exchange_trial" in stats and trial is None):
            names = {b["exchange"] for b in stats["buckets"].values()}
            where = ", ".join(f"bucket {i}: {b['exchange']}" for i, b in stats["buckets"].items())
            where = names.pop() if len(names) == 1 else where
            if trial:
                timed = "; ".join(
                    f"bucket {i}: " + ", ".join(f"{name} {1e3 * seconds:.1f}" for name, seconds in means.items())
                    for i, means in trial.items()
                )
                where += f" (timed, ms: {timed})"
            if where != self.exchanges:
                print(f"[{self.method:>9}] exchange: {where}", flush=True)
            self.exchanges = where
        total = stats["total"]
        density = total["achieved_density"]
        return {
            "density": 1.0 if math.isnan(density) else density,
            "bytes_sent": total["bytes_sent"],
            "select_seconds": total["select_seconds"],
            "exchange_seconds": total["exchange_seconds"],
        }

    @contextlib.contextmanager
    def discarded(self):
        """An iteration whose gradients are thrown away leaves PowerSGD's state as it was."""
        # A copy taken now: state_dict() holds PowerSGD's live dicts, whose entries the hook replaces.
        saved = copy.deepcopy(self.state_dict())
        yield
        self.load_state_dict(saved)

    def state_dict(self) -> dict:
        if self.state is not None:
            return {"gradsparse": self.state.state_dict()}
        if self.torch_state is not None:  # PowerSGD keeps error feedback and warm-start matrices
            with _quiet_powersgd():
                return {"powersgd": self.torch_state.__getstate__()}
        return {}

    def load_state_dict(self, saved: dict) -> None:
        if self.state is not None:
            self.state.load_state_dict(saved["gradsparse"])
        elif self.torch_state is not None:
            with _quiet_powersgd():
                self.torch_state.__setstate__(saved["powersgd"])

    def close(self) -> None:
        if self.state is not None:
            self.state.close()


@contextlib.contextmanager
def _quiet_powersgd():
    """PowerSGDState's __getstate__/__setstate__ log a note at every call that the process group
    is not saved (it is set again on load): expected here, so kept out of the output."""
    log = logging.getLogger(powerSGD_hook.__name__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def _powersgd_elements(model: nn.Module, rank: int) -> int:
    """Elements PowerSGD all-reduces per step once it compresses: P and Q for matrices whose size
    that more than halves (torch's default min_compression_rate), the tensor itself otherwise."""
    total = 0
    for p in model.parameters():
        n, m = (p.shape[0], p.numel() // p.shape[0]) if p.dim() > 1 else (p.numel(), 1)
        r = min(n, m, rank)
        compressed = (n + m) * r
        total += compressed if p.dim() > 1 and 2 * compressed < n * m else p.numel()  # torch's _should_compress
    return total


# ----------------------------------------------------------------------------------------------
# Arguments and presets
# ----------------------------------------------------------------------------------------------


def count(text: str) -> int:
    """argparse type of the options where 0 means "all" or "none": a negative number is refused."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative: give 0 or a positive number")
    return value


def thread_count(text: str) -> int:
    """argparse type of --threads: 0 (the launcher's share) or a count the CPU kernels take."""
    value = count(text)
    if value > gs.MAX_THREADS:  # else gradsparse.set_num_threads' ValueError on every rank, once launched
        raise argparse.ArgumentTypeError(
            f"{value} is more than {gs.MAX_THREADS}, the most gradsparse's CPU kernels take: give a count up to "
            f"{gs.MAX_THREADS}, or 0 for OMP_NUM_THREADS, else this process's share of the CPUs"
        )
    return value


def seed(text: str) -> int:
    """argparse type of --seed: the runs derive their data order and augmentation from it in
    64-bit arithmetic (seed * 100003 + ...), so it is kept to 32 bits."""
    value = int(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"{value} is outside 0 to {2**32 - 1}: give a seed in that range")
    return value


def positive(text: str) -> int:
    """argparse type of sizes and counts that must be at least 1 (epochs, batch size, widths)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not positive: give 1 or more")
    return value


def _outside(value: float, low: float, high: float = math.inf, low_ok: bool = True) -> str | None:
    """None when ``value`` is a finite number >= ``low`` (> with ``low_ok`` False) and < ``high``;
    else those bounds as the errors name them, for example ">= 0 and < 1"."""
    above = value >= low if low_ok else value > low
    if math.isfinite(value) and above and value < high:
        return None
    return f"{'>=' if low_ok else '>'} {low:g}" + ("" if high == math.inf else f" and < {high:g}")


def bounded(low: float, high: float = math.inf, *, low_ok: bool = True, example: str) -> Callable[[str], float]:
    """argparse type of a finite number >= ``low`` (> with ``low_ok`` False) and < ``high``: text
    that is no number, NaN, infinities and numbers out of bounds are refused with the bounds and
    ``example``, which argparse prefixes with the flag."""

    def number(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        bounds = _outside(value, low, high, low_ok)
        if bounds is not None:
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number {bounds}: give for example {example}")
        return value

    return number


#: argparse type of dropout probabilities: a number in [0, 1) (NaN reached the first forward).
probability = bounded(0, 1, example="0.2 (0: none)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("method")
    g.add_argument(
        "--method",
        default="dense,topk",
        help=f"method, or comma-separated methods trained one after the other: {', '.join(METHODS)} "
        "(dense: an all-reduce of every gradient, through gradsparse's Dense state, the baseline; powersgd, fp16: "
        "torch's built-in hooks)",
    )
    g.add_argument("--density", type=float, default=0.01, help="fraction of each bucket sent")
    g.add_argument(
        "--threshold",
        type=float,
        default=1e-3,
        help="threshold: magnitude threshold; with --density given and --threshold not, threshold takes that "
        "density's threshold 1 / (2 sqrt(k)) per bucket instead",
    )
    for name, (flag, help_text) in method_flags().items():  # default None: the method's own default
        g.add_argument("--" + name.replace("_", "-"), default=None, help=help_text, **flag)
    g.add_argument("--powersgd-rank", type=positive, default=4, help="powersgd: matrix approximation rank")
    g.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="DDP's bucket size in MB (default 25); a gradsparse method selects density x size per bucket",
    )
    g.add_argument(
        "--fsdp",
        action="store_true",
        help="shard the model with FSDP2 (fully_shard) instead of DDP: the method replaces FSDP's reduce-scatter",
    )
    g.add_argument("--sparse-warmup-steps", type=count, default=0, help="dense steps before sparsification")
    g.add_argument("--reference", action="store_true", help="the original code's rules (docs/methods.md)")
    g.add_argument(
        "--momentum-correction",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="gradsparse methods apply --momentum themselves (momentum correction: each rank's velocity is "
        "sparsified, with error feedback) and the optimizer runs without it; torch's hooks keep it in the optimizer. "
        "On in the CNN's main-job preset, which a run without --preset takes (--no-momentum-correction turns it off)",
    )
    g.add_argument(
        "--transport",
        choices=("process_group", "mpi"),
        default="process_group",
        help="what gradsparse's exchanges run on: the torch.distributed group, or OpenMPI (under mpirun)",
    )
    g = parser.add_argument_group("training")
    g.add_argument("--preset", default=None, help="named settings of the original benchmarks (see --list-presets)")
    g.add_argument("--list-presets", action="store_true", help="print the presets and exit")
    g.add_argument("--epochs", type=positive, default=2)
    g.add_argument("--batch-size", type=positive, default=64, help="per worker")
    g.add_argument("--lr", type=float, default=0.05, help="peak learning rate")
    g.add_argument("--lr-warmup-epochs", type=float, default=0.0, help="linear warm-up from lr / 10")
    g.add_argument("--lr-milestones", default="", help="comma-separated epochs at which the lr drops x0.1")
    g.add_argument("--momentum", type=float, default=0.9)
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--clip", type=float, default=0.0, help="gradient norm clipping (0: none)")
    g.add_argument(
        "--amp",
        choices=("off", "fp16", "bf16"),
        default="off",
        help="mixed precision: the forward pass autocast to float16, with a GradScaler (gradsparse methods run "
        "with nonfinite='propagate' and their residuals follow its scale), or to bfloat16 (no scaler); on the CPU "
        "float16 runs far slower than float32 (dense on the CNN 270 s an epoch against 6 s, examples/README.md): it is for GPUs",
    )
    g.add_argument("--seed", type=seed, default=0)
    g.add_argument("--max-steps", type=count, default=0, help="stop (with a checkpoint) after this many steps")
    g.add_argument(
        "--threads",
        type=thread_count,
        default=0,
        help="CPU threads per worker (0: OMP_NUM_THREADS, else this process's CPUs / local workers)",
    )
    g.add_argument(
        "--backend",
        choices=("auto", "nccl", "gloo", "mpi"),
        default="auto",
        help="process group backend (auto: nccl where CUDA is available, else gloo; mpi: a torch built with MPI); gloo on a GPU "
        "machine trains CUDA tensors over Gloo, several workers may share one GPU",
    )
    g.add_argument("--data-dir", default=None, help="folder holding the dataset files")
    g.add_argument("--out", default=None, help="run folder (default runs/<task>)")
    g.add_argument("--checkpoint-every", type=count, default=0, help="also checkpoint every N steps")
    g.add_argument("--fresh", action="store_true", help="ignore existing checkpoints")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--synthetic-data",
        action="store_true",
        help="random inputs of the dataset's shapes and sizes: step time and traffic only (no evaluation, "
        "no checkpoints)",
    )


def preset_flag(key: str, value: Any) -> str:
    """A preset's setting as the command line gives it (a switch as --x or --no-x)."""
    flag = key.replace("_", "-")
    if isinstance(value, bool):
        return f"--{flag}" if value else f"--no-{flag}"
    return f"--{flag} {value}"


def apply_preset(parser: argparse.ArgumentParser, args: argparse.Namespace, presets: dict, argv) -> None:
    """Fills the preset's settings into every argument the command line did not give."""
    if args.preset is None:
        return
    if args.preset not in presets:
        parser.error(f"--preset: unknown preset {args.preset!r}; choose from {', '.join(sorted(presets))}")
    given = given_options(parser, args, argv)
    for key, value in presets[args.preset].items():
        if key not in given:
            setattr(args, key, value)


def given_options(parser: argparse.ArgumentParser, args: argparse.Namespace, argv) -> set[str]:
    """The options the command line gave, as argparse read them (abbreviations such as --epoch
    and --no-x included): parsed again into a namespace whose every value is a marker, which
    argparse replaces only for the options given."""
    unset = object()
    probe = argparse.Namespace(**dict.fromkeys(vars(args), unset))
    parser.parse_known_args(argv, namespace=probe)
    return {key for key, value in vars(probe).items() if value is not unset}


# ----------------------------------------------------------------------------------------------
# Process group
# ----------------------------------------------------------------------------------------------


def check_arguments(
    parser: argparse.ArgumentParser,
    args: argparse.Namespace,
    methods: list[str],
    argv,
    optimizer_class: type[torch.optim.Optimizer] = Task.optimizer_class,
) -> None:
    """Refuses, on every rank and before the process group, what argparse's types let through
    (NaN, negative rates, unreadable milestones), every gradsparse method's options as its state
    checks them (otherwise a bad --density surfaced as a traceback when its method's turn came,
    after the methods before it had trained), --momentum-correction and --momentum with a task
    whose ``optimizer_class`` is not SGD (refused only once the data had loaded, or ignored), and
    a method option that no method of --method reads (ignored without a word). Threshold given
    --density and no --threshold takes that density: args.threshold becomes None."""
    given = given_options(parser, args, argv)

    def number(flag: str, value: float | None, low: float, high: float = math.inf, low_ok: bool = True) -> None:
        bounds = None if value is None else _outside(value, low, high, low_ok)
        if bounds is not None:
            parser.error(f"{flag} must be a finite number {bounds}, got {value}")

    number("--lr", args.lr, 0.0, low_ok=False)
    number("--momentum", args.momentum, 0.0, 1.0)
    number("--weight-decay", args.weight_decay, 0.0)
    number("--clip", args.clip, 0.0)
    number("--lr-warmup-epochs", args.lr_warmup_epochs, 0.0)
    number("--bucket-cap-mb", args.bucket_cap_mb, 0.0, low_ok=False)
    if args.fsdp and "bucket_cap_mb" in given:  # else ignored without a word
        parser.error(
            f"--bucket-cap-mb {args.bucket_cap_mb} sizes DDP's buckets, and --fsdp builds none: FSDP exchanges "
            "each fully_shard module's gradients at once (one residual per module); drop one of the two"
        )
    if args.momentum_correction and not issubclass(optimizer_class, torch.optim.SGD):
        parser.error(momentum_correction_refusal(optimizer_class))
    if "momentum" in given and not issubclass(optimizer_class, torch.optim.SGD):
        parser.error(f"--momentum is SGD's, but this task trains with {optimizer_class.__name__}; drop the flag")
    read = set().union(*(method_options(method) for method in methods))
    for name in sorted((given & METHOD_OPTIONS) - read):
        readers = [method for method in METHODS if name in method_options(method)]
        parser.error(
            f"--{name.replace('_', '-')} is an option of {', '.join(readers)}, and --method {args.method} trains "
            "none of them: drop the flag, or add one of those methods"
        )
    if "threshold" in methods and "density" in given and "threshold" not in given:
        args.threshold = None
    for milestone in str(args.lr_milestones).split(","):
        try:
            ok = not milestone.strip() or math.isfinite(float(milestone))
        except ValueError:
            ok = False
        if not ok:
            parser.error(
                f"--lr-milestones: {milestone.strip()!r} is no epoch; write epochs separated by commas, e.g. 80,120"
            )
        if milestone.strip() and float(milestone) <= 0:  # every step is at or past it: the rate /10 from the start
            parser.error(
                f"--lr-milestones: {milestone.strip()} is not after the start of training; give epochs > 0, "
                "e.g. 80,120 (for a lower rate from the start, lower --lr)"
            )
    for method in methods:
        if method in gs.METHODS:
            try:
                gs.METHODS[method](**gradsparse_options(method, args))
            except (TypeError, ValueError) as e:
                parser.error(f"--method {method}: {e}")
        elif args.fsdp:  # else refused by Communication at its turn, after the methods before it had trained
            parser.error(f"--method {method} is a DDP hook of torch's; with --fsdp use dense or a gradsparse method")


def init_distributed(args: argparse.Namespace) -> tuple[int, int]:
    """Joins the process group described by the launcher's environment: torchrun's variables,
    or OpenMPI's and SLURM's mapped by gradsparse.launch. Returns (rank, world size)."""
    launcher = gs.launch.setup_environment()
    if launcher == "none":
        raise SystemExit(
            "no launcher found: run under torchrun, mpirun or srun, for example "
            f"`torchrun --standalone --nproc-per-node=4 -m {_module()}`"
        )
    try:
        threads = args.threads or gs.launch.threads_per_worker(launcher)
    except ValueError as e:  # a bad OMP_NUM_THREADS, say: the same on every rank, before the process group
        raise SystemExit(str(e)) from None
    torch.set_num_threads(threads)
    gs.set_num_threads(threads)
    # The methods of a job train in turn in one process: with glibc's defaults the first ones
    # faulted their gradients in anew each step and the later ones did not (README, "Launch").
    gs.launch.keep_freed_memory()
    backend = args.backend if args.backend != "auto" else "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "mpi" and not dist.is_mpi_available():  # pip's torch: else torch's traceback
        raise SystemExit(
            "--backend mpi: this torch has no MPI backend (torch.distributed.is_mpi_available() is False, as in "
            "pip's builds); use --backend gloo (across nodes: mpirun -x MASTER_ADDR=node1 "
            "-x MASTER_PORT=29500 ...), or a torch built from source against MPI"
        )
    if backend != "mpi" and "MASTER_ADDR" not in os.environ:  # mpirun across nodes (gradsparse.launch)
        raise SystemExit(
            f"MASTER_ADDR is unset: this mpirun spans several nodes, and the {backend} process group meets at "
            "rank 0's node; pass its address to every worker (mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29500 ...)"
            + (", or --backend mpi" if dist.is_mpi_available() else "")
        )
    if torch.cuda.is_available():
        # One GPU per local worker (or several workers sharing a GPU over Gloo); a task bound to
        # its own GPU (srun --gpus-per-task=1) sees one.
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    # NCCL moves CUDA tensors only; the driver's own bookkeeping (resume agreement, metrics)
    # uses CPU tensors, which Gloo carries beside it.
    dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else backend)
    return dist.get_rank(), dist.get_world_size()


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


# ----------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------

STEP_FIELDS = [
    "step", "epoch", "loss", "lr", "density", "bytes_sent", "select_seconds", "exchange_seconds",
    "step_seconds", "throughput", "elapsed_seconds",
]  # fmt: skip


class Recorder:
    """CSV files and TensorBoard, written by rank 0; appends when a run resumes."""

    def __init__(self, folder: str, metric_fields: list[str], rank: int, resume: bool, step: int = 0):
        """``resume``: continue the files of a run resumed at ``step``, whose rows and TensorBoard
        events past that step (trained after its last checkpoint, by a process that then stopped)
        are dropped, since the resumed run trains those steps again."""
        self.active = rank == 0
        self.epoch_fields = ["epoch", "step", "loss", *metric_fields, "density", "bytes_sent", "bytes_total",
                             "train_seconds", "elapsed_seconds"]  # fmt: skip
        self.writer = None
        if not self.active:
            return
        self.steps = self._open(os.path.join(folder, "steps.csv"), STEP_FIELDS, resume, step)
        self.epochs = self._open(os.path.join(folder, "epochs.csv"), self.epoch_fields, resume, step)
        try:
            from torch.utils.tensorboard import SummaryWriter

            # A resumed run hides the events past its checkpoint that the stopped process logged.
            self.writer = SummaryWriter(os.path.join(folder, "tb"), purge_step=step + 1 if resume else None)
        except ImportError:  # pragma: no cover - tensorboard is an optional dependency
            print("tensorboard is not installed: metrics go to CSV only (pip install tensorboard)", flush=True)

    @staticmethod
    def _open(path: str, fields: list[str], resume: bool, step: int = 0):
        fresh = not (resume and os.path.exists(path))
        if not fresh:
            Recorder._drop_rows_after(path, fields, step)
        f = open(path, "w" if fresh else "a", newline="")  # noqa: SIM115 (closed in close())
        writer = csv.DictWriter(f, fieldnames=fields)
        if fresh:
            writer.writeheader()
        return f, writer

    @staticmethod
    def _drop_rows_after(path: str, fields: list[str], step: int) -> None:
        """Rewrites the CSV file at ``path`` with its rows up to ``step`` (a row cut short by a
        stop in the middle of its writing is dropped too)."""
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))

        def kept(row: dict) -> bool:
            try:
                return None not in row.values() and float(row["step"]) <= step
            except (KeyError, TypeError, ValueError):
                return False

        keep = [row for row in rows if kept(row)]
        tmp = path + ".tmp"  # written whole even when every row stays: a cut-short last line has no line end
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(keep)
        os.replace(tmp, path)

    def step(self, row: dict) -> None:
        if not self.active:
            return
        self.steps[1].writerow({k: row[k] for k in STEP_FIELDS})
        if self.writer is not None:
            for key in ("loss", "lr", "density", "bytes_sent", "exchange_seconds", "throughput"):
                self.writer.add_scalar(f"step/{key}", row[key], row["step"])

    def epoch(self, row: dict) -> None:
        if not self.active:
            return
        self.epochs[1].writerow({k: row[k] for k in self.epoch_fields})
        self.epochs[0].flush()
        self.steps[0].flush()
        if self.writer is not None:
            # At the optimizer step, as the steps' scalars: a stop inside an epoch has a fractional
            # epoch (1.5 was shown at 1, beside epoch 1's row), and a resumed run's purge_step hides
            # the rows past its checkpoint only in steps.
            for key, value in row.items():
                if key != "step":
                    self.writer.add_scalar(f"epoch/{key}", value, row["step"])
            self.writer.flush()

    def flush(self) -> None:
        """Writes the rows so far to disk: a process that stops after a checkpoint (killed, a crash)
        leaves the rows up to it, which a resumed run keeps."""
        if not self.active:
            return
        for f, _ in (self.steps, self.epochs):
            f.flush()
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if not self.active:
            return
        for f, _ in (self.steps, self.epochs):
            f.close()
        if self.writer is not None:
            self.writer.close()


# ----------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------


def lr_factor(step: int, steps_per_epoch: int, args: argparse.Namespace) -> float:
    """Linear warm-up from 1/10 over lr_warmup_epochs, then x0.1 at every milestone epoch."""
    epoch = step / steps_per_epoch
    factor = 1.0
    if args.lr_warmup_epochs > 0 and epoch < args.lr_warmup_epochs:
        factor = 0.1 + 0.9 * epoch / args.lr_warmup_epochs
    milestones = [float(m) for m in str(args.lr_milestones).split(",") if m.strip()]
    return factor * 0.1 ** sum(epoch >= m for m in milestones)


def ddp_options(method: str, model: nn.Module, bucket_cap_mb: float | None = None) -> dict:
    """DDP's bucket size: ``bucket_cap_mb`` (--bucket-cap-mb; None: DDP's 25 MB), except for
    torch's PowerSGD hook off NCCL. That hook chains further all-reduces in future callbacks; on
    Gloo and MPI those callbacks run on the backend's threads, so with several buckets the ranks
    can issue their collectives in different orders (Gloo aborts with a size mismatch). One bucket
    holding the whole model removes the race; NCCL keeps DDP's buckets (--backend nccl's group is
    "cpu:gloo,cuda:nccl": the gradients, CUDA tensors, go through NCCL)."""
    backend = dist.get_backend()
    if method != "powersgd" or backend == "nccl" or "cuda:nccl" in backend.split(","):
        return {} if bucket_cap_mb is None else {"bucket_cap_mb": bucket_cap_mb}
    model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    return {"bucket_cap_mb": model_mib + 1}


def shard(model: nn.Module, world: int) -> nn.Module:
    """FSDP2 over all ranks (--fsdp): every child module whose parameters are its own (not tied to
    another child's) is one FSDP unit, and the root holds the rest (tied embeddings, loose
    parameters). Every rank built the model from the same seed, so the shards agree."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device().type, (world,))
    holders: dict[int, int] = {}  # id(parameter) -> children holding it
    for child in model.children():
        for p in child.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    for child in model.children():
        params = list(child.parameters())
        if params and all(holders[id(p)] == 1 for p in params):
            fully_shard(child, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _local(value: Any) -> Any:
    """``value`` with every DTensor replaced by this rank's shard of it."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_local(v) for v in value]
    return value


# Options a resumed run may change: where it is written, how long it goes on, how it is launched
# and shown. Every other option shapes the training, and a checkpoint keeps the values it ran with.
RESUMABLE = frozenset(
    {"out", "fresh", "no_progress", "list_presets", "preset", "method", "epochs", "max_steps", "checkpoint_every",
     "threads", "data_dir", "backend", "transport"}
)  # fmt: skip


def run_options(args: argparse.Namespace, method: str) -> dict:
    """The options that shape ``method``'s training (all but RESUMABLE, and the other methods'
    options), as saved in its checkpoints."""
    others = METHOD_OPTIONS - method_options(method)
    return {key: value for key, value in sorted(vars(args).items()) if key not in RESUMABLE | others}


def changed_options(saved: dict, now: dict) -> list[str]:
    """The options whose value differs between a checkpoint and this run, as the command line
    gives them (an option added since the checkpoint was saved is not compared)."""
    return [
        f"--{key.replace('_', '-')} {saved[key]!r} in the checkpoint, {now[key]!r} now"
        for key in sorted(saved.keys() & now.keys())
        if saved[key] != now[key]
    ]


def exit_on_every_rank(message: str | None) -> None:
    """Ends the run on every rank (each calls it) with status 1, after each has printed its
    ``message`` (None: nothing), since torchrun stops the others once one has exited."""
    if message is not None:
        print(message, file=sys.stderr, flush=True)
    dist.barrier()
    raise SystemExit(1)


class Run:
    """One method's training run, resumable."""

    def __init__(self, task: Task, method: str, args: argparse.Namespace, folder: str, rank: int, world: int):
        self.task, self.method, self.args, self.folder, self.rank, self.world = task, method, args, folder, rank, world
        torch.manual_seed(args.seed)
        self.model = task.build_model().to(device())
        # Every rank builds the model from the same seed: a synthetic run (a measurement of steps)
        # skips DDP's initial broadcast, which on a slow link would cost more than its steps.
        if args.fsdp:
            self.parallel = shard(self.model, world)
        else:
            self.parallel = DDP(
                self.model, init_sync=not args.synthetic_data, **ddp_options(method, self.model, args.bucket_cap_mb)
            )
        self.comm = Communication(method, self.parallel, args, world)
        self.optimizer = task.make_optimizer(self.parallel.parameters(), optimizer_args(method, args))
        # --amp fp16: loss scaling (a disabled scaler passes everything through unchanged)
        self.scaler = torch.amp.GradScaler(device().type, enabled=args.amp == "fp16")
        if self.comm.state is not None and args.amp == "fp16":
            self.comm.state.set_scaler(self.scaler)
        # main checked the task's optimizer_class: this stops a task whose make_optimizer builds another
        if args.momentum_correction and not isinstance(self.optimizer, torch.optim.SGD):
            raise SystemExit(momentum_correction_refusal(type(self.optimizer)))
        self.steps_per_epoch = task.steps_per_epoch(world)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, self.steps_per_epoch, args)
        )
        self.step = 0  # optimizer steps taken
        self.elapsed = 0.0  # training seconds before this process (resumed runs)
        self.bytes_total = 0
        self.epoch_tally = self._empty_tally()
        # Every epoch's row since the run began, those of earlier processes included (a resumed
        # run's summary reads its whole history), and the rows of stops inside an epoch.
        self.rows: list[dict] = []
        self.steps: list[tuple[float, int]] = []  # (seconds, bytes sent) of this process's steps
        torch.manual_seed(args.seed * 7919 + rank)  # per-rank stream (dropout, sampling)

    @staticmethod
    def _empty_tally() -> dict:
        return {"loss": 0.0, "steps": 0, "bytes": 0, "density": 0.0, "seconds": 0.0}

    # checkpoints ------------------------------------------------------------------------------
    def checkpoint_path(self, rank: int | None = None) -> str:
        return os.path.join(self.folder, f"checkpoint-rank{self.rank if rank is None else rank}.pt")

    def previous_checkpoint_path(self) -> str:
        """This rank's checkpoint before its latest: where a process stopped while the ranks saved,
        the others' latest is a save ahead of its own, and every rank resumes from this one."""
        return self.checkpoint_path() + ".previous"

    def save(self) -> None:
        if self.args.synthetic_data:
            return
        state = {
            "task_name": self.task.name,
            "method": self.method,
            "world_size": self.world,
            "options": run_options(self.args, self.method),
            "network": network(self.world),
            "step": self.step,
            "elapsed": self.elapsed,
            "bytes_total": self.bytes_total,
            "epoch_tally": self.epoch_tally,
            "rows": self.rows,
            **self._model_and_optimizer(),
            "schedule": self.schedule.state_dict(),
            "communication": self.comm.state_dict(),
            "scaler": self.scaler.state_dict(),  # empty without --amp fp16
            "task": self.task.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        }
        tmp = self.checkpoint_path() + ".tmp"
        torch.save(state, tmp)
        if os.path.exists(self.checkpoint_path()):
            os.replace(self.checkpoint_path(), self.previous_checkpoint_path())
        os.replace(tmp, self.checkpoint_path())  # never a half-written checkpoint
        dist.barrier()

    def _model_and_optimizer(self) -> dict:
        """Their state dicts; with --fsdp this rank's shards (each rank saves its own file)."""
        return {"model": _local(self.model.state_dict()), "optimizer": _local(self.optimizer.state_dict())}

    def _load_model_and_optimizer(self, model: dict, optimizer: dict) -> None:
        if not self.args.fsdp:
            self.model.load_state_dict(model)
            self.optimizer.load_state_dict(optimizer)
            return
        from torch.distributed.tensor import DTensor

        with torch.no_grad():  # into this rank's shards
            for name, tensor in self.model.state_dict().items():
                (tensor.to_local() if isinstance(tensor, DTensor) else tensor).copy_(model[name])
        self.optimizer.load_state_dict(optimizer)
        for param, state in self.optimizer.state.items():  # the sharded parameters' states as DTensors again
            for key, value in state.items():
                if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and value.dim() > 0:
                    state[key] = DTensor.from_local(
                        value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
                    )

    def try_resume(self) -> bool:
        if self.args.synthetic_data:
            return False
        # The latest first; the one before it where a stop between the two renames of save() left none.
        paths = [p for p in (self.checkpoint_path(), self.previous_checkpoint_path()) if os.path.exists(p)]
        held = torch.tensor([bool(paths), len(paths) > 1], dtype=torch.int32)
        dist.all_reduce(held)
        holding, with_previous = int(held[0]), int(held[1])
        if holding == 0:
            return False
        chosen = paths[0] if paths else None
        state = torch.load(chosen, map_location=device(), weights_only=False) if chosen else None
        if holding != self.world:
            self._start_over_after_a_first_save(state, paths, holding, with_previous)
            return False
        # Each rank replaces its own file: a process stopped while the ranks saved leaves the latest
        # checkpoints of different steps, one apart. Every rank then resumes from the oldest of
        # them, which the ranks ahead hold as their previous one.
        newest, oldest = self._steps_of_every_rank(state["step"])
        if newest != oldest and state["step"] != oldest and len(paths) > 1:
            previous = torch.load(paths[1], map_location=device(), weights_only=False)
            if previous["step"] == oldest:
                chosen, state = paths[1], previous
        newest, oldest = self._steps_of_every_rank(state["step"])
        problem = None
        changed = changed_options(state.get("options", {}), run_options(self.args, self.method))
        saved_task = state.get("task_name", self.task.name)  # not recorded before 2026-12-01
        if state["world_size"] != self.world or state["method"] != self.method or saved_task != self.task.name:
            problem = (
                f"{self.folder}: the checkpoint is for {state['method']} on {state['world_size']} workers "
                f"({saved_task}), this run is {self.method} on {self.world} ({self.task.name}); use another --out or "
                "pass --fresh"
            )
        elif state.get("network", here := network(self.world)) != here:  # not recorded before 2026-12-07
            problem = (
                f"{self.folder}: the checkpoint's run trained on {state['network']}, this run is on {here}: its "
                "times would mix the two networks; use another --out or pass --fresh"
            )
        elif changed:  # resuming would continue the saved run as if it had been this one
            problem = (
                f"{self.folder}: the checkpoint's run was trained with other options ({'; '.join(changed)}); "
                "resume with the saved values, use another --out, or pass --fresh"
            )
        # Checkpoints of different steps still (the files changed by hand, or copied from elsewhere):
        # the ranks would train different numbers of steps (a hang).
        if problem is None and newest != oldest:
            problem = (
                f"{self.folder}: the ranks' checkpoints are of different steps, from {oldest} to {newest} (this "
                f"rank's: {state['step']}), and no rank ahead holds the oldest as its previous checkpoint: they "
                "cannot be resumed together; pass --fresh to start over, or use another --out"
            )
        refused = torch.tensor([problem is not None], dtype=torch.int32)
        dist.all_reduce(refused)  # every rank refuses if one does (each read its own checkpoint)
        if int(refused):
            exit_on_every_rank(problem or f"{self.folder}: another rank's checkpoint was refused (see its message)")
        if chosen != self.checkpoint_path():  # the save resumed from is the latest again (a later one is stale)
            os.replace(chosen, self.checkpoint_path())
        self._load_model_and_optimizer(state["model"], state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])
        self.comm.load_state_dict(state["communication"])
        if self.scaler.is_enabled():
            self.scaler.load_state_dict(state["scaler"])
        self.task.load_state_dict(state["task"])
        self.step, self.elapsed, self.bytes_total = state["step"], state["elapsed"], state["bytes_total"]
        self.epoch_tally = state["epoch_tally"]
        self.rows = list(state.get("rows", []))  # a checkpoint saved before rows were kept: this process's only
        # map_location put the generators' states on the GPU too; torch takes them on the CPU only
        torch.set_rng_state(state["rng"].cpu())
        if state["cuda_rng"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda_rng"].cpu())
        return True

    def _start_over_after_a_first_save(self, state: dict | None, paths: list[str], holding: int, with_previous: int):
        """Some ranks hold a checkpoint (``holding``) and others none. Where none holds more than one
        save (``with_previous``: how many do) and each was saved by this many workers, a process
        stopped while the ranks saved the run's first checkpoint: the run starts over, and the
        ranks that saved it delete it. Otherwise the run is refused on every rank."""
        fits = torch.tensor([state is None or state["world_size"] == self.world], dtype=torch.int32)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
        if with_previous or not int(fits):
            exit_on_every_rank(
                f"{self.folder}: only {holding} of {self.world} ranks have a checkpoint ("
                + (f"this rank's saved by {state['world_size']} workers" if state else "this rank has none")
                + "); resume with the number of workers that saved them, or pass --fresh"
            )
        for path in paths:
            os.remove(path)
        if self.rank == 0:
            print(
                f"[{self.method:>9}] {self.folder}: only {holding} of {self.world} ranks had saved the run's first "
                "checkpoint when its process stopped: starting over",
                flush=True,
            )

    @staticmethod
    def _steps_of_every_rank(step: int) -> tuple[int, int]:
        """(newest, oldest) of every rank's ``step``."""
        steps = torch.tensor([step, -step], dtype=torch.int64)
        dist.all_reduce(steps, op=dist.ReduceOp.MAX)
        return int(steps[0]), -int(steps[1])

    def settle_powersgd_buckets(self) -> None:
        """DDP builds its buckets in parameter order, then rebuilds them once in the order the
        first iteration's gradients arrived. torch's PowerSGD keeps its error feedback and warm
        starts by bucket index, so a resumed process would hand it the saved run's per-bucket
        tensors in the first-step layout. For PowerSGD, every process therefore starts with one
        iteration whose gradients, and every state it touches (parameters, buffers, RNG, task and
        communication state), are thrown away. gradsparse needs none: a state reduces the first
        step after load_state_dict in the saved layout itself."""
        model_state = copy.deepcopy(self.model.state_dict())
        task_state = copy.deepcopy(self.task.state_dict())
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        epoch = self.step // self.steps_per_epoch
        batch = next(iter(self.task.batches(epoch, self.rank, self.world)))
        with self.comm.discarded():
            self._loss(batch).backward()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.load_state_dict(model_state)
        self.task.load_state_dict(task_state)
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng)

    # the loop ---------------------------------------------------------------------------------
    def total_steps(self) -> int:
        """The steps of the whole run: --epochs, or --max-steps when it ends first."""
        total = self.args.epochs * self.steps_per_epoch
        return min(total, self.args.max_steps) if self.args.max_steps else total

    def train(self, recorder: Recorder) -> list[dict]:
        """Trains to the end (--epochs, --max-steps) and returns the run's rows, as an uninterrupted
        run would: every whole epoch's, those trained before a resume included, and the last
        row when it is a stop inside an epoch."""
        args = self.args
        if self.comm.torch_state is not None:
            self.settle_powersgd_buckets()
        total_steps = self.total_steps()
        bar = None
        if self.rank == 0 and tqdm is not None and not args.no_progress:
            bar = tqdm(total=total_steps, initial=self.step, desc=self.method, unit="step", disable=None)
        while self.step < total_steps:
            epoch, first = divmod(self.step, self.steps_per_epoch)
            if first == 0:
                self.task.start_epoch(epoch)
            batches = itertools.islice(self.task.batches(epoch, self.rank, self.world), first, None)
            for batch in batches:
                self._one_step(epoch, batch, recorder, bar)
                last_of_epoch = self.step % self.steps_per_epoch == 0
                if last_of_epoch:
                    self.rows.append(self._end_epoch(epoch, recorder))
                elif self.step >= total_steps:  # stopped inside an epoch: report it so far
                    self.rows.append(self._end_epoch(epoch, recorder, partial=True))
                if (
                    last_of_epoch
                    or self.step >= total_steps
                    or (args.checkpoint_every and self.step % args.checkpoint_every == 0)
                ):
                    recorder.flush()  # the rows up to the checkpoint, which a resumed run keeps
                    self.save()
                if last_of_epoch or self.step >= total_steps:
                    break
            else:
                raise RuntimeError(
                    f"{self.task.name}: batches() of epoch {epoch + 1} ended before steps_per_epoch() = "
                    f"{self.steps_per_epoch} batches"
                )
        if bar is not None:
            bar.close()
        whole = [row for row in self.rows if row["step"] % self.steps_per_epoch == 0]
        if self.rows and self.rows[-1]["step"] % self.steps_per_epoch:
            whole.append(self.rows[-1])
        return whole

    def _loss(self, batch: Any) -> torch.Tensor:
        """The task's training loss of ``batch``, its forward pass autocast with --amp."""
        dtype = torch.bfloat16 if self.args.amp == "bf16" else torch.float16
        with torch.autocast(device().type, dtype=dtype, enabled=self.args.amp != "off"):
            return self.task.train_step(self.parallel, batch)

    def _one_step(self, epoch: int, batch: Any, recorder: Recorder, bar) -> None:
        start = time.perf_counter()
        loss = self._loss(batch)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if self.args.clip > 0:
            self.scaler.unscale_(self.optimizer)
            nn.utils.clip_grad_norm_(self.parallel.parameters(), self.args.clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)  # skipped when the scaled gradients overflowed
        self.scaler.update()
        self.schedule.step()
        loss_value = loss.item()
        seconds = time.perf_counter() - start
        self.step += 1
        self.elapsed += seconds
        figures = self.comm.step_figures()
        self.steps.append((seconds, figures["bytes_sent"]))
        self.bytes_total += figures["bytes_sent"]
        t = self.epoch_tally
        t["loss"] += loss_value
        t["steps"] += 1
        t["bytes"] += figures["bytes_sent"]
        t["density"] += figures["density"]
        t["seconds"] += seconds
        recorder.step(
            {
                "step": self.step,
                "epoch": epoch + 1,
                "loss": loss_value,
                "lr": lr,
                **figures,
                "step_seconds": seconds,
                "throughput": self.task.samples_per_batch * self.world / seconds,
                "elapsed_seconds": self.elapsed,
            }
        )
        if bar is not None:
            bar.update(1)
            if self.step % 10 == 0:
                bar.set_postfix(loss=f"{loss_value:.3f}", epoch=epoch + 1)

    def _evaluate(self) -> dict[str, float]:
        """The task's figures of rank 0's model, each rank scoring its share of the test data. The
        ranks' buffers differ after a training step (each BatchNorm's running statistics follow its
        own rank's batches; DDP sends rank 0's at the next forward, FSDP never does), so each rank
        scored its share with a model of its own: rank 0's are lent for the evaluation, and each
        rank's own put back after it (training goes on from them, as it did)."""
        buffers = list(self.model.buffers())
        own = [b.clone() for b in buffers]
        for b in buffers:
            dist.broadcast(b, 0)
        try:
            return self.task.evaluate(self.model, self.rank, self.world)
        finally:
            with torch.no_grad():
                for b, mine in zip(buffers, own, strict=True):
                    b.copy_(mine)

    def _end_epoch(self, epoch: int, recorder: Recorder, partial: bool = False) -> dict:
        """Evaluates and records the epoch; ``partial``: a stop inside the epoch, whose tally
        continues when the run resumes (its row's epoch is fractional)."""
        t = self.epoch_tally
        # Summed over the ranks: the loss and steps for the mean loss, and the bytes for the mean
        # a rank sent (ranks of MiCRO, ExDyna and the threshold methods send different counts).
        summed = torch.tensor([t["loss"], t["steps"], t["bytes"], self.bytes_total], dtype=torch.float64)
        dist.all_reduce(summed)
        loss, steps, sent, sent_in_all = summed.tolist()
        sent, sent_in_all = sent / self.world, sent_in_all / self.world
        metrics = dict.fromkeys(self.task.metric_fields, math.nan) if self.args.synthetic_data else self._evaluate()
        self.model.train()
        row = {
            "epoch": round(self.step / self.steps_per_epoch, 4) if partial else epoch + 1,
            "step": self.step,
            "loss": loss / steps,
            **metrics,
            "density": t["density"] / max(1, t["steps"]),
            "bytes_sent": sent,
            "bytes_total": sent_in_all,
            "train_seconds": t["seconds"],
            "elapsed_seconds": self.elapsed,
        }
        recorder.epoch(row)
        if self.rank == 0:
            dense = self.comm.dense_bytes * max(1, t["steps"])
            quality = "  ".join(f"{k} {v:.4f}" for k, v in metrics.items())
            share = f"{100 * sent / dense:5.1f}% of dense" if dense else "one worker: nothing to send"
            print(
                f"[{self.method:>9}] epoch {row['epoch']}/{self.args.epochs}  loss {row['loss']:.4f}  {quality}  "
                f"density {row['density']:.4f}  sent {sent / 1e6:8.3f} MB/rank ({share})  "
                f"time {t['seconds']:6.1f} s",
                flush=True,
            )
        if not partial:
            self.epoch_tally = self._empty_tally()
        return row


def time_to(task: Task, rows: list[dict], target: float) -> float | None:
    """Training seconds until the first evaluation that reached ``target`` (None: never)."""
    return next((row["elapsed_seconds"] for row in rows if task.reached(row[task.metric], target)), None)


def summarize(task: Task, results: dict[str, list[dict]]) -> str:
    """One line per method: final quality, training time, the time to reach the first method's
    quality (within the task's tolerance; evaluated once per epoch) and its ratio to that
    method's, and traffic."""
    runs = {method: rows for method, rows in results.items() if rows}
    if not runs:
        return ""
    first, first_rows = next(iter(runs.items()))
    final, loss = first_rows[-1][task.metric], first_rows[-1].get("loss", 0.0)
    if math.isfinite(final) and math.isfinite(loss):
        target, how = task.target(final)
        heading = f"target {task.metric} {target:.4f} ({first}'s final {how}), checked after every epoch"
    else:  # a diverged reference sets no target: a NaN perplexity, which every method would read as
        # "not yet", or a score at chance level after a NaN loss, which every method would reach
        target = None
        why = f"{task.metric} is {final}" if not math.isfinite(final) else f"loss is {loss} ({task.metric} {final:.4f})"
        heading = f"no target: {first}'s final {why}, so no time to it is given"
    reference = time_to(task, first_rows, target) if target is not None else None
    lines = [
        heading,
        f"{'method':>9}  {task.metric:>10}  {'train time':>10}  {'to target':>10}  {'vs ' + first:>10}  "
        f"{'MB sent/rank':>12}",
    ]
    for method, rows in runs.items():
        seconds = time_to(task, rows, target) if target is not None else None
        to_target = f"{seconds:9.1f}s" if seconds is not None else f"{'not yet' if target is not None else '-':>10}"
        ratio = f"{seconds / reference:9.2f}x" if seconds is not None and reference else f"{'-':>10}"
        lines.append(
            f"{method:>9}  {rows[-1][task.metric]:10.4f}  {rows[-1]['elapsed_seconds']:9.1f}s  {to_target}  {ratio}  "
            f"{rows[-1]['bytes_total'] / 1e6:12.3f}"
        )
    return "\n".join(lines)


def step_costs(steps: list[tuple[float, float]]) -> tuple[float, float]:
    """(median seconds, mean bytes sent) of (seconds, bytes) per step, leaving the first step out
    when there are others: it carries one-time work (DDP's bucket rebuild, first allocations)."""
    steps = steps[1:] if len(steps) > 1 else steps
    if not steps:
        return math.nan, math.nan
    return statistics.median(s for s, _ in steps), statistics.fmean(b for _, b in steps)


def summarize_steps(costs: dict[str, tuple[float, float]]) -> str:
    """One line per method: median step time and bytes sent per step by a worker, each with its
    ratio to the first method's (the summary of a --synthetic-data run)."""
    if not costs:
        return ""
    first, (base_seconds, base_bytes) = next(iter(costs.items()))
    lines = [
        "per step and worker (synthetic data: no quality; median step, the first left out)",
        f"{'method':>9}  {'step time':>10}  {'vs ' + first:>10}  {'MB sent':>10}  {'vs ' + first:>10}",
    ]
    for method, (seconds, sent) in costs.items():
        lines.append(
            f"{method:>9}  {seconds:9.3f}s  {_ratio(seconds, base_seconds, 3)}  {sent / 1e6:10.3f}  "
            f"{_ratio(sent, base_bytes, 4)}"
        )
    return "\n".join(lines)


def _ratio(value: float, base: float, digits: int) -> str:
    """``value / base`` in a 10-character column, or "-" where there is no ratio: a base of 0
    (one worker sends nothing) or NaN (no step timed)."""
    if base == 0 or math.isnan(base):
        return f"{'-':>10}"
    return f"{value / base:9.{digits}f}x"


SLOW_LINK_BITS = 50e6  # benchmarks.cluster's default rate (docs/benchmarks.md says why)
LOOPBACK = "loopback (every worker on this machine)"


def network(world: int) -> str:
    """What the workers' messages cross: the emulated cluster's links ("emulated cluster 4x50mbit"),
    loopback, or the network between hosts. Recorded in checkpoints: a run resumed on another one
    would report times measured on two networks as one."""
    if os.environ.get("GRADSPARSE_CLUSTER"):
        return f"emulated cluster {os.environ['GRADSPARSE_CLUSTER']}"
    return LOOPBACK if int(os.environ.get("LOCAL_WORLD_SIZE", world)) == world else "a network between hosts"


def network_note(world: int, sent: dict[str, float] | None = None) -> str:
    """Said when every worker runs on this machine outside the emulated cluster: loopback hides
    what sparsification saves. ``sent``: bytes each method's worker sent, whose least time on a
    slow link (bytes x 8 / rate) the note gives."""
    if network(world) != LOOPBACK:
        return ""
    wire = ", ".join(f"{method} {b * 8 / SLOW_LINK_BITS:.1f} s" for method, b in (sent or {}).items())
    return (
        "\n\nAll workers ran on this machine: over loopback communication is nearly free, so the times above show "
        "what selection costs, not what a slow network saves. "
        + (
            f"On links of {SLOW_LINK_BITS / 1e6:g} Mbit/s, each worker's bytes alone would take at least: {wire} "
            "(bytes x 8 / rate, added to the times above where communication cannot overlap compute). "
            if wire
            else ""
        )
        + "To measure it, run the same job on an emulated "
        f"cluster (root): sudo python -m benchmarks.cluster --hosts {world} -- -m {_module()} [ARGS] (docs/benchmarks.md)."
    )


def _module() -> str:
    """The module this run was started as (`-m examples.cnn`)."""
    import sys

    spec = getattr(sys.modules["__main__"], "__spec__", None)
    return spec.name.removesuffix(".__main__") if spec is not None else "examples.cnn"


class _Parser(argparse.ArgumentParser):
    """Prints the usage with an error on the first rank only. Under a launcher every rank parses
    the same command line and refuses it alike; each rank's 24 lines of usage buried the one line
    that says what is wrong, which every rank still prints."""

    def print_usage(self, file=None) -> None:
        rank = next((os.environ[n] for n in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID") if n in os.environ), "0")
        if rank == "0":
            super().print_usage(file)


def main(
    make_task: Callable[[argparse.Namespace], Task],
    description: str,
    argv: list[str] | None = None,
    add_task_arguments: Callable[[argparse.ArgumentParser], None] | None = None,
    presets: dict[str, dict] | None = None,
    default_out: str = "runs/task",
) -> dict[str, list[dict]]:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    parser = _Parser(
        prog=f"python -m {_module()}", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    if add_task_arguments is not None:
        add_task_arguments(parser.add_argument_group("task"))
    args = parser.parse_args(argv)
    presets = presets or {}
    if args.list_presets:
        for name, settings in sorted(presets.items()):
            print(f"{name}: " + " ".join(preset_flag(k, v) for k, v in settings.items()))
        return {}
    apply_preset(parser, args, presets, argv)
    methods = [m.strip() for m in args.method.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"--method: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    if not methods:
        parser.error(f"--method: no method in {args.method!r}; give one, or several separated by commas")
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:  # one run folder per method: the second would resume, or overwrite, the first
        parser.error(
            f"--method: {', '.join(twice)} given twice; each method trains once, in its run folder <out>/<method>"
        )
    check_arguments(parser, args, methods, argv, getattr(make_task, "optimizer_class", Task.optimizer_class))
    out = args.out or default_out
    rank, world = init_distributed(args)
    for method in methods:  # the options that depend on the world size (SparDL's teams), on every rank alike
        if method in gs.METHODS:
            try:
                gs.METHODS[method](**gradsparse_options(method, args)).check_world_size(world)
            except ValueError as e:
                exit_on_every_rank(f"--method {method}: {e}")
    try:
        task, problem = make_task(args), None
    except (FileNotFoundError, ValueError) as e:  # a dataset missing (its message says where to put it)
        task, problem = None, str(e)
    agree_or_exit(problem, rank, world)
    if rank == 0:
        n = sum(p.numel() for p in task.build_model().parameters())
        threads = torch.get_num_threads()
        print(
            f"{task.name}: {world} workers ({dist.get_backend()}), {n:,} parameters, "
            f"{threads} CPU thread{'s' if threads > 1 else ''} per worker",
            flush=True,
        )
    folders = {method: os.path.join(out, method) if len(methods) > 1 else out for method in methods}
    agree_or_exit(other_layout(out, methods), rank, world)
    ready_folders(out, list(folders.values()), args, rank, world)
    results, costs, sent = {}, {}, {}
    for method, folder in folders.items():
        run = Run(task, method, args, folder, rank, world)
        resumed = not args.fresh and run.try_resume()
        if rank == 0:  # after the checks, so that a refused resume leaves the saved run's config
            with open(os.path.join(folder, "config.json"), "w") as f:
                json.dump(
                    {**vars(args), "method": method, "world_size": world, "task": task.name, "parameters": n},
                    f,
                    indent=2,
                )
        if resumed and rank == 0:
            done = run.step >= run.total_steps()
            print(
                f"[{method:>9}] {'already trained, to' if done else 'resuming from'} step {run.step} ({folder})"
                + ("; its saved figures are shown: pass --fresh to train it again" if done else ""),
                flush=True,
            )
        recorder = Recorder(folder, _metric_fields(task), rank, resumed, run.step)
        try:
            results[method] = run.train(recorder)
            costs[method] = step_costs(run.steps)
            sent[method] = run.bytes_total
        finally:
            recorder.close()
            run.comm.close()
        # The next method builds its own model, optimizer and state: free this one's first
        # (DDP, its hook and the state reference each other, so only a collection frees them).
        del run
        gc.collect()
    if rank == 0:
        summary = summarize_steps(costs) if args.synthetic_data else summarize(task, results)
        print("\n" + summary + network_note(world, sent), flush=True)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    return results


def ready_folders(out: str, folders: list[str], args: argparse.Namespace, rank: int, world: int) -> None:
    """Every rank makes the run folders and, with --fresh, clears their checkpoints, before any
    method trains: each rank writes its own checkpoint, and nodes without a shared filesystem see
    only their own folders (made by rank 0 alone, they were missing on the other nodes, whose
    ranks failed at their first checkpoint, and --fresh left those nodes' checkpoints to be
    resumed). Where any rank cannot, every rank stops, and rank 0 prints each distinct reason."""
    agree_or_exit(prepare_folders(out, folders) or clear_checkpoints(folders, args), rank, world)


def agree_or_exit(problem: str | None, rank: int, world: int) -> None:
    """Every rank tells the others its ``problem`` (None: none); where any rank has one, every rank
    stops, and rank 0 prints each distinct one (a rank stopping alone left the others waiting in
    their next collective)."""
    problems: list[str | None] = [None] * world
    dist.all_gather_object(problems, problem)
    if any(problems):
        exit_on_every_rank("\n".join(dict.fromkeys(p for p in problems if p)) if rank == 0 else None)


def holds_run(folder: str) -> bool:
    """Whether a run wrote into ``folder`` (its epochs.csv, or checkpoints)."""
    return any(glob.glob(os.path.join(glob.escape(folder), name)) for name in ("epochs.csv", "checkpoint-rank*.pt"))


def other_layout(out: str, methods: list[str]) -> str | None:
    """Refuses (the message, else None) an --out laid out for another number of methods: a job of
    one method writes into --out itself, a job of several into <out>/<method>. Mixed in one
    folder, the one-method run would start afresh beside the folder of its method's earlier run
    instead of resuming it, and examples.plot, reading --out as one run, would leave the others out."""
    if len(methods) == 1:
        nested = [m for m in METHODS if holds_run(os.path.join(out, m))]
        if nested:
            return (
                f"--out {out} holds the run folders of a job of several methods ({', '.join(nested)}), and a job of "
                f"one method writes into --out itself; give --out {os.path.join(out, methods[0])} (it resumes that "
                "folder's run), or another --out"
            )
    elif holds_run(out):
        return (
            f"--out {out} holds the run of a job of one method, and a job of several writes one folder per method "
            "into it; give another --out"
        )
    return None


def prepare_folders(out: str, folders: list[str]) -> str | None:
    """Makes every run folder and checks that a file can be written in each; None when they can,
    else what failed and how to fix it. Checked once before the first method trains: a folder that
    could not be made (--out or <out>/<method> an existing file, no permission, a read-only
    filesystem) ended the run in a traceback, for <out>/<method> after the methods before it."""
    for folder in folders:
        path = existing = os.path.abspath(folder)
        while not os.path.lexists(existing):
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            reason = f"{existing} is a file, not a folder"
        else:
            try:
                os.makedirs(path, exist_ok=True)
                with tempfile.TemporaryFile(dir=path):
                    pass
                continue
            except OSError as e:
                reason = e.strerror or str(e)
        return (
            f"--out {out}: cannot write the run folder {path}: {reason}; give an --out that is, or can be made, "
            "a folder this user may write in"
        )
    return None


def clear_checkpoints(folders: list[str], args: argparse.Namespace) -> str | None:
    """--fresh deletes the run folders' checkpoints before the first method trains, so that the
    run it starts over can no longer be resumed: a --fresh run stopped before its first checkpoint
    (or one with --synthetic-data, which writes none) left them, and the next run resumed the old
    run over the new one's metrics. Without --fresh, a --synthetic-data run into a folder holding
    checkpoints is refused (the message, else None): it would replace the saved run's metrics."""
    for folder in folders:
        saved = sorted(glob.glob(os.path.join(glob.escape(folder), "checkpoint-rank*.pt*")))
        if args.fresh:
            for path in saved:
                with contextlib.suppress(FileNotFoundError):  # another rank's, on a shared filesystem
                    os.remove(path)
        elif args.synthetic_data and saved:
            return (
                f"{folder}: holds the checkpoints of a training run, whose metrics a --synthetic-data run would "
                "replace; use another --out, or pass --fresh to start over"
            )
    return None


def _metric_fields(task: Task) -> list[str]:
    return list(task.metric_fields)
