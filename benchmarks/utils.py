"""Timing helpers shared by the benchmarks: medians of repeated runs, ratios against a baseline
measured in the same run, and markdown tables."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], setup: Callable[[], object] | None = None, repeat: int = 7) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs (after one warm-up); ``setup()`` runs
    before each call, outside the timing."""
    times = []
    for i in range(repeat + 1):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        if i > 0:
            times.append(elapsed)
    return statistics.median(times)


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, text: str) -> str:
    """Writes ``text`` to benchmarks/results/<name> and returns the path."""
    folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(text)
    return path
