"""How closely each method hits its target density, on gradient streams that drift.

    python -m benchmarks.density [--steps 500] [--world-size 4] [--densities 0.01,0.001]

Streams (every rank gets its own gradients; error feedback on, as in training):
- drift: synthetic, n = 200,000 (--drift-size) in 8 "layers" (--drift-layers) of scales from 0.1
  to 10 in random order; the global scale swings by a factor of 9 over about 20 steps
  (docs/method-spec.md ruling 1) and the shape moves between a normal and a heavy-tailed Student-t;
- cnn: gradients recorded from the demo model (SmallCNN on Fashion-MNIST, 80,202 parameters,
  SGD, one mini-batch per rank and step).
For each method, after 50 warm-up steps: the mean and the 95th percentile of
|achieved density / target - 1| per step; the target is k / n with k = max(1, floor(density x
n)), the count the methods aim at (DGC's k = ceil(density x n)). Achieved density: all ranks' selected count / n for
MiCRO, ExDyna and SparDL (one global target), the mean over ranks of count / n for the others.
MiCRO's and ExDyna's rows also give the mean factor of their adaptive band (1.05 to 1.25: the
narrower, the fewer candidates each step lists and counts).

A third table compares the load imbalance of MiCRO's static partitions with ExDyna's dynamic
ones on a gradient whose large values sit in a few layers.
"""

from __future__ import annotations

import argparse
import math
import platform

import torch

import gradsparse as gs
from benchmarks.utils import (
    OUTPUT_HELP,
    check_output,
    markdown_table,
    names,
    number_list,
    require_fashion_mnist,
    whole,
    write_result,
)
from gradsparse.methods import core_method
from gradsparse.testing.thread_ranks import run_steps

WARMUP = 50


def methods(density: float) -> dict[str, callable]:
    """Method factories, by the name printed in the tables: each method with modes in its default
    mode and with ``reference=True`` (the original rule)."""

    def both(name: str, core: str, **options) -> dict[str, callable]:
        return {
            name: lambda r: core_method(core, density=density, **options),
            f"{name} reference": lambda r: core_method(core, density=density, reference=True, **options),
        }

    return {
        "TopK": lambda r: core_method("topk", density=density),
        "RandomK": lambda r: core_method("randomk", density=density),
        "RandomBlock": lambda r: core_method("randomblock", density=density),
        "Threshold (1/(2 sqrt k))": lambda r: core_method("threshold", density=density),
        **both("GaussianK spardl", "gaussiank", variant="spardl"),
        **both("GaussianK sidco", "gaussiank", variant="sidco"),
        **both("DGC", "dgc"),
        **both("RedSync", "redsync"),
        **both("SAGE", "sage"),
        **both("MiCRO", "micro"),
        **both("ExDyna", "exdyna"),
        **both("SIDCo exp", "sidco", fit="exp", stages=1),
        **both("SIDCo gpareto 2", "sidco", fit="gpareto", stages=2),
        **both("SIDCo gamma_gpareto 2", "sidco", fit="gamma_gpareto", stages=2),
        **both("SIDCo exp adaptive", "sidco", fit="exp", stages=-1),
        "SparDL": lambda r: core_method("spardl", density=density),
    }


GLOBAL_TARGET = ("MiCRO", "ExDyna", "SparDL")
STREAMS = ("drift", "cnn")  # the gradient streams (see the module docstring)


def drift_stream(
    steps: int, world_size: int, n: int = 200_000, seed: int = 0, layers: int = 8
) -> list[list[torch.Tensor]]:
    """Synthetic gradients whose scale and shape drift (see the module docstring)."""
    torch.manual_seed(seed)
    layer_scale = torch.logspace(-1, 1, layers)[torch.randperm(layers)]
    bounds = torch.linspace(0, n, layers + 1).long()
    stream = []
    for t in range(steps):
        scale = 3.0 ** math.sin(2 * math.pi * t / 40.0) * (1.0 + 0.3 * math.sin(2 * math.pi * t / 173.0))
        dof = 3.0 + 27.0 * (0.5 + 0.5 * math.sin(2 * math.pi * t / 97.0))  # heavy (3) to nearly normal (30)
        step = []
        for _ in range(world_size):
            g = torch.distributions.StudentT(dof).sample((n,))
            for j in range(layers):
                g[bounds[j] : bounds[j + 1]] *= layer_scale[j]
            step.append((g * scale * 1e-3).float())
        stream.append(step)
    return stream


def cnn_stream(steps: int, world_size: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """Gradients recorded from the demo model while it trains on their average, one mini-batch
    per rank and step."""
    from examples.cnn.data import fashion_mnist
    from examples.cnn.models import SmallCNN

    torch.manual_seed(seed)
    x, y, _, _ = fashion_mnist()
    model = SmallCNN()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    stream = []
    for _ in range(steps):
        step = []
        for _ in range(world_size):
            idx = torch.randint(0, len(x), (64,))
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            step.append(torch.cat([p.grad.reshape(-1) for p in params]).clone())
        average = torch.stack(step).mean(0)
        for p, g in zip(params, average.split([p.numel() for p in params]), strict=True):
            p.grad = g.view_as(p).clone()
        opt.step()
        stream.append(step)
    return stream


def target_fraction(density: float, n: int, name: str = "") -> float:
    """The share of n the method ``name`` aims at, not density itself (80 of 80,202 at 0.001):
    k / n with k = max(1, floor(density * n)) capped at n, the core's target_count
    (docs/method-spec.md ruling 4), and for DGC k = ceil(density * n) (method-spec 4.5)."""
    k = math.ceil(density * n) if name.startswith("DGC") else max(1, math.floor(density * n))
    return min(n, k) / n


def density_errors(stream, density: float, world_size: int, name: str, make) -> tuple[float, float, float | str]:
    """The mean and 95th percentile of |achieved / target - 1| after the warm-up, and the mean band
    factor of the steps after it (MiCRO's and ExDyna's default mode; "" for the others)."""
    n = stream[0][0].numel()
    target = target_fraction(density, n, name)
    steps = run_steps(world_size, make, stream)
    bands = [step[0].state["band"] for step in steps[WARMUP:] if "band" in step[0].state]
    # One global target for the partitioned methods, one per rank for the others.
    divisor = n if any(name.startswith(g) for g in GLOBAL_TARGET) else world_size * n
    errors = []
    for step in steps[WARMUP:]:
        # global targets: the elements the exchange wrote (all ranks' selections together)
        achieved = step[0].union_size / n if divisor == n else sum(rs.indices.numel() for rs in step) / divisor
        errors.append(abs(achieved / target - 1.0))
    errors_t = torch.tensor(errors, dtype=torch.float64)
    return float(errors_t.mean()), float(torch.quantile(errors_t, 0.95)), sum(bands) / len(bands) if bands else ""


def imbalance_table(world_size: int, densities: list[float], steps: int) -> list[list[object]]:
    """MiCRO against ExDyna on a gradient whose large values sit in 2 of 16 layers (one stream for
    every density; the first 10 steps are not counted)."""
    n = 1 << 20
    gen = torch.Generator().manual_seed(1)
    layer = n // 16
    stream = []
    for _ in range(steps):
        step = []
        for _ in range(world_size):
            g = torch.randn(n, generator=gen) * 1e-3
            g[3 * layer : 4 * layer] *= 20.0
            g[11 * layer : 12 * layer] *= 10.0
            step.append(g)
        stream.append(step)
    rows = []
    for density in densities:
        for name, method, reference in (
            ("MiCRO", "micro", False),
            ("ExDyna", "exdyna", False),
            ("MiCRO reference", "micro", True),
            ("ExDyna reference", "exdyna", True),
        ):

            def make(rank, m=method, d=density, ref=reference):
                return core_method(m, density=d, reference=ref)

            result = run_steps(world_size, make, stream)
            values = [step[0].imbalance for step in result[10:]]
            rows.append([name, world_size, density, sum(values) / len(values), max(values)])
    return rows


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--densities", default="0.01,0.001")
    parser.add_argument("--streams", default="drift,cnn")
    parser.add_argument(
        "--drift-size",
        type=float,
        default=200_000,
        help="elements of the drift stream (from 32 blocks of 32768, about 1.05M, SIDCo's default mode samples)",
    )
    parser.add_argument(
        "--drift-layers",
        type=int,
        default=8,
        help="layers of the drift stream, of scales from 0.1 to 10 (many small layers test a sampled fit)",
    )
    parser.add_argument("--methods", default="", help="comma-separated method names of the tables (default: all)")
    parser.add_argument("--no-imbalance", action="store_true", help="skip the load-imbalance table")
    parser.add_argument("--imbalance-steps", type=int, default=100, help="steps of the load-imbalance table (> 10)")
    parser.add_argument("--output", default="density.md", help=OUTPUT_HELP)
    args = parser.parse_args(argv)
    if args.steps <= WARMUP:
        parser.error(f"--steps {args.steps}: the first {WARMUP} steps are not counted; give more than {WARMUP}")
    if not args.no_imbalance and args.imbalance_steps <= 10:
        parser.error(f"--imbalance-steps {args.imbalance_steps}: the first 10 steps are not counted; give more than 10")
    if args.world_size < 1:
        parser.error(f"--world-size must be at least 1 (thread ranks), got {args.world_size}")
    if not whole(args.drift_size):
        parser.error(
            f"--drift-size must be a whole number of elements, at least 1 (for example 200000), got {args.drift_size:g}"
        )
    if not 1 <= args.drift_layers <= args.drift_size:
        parser.error(f"--drift-layers must be from 1 to --drift-size ({args.drift_size:g}), got {args.drift_layers}")
    densities = number_list(
        parser, "--densities", args.densities, lambda d: 0 < d <= 1, "density in (0, 1]", "0.01,0.001"
    )
    streams = names(parser, "--streams", args.streams, STREAMS, "stream")
    if "cnn" in streams:
        require_fashion_mnist(parser, "--streams cnn", "leave that stream out: --streams drift")
    # none named (also " , "): every method, as benchmarks.select's --only reads it
    chosen = (
        names(parser, "--methods", args.methods, methods(0.01), "method")
        if args.methods.replace(",", "").strip()
        else []
    )
    check_output(parser, "--output", args.output, "density.md")
    torch.set_num_threads(2)
    gs.set_num_threads(1)  # the ranks are threads already
    text = f"# Density error over {args.steps} steps ({args.world_size} thread ranks, {platform.machine()})\n\n"
    for stream_name in streams:
        if stream_name == "drift":
            stream = drift_stream(args.steps, args.world_size, n=int(args.drift_size), layers=args.drift_layers)
        else:
            stream = cnn_stream(args.steps, args.world_size)
        rows = []
        for density in densities:
            for name, make in methods(density).items():
                if chosen and name not in chosen:
                    continue
                mean, p95, band = density_errors(stream, density, args.world_size, name, make)
                rows.append([name, density, mean, p95, band])
                print(
                    f"{stream_name:>5} {name:<26} density {density:<6} mean {mean:.3f} p95 {p95:.3f} band {band}",
                    flush=True,
                )
        layers = f", {args.drift_layers} layers" if stream_name == "drift" else ""
        text += f"## Stream: {stream_name} (n = {stream[0][0].numel():,}{layers})\n\n"
        text += markdown_table(["method", "density", "mean |d/target - 1|", "p95", "mean band factor"], rows) + "\n\n"
    if not args.no_imbalance:
        rows = imbalance_table(args.world_size, densities, args.imbalance_steps)
        text += "## Load imbalance (max count x P / total - 1), large values in 2 of 16 layers\n\n"
        text += markdown_table(["method", "ranks", "density", "mean", "max"], rows) + "\n"
    print(text)
    print(f"written to {write_result(args.output, text)}")
    return text


if __name__ == "__main__":
    main()
