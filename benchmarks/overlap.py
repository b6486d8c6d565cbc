"""Does the engine overlap communication with the backward pass?

    python -m benchmarks.overlap [--world-size 2] [--steps 20] [--methods dense,topk,micro,spardl] [--bucket-cap-mb 4]
    python -m benchmarks.overlap --methods exdyna,exdyna@gather   # a method with another exchange
    torchrun --nproc-per-node 2 -m benchmarks.overlap [--output overlap-lo.md] [--network "..."]

On a model with several DDP buckets, per method, four timings of forward + backward (the median
step, measured in the same processes, the four modes taking turns step by step):

- **compute**: a hook that returns its bucket at once (no communication at all);
- **feedback**: a hook that adds its bucket into a residual of its own and zeroes it, as error
  feedback must (read the gradient and the residual, write both back), with no selection and no
  communication: the floor of any error-feedback method's step where its passes over memory share
  the core with the backward pass (one core per worker);
- **serial**: the gradsparse hook, but waiting for each bucket's exchange inside the hook, so
  the backward pass stops while it communicates: compute + exchange, nothing overlapped;
- **overlapped**: the gradsparse hook as users register it (the engine thread exchanges while
  autograd computes the next buckets).

exchange = serial - compute; the overlap goal is overlapped < compute + exchange (= serial), and
"hidden" is the share of the exchange time that disappeared. At most min(compute, exchange) can
disappear: on a slow link (exchange > compute) overlapped / serial stays above
exchange / (compute + exchange), and "hidden" below compute / exchange. Two more ratios answer
what a user asks: overlapped / compute, the step against one that sends nothing (1 when the
exchange is all hidden), and overlapped / dense's, the step against dense's in the same run;
feedback / compute says how much of the first is error feedback's memory traffic alone.

Each process's malloc keeps the memory it frees (gradsparse.launch.keep_freed_memory: glibc, the
header says so, unless the environment chose its own settings): otherwise the
gradients each step frees and allocates were given back and faulted in again on some steps, which
fell on the first methods of a run (docs/benchmarks.md, "Overlap").

By default the Gloo processes are spawned here and talk over loopback (--world-size). When RANK
is set (with WORLD_SIZE, MASTER_ADDR and MASTER_PORT: torchrun, or set by hand), each process is
one rank and joins the group by env:// rendezvous; rank 0 prints and writes the table.
benchmarks/slow_network.sh starts two ranks that way in network namespaces joined by a
rate-limited link.

No `from __future__ import annotations`: DDP checks hook annotations as objects.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsparse as gs
from benchmarks.utils import (
    OUTPUT_HELP,
    check_output,
    gather_on_rank_0,
    markdown_table,
    names,
    require_launcher,
    write_result,
)
from gradsparse.testing import run_distributed


def make_model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def immediate(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def blocking(state: gs.State, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    fut = gs.hook(state, bucket)
    fut.wait()
    return fut


def feedback(residuals: dict, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    gradient = bucket.buffer()
    key = (bucket.index(), gradient.numel())  # DDP rebuilds its buckets after the first step
    if key not in residuals:
        residuals[key] = torch.zeros_like(gradient)
    residuals[key].add_(gradient)
    gradient.zero_()
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(gradient)
    return fut


MODES = ("compute", "feedback", "serial", "overlapped")


def one_step(ddp: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    dist.barrier()  # every rank starts together (the compute mode has no collective to pace it)
    start = time.perf_counter()
    loss = nn.functional.cross_entropy(ddp(x), y)
    loss.backward()
    ddp.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def make_state(method: str, density: float) -> gs.State:
    """The state of a --methods entry: a method's name, optionally with an exchange
    (``exdyna@gather``)."""
    if method == "dense":
        return gs.Dense()
    name, _, exchange = method.partition("@")
    return gs.METHODS[name](density=density, **({"exchange": exchange} if exchange else {}))


def worker(
    rank: int,
    world_size: int,
    methods: list[str],
    density: float,
    steps: int,
    width: int,
    depth: int,
    bucket_cap_mb: float,
):
    # Else the gradients freed and allocated each step were faulted in again on some steps, which
    # fell on the first methods of a run: the same method's compute-only step took 1.3x as long
    # first as third.
    freed_memory_kept = gs.launch.keep_freed_memory()
    torch.set_num_threads(1)
    gs.set_num_threads(1)
    results = {}
    for method in methods:
        ddps, states = {}, []
        for mode in MODES:
            ddps[mode] = DDP(make_model(width, depth), bucket_cap_mb=bucket_cap_mb)
            if mode == "compute":
                ddps[mode].register_comm_hook(None, immediate)
            elif mode == "feedback":
                ddps[mode].register_comm_hook({}, feedback)
            else:
                state = make_state(method, density)
                ddps[mode].register_comm_hook(state, blocking if mode == "serial" else gs.hook)
                states.append(state)
        # The modes take turns step by step, so that a slow spell of this shared machine hits all
        # four alike; three warm-up rounds (DDP rebuilds its buckets after the first).
        times: dict[str, list[float]] = {mode: [] for mode in MODES}
        g = torch.Generator().manual_seed(rank)  # the same batches for every method
        for i in range(steps + 3):
            # A new batch each round, as in training: with one batch every step's gradient would be
            # the same, and the residuals would grow step after step, a phase that training leaves
            # within its first steps, in which the methods that list candidates above their last
            # step's threshold find too many and fall back to exact passes.
            x, y = torch.randn(64, width, generator=g), torch.randint(0, 10, (64,), generator=g)
            for mode in MODES:
                seconds = one_step(ddps[mode], x, y)
                if i >= 3:
                    times[mode].append(seconds)
        row = {mode: statistics.median(t) for mode, t in times.items()}
        row["buckets"] = len(states[0].stats()["buckets"])
        row["freed memory kept"] = freed_memory_kept
        for state in states:
            state.close()
        results[method] = row
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--methods", default="dense,topk,micro,spardl")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--bucket-cap-mb", type=float, default=4.0, help="DDP's bucket_cap_mb (default 4)")
    parser.add_argument("--output", default="overlap.md", help=OUTPUT_HELP)
    parser.add_argument("--network", help="how the ranks are connected, for the header")
    args = parser.parse_args(argv)
    for flag, value, low in (
        ("--world-size", args.world_size, 1),
        ("--steps", args.steps, 1),
        ("--width", args.width, 1),
        ("--depth", args.depth, 0),  # hidden layers: 0 leaves the output layer alone
    ):
        if value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    if not args.bucket_cap_mb > 0:
        parser.error(f"--bucket-cap-mb must be more than 0 (DDP's bucket_cap_mb, in MB), got {args.bucket_cap_mb}")
    # one report row per entry: an entry given twice showed the second's figures twice
    methods = names(parser, "--methods", args.methods, gs.METHODS, "method", key=lambda m: m.partition("@")[0])
    for method in methods:  # as the workers create them, before any process starts
        try:
            make_state(method, args.density).close()
        except (TypeError, ValueError) as e:
            parser.error(f"--methods {method} --density {args.density}: {e}")
    if os.environ.get("RANK", "0") == "0":  # the rank that writes the report
        check_output(parser, "--output", args.output, "overlap.md")
    worker_args = (methods, args.density, args.steps, args.width, args.depth, args.bucket_cap_mb)
    if "RANK" not in os.environ:
        per_rank = run_distributed(worker, args.world_size, *worker_args, timeout=1800)
        network = args.network or "loopback"
    else:
        require_launcher(parser, "benchmarks.overlap")  # RANK alone ended in torch's traceback about WORLD_SIZE
        dist.init_process_group("gloo")  # env:// rendezvous
        rank = dist.get_rank()
        per_rank = gather_on_rank_0(worker(rank, dist.get_world_size(), *worker_args))
        dist.destroy_process_group()
        if rank != 0:
            return
        network = args.network or f"env:// rendezvous at {os.environ['MASTER_ADDR']}"
    params = sum(p.numel() for p in make_model(args.width, args.depth).parameters())
    rows = []
    # the slowest rank sets the pace of a synchronous step
    slowest = {method: {mode: max(r[method][mode] for r in per_rank) for mode in MODES} for method in methods}
    for method in methods:
        t = slowest[method]
        exchange = t["serial"] - t["compute"]
        # An exchange that the noise puts at or below zero has no share to hide: "-" rather than "nan%".
        hidden = f"{100 * (t['serial'] - t['overlapped']) / exchange:.0f}%" if exchange > 0 else "-"
        rows.append(
            [
                method,
                per_rank[0][method]["buckets"],
                1e3 * t["compute"],
                1e3 * exchange,
                1e3 * t["serial"],
                1e3 * t["overlapped"],
                1e3 * t["feedback"],
                t["overlapped"] / t["serial"],
                hidden,
                t["overlapped"] / t["compute"],
                t["overlapped"] / slowest["dense"]["overlapped"] if "dense" in slowest else "-",
                t["feedback"] / t["compute"],
            ]
        )
    table = markdown_table(
        [
            "method",
            "buckets",
            "compute ms",
            "exchange ms",
            "compute + exchange ms",
            "overlapped ms",
            "feedback ms",
            "overlapped / (compute + exchange)",
            "exchange hidden",
            "overlapped / compute",
            "overlapped / dense's",
            "feedback / compute",
        ],
        rows,
    )
    every_row = [r[m] for r in per_rank for m in methods]
    kept = ", freed memory kept (glibc)" if all(row.get("freed memory kept") for row in every_row) else ""
    header = (
        f"{len(per_rank)} Gloo processes ({network}), MLP {args.depth}x{args.width} ({params:,} parameters), "
        f"batch 64, buckets of {args.bucket_cap_mb:g} MB, density {args.density}, median of {args.steps} steps"
        f"{kept}\n\n"
    )
    print(header + table)
    print("written to", write_result(args.output, header + table + "\n"))


if __name__ == "__main__":
    main()
