"""The shared training driver of the examples: process group from the launcher's environment,
DDP wrapping, the gradsparse hook, the epoch loop with a progress bar, evaluation and metrics.

A task module supplies a :class:`Task` (model factory, data, loss, evaluation); the driver runs it
once per requested method in the same processes, so the methods see the same data and seeds.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsparse as gs

try:  # the progress bar is optional
    from tqdm import tqdm
except ImportError:  # pragma: no cover
    tqdm = None


@dataclass
class Task:
    """What a task module hands to the driver."""

    name: str
    build_model: Callable[[], nn.Module]
    train_inputs: torch.Tensor
    train_targets: torch.Tensor
    test_inputs: torch.Tensor
    test_targets: torch.Tensor
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = nn.functional.cross_entropy


# Methods the driver knows: plain DDP ("dense") and every gradsparse method.
METHODS = ("dense", *[m for m in gs.METHODS if m != "dense"])


def make_state(method: str, args: argparse.Namespace) -> gs.State | None:
    """The gradsparse state for a method name (None: plain DDP without a hook)."""
    if method == "dense":
        return None
    options = {"warmup_steps": args.warmup_steps, "reference": args.reference, "transport": args.transport}
    if method == "threshold":
        return gs.Threshold(threshold=args.threshold, **options)
    return gs.METHODS[method](density=args.density, **options)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--methods",
        default="dense,topk",
        help=f"comma-separated methods to train one after the other (choices: {', '.join(METHODS)}); "
        "dense is plain DDP without a hook",
    )
    parser.add_argument("--density", type=float, default=0.01, help="fraction of each bucket sent (topk)")
    parser.add_argument("--threshold", type=float, default=1e-3, help="magnitude threshold (threshold)")
    parser.add_argument("--warmup-steps", type=int, default=0, help="dense steps before sparsification")
    parser.add_argument("--reference", action="store_true", help="the original code's rules (docs/methods.md)")
    parser.add_argument(
        "--transport",
        choices=("process_group", "mpi"),
        default="process_group",
        help="what gradsparse's exchanges run on: the torch.distributed group (Gloo), or OpenMPI (under mpirun)",
    )
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="per worker")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-steps", type=int, default=0, help="cap on steps per epoch (0: full epochs)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per worker (0: cores / workers)")
    parser.add_argument("--out", default="", help="write the per-epoch results to this JSON file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def init_distributed(args: argparse.Namespace) -> tuple[int, int]:
    """Joins the process group described by the launcher's environment: torchrun's variables, or
    OpenMPI's and SLURM's mapped by gradsparse.launch. Returns (rank, world size)."""
    gs.launch.setup_environment()
    missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise SystemExit(
            f"missing {', '.join(missing)}: launch with torchrun, mpirun or srun, for example "
            "`torchrun --standalone --nproc-per-node=4 -m examples.cnn`"
        )
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
    threads = args.threads or max(1, (os.cpu_count() or 1) // local)
    torch.set_num_threads(threads)
    gs.set_num_threads(threads)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def _evaluate(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, rank: int, world: int) -> float:
    """Accuracy on the test set, each rank scoring a shard."""
    model.eval()
    correct = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for start in range(rank * 1000, len(inputs), world * 1000):
            logits = model(inputs[start : start + 1000])
            correct[0] += (logits.argmax(1) == targets[start : start + 1000]).sum()
            correct[1] += len(logits)
    dist.all_reduce(correct)
    model.train()
    return float(correct[0] / correct[1])


def _megabytes(n: float) -> float:
    return n / 1e6


def train_method(task: Task, method: str, args: argparse.Namespace, rank: int, world: int) -> list[dict]:
    torch.manual_seed(args.seed)
    model = task.build_model()
    ddp = DDP(model)
    state = make_state(method, args)
    if state is not None:
        ddp.register_comm_hook(state, gs.hook)
    numel = sum(p.numel() for p in model.parameters())
    dense_bytes_per_step = 2 * (world - 1) * numel * 4 // world  # ring all-reduce, as gradsparse counts
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)
    n_train = len(task.train_inputs)
    steps = (n_train // world) // args.batch_size
    if args.max_steps:
        steps = min(steps, args.max_steps)
    rows = []
    for epoch in range(args.epochs):
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        shard = order[rank::world]
        bar = None
        if rank == 0 and tqdm is not None and not args.no_progress:
            bar = tqdm(
                total=steps, desc=f"{method} epoch {epoch + 1}/{args.epochs}", unit="step", leave=False, disable=None
            )
        loss_sum = torch.zeros(2, dtype=torch.float64)
        start = time.perf_counter()
        for step in range(steps):
            idx = shard[step * args.batch_size : (step + 1) * args.batch_size]
            loss = task.loss(ddp(task.train_inputs[idx]), task.train_targets[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_sum += torch.tensor([loss.item(), 1.0], dtype=torch.float64)
            if bar is not None:
                bar.update(1)
                if step % 20 == 0:
                    bar.set_postfix(loss=f"{loss.item():.3f}")
        seconds = time.perf_counter() - start
        if bar is not None:
            bar.close()
        dist.all_reduce(loss_sum)
        accuracy = _evaluate(model, task.test_inputs, task.test_targets, rank, world)
        if state is None:
            density, sent, dense = 1.0, dense_bytes_per_step * steps, dense_bytes_per_step * steps
        else:
            total = state.stats(reset=True)["total"]
            density = total["density"] if not math.isnan(total["density"]) else 1.0
            sent, dense = total["bytes_sent"], total["dense_bytes"]
        row = {
            "method": method,
            "epoch": epoch + 1,
            "loss": float(loss_sum[0] / loss_sum[1]),
            "accuracy": accuracy,
            "density": density,
            "bytes_sent": sent,
            "dense_bytes": dense,
            "seconds": seconds,
            "steps": steps,
        }
        rows.append(row)
        if rank == 0:
            print(
                f"[{method:>9}] epoch {epoch + 1}/{args.epochs}  loss {row['loss']:.4f}  "
                f"accuracy {100 * accuracy:5.2f}%  density {density:.4f}  "
                f"sent {_megabytes(sent):8.3f} MB/rank ({100 * sent / dense:5.1f}% of dense)  "
                f"time {seconds:6.1f} s",
                flush=True,
            )
    if state is not None:
        state.close()
    return rows


def summarize(rows: list[dict]) -> str:
    """One line per method: final accuracy, training time and traffic."""
    lines = [f"{'method':>9}  {'accuracy':>8}  {'train time':>10}  {'MB sent/rank':>12}  {'vs dense':>8}"]
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        sent = sum(r["bytes_sent"] for r in mine)
        dense = sum(r["dense_bytes"] for r in mine)
        lines.append(
            f"{method:>9}  {100 * mine[-1]['accuracy']:7.2f}%  {sum(r['seconds'] for r in mine):9.1f}s  "
            f"{_megabytes(sent):12.3f}  {100 * sent / dense:7.1f}%"
        )
    return "\n".join(lines)


def main(task_factory: Callable[[argparse.Namespace], Task], description: str, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=description)
    add_arguments(parser)
    parser.add_argument("--data-dir", default=None, help="folder holding the dataset files")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    rank, world = init_distributed(args)
    task = task_factory(args)
    if rank == 0:
        n = sum(p.numel() for p in task.build_model().parameters())
        print(
            f"{task.name}: {world} workers (Gloo), {n:,} parameters, {len(task.train_inputs):,} training and "
            f"{len(task.test_inputs):,} test examples, batch {args.batch_size} per worker",
            flush=True,
        )
    rows = []
    for method in methods:
        rows += train_method(task, method, args, rank, world)
    if rank == 0:
        print("\n" + summarize(rows), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=2)
    dist.destroy_process_group()
