"""The demo training script runs unchanged under torchrun and under mpirun (gradsparse.launch
maps OpenMPI's variables), with the same results for the same seed; and with gradsparse's own
OpenMPI transport under mpirun."""

import csv
import os
import re
import shutil
import subprocess
import sys

import pytest

from gradsparse.testing import free_port
from tests.subprocesses import ROOT, environment

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(900)]

# One thread per worker under both launchers, so that they run the same kernels on any machine.
DEMO = ["-m", "examples.cnn", "--method", "dense,topk,micro", "--epochs", "1", "--max-steps", "6", "--no-progress",
        "--threads", "1"]  # fmt: skip


def run(command: list[str], out: str) -> list[dict]:
    env = environment(OMP_NUM_THREADS="1")
    done = subprocess.run([*command, "--out", out], env=env, cwd=ROOT, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    rows = []
    for method in ("dense", "topk", "micro"):  # the driver writes one folder per method
        with open(os.path.join(out, method, "epochs.csv"), newline="") as f:
            rows += [dict(row, method=method) for row in csv.DictReader(f)]
    return rows


def mpirun(world_size: int) -> list[str]:
    if shutil.which("mpirun") is None:
        pytest.fail("mpirun is required (scripts/setup.sh installs OpenMPI)")
    return [
        "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(world_size),
        "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS", "-x", f"MASTER_PORT={free_port()}",
        sys.executable,
    ]  # fmt: skip


def same_results(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        for key in ("method", "epoch", "step", "loss", "accuracy", "density", "bytes_sent"):
            assert x[key] == y[key], (key, x, y)


def test_demo_gives_the_same_results_under_torchrun_and_mpirun(tmp_path):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    by_torchrun = run([*torchrun, *DEMO], str(tmp_path / "torchrun"))
    by_mpirun = run([*mpirun(2), *DEMO], str(tmp_path / "mpirun"))
    same_results(by_torchrun, by_mpirun)
    # gradsparse's own OpenMPI transport moves the same pairs: the same training, bit for bit
    by_mpi_transport = run([*mpirun(2), *DEMO, "--transport", "mpi"], str(tmp_path / "mpi"))
    same_results(by_mpirun, by_mpi_transport)


def test_srun_on_part_of_the_allocation_meets_at_the_steps_first_node():
    """An srun on one node of a job of two (srun --nodes=1 --ntasks=2 in an sbatch --nodes=2) runs
    rank 0 on the step's node, n8 here: MASTER_ADDR was the job's first node, n7, where nobody
    listened, and every worker waited until its rendezvous timed out. SLURM_NTASKS may still be the
    job's 4 there: the step's 2 tasks make the world."""
    from gradsparse.launch import setup_environment

    env = {
        "SLURM_PROCID": "1", "SLURM_STEP_ID": "3", "SLURM_LOCALID": "1", "SLURM_NODEID": "0",
        "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_JOB_NODELIST": "n[7-8]", "SLURM_NODELIST": "n[7-8]", "SLURM_STEP_NODELIST": "n8",
        "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_TASKS_PER_NODE": "2",
    }  # fmt: skip
    assert setup_environment(env) == "srun"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"]) == ("1", "2", "2", "n8")
    # outside a step (an older SLURM, a hand-made environment) the job's list still serves
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[7-8]"}
    assert setup_environment(env) == "srun" and env["MASTER_ADDR"] == "n7"


@pytest.mark.parametrize("port", ["abc", "", " ", "0", "70000", "29500.0"])
def test_setup_environment_refuses_a_master_port_that_is_no_port(port):
    """MASTER_PORT is the user's own under mpirun and srun. A wrong one was passed on, and
    torch.distributed.init_process_group said "invalid literal for int() with base 10: 'abc'" or,
    for an empty one, that MASTER_PORT was not set."""
    from gradsparse.launch import setup_environment

    for env in (
        {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_PORT": port},
        {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n1", "MASTER_PORT": port},
    ):
        with pytest.raises(ValueError, match=rf"setup_environment: MASTER_PORT={port!r} is not a port, a whole number "
                                             r"from 1 to 65535: set it to a free port .*or unset it for 29500"):  # fmt: skip
            setup_environment(env)


def test_setup_environment_keeps_a_master_port_that_is_one():
    from gradsparse.launch import setup_environment

    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_PORT": " 65535"}
    assert setup_environment(env) == "mpirun" and env["MASTER_PORT"] == " 65535"
    env = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert setup_environment(env) == "mpirun" and env["MASTER_PORT"] == "29500"


@pytest.mark.parametrize("launcher", ["slurm", "TORCHRUN", None, ""])
def test_threads_per_worker_refuses_a_launcher_it_does_not_know(launcher):
    """A name other than setup_environment's was taken for mpirun's and srun's rule without a word:
    threads_per_worker("torch_run") under torchrun gave each of 4 local workers all 32 CPUs of its
    agent's rather than 8."""
    from gradsparse.launch import threads_per_worker

    with pytest.raises(ValueError, match=rf"threads_per_worker: launcher must be one of 'torchrun', 'mpirun', 'srun', "
                                         rf"'none', .* got {re.escape(repr(launcher))}; pass threads_per_worker\(setup_"):  # fmt: skip
        threads_per_worker(launcher, {"LOCAL_WORLD_SIZE": "4"}, allowed=32, machine=128)
