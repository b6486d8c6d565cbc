"""Every exchange on real transports: torch.distributed Gloo process groups (2 to 4
processes) and gradsparse's own MpiTransport under ``mpirun -np 2..4``.

A known gradient stream goes through DDP and the hook. Per exchange and step, on every rank:
the averaged bucket equals the same method run on ThreadTransport (whose results the re-statement
tests check), the residuals are identical, every replica receives the same bucket, gradient mass
is conserved, the transport counts the same bytes as ThreadTransport, and at density 1.0 the
result is the dense average.
"""

import re
import shutil
import subprocess
import sys
import time

import pytest
import torch

import gradsparse as gs
from gradsparse.testing import DistributedError, free_port, run_distributed
from tests.distributed import workers
from tests.subprocesses import ROOT, environment

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

STEPS, NUMEL = 6, 1237
FULL = {"fixed_size_gather_full", "gather_and_add_full", "shared_full", "spardl_full"}
# How transport="mpi"'s refusals of a low MPI thread level say to ask for MPI_THREAD_MULTIPLE.
ASK_FOR_MULTIPLE = (
    'mpi4py: set mpi4py.rc.thread_level = "multiple" before `from mpi4py import MPI`; '
    "C or C++: MPI_Init_thread with MPI_THREAD_MULTIPLE"
)


def check_exchanges(results: list[dict]) -> None:
    world_size = len(results)
    stream = workers.gradient_stream(world_size, STEPS, NUMEL)
    names = [n for n in workers.EXCHANGE_CASES if workers.exchange_case_applies(n, world_size)]
    assert sorted(results[0]) == sorted(names)
    for name in names:
        runs = [r[name] for r in results]
        ref = runs[0]
        previous = [torch.zeros(NUMEL) for _ in range(world_size)]
        for t in range(STEPS):
            out = runs[0]["out"][t]
            for r in range(1, world_size):
                assert torch.equal(runs[r]["out"][t], out), f"{name} step {t}: rank {r} received another bucket"
            grads = stream[t]
            if name == "dense":
                torch.testing.assert_close(out, sum(grads) / world_size, rtol=1e-5, atol=1e-6)
                continue
            torch.testing.assert_close(out, ref["thread_out"][t], rtol=1e-5, atol=1e-6, msg=f"{name} step {t}")
            for r in range(world_size):
                assert torch.equal(runs[r]["residual"][t], ref["thread_residual"][t][r]), f"{name} step {t} rank {r}"
                sent = runs[r]["bytes"][t] - (runs[r]["bytes"][t - 1] if t else 0)
                assert sent == ref["thread_bytes"][t][r], f"{name} step {t} rank {r}: {sent} bytes counted"
            # Conservation (docs/method-spec.md ruling 6): what was sent plus what stayed is what there was.
            before = sum(previous[r].double() + grads[r].double() for r in range(world_size))
            after = world_size * out.double() + sum(runs[r]["residual"][t].double() for r in range(world_size))
            torch.testing.assert_close(after, before, rtol=0, atol=1e-4, msg=f"{name} step {t}: mass")
            previous = [runs[r]["residual"][t] for r in range(world_size)]
            if name in FULL:
                torch.testing.assert_close(out, sum(grads) / world_size, rtol=1e-5, atol=1e-6)
                assert all(not runs[r]["residual"][t].any() for r in range(world_size))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_exchanges_on_gloo(world_size):
    check_exchanges(run_distributed(workers.exchange_stream, world_size, "process_group", timeout=300))


def run_under_mpirun(tmp_path, world_size: int, function: str, *args: str, timeout: float = 300, expect_failure=False):
    """Runs workers.<function>(rank, world_size, *args) under mpirun; returns every rank's result
    (or, with expect_failure, mpirun's output after checking that it failed)."""
    mpirun = shutil.which("mpirun")
    if mpirun is None or not gs._C.mpi_available():
        pytest.fail("mpirun and a gradsparse build with MPI are required (scripts/setup.sh installs both)")
    env = environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    command = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(world_size), "--mca", "btl", "self,tcp"]
    command += ["-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS"]
    command += [sys.executable, "-m", "tests.distributed.mpi_run", str(tmp_path), function, *args]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if expect_failure:
        assert done.returncode != 0, f"mpirun succeeded:\n{done.stdout[-4000:]}"
        return done.stdout + done.stderr
    assert done.returncode == 0, f"mpirun failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world_size)]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_exchanges_on_mpi(tmp_path, world_size):
    check_exchanges(run_under_mpirun(tmp_path, world_size, "exchange_stream", "mpi"))


def test_auto_exchange_on_mpi(tmp_path):
    """exchange="auto" with transport="mpi": the agreement on the timings goes through MpiTransport."""
    results = run_under_mpirun(tmp_path, 3, "auto_exchange", str(tmp_path / "ckpt"), "topk", "mpi")
    workers.check_auto_exchange(results, "topk")


@pytest.mark.parametrize(
    "method,stall", [("topk", False), ("micro", False), ("spardl", False), ("topk", True), ("spardl", True)]
)
def test_a_rank_that_exits_or_stalls_mid_step_fails_the_others_within_the_timeout(tmp_path, method, stall):
    timeout = 20.0 if not stall else 5.0
    with pytest.raises(DistributedError) as info:
        run_distributed(workers.peer_exits, 3, method, timeout, "process_group", stall, str(tmp_path), timeout=120)
    errors = info.value.errors
    assert set(errors) == {1} and "exited with code 3" in errors[1], errors
    survivors = info.value.results
    for r in (0, 2):
        seen = survivors[r]
        assert seen["step"] == 3, seen
        assert seen["error"] == "RuntimeError" and "gradsparse" in seen["message"], seen
        assert seen["seconds"] < timeout + 10, seen
        # The cause as PyTorch words it, without the C++ stack trace c10's errors carry, before the advice.
        assert "frame #" not in seen["message"] and "A peer may have stopped" in seen["message"], seen["message"]
        if stall:  # the peer is alive but silent: the exchange's timeout ends the wait
            assert "timed out" in seen["message"].lower() or "timeout" in seen["message"].lower(), seen


@pytest.mark.parametrize("case", ["mixed", "sub_group"])
def test_transport_mpi_refusals_reach_every_rank_at_once(tmp_path, case):
    """Ranks given different transports waited the whole timeout, then blamed the set-up (the
    "process_group" ranks created a group the "mpi" ranks did not); transport="mpi" on a sub-group
    initialised MPI before its check, which waits for every rank of the world: forever."""
    results = run_under_mpirun(tmp_path, 3, "mpi_refusal", case, timeout=120)
    expected = (
        "the ranks were given different configurations"
        if case == "mixed"
        else "but the process group [0, 1] given is not the default group"
    )
    for rank, (kind, text) in enumerate(results):
        if case == "sub_group" and rank == 2:
            continue
        assert kind == "ValueError" and expected in text, f"rank {rank}: {kind}: {text}"
        if case == "mixed":
            assert "('transport', 'mpi')" in text and "('transport', 'process_group')" in text, text


# Under mpirun -np 3, a job whose third process trains not: torch's world is ranks 0 and 1.
_SMALLER_TORCH_WORLD = """
import os, sys
import torch.distributed as dist, torch.nn as nn
import gradsparse as gs
from torch.nn.parallel import DistributedDataParallel as DDP

gs.launch.setup_environment()
if os.environ["RANK"] == "2":
    sys.exit(0)
os.environ["WORLD_SIZE"] = "2"
dist.init_process_group("gloo", init_method="env://")
try:
    gs.register(DDP(nn.Linear(4, 1)), gs.TopK(density=0.5, transport="mpi", timeout=20))
    print(f"rank {dist.get_rank()}: registered", flush=True)
except ValueError as e:
    print(f"rank {dist.get_rank()}: {e}", flush=True)
dist.destroy_process_group()
"""


def test_transport_mpi_in_a_torch_world_smaller_than_the_mpi_job_is_refused_before_mpi_init(tmp_path):
    """Two of mpirun's three processes in torch's world: MPI_Init waited for the third for ever,
    past the state's timeout, before the check of the numbering could run. The launcher's
    numbering is compared first."""
    script = tmp_path / "smaller.py"
    script.write_text(_SMALLER_TORCH_WORLD)
    env = environment(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    command = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", "3", "--mca", "btl",
               "self,tcp", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", "-x", "PYTHONPATH", sys.executable, str(script)]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    for rank in (0, 1):
        expected = (f"rank {rank}: TopK: transport=\"mpi\" runs on MPI_COMM_WORLD (here rank {rank} of 3, as the "
                    f"launcher numbers it) but torch.distributed has rank {rank} of 2; the two differ on 2 of the 2 ranks")  # fmt: skip
        assert expected in done.stdout, done.stdout + done.stderr


def test_a_closed_mpi_state_makes_way_for_the_next_under_mpi_thread_serialized(tmp_path):
    """MPI initialised by the program at MPI_THREAD_SERIALIZED admits one transport="mpi" state at
    a time, and the refusal of a second says to close() the first. The closed state's engine kept
    its transport until the state itself was freed (DDP's hook holds it), so the next state was
    refused all the same; the engine thread now releases its transport as it ends."""
    for rank, (provided, alive, closed) in enumerate(
        run_under_mpirun(tmp_path, 2, "mpi_serialized_states", timeout=120)
    ):
        assert provided == 2, f"rank {rank}: MPI provided thread level {provided}"
        assert alive[0] == "ValueError" and 'another transport="mpi" state is alive' in alive[1], (rank, alive)
        assert "MPI_THREAD_SERIALIZED" in alive[1] and ASK_FOR_MULTIPLE in alive[1], (rank, alive)
        assert closed == ("ok", ""), (rank, closed)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_transport_mpi_refusals_name_the_thread_level_and_how_to_ask_for_more(tmp_path, level):
    """MPI initialised below MPI_THREAD_SERIALIZED was refused as "thread level 1", without how to
    ask for more. torch.distributed's MPI process group (backend "mpi") initialises MPI at
    MPI_THREAD_SERIALIZED and calls MPI from its own worker thread: an engine beside it was
    admitted (gradsparse counted only its own engines), and the two threads called MPI at once.
    Each refusal is the same on every rank."""
    for rank, (provided, alone, beside) in enumerate(
        run_under_mpirun(tmp_path, 2, "mpi_thread_level", str(level), timeout=120)
    ):
        assert provided == level, f"rank {rank}: MPI provided thread level {provided}"
        if level == 1:
            for kind, text in (alone, beside):
                assert kind == "CommError" and "initialised MPI at MPI_THREAD_FUNNELED" in text, (rank, kind, text)
                assert ASK_FOR_MULTIPLE in text and "thread level" not in text, (rank, text)
        elif level == 2:
            assert alone == ("ok", ""), (rank, alone)
            kind, text = beside
            assert kind == "ValueError" and "MPI_THREAD_SERIALIZED" in text, (rank, kind, text)
            assert "another thread of this process calls MPI" in text and 'use transport="process_group"' in text
            assert ASK_FOR_MULTIPLE in text, (rank, text)
        else:
            assert alone == beside == ("ok", ""), (rank, alone, beside)


@pytest.mark.parametrize("how", ["exit", "raise"])
def test_a_rank_that_exits_under_mpirun_ends_the_job(tmp_path, how):
    """OpenMPI ends the whole job when a rank exits mid-step, within seconds (MPI has no timeout:
    the survivors would otherwise wait in their collective forever), naming the rank and its code.
    A rank that dies of an uncaught exception ran MPI_Finalize at its exit, which waited for the
    others while they waited for it: the job hung for ever. It now aborts the job."""
    output = run_under_mpirun(
        tmp_path, 3, "peer_exits", "micro", "20", "mpi", "", "", how, expect_failure=True, timeout=120
    )
    ended = time.time()
    exited = re.search(r"rank 1 exits at ([0-9.]+)", output)
    assert exited, output
    if how == "exit":
        assert re.search(r"Process name: \[\[\d+,\d+\],1\]\s+Exit code:\s+3", output), output
    else:
        assert "_Crash: rank 1 dies of an error in its training loop" in output, output  # its traceback first
        # the library's own line (OpenMPI's "MPI_ABORT was invoked on rank 1" came garbled in one run)
        assert "gradsparse: rank 1 ends the MPI job (MPI_Abort) after its uncaught _Crash" in output, output
    assert ended - float(exited.group(1)) < 60, f"the job took {ended - float(exited.group(1)):.1f} s to end"
