"""The training stage of scripts/gpu_check.sh as a Markdown table: for each method, from the run
folders of the Gloo and the NCCL launches, the first and last step's loss, the test accuracy
after the last step, the mean step time and bytes sent per step. Exits 1, naming the method,
when a run is missing or its loss is not finite.

    python scripts/gpu_train_table.py GLOO_DIR NCCL_DIR METHOD[,METHOD...]
"""

from __future__ import annotations

import csv
import math
import os
import sys


def summary(folder: str) -> list[str]:
    with open(os.path.join(folder, "steps.csv"), newline="") as f:
        steps = list(csv.DictReader(f))
    with open(os.path.join(folder, "epochs.csv"), newline="") as f:
        epochs = list(csv.DictReader(f))
    losses = [float(r["loss"]) for r in steps]
    if not steps or not epochs or not all(math.isfinite(x) for x in losses):
        raise ValueError(f"{folder}: no steps, no evaluation, or a loss that is not finite")
    later = steps[1:] or steps  # the first step also pays for warm-up
    ms = 1e3 * sum(float(r["step_seconds"]) for r in later) / len(later)
    sent = sum(float(r["bytes_sent"]) for r in steps) / len(steps)
    return [
        f"{losses[0]:.3f}",
        f"{losses[-1]:.3f}",
        f"{float(epochs[-1]['accuracy']):.4f}",
        f"{ms:.1f}",
        f"{sent:,.0f}",
    ]


def main(argv: list[str]) -> int:
    gloo, nccl, methods = argv[0], argv[1], argv[2].split(",")
    cells = ["first loss", "last loss", "accuracy", "ms/step", "bytes/step"]
    lines = [
        "## Training on the GPU (CNN on Fashion-MNIST; Gloo: 2 processes on one GPU, NCCL: 1 process)",
        "",
        "| method | " + " | ".join(f"Gloo {c}" for c in cells) + " | " + " | ".join(f"NCCL {c}" for c in cells) + " |",
        "|---" * (1 + 2 * len(cells)) + "|",
    ]
    bad = []
    for method in methods:
        row = [method]
        for folder in (gloo, nccl):
            try:
                row += summary(os.path.join(folder, method))
            except (OSError, ValueError, KeyError) as e:
                bad.append(f"{method}: {e}")
                row += ["-"] * len(cells)
        lines.append("| " + " | ".join(row) + " |")
    print("\n".join(lines))
    for line in bad:
        print(f"gpu_train_table: {line}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
