"""Quality against training time and against bytes sent, for several runs on one figure.

    python -m examples.plot RUN_DIR [RUN_DIR ...] [--out compare.png] [--metric accuracy] [--table]

A RUN_DIR is a run folder (holding epochs.csv) or a folder of run folders (one per method, as
``--method dense,topk`` writes them). Each run is one line, labelled by its folder name, or, where
two runs have the same name (``job1/topk`` and ``job2/topk``), by as many of its folder's last
names as tell them apart; a run stopped in its first epoch (its epochs.csv holds the header alone)
is left out, with a note. ``--table`` also prints a Markdown table of every run's last epoch:
quality, training time and bytes sent, against the run labelled ``dense`` (``job1/dense`` for
``job1/topk``) when there is one.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import os
import sys


def find_runs(paths: list[str]) -> list[tuple[str, str]]:
    """(label, epochs.csv path) of every run under the given folders (a folder given twice once).
    A run is labelled by its folder's name; where two runs' names are the same (the same method in
    the folders of two jobs), every run by as many of its folder's last names as tell them apart."""
    folders = []
    for path in paths:
        if os.path.exists(os.path.join(path, "epochs.csv")):
            folders.append(path)
            continue
        found = sorted(
            os.path.join(path, name)
            for name in (os.listdir(path) if os.path.isdir(path) else [])
            if os.path.exists(os.path.join(path, name, "epochs.csv"))
        )
        if not found:
            raise SystemExit(f"{path}: no epochs.csv here or in its sub-folders (is it a run folder?)")
        folders += found
    folders = list({os.path.abspath(folder): folder for folder in folders}.values())
    names = [os.path.abspath(folder).strip(os.sep).split(os.sep) for folder in folders]
    last = 1
    while len({tuple(n[-last:]) for n in names}) < len(names):
        last += 1
    return [("/".join(n[-last:]), os.path.join(folder, "epochs.csv")) for n, folder in zip(names, folders, strict=True)]


def read_rows(path: str) -> list[dict[str, float]]:
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for row in reader:
            try:  # a row cut short (a run stopped, or a full disk, while writing it) has None or '' fields
                rows.append({k: float(v) for k, v in row.items()})
            except (TypeError, ValueError):
                print(f"note: {path}: line {reader.line_num} is incomplete and left out", file=sys.stderr)
    # A run stopped inside an epoch reports that partial epoch and later the whole one: keep
    # the latest row of each step count, in step order.
    by_step = {row["step"]: row for row in rows}
    return [by_step[s] for s in sorted(by_step)]


def _ratio(value: float, base: float, form: str) -> str:
    """``value / base`` written with ``form``, or "-" where dense is no base: 0 (one worker's dense
    run sends nothing) or NaN."""
    if base == 0 or base != base:
        return "-"
    return form.format(value / base)


def table(runs: list[tuple[str, list[dict[str, float]]]], metric: str) -> str:
    """Markdown: one row per run, its last epoch; ratios against the run labelled dense, or, where
    labels name folders (job1/topk), against the dense run of the same folder (job1/dense)."""
    labelled = dict(runs)
    lines = [
        f"| method | epochs | {metric} | loss | train time (s) | MB sent per worker | bytes vs dense | time vs dense |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, rows in runs:
        last = rows[-1]
        base = labelled.get(label[: label.rfind("/") + 1] + "dense")
        vs_bytes = _ratio(last["bytes_total"], base[-1]["bytes_total"], "{:.2%}") if base else ""
        vs_time = _ratio(last["elapsed_seconds"], base[-1]["elapsed_seconds"], "{:.2f}x") if base else ""
        lines.append(
            f"| {label} | {last['epoch']:g} | {last[metric]:.4g} | {last['loss']:.4f} | {last['elapsed_seconds']:.1f} "
            f"| {last['bytes_total'] / 1e6:.2f} | {vs_bytes} | {vs_time} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run folders, or folders of run folders")
    parser.add_argument("--out", default="compare.png", help="PNG file to write")
    parser.add_argument("--metric", default=None, help="column to plot (default: the first quality column)")
    parser.add_argument("--title", default=None)
    parser.add_argument("--table", action="store_true", help="also print a Markdown table of the last epochs")
    args = parser.parse_args(argv)
    if os.path.splitext(args.out)[1].lower() != ".png":  # else savefig picks the format from the name, or fails
        parser.error(f"--out {args.out}: the plot is a PNG; give a file name ending in .png")
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):  # else savefig's FileNotFoundError, once everything is drawn
        parser.error(f"--out {args.out}: the folder {folder} does not exist; create it or write the PNG elsewhere")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for label, path in find_runs(args.runs):
        rows = read_rows(path)
        if rows:
            runs.append((label, rows))
        else:  # a run stopped in its first epoch: its epochs.csv holds the header alone
            print(
                f"{label}: no epoch recorded yet in {path} (the run stopped in its first epoch): left out",
                file=sys.stderr,
            )
    if not runs:
        raise SystemExit(f"no run under {', '.join(args.runs)} has recorded an epoch yet: nothing to plot")
    standard = {"epoch", "step", "loss", "density", "bytes_sent", "bytes_total", "train_seconds", "elapsed_seconds"}
    metric = args.metric or next((k for k in runs[0][1][0] if k not in standard), "loss")
    fig, (by_time, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2))
    # Twenty colours (tab20's ten hues, dark then light) and five markers: no two of 20 runs alike.
    colours = itertools.cycle(plt.cm.tab20.colors[0::2] + plt.cm.tab20.colors[1::2])
    for (label, rows), colour, marker in zip(runs, colours, itertools.cycle("os^Dv")):
        if metric not in rows[0]:
            raise SystemExit(f"{label}: no column {metric!r} in its epochs.csv (columns: {', '.join(rows[0])})")
        y = [r[metric] for r in rows]
        style = dict(marker=marker, color=colour, label=label)
        by_time.plot([r["elapsed_seconds"] for r in rows], y, **style)
        by_bytes.plot([r["bytes_total"] / 1e6 for r in rows], y, **style)
    by_time.set_xlabel("training time (s)")
    by_bytes.set_xlabel("MB sent per worker")
    # A log scale drops the points at zero bytes (one worker sends nothing), and with them a whole run.
    if all(r["bytes_total"] > 0 for _, rows in runs for r in rows):
        by_bytes.set_xscale("log")
    for ax in (by_time, by_bytes):
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
    by_bytes.legend(fontsize=8)
    fig.suptitle(args.title or f"{metric} against time and traffic")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out} ({len(runs)} runs)")
    if args.table:
        print(table(runs, metric))
    return args.out


if __name__ == "__main__":
    main(sys.argv[1:])
