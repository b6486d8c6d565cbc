"""How far a step's threshold moves from one step to the next, in training and in the selection
benchmark's gradients.

    python -m benchmarks.threshold_moves [--steps 300] [--density 0.01] [--size 2e6]

The threshold is the k-th largest |residual + gradient| under Top-k's error feedback (k = density
x n; the k largest are sent and zeroed in the residual, the rest kept), the quantity every
threshold method predicts from its last steps. Two streams:
- cnn: the gradients of the CNN example (benchmarks.density's cnn stream: SmallCNN on
  Fashion-MNIST, one worker, 64 samples a step), after 50 steps;
- select: benchmarks.select's methods-table gradients (step_gradient, at --size elements), the
  residual restored before every step as that benchmark restores it.
Printed per stream: the median, mean and 90th percentile of |ln(threshold_t / threshold_t-1)|.
benchmarks.select's SCALE_SPREAD is chosen so that the second matches the first.
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics

import torch

from benchmarks.utils import OUTPUT_HELP, check_output, markdown_table, require_fashion_mnist, whole, write_result


def moves(thresholds: list[float]) -> list[float]:
    """|ln(t_i / t_{i-1})| between consecutive thresholds."""
    return [abs(math.log(b / a)) for a, b in itertools.pairwise(thresholds)]


def topk_thresholds(gradients, n: int, k: int, restore: torch.Tensor | None = None) -> list[float]:
    """The k-th largest |residual + gradient| of each step under Top-k's error feedback; with
    `restore`, the residual is set to it before every step instead of carried over."""
    residual = torch.zeros(n)
    out = []
    for grad in gradients:
        if restore is not None:
            residual.copy_(restore)
        residual += grad
        magnitude = residual.abs()
        threshold = float(torch.topk(magnitude, k).values[-1])
        residual[magnitude >= threshold] = 0
        out.append(threshold)
    return out


def summary(name: str, thresholds: list[float]) -> list[object]:
    m = sorted(moves(thresholds))
    return [name, len(m), statistics.median(m), statistics.mean(m), m[int(0.9 * (len(m) - 1))]]


def main(argv: list[str] | None = None) -> str:
    from benchmarks import density, select

    parser = argparse.ArgumentParser(prog="python -m benchmarks.threshold_moves", description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="steps of each stream (the cnn's first 50 not counted)")
    parser.add_argument("--density", type=float, default=0.01)
    parser.add_argument("--size", type=float, default=2e6, help="elements of the select stream's gradients")
    parser.add_argument("--output", default="threshold_moves.md", help=OUTPUT_HELP)
    args = parser.parse_args(argv)
    if args.steps < 60:
        parser.error(f"--steps must be at least 60 (the cnn stream's first 50 are left out), got {args.steps}")
    if not 0 < args.density <= 0.5:  # above, the k-th largest reaches the CNN's exact zeros (13% of its
        # gradient), and a move ln(t_i / t_i-1) from or to 0 is none a threshold makes
        parser.error(
            f"--density must be in (0, 0.5] (a sparsifier's: the CNN's gradient is 13% zeros), got {args.density}"
        )
    if not (whole(args.size) and args.size >= 1000):
        parser.error(f"--size must be a whole number of elements, at least 1000 (for example 2e6), got {args.size:g}")
    check_output(parser, "--output", args.output, "threshold_moves.md")
    require_fashion_mnist(parser, "the cnn stream")
    cnn = [step[0] for step in density.cnn_stream(args.steps, 1)]
    n = cnn[0].numel()
    rows = [summary("cnn", topk_thresholds(cnn, n, max(1, int(args.density * n)))[50:])]
    n = int(args.size)
    gen = torch.Generator().manual_seed(0)
    draws = [torch.randn(n, generator=gen) * 1e-3 for _ in range(select.GRADIENT_DRAWS)]
    start = torch.randn(n, generator=gen) * 5e-4
    gradients = (select.step_gradient(draws, s) for s in range(args.steps - 50))
    rows.append(summary("select", topk_thresholds(gradients, n, max(1, int(args.density * n)), restore=start)))
    text = (
        f"# Threshold moves per step (density {args.density:g}, Top-k's error feedback)\n\n"
        + markdown_table(["stream", "moves", "median", "mean", "p90"], rows)
        + "\n"
    )
    print(text)
    print(f"written to {write_result(args.output, text)}")
    return text


if __name__ == "__main__":
    main()
