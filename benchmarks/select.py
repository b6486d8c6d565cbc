"""Selection cost: the fused error-feedback + selection ops against a plain residual add and
against torch.topk, as ratios measured in one run.

    python -m benchmarks.select [--sizes 1e6,25e6] [--densities 0.01,0.001] [--threads N]

For each size N and density d, on the same float32 gradient and residual:
- add:        residual.add_(grad), the memory traffic any error feedback needs (baseline);
- threshold:  gradsparse.select_threshold (fused add + select + compact + zero), with the
              threshold set to the d-quantile of |residual + grad| so it selects about d*N;
- topk:       gradsparse.select_topk (fused add + exact top-k);
- torch.topk: residual.add_(grad) then torch.topk(residual.abs(), k), the unfused way.
The residual is restored before every timed call, so each call does the same work.
"""

from __future__ import annotations

import argparse
import platform

import torch

import gradsparse as gs
from benchmarks.utils import markdown_table, median_seconds, write_result


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


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1e6,25e6")
    parser.add_argument("--densities", default="0.01,0.001")
    parser.add_argument("--threads", type=int, default=0, help="threads for torch and gradsparse (0: default)")
    parser.add_argument("--repeat", type=int, default=7)
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
    print(text)
    print(f"written to {write_result(args.output, text)}")
    return text


if __name__ == "__main__":
    main()
