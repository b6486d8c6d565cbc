"""gradsparse.launch: the launchers' variables and each worker's threads."""

import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys

import pytest

from gradsparse.launch import (
    first_host,
    rendezvous_port,
    setup_environment,
    threads_per_worker,
    without_malloc_settings,
)


def test_first_host_of_slurm_node_lists():
    assert first_host("node[03-05,09],gpu1") == "node03"
    assert first_host("gpu1,gpu2") == "gpu1"
    with pytest.raises(ValueError, match="cannot parse"):
        first_host("")


def test_mpirun_and_srun_variables_become_torchs_without_overwriting():
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "node1",  # two nodes: mpirun gives no address there
        "MASTER_PORT": "1",
    }
    assert setup_environment(env) == "mpirun"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_PORT"]) == ("3", "4", "2", "1")
    env = {
        "SLURM_PROCID": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_NTASKS": "8",
        "SLURM_NTASKS_PER_NODE": "4(x2)",
        "SLURM_JOB_NODELIST": "n[7-8]",
    }
    assert setup_environment(env) == "srun"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["MASTER_ADDR"]) == ("1", "8", "4", "n7")
    assert setup_environment({}) == "none"


def test_a_second_call_names_the_launcher_the_first_one_found():
    """RANK and WORLD_SIZE, which the first call derived from mpirun's or srun's variables, were
    taken for torchrun's by a second call (or in a child process that inherited them), whose
    threads then followed torchrun's rule and dropped the user's OMP_NUM_THREADS=1. torchrun's
    workers started under mpirun or srun stay torchrun's."""
    mpirun = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    srun = {"SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n1"}
    for env, launcher in ((mpirun, "mpirun"), (srun, "srun")):
        assert setup_environment(env) == launcher
        child = dict(env)
        assert setup_environment(env) == setup_environment(child) == launcher, env
        assert threads_per_worker(launcher, {**child, "OMP_NUM_THREADS": "1"}, allowed=8, machine=8) == 1
        torchruns = {**env, "RANK": "1", "WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "job"}
        assert setup_environment(torchruns) == "torchrun"
    assert setup_environment({**mpirun, "RANK": "0", "WORLD_SIZE": "2"}) == "torchrun"  # not mpirun's rank


@pytest.mark.parametrize(
    ("launcher", "env", "allowed", "machine", "threads"),
    [
        # torchrun's workers share their agent's CPUs: a job of 32 CPUs on a node of 128
        ("torchrun", {"LOCAL_WORLD_SIZE": "4"}, 32, 128, 8),
        ("torchrun", {"LOCAL_WORLD_SIZE": "4"}, 2, 2, 1),  # never fewer than one
        # ... and its own OMP_NUM_THREADS=1 for several workers is not the caller's choice
        ("torchrun", {"LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}, 32, 128, 8),
        ("torchrun", {"LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}, 32, 128, 1),
        ("torchrun", {"LOCAL_WORLD_SIZE": "4", "OMP_NUM_THREADS": "3"}, 32, 128, 3),
        ("torchrun", {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "6,2"}, 32, 128, 6),
        # a process bound to 8 CPUs of its own (srun --cpus-per-task=8, 4 tasks on the node)
        ("srun", {"LOCAL_WORLD_SIZE": "4"}, 8, 128, 8),
        # unbound processes of mpirun share the machine
        ("mpirun", {"LOCAL_WORLD_SIZE": "4"}, 64, 64, 16),
        ("mpirun", {"LOCAL_WORLD_SIZE": "2", "OMP_NUM_THREADS": "1"}, 64, 64, 1),
    ],
)
def test_threads_per_worker(launcher, env, allowed, machine, threads):
    assert threads_per_worker(launcher, env, allowed=allowed, machine=machine) == threads


@pytest.mark.parametrize("value", ["0", "four", "-2", "\u00b2"])  # a superscript two is a digit, not a number
def test_threads_per_worker_rejects_a_bad_omp_num_threads(value):
    with pytest.raises(ValueError, match=f"OMP_NUM_THREADS='{value}'.*for example OMP_NUM_THREADS=4"):
        threads_per_worker("torchrun", {"LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": value})


def test_threads_per_worker_counts_the_cpus_this_process_may_use():
    # taskset narrows the affinity to one CPU on a machine of several: one thread, not cores / workers
    if shutil.which("taskset") is None:
        pytest.fail("taskset is required (util-linux)")
    code = "from gradsparse.launch import threads_per_worker as t; print(t('torchrun', {'LOCAL_WORLD_SIZE': '1'}))"
    done = subprocess.run(
        ["taskset", "-c", str(min(os.sched_getaffinity(0))), sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "1"
    assert threads_per_worker("torchrun", {"LOCAL_WORLD_SIZE": "1"}) == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE='0'"),
        ({"LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE='two'"),
        ({"LOCAL_WORLD_SIZE": ""}, "LOCAL_WORLD_SIZE=''"),
        ({"LOCAL_WORLD_SIZE": "-4"}, "LOCAL_WORLD_SIZE='-4'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE='0'"),
        ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
    ],
)
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun", "srun"])
def test_threads_per_worker_rejects_a_bad_process_count_naming_the_variable(launcher, env, named):
    # a broken launcher environment: the variable, its value and the fix, not a ZeroDivisionError
    with pytest.raises(ValueError, match=rf"threads_per_worker: {named} is not a positive whole number.*set it to"):
        threads_per_worker(launcher, env, allowed=8, machine=8)


@pytest.mark.parametrize(
    ("env", "local"),
    [
        # SLURM's compressed per-node counts: "2(x3),1" is 2, 2, 2, 1; each node takes its own
        ({"SLURM_NTASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "3"}, "1"),
        ({"SLURM_NTASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "2"}, "2"),
        ({"SLURM_TASKS_PER_NODE": "3,1", "SLURM_NODEID": "1"}, "1"),
        ({"SLURM_TASKS_PER_NODE": "4(x2)"}, "4"),  # the same on every node: no node id needed
        # the step's own layout (srun -n inside a larger allocation) before the job's
        ({"SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_NODEID": "1"}, "1"),
        ({"SLURM_TASKS_PER_NODE": "2,1"}, None),  # differs by node, and the node is unknown: left unset
    ],
)
def test_srun_takes_this_nodes_task_count(env, local):
    env = {"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "7", **env}
    assert setup_environment(env) == "srun"
    assert env.get("LOCAL_WORLD_SIZE") == local


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SLURM_TASKS_PER_NODE": "", "SLURM_NODEID": "0"}, "SLURM_TASKS_PER_NODE=''"),
        ({"SLURM_TASKS_PER_NODE": "2(x", "SLURM_NODEID": "0"}, "SLURM_TASKS_PER_NODE='2\\(x'"),
        ({"SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_NODEID": "3"}, "SLURM_NODEID='3'"),
        ({"SLURM_TASKS_PER_NODE": "2,1", "SLURM_NODEID": "x"}, "SLURM_NODEID='x'"),
    ],
)
def test_srun_refuses_a_task_count_it_cannot_read_naming_the_variable(env, named):
    with pytest.raises(ValueError, match=rf"setup_environment: {named}"):
        setup_environment({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "7", **env})


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"SLURM_PROCID": ""}, "SLURM_PROCID=''"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": ""}, "SLURM_NTASKS=''"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "0"}, "SLURM_NTASKS='0'"),
        ({"SLURM_PROCID": "0", "SLURM_LOCALID": "a"}, "SLURM_LOCALID='a'"),
        ({"SLURM_PROCID": "0", "SLURM_JOB_NODELIST": ""}, "SLURM_JOB_NODELIST=''"),
        ({"OMPI_COMM_WORLD_RANK": "1"}, "OMPI_COMM_WORLD_SIZE"),  # unset
        ({"OMPI_COMM_WORLD_RANK": "-1", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK='-1'"),
        (
            {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": ""},
            "OMPI_COMM_WORLD_LOCAL_SIZE=''",
        ),
    ],
)
def test_setup_environment_refuses_a_damaged_launcher_variable_naming_it(env, named):
    # the variable and its value, where torch's env:// rendezvous would meet int('') later
    with pytest.raises(ValueError, match=rf"setup_environment: {named}.*set"):
        setup_environment(env)


def test_setup_environment_reads_no_launcher_variable_it_does_not_need():
    # variables already set are kept, and the launcher's counterparts are then not read
    env = {"SLURM_PROCID": "1", "SLURM_STEPID": "0", "SLURM_NTASKS": "", "WORLD_SIZE": "2", "SLURM_JOB_NODELIST": ""}
    env["MASTER_ADDR"] = "h"
    assert setup_environment(env) == "srun"
    assert (env["RANK"], env["WORLD_SIZE"], env["MASTER_ADDR"]) == ("1", "2", "h")


# What SLURM sets in the batch script of `sbatch --ntasks=2` (taken from a job on this project's
# one-node SLURM): SLURM_PROCID and the job's task count, but no step.
BATCH_SCRIPT = {
    "SLURM_JOB_NODELIST": "vm",
    "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_PROCID": "0",
    "SLURM_TASKS_PER_NODE": "2",
}


def test_setup_environment_refuses_the_batch_script_of_a_job_of_several_tasks():
    # without srun no other task runs: the process would wait for them until its rendezvous timed out
    with pytest.raises(ValueError, match=r"batch script of a SLURM job of 2 tasks .*srun"):
        setup_environment(dict(BATCH_SCRIPT))
    # a job of one task may run its worker in the script; srun's tasks are steps
    assert setup_environment({**BATCH_SCRIPT, "SLURM_NTASKS": "1"}) == "srun"
    assert setup_environment({**BATCH_SCRIPT, "SLURM_STEP_ID": "0"}) == "srun"
    # a WORLD_SIZE the user set (SLURM's is not read then) is checked before it is counted
    with pytest.raises(ValueError, match=r"WORLD_SIZE='four' is not a whole number.*for example WORLD_SIZE=4"):
        setup_environment({**BATCH_SCRIPT, "WORLD_SIZE": "four"})


def test_first_host_keeps_what_follows_a_range():
    # SLURM's host lists may carry text after a range, or several ranges in one name
    assert first_host("n[7-8]-ib,gpu1") == "n7-ib"
    assert first_host("rack[2-3]-node[01-04,09]") == "rack2-node01"
    assert first_host(" a1 ") == "a1"
    for broken in ("node[1-", "node]1[", ",node1", "[1-2]"):
        with pytest.raises(ValueError, match="cannot parse SLURM node list"):
            first_host(broken)


@pytest.mark.parametrize(
    ("env", "named"),
    [
        # a WORLD_SIZE left in the environment (an earlier torchrun's, a job script's export) under
        # mpirun -np 4: the ranks 2 and 3 joined a world of 2, and waited for the rendezvous until it timed out
        ({"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "WORLD_SIZE": "2"}, r"RANK='3'.*WORLD_SIZE='2'"),
        # srun's task without a task count: a world of 1 that its rank 3 is outside
        ({"SLURM_PROCID": "3", "SLURM_STEP_ID": "0"}, r"RANK='3'.*WORLD_SIZE='1'"),
        ({"SLURM_PROCID": "0", "SLURM_STEP_ID": "0", "SLURM_NTASKS": "2", "RANK": "2"}, r"RANK='2'.*WORLD_SIZE='2'"),
        # a hand-made torchrun environment
        ({"RANK": "2", "WORLD_SIZE": "2"}, r"RANK='2'.*WORLD_SIZE='2'"),
    ],
)
def test_setup_environment_refuses_a_rank_outside_the_world(env, named):
    """torch.distributed.init_process_group took RANK=3 with WORLD_SIZE=2 and waited for a
    rendezvous that could not complete, until its timeout (30 minutes), then said only that a
    socket had timed out. The two variables, their values and the fix are named at once."""
    with pytest.raises(ValueError, match=rf"setup_environment: {named} .*rank .* below"):
        setup_environment(env)


def test_multi_node_mpirun_leaves_master_addr_unset():
    """Under mpirun on several nodes (fewer processes on this node than in the world), the default
    MASTER_ADDR 127.0.0.1 is every node's own loopback: the workers of the other nodes waited there
    for a store that runs on rank 0's node, until the rendezvous timed out. It is left unset there
    (torch's env:// rendezvous says so at once; the MPI backend needs none); a single-node mpirun
    keeps the default, and a MASTER_ADDR given is kept."""
    ompi = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    env = dict(ompi)
    assert setup_environment(env) == "mpirun" and "MASTER_ADDR" not in env and env["RANK"] == "2"
    given = {**ompi, "MASTER_ADDR": "node1"}
    assert setup_environment(given) == "mpirun" and given["MASTER_ADDR"] == "node1"
    single = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    assert setup_environment(single) == "mpirun" and single["MASTER_ADDR"] == "127.0.0.1"


def _a_job_whose_port_is_free() -> tuple[int, int]:
    """A job id from 4321 on whose port (15000 + id % 15000) binds here, and that port."""
    for job in range(4321, 4421):
        with socket.socket() as probe:
            try:
                probe.bind(("", 15000 + job))
            except OSError:
                continue
        return job, 15000 + job
    pytest.fail("no free port from 19321 to 19420 on this machine")


def test_rendezvous_port_is_the_job_ids_unless_it_is_taken_here():
    """Jobs whose ids differed by 15000 were given one port, and on a shared node the second one's
    rendezvous failed with "address already in use": the port is the first free one here from the
    job id's on."""
    job, port = _a_job_whose_port_is_free()
    assert rendezvous_port(job) == port and rendezvous_port(str(job + 15000)) == port
    with socket.socket() as taken:
        taken.bind(("", port))
        taken.listen()
        assert port < rendezvous_port(job) < port + 100
        assert rendezvous_port(job + 15000) == rendezvous_port(job)
    assert rendezvous_port(14500) != 29500  # torchrun's default, which other jobs' workers take
    with socket.socket() as taken:  # the last port wraps around to the first
        with contextlib.suppress(OSError):  # taken already
            taken.bind(("", 29999))
        assert rendezvous_port(14999, first=29998, last=30000) == 29998
    with pytest.raises(ValueError, match=r"job id 'abc' is not a whole number \(SLURM_JOB_ID\)"):
        rendezvous_port("abc")


# A step's gradients as DDP leaves them, four 16 MiB blocks allocated, written and freed: the page
# faults of a step, in glibc's faulting setting (a trim threshold set by the program fixes the
# mapping threshold at 128 KiB: every block is mapped and given back), then after the call.
_FAULTS_PER_STEP = """
import ctypes, json, resource, statistics, torch
import gradsparse as gs
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: a fault a page, not one per 2 MiB huge page
def faults_per_step():  # the median step's, after 5 steps in which the heap grows to its size
    faults = []
    for step in range(15):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        grads = [torch.ones(4 * 2**20) for _ in range(4)]
        del grads
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return statistics.median(faults[5:])
ctypes.CDLL(None).mallopt(gs.launch._M_TRIM_THRESHOLD, 128 * 1024)
faulting = faults_per_step()
kept = gs.launch.keep_freed_memory()
print(json.dumps({"faulting": faulting, "kept": kept, "after": faults_per_step(), "pages": 2**26 // resource.getpagesize()}))
"""


def _faults_per_step(**env: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS_PER_STEP],
        env={**without_malloc_settings(), **env},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_spares_the_steps_their_page_faults():
    """With glibc's defaults a step faulted its 64 MiB of gradients in anew (16,384 pages of 4 KiB)
    on some steps and runs and not on others, as the heap's layout allowed; after
    keep_freed_memory() the heap keeps them. Settings of the environment's own are left in force."""
    run = _faults_per_step()
    assert run["faulting"] > run["pages"] // 4  # the setting the call must undo (64 MiB: 16,384 pages of 4 KiB)
    assert run["kept"] is True and run["after"] < 100
    for env in ({"MALLOC_TRIM_THRESHOLD_": "131072"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}):
        run = _faults_per_step(**env)
        assert run["kept"] is False and run["after"] > run["pages"] // 4, env
