"""Selection cost: the fused error-feedback + selection ops, and every method's whole selection
step, against a plain residual add and against torch.topk, as ratios measured in one run.

    python -m benchmarks.select [--sizes 1e6,25e6] [--densities 0.01,0.001] [--threads N] [--methods]

For each size N and density d, on the same float32 gradient and residual:
- add:        residual.add_(grad), the memory traffic any error feedback needs (baseline);
- threshold:  gradsparse.select_threshold (fused add + select + compact + zero), with the
              threshold set to the d-quantile of |residual + grad| so it selects about d*N;
- topk:       gradsparse.select_topk (fused add + exact top-k);
- torch.topk: residual.add_(grad) then torch.topk(residual.abs(), k), the unfused way.
The residual is restored before every timed call, so each call does the same work.

With --methods, a second table: every method's selection step (all its passes over the bucket,
as reduce_bucket's select_seconds reports it on one rank) as a multiple of the add.
"""

from __future__ import annotations

import argparse
import platform

import torch

import gradsparse as gs
from benchmarks.utils import markdown_table, median_seconds, write_result
from gradsparse import _C


def measure(n: int, density: float, repeat: int) -> list[object]:
    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen)
    start = torch.randn(n, generator=gen) * 0.5
    residual = start.clone()
    k = max(1, int(density * n))
    a = (start + grad).abs()
    threshold = float(torch.kthvalue(a, n - k + 1).values)  # selects about k elements
    reset = lambda: residual.copy_(start)  # noqa: E731

    t_add = median_seconds(lambda: residual.add_(grad), reset, repeat)
    t_threshold = median_seconds(lambda: gs.select_threshold(grad, residual, threshold), reset, repeat)
    reset()
    selected = gs.select_threshold(grad, residual, threshold)[0].numel()
    t_topk = median_seconds(lambda: gs.select_topk(grad, residual, k), reset, repeat)

    def torch_topk():
        residual.add_(grad)
        torch.topk(residual.abs(), k, sorted=False)

    t_torch = median_seconds(torch_topk, reset, repeat)
    return [
        f"{n / 1e6:g}M",
        density,
        selected / n,
        1e3 * t_add,
        1e3 * t_threshold,
        1e3 * t_topk,
        1e3 * t_torch,
        t_threshold / t_add,
        t_torch / t_threshold,
        t_torch / t_topk,
    ]


def method_rows(n: int, density: float, repeat: int) -> list[list[object]]:
    """Every method's selection time on one rank, relative to the plain add, in one run."""
    from benchmarks.density import methods

    gen = torch.Generator().manual_seed(0)
    grad = torch.randn(n, generator=gen) * 1e-3
    start = torch.randn(n, generator=gen) * 5e-4
    residual = start.clone()
    t_add = median_seconds(lambda: residual.add_(grad), lambda: residual.copy_(start), repeat)
    group = _C.ThreadGroup(1, 600.0)
    rows = []
    for name, make in methods(density).items():
        method = make(0)
        times = []
        for i in range(repeat + 2):  # two warm-up steps: some methods start differently
            residual.copy_(start)
            report = group.reduce(0, grad.clone(), residual, method, record=False)
            if i >= 2:
                times.append(report.select_seconds)
        t = sorted(times)[len(times) // 2]
        if t > 0:  # SparDL selects block by block inside its exchange: no separate step to time
            rows.append([f"{n / 1e6:g}M", density, name, 1e3 * t, t / t_add])
    return rows


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e6,25e6")
    parser.add_argument("--densities", default="0.01,0.001")
    parser.add_argument("--threads", type=int, default=0, help="threads for torch and gradsparse (0: default)")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--methods", action="store_true", help="also time every method's selection step")
    parser.add_argument("--output", default="select.md", help="file name under benchmarks/results/")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
        gs.set_num_threads(args.threads)
    rows = [
        measure(int(float(n)), float(d), args.repeat) for n in args.sizes.split(",") for d in args.densities.split(",")
    ]
    headers = [
        "N",
        "density",
        "achieved",
        "add ms",
        "threshold ms",
        "topk ms",
        "torch.topk ms",
        "threshold / add",
        "torch.topk / threshold",
        "torch.topk / topk",
    ]
    text = (
        f"# Selection cost (float32, {torch.get_num_threads()} torch threads, {gs.get_num_threads()} gradsparse "
        f"threads, {platform.processor() or platform.machine()}, torch {torch.__version__})\n\n"
        + markdown_table(headers, rows)
        + "\n"
    )
    if args.methods:
        method_table = [
            row
            for n in args.sizes.split(",")
            for d in args.densities.split(",")
            for row in method_rows(int(float(n)), float(d), args.repeat)
        ]
        text += (
            "\n## Selection step of every method (one rank)\n\n"
            + markdown_table(["N", "density", "method", "select ms", "/ add"], method_table)
            + "\nSparDL is not listed: it selects block by block inside its exchange.\n"
        )
    print(text)
    print(f"written to {write_result(args.output, text)}")
    return text


if __name__ == "__main__":
    main()
