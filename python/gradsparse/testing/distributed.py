"""Runs a function on N local processes that form a torch.distributed group on 127.0.0.1.

Each process gets ``fn(rank, world_size, *args)`` after ``init_process_group`` (Gloo by default)
and sends back its return value (picklable) or its exception. The whole run is bounded by a
timeout: processes still alive then are killed and the call raises, so a test never hangs.

The calling process hosts the group's rendezvous store (a TCPStore), so the store outlives every
rank, and ``fn`` starts only once every rank has finished ``init_process_group``: a rank whose
``fn`` returns at once would otherwise exit while another is still connecting to it, and Gloo
fails that rank's ``init_process_group`` with "Connection closed by peer" (about one run in a few
hundred of a ``fn`` that communicates nothing, on two busy cores).

The processes start from a fork server that has imported torch, torch._dynamo (which
DistributedDataParallel's constructor imports) and gradsparse once, where the platform has one;
elsewhere they are spawned. Those imports take seconds of CPU per process, which made up most of
a short multi-process test. A fork server's children are forked from a process that has run
nothing but those imports, so they start as clean as spawned ones; each gets the caller's
environment as it is at the call.
"""

from __future__ import annotations

import contextlib
import faulthandler
import io
import os
import random
import signal
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from gradsparse.launch import _first_free_port


class DistributedError(RuntimeError):
    """One or more ranks raised, died or timed out. ``errors`` maps rank -> traceback text (or
    how the rank ended); ``results`` maps the other ranks to what they returned."""

    def __init__(self, message: str, errors: dict[int, str], results: dict[int, Any] | None = None):
        super().__init__(message)
        self.errors = errors
        self.results = results or {}


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(v) for v in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and outside the kernel's ephemeral range.

    A port the kernel hands out (bind to 0) is in the ephemeral range, where any outgoing
    connection (a TCPStore client of another test, say) may take it between this pick and the
    store's listen: the store then fails with "address already in use". Ports below the range
    are only ever taken by an explicit bind."""
    low, high = _ephemeral_range()
    candidates = list(range(10000, low)) if low > 11000 else list(range(high + 1, 65536))
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    port = _first_free_port(rng.sample(candidates, min(200, len(candidates))), "127.0.0.1")
    if port is not None:
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # every sampled port is taken
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _context():
    """The fork server of this process, started on first use with the module docstring's imports;
    spawn where the platform has no fork server."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    preload = ["torch", "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp", "gradsparse"]
    ctx.set_forkserver_preload(preload)
    return ctx


_INITIALISED = "gradsparse.testing/initialised"
_ALL_INITIALISED = "gradsparse.testing/all_initialised"


def _worker(rank: int, world_size: int, port: int, backend: str, fn: Callable, args: tuple, queue, env: dict) -> None:
    # A fork server's child inherits the server's environment, from when it started: set the caller's.
    os.environ.clear()
    os.environ.update(env)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the parent asks for stacks on timeout
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        if store.add(_INITIALISED, 1) == world_size:  # the module docstring says why
            store.set(_ALL_INITIALISED, "")
        store.wait([_ALL_INITIALISED])
        result = fn(rank, world_size, *args)
        # Serialise to bytes: tensors sent through a queue would be shared through file
        # descriptors that vanish when this process exits.
        buffer = io.BytesIO()
        torch.save(result, buffer)
        queue.put((rank, True, buffer.getvalue()))
    except BaseException as e:  # report everything, including assertion errors
        queue.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    env: dict[str, str] | None = None,
    expect_errors: bool = False,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` new processes, with the caller's
    environment plus ``env`` (torch is imported before: variables it reads at import do not apply).

    Returns the per-rank results. Raises DistributedError if any rank raised (unless
    ``expect_errors``: then the per-rank error texts are returned in place of results, None for
    ranks that succeeded... and successful results are returned as they are), or if the run
    exceeded ``timeout`` seconds.
    """
    import torch
    import torch.distributed as dist

    ctx = _context()
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
    environment = {**os.environ, **(env or {})}
    procs = [
        ctx.Process(target=_worker, args=(r, world_size, port, backend, fn, args, queue, environment), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    import queue as queue_module

    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, ok, value = queue.get(timeout=min(remaining, 1.0))
                results[rank] = (ok, value)
            except queue_module.Empty:
                silent = [r for r, p in enumerate(procs) if r not in results]
                if all(procs[r].exitcode is not None for r in silent):
                    break  # every rank that has not reported has exited: nothing more will come
                if any(procs[r].exitcode not in (None, 0) for r in silent):
                    # A rank died without reporting (killed, crashed): give the others a moment.
                    deadline = min(deadline, time.monotonic() + 30.0)
    finally:
        stuck = [p for r, p in enumerate(procs) if r not in results and p.is_alive()]
        for p in stuck:  # print every thread's stack of a stuck rank before killing it
            os.kill(p.pid, signal.SIGUSR1)
        if stuck:
            time.sleep(1.0)
        for p in stuck:
            p.kill()
        for p in procs:
            p.join(timeout=5.0)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    missing = [r for r in range(world_size) if r not in results]
    errors = {r: v for r, (ok, v) in results.items() if not ok}
    for r in missing:
        code = procs[r].exitcode
        errors[r] = (
            f"rank {r} exited with code {code} without reporting"
            if code is not None and code >= 0 and r not in results and time.monotonic() < deadline
            else f"rank {r} did not finish within {timeout:.0f} s (killed)"
        )
    del store

    def decode(ok: bool, value: Any) -> Any:
        return torch.load(io.BytesIO(value), weights_only=False) if ok else value

    if missing or (errors and not expect_errors):
        detail = "\n".join(f"--- rank {r} ---\n{text}" for r, text in sorted(errors.items()))
        returned = {r: decode(ok, v) for r, (ok, v) in results.items() if ok}
        raise DistributedError(f"{len(errors)} of {world_size} ranks failed:\n{detail}", errors, returned)
    return [decode(*results[r]) for r in range(world_size)]
