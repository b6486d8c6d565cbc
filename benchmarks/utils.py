"""Helpers shared by the benchmarks: medians of repeated runs, ratios against a baseline
measured in the same run, markdown tables, and lists of numbers given on the command line."""

from __future__ import annotations

import argparse
import math
import os
import pickle
import platform
import statistics
import time
from collections.abc import Callable, Iterable

import torch.distributed as dist


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


def cpu_description() -> str:
    """The CPU's model and the widest SIMD paths gradsparse's CPU kernels take on it (avx512, avx2
    or portable; GRADSPARSE_SIMD narrows them): selection costs move with both, and a shared
    machine's host can change from one day to the next."""
    import gradsparse

    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        pass
    return f"{model or platform.processor() or platform.machine()}, {gradsparse.simd_paths()} kernels"


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    def fmt(v: object) -> str:
        if isinstance(v, float):  # 999.5 and up round to 1000: "1,000", not .3g's "1e+03"
            return f"{v:.3g}" if abs(v) < 999.5 else f"{v:,.0f}"
        return str(v).replace("|", "\\|")  # a bare | ends the cell ("mean |d/target - 1|")

    lines = ["| " + " | ".join(map(fmt, headers)) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


OUTPUT_HELP = (
    "report file: a bare name goes under runs/benchmarks/; a path is taken as given "
    "(benchmarks/results/NAME rewrites the committed report that docs/ quotes)"
)


def result_path(name: str) -> str:
    """Where the report ``name`` goes: a bare file name under runs/benchmarks/ (not committed, so a
    trial run never overwrites the reports docs/ quotes), a path as given."""
    return name if os.path.dirname(name) else os.path.join("runs", "benchmarks", name)


def check_output(parser: argparse.ArgumentParser, flag: str, name: str, example: str) -> None:
    """Refuses, with ``parser.error``, a report ``name`` that write_result could not write, before
    any work (else open's or makedirs' traceback once the run was over, its report lost): a folder
    (an empty name is runs/benchmarks/ itself), a path under a file, or where this user may not
    write. ``example`` is a file name to suggest."""
    path = result_path(name)
    if os.path.isdir(path) or not os.path.basename(path):
        inside = os.path.join(name, example) if os.path.dirname(name) else example
        parser.error(f"{flag} {name!r}: {path} is a folder; give the file to write, for example {flag} {inside}")
    existing = os.path.abspath(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if existing != os.path.abspath(path) and not os.path.isdir(existing):
        reason = f"{existing} is a file, not a folder"
    elif not os.access(existing, os.W_OK):
        reason = f"{existing} is not writable by this user"
    else:
        return
    parser.error(f"{flag} {name}: cannot write {path}: {reason}; give a path in a folder this user may write in")


def write_result(name: str, text: str) -> str:
    """Writes ``text`` to result_path(name), making its folder, and returns the path."""
    path = result_path(name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def number_list(
    parser: argparse.ArgumentParser, flag: str, text: str, valid: Callable[[float], bool], what: str, example: str
) -> list[float]:
    """The comma-separated numbers ``text`` of ``flag``; ``parser.error`` names the first that is
    not ``what`` (``valid`` false, or no number at all) and shows ``example``."""
    values = []
    for item in text.split(","):
        try:
            value = float(item)
        except ValueError:
            value = math.nan
        if not valid(value):
            parser.error(f"{flag}: {item.strip()!r} is no {what}; write e.g. {example}")
        values.append(value)
    return values


def names(
    parser: argparse.ArgumentParser,
    flag: str,
    text: str,
    known: Iterable[str],
    noun: str,
    key: Callable[[str], str] = lambda name: name,
) -> list[str]:
    """The comma-separated names ``text`` of ``flag`` (spaces around them and empty ones ignored);
    ``parser.error`` refuses none at all, one whose ``key`` is not ``known`` and one given twice (a
    report row or run folder per name: the second overwrote the first, or repeated its figures)."""
    known = list(known)
    chosen = [name.strip() for name in text.split(",") if name.strip()]
    if not chosen:
        parser.error(f"{flag} {text!r}: no {noun}; give some of {', '.join(known)}, separated by commas")
    unknown = [name for name in chosen if key(name) not in known]
    if unknown:
        parser.error(f"{flag}: unknown {noun} {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    twice = sorted({name for name in chosen if chosen.count(name) > 1})
    if twice:
        parser.error(f"{flag}: {', '.join(twice)} given twice; name each {noun} once")
    return chosen


def whole(value: float) -> bool:
    """Whether ``value`` (a float argparse read: 1.5, 25e6, nan) is a whole number of at least 1,
    a count of elements or bytes that int() would not cut."""
    return math.isfinite(value) and value >= 1 and value == int(value)


def check_threads(parser: argparse.ArgumentParser, threads: int, zero: str = "") -> None:
    """Refuses, with ``parser.error``, a --threads above gradsparse.MAX_THREADS before torch takes
    them (torch.set_num_threads(100000) segfaults; gradsparse.set_num_threads' ValueError came
    once torch had taken them). ``zero``: what --threads 0 means, where it is allowed."""
    from gradsparse import MAX_THREADS

    if threads > MAX_THREADS:
        parser.error(
            f"--threads {threads}: more than {MAX_THREADS}, the most gradsparse's CPU kernels take; give a count "
            f"up to {MAX_THREADS}" + (f", or 0 for {zero}" if zero else "")
        )


LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def require_launcher(parser: argparse.ArgumentParser, module: str, least_ranks: int = 1) -> None:
    """Refuses, with ``parser.error``, a run outside a launcher (torch's env:// rendezvous then
    ends in a traceback about RANK) or with fewer than ``least_ranks`` ranks."""
    missing = [name for name in LAUNCHER_VARIABLES if name not in os.environ]
    launch = (
        f"torchrun --standalone --nproc-per-node={max(2, least_ranks)} -m {module}, "
        f"or sudo python -m benchmarks.cluster --hosts 4 -- -m {module}"
    )
    if missing:
        parser.error(f"{', '.join(missing)} not set: {module} runs one rank per process; start it with {launch}")
    world = os.environ["WORLD_SIZE"]
    if not (world.isdigit() and int(world) >= least_ranks):
        parser.error(f"WORLD_SIZE={world}: {module} needs at least {least_ranks} ranks; start it with {launch}")


def end_process_group() -> None:
    """Destroys the default process group once every rank has reached this point. A Gloo worker
    thread lets go of a finished collective's tensors only once it holds the GIL; a rank that went
    straight on to exit could reach the interpreter's finalization first, and the thread then
    aborted the process ("terminate called without an active exception"). The barrier's wait
    hands the GIL over, which narrows that window but does not close it: a rank that gathers
    results last does so with gather_on_rank_0, which needs no Gloo collective."""
    dist.barrier()
    dist.destroy_process_group()


def gather_on_rank_0(result: object) -> list | None:
    """Every rank's ``result`` by rank on rank 0 (None on the others), through the rendezvous
    store: no Gloo collective, so no worker thread is left holding its tensors when a rank exits
    (with all_gather_object last, about one run in two of benchmarks/slow_network.sh aborted as
    end_process_group says, a barrier after it included)."""
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        store.set(f"gradsparse-benchmarks/result/{rank}", pickle.dumps(result))
        return None
    keys = [f"gradsparse-benchmarks/result/{r}" for r in range(1, world)]
    if keys:
        store.wait(keys)
    return [result, *(pickle.loads(store.get(key)) for key in keys)]


def require_fashion_mnist(parser: argparse.ArgumentParser, reader: str, otherwise: str = "") -> None:
    """Refuses, with ``parser.error`` before any work, a run whose ``reader`` (a stream, a
    benchmark) trains on Fashion-MNIST where the dataset is not installed; ``otherwise`` names a
    run that does without it."""
    from examples.cnn.data import fashion_mnist_missing

    missing = fashion_mnist_missing()
    if missing:
        parser.error(
            f"{reader} trains the CNN on Fashion-MNIST, not found: {', '.join(missing)}; install it with "
            f"`apt-get install dataset-fashion-mnist`{', or ' + otherwise if otherwise else ''}"
        )
