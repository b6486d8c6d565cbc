"""Launcher environments: one training script runs unchanged under torchrun, mpirun and srun.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT itself. Under OpenMPI
(``mpirun``) and SLURM (``srun``) those variables are derived here from the launcher's own:

| variable    | OpenMPI                      | SLURM                                   |
|-------------|------------------------------|-----------------------------------------|
| RANK        | OMPI_COMM_WORLD_RANK         | SLURM_PROCID                            |
| WORLD_SIZE  | OMPI_COMM_WORLD_SIZE         | SLURM_STEP_NUM_TASKS (or SLURM_NTASKS)  |
| LOCAL_RANK  | OMPI_COMM_WORLD_LOCAL_RANK   | SLURM_LOCALID                           |
| MASTER_ADDR | (set it; 127.0.0.1 on one    | first host of SLURM_STEP_NODELIST (or   |
|             | node, unset on several)      | SLURM_JOB_NODELIST)                     |
| MASTER_PORT | (set it, default 29500)      | (set it, default 29500)                 |

LOCAL_WORLD_SIZE, the processes on this node, comes from OMPI_COMM_WORLD_LOCAL_SIZE, or from this
node's (SLURM_NODEID's) entry of SLURM's per-node counts (SLURM_STEP_TASKS_PER_NODE,
SLURM_TASKS_PER_NODE or SLURM_NTASKS_PER_NODE, such as ``2(x3),1``). SLURM's variables are
read for the step (srun's own) before the job's: an srun on part of the allocation (srun
--nodes=1 in a job of two nodes) runs rank 0 on the step's first node, which may not be the
job's. Variables already set are never overwritten.

``threads_per_worker`` gives each worker its share of the CPUs it may run on, and
``keep_freed_memory`` spares CPU workers the page faults of gradients given back and taken again.
"""

from __future__ import annotations

import ctypes
import os
import re
import socket
from collections.abc import Iterable

__all__ = [
    "first_host",
    "keep_freed_memory",
    "mpi_numbering",
    "rendezvous_port",
    "setup_environment",
    "threads_per_worker",
]

_DEFAULT_PORT = "29500"
#: What setup_environment returns.
_LAUNCHERS = ("torchrun", "mpirun", "srun", "none")


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list such as ``node[03-05,09],gpu1`` -> ``node03`` (also
    with text after a range, ``rack[2-3]-n[01-04]`` -> ``rack2-n01``)."""
    match = re.match(r"^([^,\[\]]+)((?:\[[^\[\]]+\][^,\[\]]*)*)(?:,|$)", nodelist.strip())
    if not match:
        raise ValueError(f"cannot parse SLURM node list {nodelist!r}")
    # each range gives its first number: "03-05,09" -> "03"
    return match[1] + re.sub(r"\[([^\]]+)\]", lambda m: m[1].split(",")[0].split("-")[0], match[2])


def rendezvous_port(job_id: int | str, first: int = 15000, last: int = 30000) -> int:
    """A port free on this host for a job's rendezvous, for a job script that runs on the job's
    first node (SLURM's batch script does): the first that binds of ``first + job id % (last -
    first)`` and the ports after it, wrapping around to ``first``, leaving out torchrun's default
    29500 (other jobs' workers take it). From the job id alone, two jobs on one node whose ids
    differed by a multiple of ``last - first`` were given the same port, and the second one's
    rendezvous failed with "address already in use"."""
    job = _whole_number(str(job_id), 0)
    if job is None:
        raise ValueError(f"gradsparse.launch.rendezvous_port: job id {job_id!r} is not a whole number (SLURM_JOB_ID)")
    start = first + job % (last - first)
    port = _first_free_port(p for p in (*range(start, last), *range(first, start)) if p != int(_DEFAULT_PORT))
    if port is not None:
        return port
    raise RuntimeError(
        f"gradsparse.launch.rendezvous_port: no free port from {first} to {last - 1} on this host: set MASTER_PORT"
    )


def _first_free_port(ports: Iterable[int], host: str = "") -> int | None:
    """The first of ``ports`` that binds on ``host`` now (None: none does)."""
    for port in ports:
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
        return port
    return None


def mpi_numbering(environ: dict[str, str] | None = None) -> tuple[int, int] | None:
    """This process's (rank, size) in its MPI job as the launcher's variables give them before
    MPI_Init (OpenMPI's mpirun, MPICH's and Intel MPI's PMI), or None where they give none."""
    env = os.environ if environ is None else environ
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        numbers = (_whole_number(env.get(rank, ""), 0), _whole_number(env.get(size, ""), 1))
        if None not in numbers:
            return numbers
    return None


#: SLURM's per-node task counts, the step's (srun's own) first: ``2(x3),1`` is 2, 2, 2 and 1.
_SLURM_TASKS_PER_NODE = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")


#: SLURM's node lists, the step's (srun's own) first, as for the task counts.
_SLURM_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


def _slurm_tasks_on_this_node(env) -> str | None:
    """The number of tasks on this node (SLURM_NODEID's entry of SLURM's per-node counts), or None
    where SLURM names none, or where the counts differ by node and SLURM_NODEID is unset."""
    name = next((n for n in _SLURM_TASKS_PER_NODE if n in env), None)
    if name is None:
        return None
    counts = []
    for part in env[name].split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if not match or int(match[1]) < 1:
            raise ValueError(
                f"gradsparse.launch.setup_environment: {name}={env[name]!r} is not a list of per-node task counts "
                "such as '4' or '2(x3),1'; the job's environment is damaged: run under srun as SLURM sets it, or "
                "set LOCAL_WORLD_SIZE to the number of tasks on this node"
            )
        counts += [match[1]] * int(match[2] or 1)
    if len(set(counts)) == 1:  # the same on every node (SLURM_NTASKS_PER_NODE names it once)
        return counts[0]
    if "SLURM_NODEID" not in env:
        return None
    node = _whole_number(env["SLURM_NODEID"], 0)
    if node is None or node >= len(counts):
        raise ValueError(
            f"gradsparse.launch.setup_environment: SLURM_NODEID={env['SLURM_NODEID']!r} is not a node of "
            f"{name}={env[name]!r} (nodes 0 to {len(counts) - 1}); the job's environment is damaged: run under srun as SLURM sets it, "
            "or set LOCAL_WORLD_SIZE to the number of tasks on this node"
        )
    return counts[node]


def _whole_number(value: str, least: int) -> int | None:
    """``value`` as an int where it is a whole number of at least ``least`` (spaces around it
    allowed), else None."""
    value = value.strip()
    return int(value) if value.isdecimal() and int(value) >= least else None


def _derive(env, launcher: str, target: str, names: tuple[str, ...], default: str | None, least: int) -> None:
    """Sets ``target`` where it is unset from the first of the launcher's variables ``names`` that
    is set (``default`` where none is), a whole number of at least ``least``."""
    if target in env:
        return
    name = next((n for n in names if n in env), None)
    if name is None and default is None:
        raise ValueError(
            f"gradsparse.launch.setup_environment: {names[0]} is unset, though {launcher} sets it; the launcher's "
            f"environment is damaged: run under {launcher} as it sets it, or set {target} yourself"
        )
    value = default if name is None else env[name].strip()
    if name is not None and _whole_number(value, least) is None:
        raise ValueError(
            f"gradsparse.launch.setup_environment: {name}={env[name]!r} is not a whole number of at least {least} "
            f"for {target}; the launcher's environment is damaged: run under {launcher} as it sets it, or set "
            f"{target} yourself"
        )
    env[target] = value


def _refuse_batch_script(env) -> None:
    """SLURM sets SLURM_PROCID and the job's SLURM_NTASKS in the batch script too, where no srun
    started the other tasks: a process there would wait for them until its rendezvous timed out.
    srun's tasks (job steps) carry SLURM_STEP_ID (SLURM_STEPID in older releases)."""
    if "SLURM_STEP_ID" in env or "SLURM_STEPID" in env:
        return
    size = _whole_number(env["WORLD_SIZE"], 1)
    if size is None:
        raise ValueError(
            f"gradsparse.launch.setup_environment: WORLD_SIZE={env['WORLD_SIZE']!r} is not a whole number of at "
            "least 1: set it to the number of workers (for example WORLD_SIZE=4), or unset it under srun"
        )
    if size == 1:
        return
    raise ValueError(
        f"gradsparse.launch.setup_environment: this process is the batch script of a SLURM job of "
        f"{env['WORLD_SIZE']} tasks (SLURM_PROCID is set, SLURM_STEP_ID is not), so no other worker was started "
        "and it would wait for them: start the workers with srun (for example `srun python -m examples.cnn`), "
        "or start torchrun or mpirun in the script"
    )


def _on_one_node(env) -> bool:
    """Whether all of mpirun's processes run on this node (OMPI_COMM_WORLD_LOCAL_SIZE, the
    processes here, is the world's size)."""
    here, size = _whole_number(env["LOCAL_WORLD_SIZE"], 1), _whole_number(env["WORLD_SIZE"], 1)
    return here is not None and size is not None and here >= size


def _refuse_rank_outside_world(env) -> None:
    """A RANK at or above WORLD_SIZE (one of them left over from another launcher, or a task count
    SLURM did not give) joins a world that cannot complete: init_process_group waited until its
    rendezvous timed out (30 minutes), then named only a socket."""
    rank, size = _whole_number(env["RANK"], 0), _whole_number(env["WORLD_SIZE"], 1)
    if rank is None or size is None or rank < size:
        return
    raise ValueError(
        f"gradsparse.launch.setup_environment: RANK={env['RANK']!r} and WORLD_SIZE={env['WORLD_SIZE']!r} disagree: "
        "a worker's rank must be below the world size, or the workers wait for a rendezvous that cannot complete; "
        "unset the one left over from another run (an export in a job script) so that the launcher sets it, or "
        "set both to agree"
    )


def setup_environment(environ: dict[str, str] | None = None) -> str:
    """Fills RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from the launcher's
    variables. Returns the launcher's name: "torchrun", "mpirun", "srun" or "none"."""
    env = os.environ if environ is None else environ
    # RANK and WORLD_SIZE are torchrun's (or another launcher's that sets them), but for those an
    # earlier call derived from mpirun's or srun's variables (in this process, or in the parent a
    # child inherited them from): those stay mpirun's and srun's. torchrun started under mpirun or
    # srun marks its workers (TORCHELASTIC_RUN_ID).
    derived = env.get("RANK") in (env.get("OMPI_COMM_WORLD_RANK"), env.get("SLURM_PROCID"))
    if "RANK" in env and "WORLD_SIZE" in env and ("TORCHELASTIC_RUN_ID" in env or not derived):
        launcher = "torchrun"
    elif "OMPI_COMM_WORLD_RANK" in env:
        launcher = "mpirun"
        _derive(env, launcher, "RANK", ("OMPI_COMM_WORLD_RANK",), None, 0)
        _derive(env, launcher, "WORLD_SIZE", ("OMPI_COMM_WORLD_SIZE",), None, 1)
        _derive(env, launcher, "LOCAL_RANK", ("OMPI_COMM_WORLD_LOCAL_RANK",), "0", 0)
        _derive(env, launcher, "LOCAL_WORLD_SIZE", ("OMPI_COMM_WORLD_LOCAL_SIZE",), env["WORLD_SIZE"], 1)
        # 127.0.0.1 is each node's own: across nodes the other nodes' workers would wait there
        # for rank 0's store until the rendezvous timed out. Left unset there, torch's env://
        # rendezvous says so at once, and the MPI backend, which needs no address, runs.
        if "MASTER_ADDR" not in env and _on_one_node(env):
            env["MASTER_ADDR"] = "127.0.0.1"
    elif "SLURM_PROCID" in env:
        launcher = "srun"
        _derive(env, launcher, "RANK", ("SLURM_PROCID",), None, 0)
        _derive(env, launcher, "WORLD_SIZE", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"), "1", 1)
        _refuse_batch_script(env)
        _derive(env, launcher, "LOCAL_RANK", ("SLURM_LOCALID",), "0", 0)
        if "LOCAL_WORLD_SIZE" not in env:
            local = _slurm_tasks_on_this_node(env)
            if local is not None:
                env["LOCAL_WORLD_SIZE"] = local
        if "MASTER_ADDR" not in env:
            # the step's nodes first: rank 0 runs on the step's first node, which is not the job's first
            # where srun runs on part of the allocation (srun --nodes=1 in a job of two nodes)
            name = next((n for n in _SLURM_NODELISTS if n in env), None)
            try:
                env["MASTER_ADDR"] = first_host(env[name]) if name else "localhost"
            except ValueError:
                raise ValueError(
                    f"gradsparse.launch.setup_environment: {name}={env[name]!r} is not a SLURM node list such as "
                    "'node[03-05],gpu1'; the job's environment is damaged: run under srun as SLURM sets it, or set "
                    "MASTER_ADDR to the first node's address"
                ) from None
    else:
        return "none"
    _refuse_rank_outside_world(env)
    env.setdefault("MASTER_PORT", _DEFAULT_PORT)
    port = _whole_number(env["MASTER_PORT"], 1)
    if port is None or port > 65535:  # torch.distributed said "invalid literal for int()", or, for
        # an empty one, that MASTER_PORT was not set
        raise ValueError(
            f"gradsparse.launch.setup_environment: MASTER_PORT={env['MASTER_PORT']!r} is not a port, a whole number "
            f"from 1 to 65535: set it to a free port that every worker is given (for example MASTER_PORT=29500), or "
            f"unset it for {_DEFAULT_PORT}"
        )
    return launcher


def _allowed_cpus() -> int:
    """The CPUs this process may run on: its affinity, which taskset, SLURM's cgroups and
    mpirun's and srun's binding narrow (os.cpu_count() counts the whole machine)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _workers_on_this_node(env) -> int:
    """LOCAL_WORLD_SIZE (WORLD_SIZE where it is unset; 1 without either), checked."""
    name = "LOCAL_WORLD_SIZE" if "LOCAL_WORLD_SIZE" in env else "WORLD_SIZE"
    if name not in env:
        return 1
    value = env[name]
    count = _whole_number(value, 1)
    if count is None:
        raise ValueError(
            f"gradsparse.launch.threads_per_worker: {name}={value!r} is not a positive whole number of processes; "
            "the launcher's environment is broken: set it to the number of workers "
            + (
                "on this node (for example LOCAL_WORLD_SIZE=4)"
                if name == "LOCAL_WORLD_SIZE"
                else "(for example WORLD_SIZE=4)"
            )
            + ", or unset it and call gradsparse.launch.setup_environment() under mpirun or srun"
        )
    return count


def threads_per_worker(
    launcher: str,
    environ: dict[str, str] | None = None,
    allowed: int | None = None,
    machine: int | None = None,
) -> int:
    """CPU threads for one worker's torch and gradsparse kernels, after ``setup_environment``.

    ``OMP_NUM_THREADS`` when the caller set it (the first number of a list such as ``4,2``).
    torchrun sets it to 1 itself for several local workers when the caller did not, so a 1 there
    is not taken as a choice. Otherwise the CPUs this process may run on (``allowed``, its
    affinity): torchrun's local workers share their agent's CPUs, so each takes ``allowed /
    LOCAL_WORLD_SIZE``; a process of mpirun or srun may be bound to CPUs of its own, so it takes
    at most ``allowed`` and at most an even share of the ``machine``'s CPUs. At least 1.
    """
    if launcher not in _LAUNCHERS:  # another name was taken for mpirun's or srun's rule, without a word
        raise ValueError(
            f"gradsparse.launch.threads_per_worker: launcher must be one of {', '.join(map(repr, _LAUNCHERS))}, the "
            f"name setup_environment() returns, got {launcher!r}; pass threads_per_worker(setup_environment())"
        )
    env = os.environ if environ is None else environ
    local = _workers_on_this_node(env)
    chosen = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if chosen and not (launcher == "torchrun" and local > 1 and chosen == "1"):
        threads = _whole_number(chosen, 1)
        if threads is None:
            raise ValueError(
                f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']!r} is not a positive whole number of threads: "
                "set it to a count (for example OMP_NUM_THREADS=4), or unset it to share this process's CPUs"
            )
        return threads
    allowed = _allowed_cpus() if allowed is None else allowed
    if launcher == "torchrun":
        return max(1, allowed // local)
    machine = (os.cpu_count() or 1) if machine is None else machine
    return max(1, min(allowed, machine // local))


#: glibc's mallopt parameters (malloc.h) and the settings keep_freed_memory gives them: a heap that
#: is never trimmed, and blocks of up to 32 MiB (the largest glibc accepts) taken from it.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP = {_M_TRIM_THRESHOLD: 2**31 - 1, _M_MMAP_THRESHOLD: 32 * 2**20}
#: The environment's own settings of those two, which keep_freed_memory leaves in force.
_MALLOC_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_")


def keep_freed_memory(environ: dict[str, str] | None = None) -> bool:
    """Has glibc's malloc keep the memory this process frees, for the rest of its life; True where
    it was set, False where the C library is not glibc or the environment already chose
    (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``, or a
    ``glibc.malloc`` tunable in ``GLIBC_TUNABLES``), which it leaves alone.

    A training step on the CPU frees its gradients and the next allocates them again. glibc gives
    large freed blocks back to the kernel (blocks above its mapping threshold, and a heap top above
    its trim threshold), so each step faulted them in anew: a 16.8M-parameter MLP under DDP took
    16,000 page faults a step and about 1.3x the time of a step without, and a process that
    trained several models in turn faulted on the first ones and not on the later, as the heap's
    layout happened to allow. Afterwards the heap is never trimmed and blocks of up to 32 MiB come
    from it: the process keeps its peak memory. The same as starting the workers with
    ``MALLOC_TRIM_THRESHOLD_=2147483647 MALLOC_MMAP_THRESHOLD_=33554432``; an allocator such as
    jemalloc or tcmalloc avoids the faults too. Call it early, before the model is built."""
    env = os.environ if environ is None else environ
    if any(name in env for name in _MALLOC_SETTINGS) or "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library to open, or one without mallopt (musl, macOS)
        return False
    return all(mallopt(parameter, value) == 1 for parameter, value in _KEEP.items())


def without_malloc_settings(environ: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of ``environ`` (default: this process's environment) without glibc's malloc settings
    (every ``MALLOC_*`` variable and ``GLIBC_TUNABLES``): a process started with it runs with
    glibc's defaults, for example to measure what keep_freed_memory changes."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
