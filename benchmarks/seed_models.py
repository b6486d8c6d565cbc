"""The seeds' models at their real sizes on the emulated cluster: step time and bytes per step of
every method against dense.

    sudo python -m benchmarks.seed_models [--hosts 4] [--rate 50mbit] [--steps 4]
                                          [--models resnet20,vgg16,lstm,ncf] [--methods dense,topk,...]

Per model, one torchrun job on the cluster (benchmarks/cluster.py) trains every method one after
the other for --steps steps with the model's seed preset (batch size per worker, density,
optimizer; NeuMF with a quarter of its batch, see MODELS) on --synthetic-data: inputs of the real
shapes, since CIFAR-10, WikiText-2 and MovieLens-20M cannot be downloaded here. The report
(--report, default runs/benchmarks/seed-models.md, rewritten after each model) gives per
method the median step time (the first step left out: DDP's bucket rebuild), the bytes a worker
sent per step (rank 0), the least time those bytes need on the link (bytes x 8 / rate) and the
achieved density, with the ratios to the first method (dense by default), all from the same job.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

from benchmarks import cluster
from benchmarks.utils import OUTPUT_HELP, check_output, markdown_table, names, write_result
from examples.driver import METHODS, step_costs
from examples.plot import read_rows

# model -> (example module, preset, further driver arguments): the seeds' benchmark settings
# (examples/*/__main__.py). NeuMF's batch is a quarter of the seeds' 2^18 per worker: on these
# CPUs a 2^18 batch computes for about 25 s, which would make its compute : communication ratio
# about 1 where the seeds' GPUs had several (docs/benchmarks.md).
MODELS = {
    "resnet20": ("examples.cnn", "spardl-resnet20-cifar10", ()),
    "vgg16": ("examples.cnn", "spardl-vgg16-cifar10", ()),
    "lstm": ("examples.lstm", "exdyna-lstm-wikitext2", ()),
    "ncf": ("examples.ncf", "exdyna-ncf-ml20m", ("--batch-size", str(2**16))),
}


def model_table(out: str, methods: list[str], rate_bits: int) -> tuple[dict, str]:
    """(the first method's config.json, a markdown table of every method's figures). "wire" is
    the least time a worker's bytes of one step need on its link: bytes x 8 / rate."""
    rows, config = [], None
    base = None
    for method in methods:
        folder = os.path.join(out, method)
        if config is None:
            with open(os.path.join(folder, "config.json")) as f:
                config = json.load(f)
        steps = read_rows(os.path.join(folder, "steps.csv"))
        seconds, sent = step_costs([(r["step_seconds"], r["bytes_sent"]) for r in steps])
        density = statistics.fmean(r["density"] for r in steps[1:] or steps)
        base = base or (seconds, sent)
        rows.append([method, seconds, seconds / base[0], sent / 1e6, sent / base[1], sent * 8 / rate_bits, density])
    headers = ["method", "step (s)", f"vs {methods[0]}", "MB sent / step", f"vs {methods[0]}", "wire (s)", "density"]
    return config, markdown_table(headers, rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.seed_models",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cluster.add_arguments(parser)
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated; the first is the baseline")
    parser.add_argument("--steps", type=int, default=4, help="steps per method (the first is left out)")
    parser.add_argument("--out", default="runs/seed-models", help="run folders: <out>/<model>/<method>")
    parser.add_argument("--report", default="seed-models.md", help=OUTPUT_HELP)
    args = parser.parse_args(argv)
    # None: the cluster was made, nothing ran, and no report was written; twice: it trained twice
    # into the same run folders, and the report had it twice
    models = names(parser, "--models", args.models, MODELS, "model")
    if args.steps < 1:  # the driver's --max-steps 0 means no limit: every epoch of the preset
        parser.error(f"--steps must be at least 1, got {args.steps}")
    # Else each worker's driver refused them, once the cluster had been made, and the report named
    # only the failed model's exit status.
    methods = names(parser, "--methods", args.methods, METHODS, "method")
    if len(methods) < 2:
        parser.error(f"--methods {args.methods!r}: give a baseline and at least one method to compare with it")
    check_output(parser, "--report", args.report, "seed-models.md")  # written after the first model trained
    sections = [
        f"# The seeds' models on the emulated cluster: {args.hosts} hosts, {args.rate} links\n\n"
        f"`sudo python -m benchmarks.seed_models{''.join(' ' + a for a in (sys.argv[1:] if argv is None else argv))}`: "
        f"{args.steps} steps per method on synthetic data of the real shapes, the seed preset's settings; "
        "median step (the first left out), bytes sent per step by one worker, ratios to the first method."
    ]
    try:
        with cluster.session(args, "benchmarks.seed_models") as emulated:
            for model in models:
                module, preset, extra = MODELS[model]
                out = os.path.join(args.out, model)
                worker = ["-m", module, "--preset", preset, "--synthetic-data", "--method", ",".join(methods),
                          "--max-steps", str(args.steps), "--fresh", "--no-progress", "--out", out, *extra]  # fmt: skip
                code = cluster.run(emulated, worker)
                if code != 0:
                    print(f"benchmarks.seed_models: {model} failed (status {code})", file=sys.stderr)
                    return code
                config, table = model_table(out, methods, emulated.rate_bits)
                sections.append(
                    f"## {model}: {config['task']}, {config['parameters']:,} parameters\n\n"
                    f"Preset `{preset}`{' ' + ' '.join(extra) if extra else ''}: batch {config['batch_size']} per worker, density {config['density']}.\n\n"
                    + table
                )
                report = write_result(args.report, "\n\n".join(sections) + "\n")
                print(f"benchmarks.seed_models: {model} done; {report}", file=sys.stderr, flush=True)
    except cluster.ClusterError as e:
        print(f"benchmarks.seed_models: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
