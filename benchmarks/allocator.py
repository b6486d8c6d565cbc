"""What glibc's malloc costs a CPU training step: page faults and time per step of plain DDP, with
the C library's defaults and after ``gradsparse.launch.keep_freed_memory()``.

    python -m benchmarks.allocator [--width 2048] [--depth 4] [--steps 30] [--rounds 2]

One process, one Gloo rank, one thread: an MLP of ``--depth`` hidden layers of ``--width``
(2048 x 4: 16.8M parameters, the model of benchmarks.overlap), SGD with momentum, a new batch of
64 each step, gradients set to None after each step (torch's default). Each setting runs in a
fresh process, the two in turns for ``--rounds`` rounds, and reports the median minor page faults
and milliseconds of ``--steps`` steps after 5 warm-up steps (a median: a block faulted in once, by
one step, is not what every step pays). No gradsparse hook: what is
measured is torch's own step, which every method's step contains.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from benchmarks.utils import markdown_table

SETTINGS = ("glibc defaults", "keep_freed_memory()")


def steps(width: int, depth: int, count: int, keep: bool) -> dict:
    """Runs in the child process: ``count`` timed steps of the MLP under DDP (one rank)."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradsparse as gs
    from benchmarks.overlap import make_model

    kept = gs.launch.keep_freed_memory() if keep else False
    torch.set_num_threads(1)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = DDP(make_model(width, depth))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    seconds, faults = [], []
    for i in range(count + 5):
        x, y = torch.randn(64, width), torch.randint(0, 10, (64,))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if i >= 5:
            seconds.append(time.perf_counter() - start)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    dist.destroy_process_group()
    return {"kept": kept, "faults": statistics.median(faults), "ms": 1e3 * statistics.median(seconds)}


def run_setting(width: int, depth: int, count: int, keep: bool) -> dict:
    # A fresh process: malloc's settings and the heap's layout are the process's own. The
    # environment's own malloc settings are left out, so that "defaults" are glibc's.
    from gradsparse.launch import without_malloc_settings

    env = without_malloc_settings()
    code = f"import json; from benchmarks.allocator import steps; print(json.dumps(steps({width}, {depth}, {count}, {keep})))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmarks.allocator: the step process failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.allocator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    for flag, value, low in (("--width", args.width, 1), ("--depth", args.depth, 0), ("--steps", args.steps, 1),
                             ("--rounds", args.rounds, 1)):  # fmt: skip
        if value < low:
            parser.error(f"{flag} must be at least {low}, got {value}")
    rows = []
    for round_ in range(1, args.rounds + 1):
        for setting in SETTINGS:
            r = run_setting(args.width, args.depth, args.steps, keep=setting != SETTINGS[0])
            name = setting if setting == SETTINGS[0] or r["kept"] else f"{setting} (not applied: not glibc)"
            rows.append([round_, name, round(r["faults"]), r["ms"]])
    text = (
        f"Plain DDP on one CPU rank, MLP {args.depth}x{args.width}, batch 64, one thread, medians of "
        f"{args.steps} steps\n\n" + markdown_table(["round", "malloc", "page faults per step", "ms per step"], rows)
    )
    print(text)
    return text


if __name__ == "__main__":
    main()
