"""Selection cost: the fused error-feedback + selection ops, and every method's whole selection
step, against a plain residual add and against torch.topk, as ratios measured in one run.

    python -m benchmarks.select [--sizes 1e6,25e6] [--densities 0.01,0.001] [--threads N] [--methods]
                                [--rounds R] [--warmup W] [--dtype D] [--device cpu|cuda]

For each size N and density d, on the same float32 gradient and residual:
- add:        residual.add_(grad), the memory traffic any error feedback needs (baseline);
- copy:       a copy of the gradient's bytes into another tensor (on a GPU: device to device);
- threshold:  gradsparse.select_threshold (fused add + select + compact + zero), with the
              threshold set to the d-quantile of |residual + grad| so it selects about d*N;
- topk:       gradsparse.select_topk (fused add + exact top-k);
- torch.topk: residual.add_(grad) then torch.topk(residual.abs(), k), the unfused way.
The residual is restored before every timed call, so each call does the same work.

With --methods, a second table: every method's selection step (all its passes over the bucket,
as reduce_bucket's select_seconds reports it on one rank) as a multiple of the add, the add timed
between the method's steps (its median is the row's "add ms"). Each method is made once and
lives through the whole table, as in a training run: its first W steps (--warmup, 20) are timed
apart, in a column of their own (a method that learns the gradient's scale is slower while it
learns), and the row is its cost after them. Every step's gradient is another draw at another
scale (step_gradient), so a method that predicts this step from the last ones misses as in
training, where no two gradients are alike. With --rounds R every method is timed R times, in
turn with the others, and the medians pool all its steps: the machine's speed drifts over
minutes, which one round per method cannot average out. With --momentum M every
method is also timed with momentum correction at factor M (the velocity's update, fused into the
method's first pass, is part of the selection step), on a row of its own, in turn with the rest.
With --dtype bfloat16 or float16 the methods' table's buckets (and its add) are of that dtype.
With --steps FILE every timed step of that table, with the add beside it, also goes to a CSV file:
on a shared host the add moves by up to 2x within a run, and a step's part that does not move
with it shows only there (docs/benchmarks.md).
With --methods --device cuda the table is every method's whole step on the GPU instead (the
bucket through gradsparse's engine over a one-rank NCCL group: selection, exchange, scatter),
timed from an idle stream to the reduced gradient, since on a GPU the host's select_seconds
misses the kernels still queued when it returns.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

import gradsparse as gs
from benchmarks.utils import (
    OUTPUT_HELP,
    check_output,
    check_threads,
    cpu_description,
    markdown_table,
    median_seconds,
    number_list,
    result_path,
    whole,
    write_result,
)
from gradsparse import _C

WARMUP = 20  # a method's first steps, timed apart from the rest (--warmup)
GRADIENT_DRAWS = 4  # the methods' table's gradients: this many draws, taken in turn
SCALE_SPREAD = 0.06  # the standard deviation of the log of each step's gradient scale


def measure(n: int, density: float, repeat: int, device: str = "cpu") -> list[object]:
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen)
    start = torch.randn(n, generator=gen) * 0.5
    k = max(1, int(density * n))
    threshold = float(torch.kthvalue((start + grad).abs(), n - k + 1).values)  # selects about k elements
    grad, start = grad.to(device), start.to(device)
    residual, copy = start.clone(), torch.empty_like(grad)
    reset = lambda: residual.copy_(start)  # noqa: E731

    def timed(fn):  # on a GPU: from an idle stream to the end of the work
        if device == "cpu":
            return median_seconds(fn, reset, repeat)
        return median_seconds(
            lambda: (fn(), torch.cuda.synchronize()), lambda: (reset(), torch.cuda.synchronize()), repeat
        )

    t_add = timed(lambda: residual.add_(grad))
    t_copy = timed(lambda: copy.copy_(grad))
    t_threshold = timed(lambda: gs.select_threshold(grad, residual, threshold))
    reset()
    selected = gs.select_threshold(grad, residual, threshold)[0].numel()
    t_topk = timed(lambda: gs.select_topk(grad, residual, k))

    def torch_topk():
        residual.add_(grad)
        torch.topk(residual.abs(), k, sorted=False)

    t_torch = timed(torch_topk)
    return [
        f"{n / 1e6:g}M",
        density,
        selected / n,
        1e3 * t_add,
        1e3 * t_copy,
        1e3 * t_threshold,
        1e3 * t_topk,
        1e3 * t_torch,
        t_threshold / t_add,
        t_threshold / t_copy,
        t_torch / t_threshold,
        t_torch / t_topk,
    ]


def method_rows(
    n: int,
    density: float,
    repeat: int,
    rounds: int = 1,
    momentum: float = 0.0,
    only: str = "",
    warmup: int = WARMUP,
    dtype: torch.dtype = torch.float32,
    steps_out: list[list[object]] | None = None,
) -> list[list[object]]:
    """Every method's selection time on one rank, relative to the plain add, in one run. The add
    is timed again next to every step of every method (add, step, add, step, ...), so the two are
    compared under the same conditions; with several rounds every method is timed once per round
    and its steps and adds pooled, since this machine's speed drifts over minutes. Each method
    lives through every round, as in training: its first ``warmup`` steps are timed on their own
    (its start, while a method learns the gradient's scale), the ``repeat`` steps of every round
    after them make its row (its cost for the rest of a run). Every step's gradient is another
    draw at another scale (``step_gradient``), so a method that predicts from its last steps
    misses as it would in training. Buckets of ``dtype`` (the add too). With ``steps_out``, each
    step of a row is appended to it as it is timed: [N, density, method, round, add ms, select ms]."""
    gen = torch.Generator().manual_seed(0)
    draws = [(torch.randn(n, generator=gen) * 1e-3).to(dtype) for _ in range(GRADIENT_DRAWS)]
    start = (torch.randn(n, generator=gen) * 5e-4).to(dtype)
    residual, velocity = start.clone(), start.clone()
    group = _C.ThreadGroup(1, 600.0)
    factories = {}  # SparDL selects inside its exchange
    for name, make in chosen_methods(density, only).items():
        if not selects_in_its_exchange(make):
            factories[name] = (make, 0.0)
            if momentum:
                factories[f"{name} + momentum {momentum:g}"] = (make, momentum)
    methods = {name: make(0) for name, (make, _) in factories.items()}
    steps = dict.fromkeys(factories, 0)
    times: dict[str, list[float]] = {name: [] for name in factories}
    adds: dict[str, list[float]] = {name: [] for name in factories}
    first: dict[str, list[float]] = {name: [] for name in factories}  # select / add of the first steps
    for r in range(rounds):
        for name, (_, factor) in factories.items():
            for _ in range(repeat + (warmup if r == 0 else 0)):
                grad = step_gradient(draws, steps[name])
                add = median_seconds(lambda g=grad: residual.add_(g), lambda: residual.copy_(start), 1)
                residual.copy_(start)
                velocity.copy_(start)
                report, _ = group.reduce(
                    0, grad, residual, methods[name], record=False, velocity=velocity if factor else None,
                    momentum=factor, momentum_masking=True,
                )  # fmt: skip
                steps[name] += 1
                if steps[name] > warmup:
                    times[name].append(report.select_seconds)
                    adds[name].append(add)
                    if steps_out is not None:
                        steps_out.append([n, density, name, r + 1, 1e3 * add, 1e3 * report.select_seconds])
                elif steps[name] > 2:  # the first two: some methods start differently
                    first[name].append(report.select_seconds / add)
    rows = []
    for name in factories:
        t, t_add = statistics.median(times[name]), statistics.median(adds[name])
        start_ratio = statistics.median(first[name]) if first[name] else float("nan")
        rows.append([f"{n / 1e6:g}M", density, name, 1e3 * t, 1e3 * t_add, t / t_add, start_ratio])
    return rows


def step_gradient(draws: list[torch.Tensor], step: int) -> torch.Tensor:
    """The gradient of a method's `step`, a new tensor: one of the draws in turn, at a scale of
    its own, exp(SCALE_SPREAD z) with z a standard normal seeded by the step. The k-th largest
    magnitude of residual + gradient then moves by 5.5% a step on average, as it does between the
    steps of the CNN example's gradients under Top-k's error feedback (density 0.01;
    benchmarks.threshold_moves)."""
    z = random.Random(step).gauss(0.0, 1.0)
    return draws[step % len(draws)] * math.exp(SCALE_SPREAD * z)


def selects_in_its_exchange(make: callable) -> bool:
    """Whether the method ``make`` builds selects block by block inside its exchange (SparDL),
    which leaves no selection step of its own to time on one rank of the CPU."""
    return make(0).exchange == "SparDL"


def chosen_methods(density: float, only: str) -> dict[str, callable]:
    """benchmarks.density's method factories, or those named in ``only`` (comma-separated, spaces
    around the names ignored: "TopK, DGC")."""
    from benchmarks.density import methods

    chosen = methods(density)
    names = [name.strip() for name in only.split(",") if name.strip()]
    if not names:
        return chosen
    unknown = sorted(set(names) - set(chosen))
    if unknown:
        raise SystemExit(f"--only: unknown method(s) {', '.join(unknown)}; choose from {', '.join(chosen)}")
    return {name: chosen[name] for name in names}


def engine_method_rows(n: int, density: float, repeat: int, device: str, only: str = "") -> list[list[object]]:
    """Every method's whole step on one rank of a GPU, as a multiple of the add: the bucket queued
    on gradsparse's engine over a one-rank NCCL group (Gloo on the CPU), timed from an idle stream
    until the reduced gradient is on the device: selection, the one-rank exchange and the scatter.
    On a GPU reduce_bucket's select_seconds would miss the kernels still queued when the host
    returns, so the step is timed whole. The first row, dense, is the one-rank all-reduce."""
    on_gpu = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    grad = (torch.randn(n, generator=gen) * 1e-3).to(device)
    start = (torch.randn(n, generator=gen) * 5e-4).to(device)
    residual, work = start.clone(), torch.empty_like(grad)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("nccl" if on_gpu else "gloo", store=store, rank=0, world_size=1)
        engine = _C.Engine(dist.group.WORLD, 600.0)
        try:
            for name, make in {"dense": None, **chosen_methods(density, only)}.items():
                method = make(0) if make else None
                steps, adds = [], []
                for _ in range(repeat + 2):  # two warm-up steps: some methods start differently
                    residual.copy_(start)
                    sync()
                    adds.append(median_seconds(lambda: (residual.add_(grad), sync()), None, 1))
                    residual.copy_(start)
                    work.copy_(grad)
                    sync()
                    t0 = time.perf_counter()
                    engine.submit(work, residual, method, method is None, "raise", name, _C.ReduceReport()).wait()
                    sync()
                    steps.append(time.perf_counter() - t0)
                t, t_add = statistics.median(steps[2:]), statistics.median(adds[2:])
                rows.append([f"{n / 1e6:g}M", density, name, 1e3 * t, 1e3 * t_add, t / t_add])
        finally:
            engine.shutdown()
            dist.destroy_process_group()
    return rows


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e6,25e6")
    parser.add_argument("--densities", default="0.01,0.001")
    parser.add_argument("--threads", type=int, default=0, help="threads for torch and gradsparse (0: default)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--methods", action="store_true", help="also time every method's selection step")
    parser.add_argument(
        "--rounds", type=int, default=1, help="times every method is timed, in turn with the others (times pooled)"
    )
    parser.add_argument(
        "--momentum", type=float, default=0.0, help="also time every method with momentum correction at this factor"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=WARMUP,
        help="a method's first steps, timed apart from its row's (the methods' table)",
    )
    parser.add_argument("--only", default="", help="comma-separated methods for --methods (default: every one)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16", "float16"],
        help="the buckets' dtype in the CPU's --methods table (its add too)",
    )
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (a gradsparse built with CUDA)")
    parser.add_argument(
        "--steps",
        default="",
        help="also write every step of the --methods table (N, density, method, round, add ms, select ms) to this "
        "CSV file, named as --output names its report; the medians hide how the add moves within a run",
    )
    parser.add_argument("--output", default="select.md", help=OUTPUT_HELP)
    args = parser.parse_args(argv)
    table_only = args.rounds != 1 or args.momentum or args.warmup != WARMUP or args.dtype != "float32" or args.steps
    if not args.methods and (table_only or args.only):
        parser.error(
            "--rounds, --momentum, --warmup, --dtype, --steps and --only apply to the --methods table; add --methods"
        )
    if args.device != "cpu" and table_only:
        parser.error(
            "--rounds, --momentum, --warmup, --dtype and --steps apply to the CPU's --methods table; drop them with "
            f"--device {args.device}"
        )
    sizes = number_list(
        parser,
        "--sizes",
        args.sizes,
        whole,
        "whole number of elements (at least 1)",
        "1e6,25e6",
    )
    sizes = [int(n) for n in sizes]
    densities = number_list(
        parser, "--densities", args.densities, lambda d: 0 < d <= 1, "density in (0, 1]", "0.01,0.001"
    )
    for flag, value, low in (
        ("--repeat", args.repeat, 1),
        ("--rounds", args.rounds, 1),
        ("--threads", args.threads, 0),
        ("--warmup", args.warmup, 0),
    ):
        if value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    check_threads(parser, args.threads, zero="the default")
    if not 0 <= args.momentum < 1:
        parser.error(f"--momentum must be in [0, 1) (0: none), got {args.momentum}")
    if args.device != "cpu" and not args.device.startswith("cuda"):
        parser.error(f"--device: {args.device!r} is neither cpu nor cuda (cuda:N for another GPU)")
    if args.device != "cpu":  # else torch's or the op's error once the CPU's add had been timed
        index = args.device.partition(":")[2]
        if not torch.cuda.is_available() or not gs.built_with_cuda():
            parser.error(
                f"--device {args.device}: no GPU here (torch sees {torch.cuda.device_count()}, gradsparse built "
                f"{'with' if gs.built_with_cuda() else 'without'} CUDA); drop --device, or build with GRADSPARSE_CUDA=1 "
                "on a machine with a GPU"
            )
        if index and not (index.isdigit() and int(index) < torch.cuda.device_count()):
            parser.error(f"--device {args.device}: no such GPU; give cuda:0 to cuda:{torch.cuda.device_count() - 1}")
        if index:  # the synchronizes, the header's name and NCCL's group take the current GPU
            torch.cuda.set_device(args.device)
    if args.methods:
        chosen = chosen_methods(0.01, args.only)  # an unknown --only name, before anything is timed
        inside = [name for name, make in chosen.items() if selects_in_its_exchange(make)]
        if args.only and inside and args.device == "cpu":
            parser.error(
                f"--only {', '.join(inside)}: selects block by block inside its exchange, so on the CPU there is no "
                "selection step of its own to time; its whole step is timed on a GPU (--device cuda)"
            )
    check_output(parser, "--output", args.output, "select.md")
    if args.steps:
        check_output(parser, "--steps", args.steps, "steps.csv")
        if result_path(args.steps) == result_path(args.output):
            parser.error(f"--steps {args.steps} and --output {args.output} name one file; give the steps another")
    if args.threads:
        torch.set_num_threads(args.threads)
        gs.set_num_threads(args.threads)
    sizes_densities = [(n, d) for n in sizes for d in densities]
    rows = [measure(n, d, args.repeat, args.device) for n, d in sizes_densities]
    headers = [
        "N",
        "density",
        "achieved",
        "add ms",
        "copy ms",
        "threshold ms",
        "topk ms",
        "torch.topk ms",
        "threshold / add",
        "threshold / copy",
        "torch.topk / threshold",
        "torch.topk / topk",
    ]
    where = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else f"{torch.get_num_threads()} torch threads, {gs.get_num_threads()} gradsparse threads, {cpu_description()}"
    )
    text = f"# Selection cost (float32, {where}, torch {torch.__version__})\n\n" + markdown_table(headers, rows) + "\n"
    if args.methods and args.device == "cpu":
        steps: list[list[object]] = []
        method_table = [
            row
            for n, d in sizes_densities
            for row in method_rows(
                n, d, args.repeat, args.rounds, args.momentum, args.only, args.warmup, getattr(torch, args.dtype), steps
            )
        ]
        if args.steps:
            lines = ["N,density,method,round,add ms,select ms"]
            lines += [f"{n},{d},{name},{r},{add:.4f},{sel:.4f}" for n, d, name, r, add, sel in steps]
            path = write_result(args.steps, "\n".join(lines) + "\n")
            print(f"steps written to {path}")
        first = f"steps 3-{args.warmup} / add" if args.warmup > 2 else "first steps / add"
        text += (
            f"\n## Selection step of every method (one rank, {args.dtype} buckets)\n\n"
            + markdown_table(["N", "density", "method", "select ms", "add ms", "/ add", first], method_table)
            + f"\n\nMedians of {args.repeat} steps in each of {args.rounds} round(s) over every method, after each "
            + f"method's first {args.warmup} steps (the last column: the median ratio of those but the first two). "
            + "Every step's gradient is another draw at another scale. "
            + "SparDL is not listed: it selects block by block inside its exchange.\n"
        )
    elif args.methods:
        method_table = [
            row for n, d in sizes_densities for row in engine_method_rows(n, d, args.repeat, args.device, args.only)
        ]
        text += (
            "\n## Whole step of every method (one rank, engine over a one-rank NCCL group)\n\n"
            + markdown_table(["N", "density", "method", "step ms", "add ms", "/ add"], method_table)
            + f"\n\nMedians of {args.repeat} steps, each timed from an idle stream until the reduced gradient is on "
            + "the device: selection, the one-rank exchange and the scatter; dense is the one-rank all-reduce.\n"
        )
    print(text)
    print(f"written to {write_result(args.output, text)}")
    return text


if __name__ == "__main__":
    main()
