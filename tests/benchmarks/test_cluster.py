"""The emulated cluster (benchmarks/cluster.py): two hosts in network namespaces on one bridge,
shaped links, the CNN example started on both by torchrun's c10d rendezvous with a sparse method;
it finishes, and nothing is left behind, also when a worker fails. Needs root (CI runs as root)."""

import csv
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.interpreter import externally_managed_python, python_at
from tests.subprocesses import ROOT, environment

pytestmark = [pytest.mark.distributed, pytest.mark.timeout(600)]

if os.geteuid() != 0:
    pytest.skip("the emulated cluster needs root (network namespaces, veth, tc)", allow_module_level=True)


def benchmark(module: str, *arguments: str) -> subprocess.CompletedProcess:
    env = environment(OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", module, "--hosts", "2", "--rate", "200mbit", *arguments]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=500)


def cluster(*worker: str) -> subprocess.CompletedProcess:
    return benchmark("benchmarks.cluster", "--", *worker)


def cluster_namespaces(prefix: str = "gradsparse-cluster-") -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout.split()
    return {name for name in listed if name.startswith(prefix)}


@pytest.fixture
def namespaces_left():
    """The emulated clusters' namespaces that appeared during the test and are still there
    (another cluster running on the machine meanwhile is not this test's)."""
    before = cluster_namespaces()
    return lambda: sorted(cluster_namespaces() - before)


def test_a_sparse_run_on_two_emulated_hosts_finishes_and_cleans_up(tmp_path, namespaces_left):
    done = cluster("-m", "examples.cnn", "--method", "topk", "--epochs", "1", "--max-steps", "4", "--no-progress",
                   "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "2 hosts on one bridge, every link 200mbit each way" in done.stderr, done.stderr[-2000:]
    # each host's worker takes the OMP_NUM_THREADS the cluster passes on (the caller's 1 here)
    assert "2 workers (gloo)" in done.stdout and "1 CPU thread per worker" in done.stdout, done.stdout[-2000:]
    with open(tmp_path / "epochs.csv", newline="") as f:  # one method: the folder itself
        rows = list(csv.DictReader(f))
    assert rows and float(rows[-1]["density"]) == pytest.approx(0.01, rel=0.05), rows
    assert namespaces_left() == []


def test_a_session_puts_back_the_signal_handlers_it_replaced(namespaces_left):
    """benchmarks.cluster.session replaces the SIGINT, SIGTERM and SIGHUP handlers so that a stop
    cleans up; a program that goes on after the session gets its own back (they stayed replaced)."""
    import argparse

    from benchmarks import cluster as emulated

    def handlers():
        return {signum: signal.getsignal(signum) for signum in emulated.STOP_SIGNALS}

    before = handlers()
    with emulated.session(argparse.Namespace(hosts=2, rate="200mbit", burst=None, delay=0.0)):
        assert set(handlers().values()) == {emulated._raise_on_signal}
    assert handlers() == before
    assert namespaces_left() == []


def test_a_failing_worker_ends_the_run_and_cleans_up(namespaces_left):
    done = cluster("-m", "examples.cnn", "--method", "no-such-method", "--max-steps", "1")
    assert done.returncode != 0
    assert "exited with status" in done.stderr, done.stderr[-2000:]
    assert namespaces_left() == []


def test_the_seed_model_benchmark_reports_every_method_against_the_first(tmp_path, namespaces_left):
    report = tmp_path / "seed.md"
    done = benchmark("benchmarks.seed_models", "--models", "resnet20", "--methods", "dense,topk", "--steps", "3",
                     "--out", str(tmp_path / "runs"), "--report", str(report))  # fmt: skip
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    text = report.read_text()
    assert "## resnet20: resnet20 on synthetic cifar10, 272,474 parameters" in text, text
    rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in text.splitlines() if line.startswith("| ")}
    assert float(rows["dense"][1]) == 1.0 and float(rows["topk"][3]) == pytest.approx(0.02, rel=0.1), text
    assert namespaces_left() == []


def processes_running(word: str, program: str | None = None) -> list[int]:
    """The processes whose command line holds ``word`` (and whose program is ``program``, when
    given); a zombie's is empty: it runs no more."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:  # ended meanwhile
            continue
        if word.encode() in argv and (program is None or argv[0] == program.encode()):
            found.append(int(pid))
    return found


def wait_for(condition, seconds: float):
    deadline = time.monotonic() + seconds
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return value


def test_a_closed_terminal_or_a_killed_run_leaves_no_namespace_or_process(tmp_path, namespaces_left):
    """SIGHUP (the terminal closed) ended the cluster at once, leaving its namespaces and every
    host's torchrun and worker running, and a run killed with SIGKILL left its workers running
    after the next run had deleted its namespaces. Both now end with nothing left: SIGHUP cleans
    up as SIGTERM does, and a namespace is deleted only once what runs in it is killed."""
    tag = f"{4000 + os.getpid() % 1000}.{time.monotonic_ns() % 10**6}"  # the workers: sleep <tag>
    env = environment()
    command = [sys.executable, "-m", "benchmarks.cluster", "--hosts", "2", "--", "--no-python", "sleep", tag]
    try:
        for signum in (signal.SIGHUP, signal.SIGKILL):
            with open(tmp_path / "stderr", "w") as stderr:
                started = subprocess.Popen(command, env=env, cwd=ROOT, stderr=stderr)
            assert wait_for(lambda: len(processes_running(tag, "sleep")) == 2, 120), (tmp_path / "stderr").read_text()
            started.send_signal(signum)
            started.wait(timeout=60)
            if signum == signal.SIGKILL:  # the next run removes what the killed one left
                assert namespaces_left() and processes_running(tag)
                done = cluster("--no-python", "true")
                assert done.returncode == 0, done.stderr[-2000:]
            assert wait_for(lambda: not processes_running(tag), 10), (signum, processes_running(tag))
            assert namespaces_left() == [], signum
    finally:  # what a failure left behind
        for pid in processes_running(tag):
            os.kill(pid, signal.SIGKILL)
        for name in namespaces_left():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_a_rate_below_a_byte_a_second_and_worker_arguments_without_the_separator_are_refused(capsys):
    """--rate 4bit passed the check of a rate above 0 and reached tc, which counts whole bytes a
    second and refused it ("the rate parameter is mandatory") once the namespaces were made; and
    the worker's arguments given without -- before them were argparse's bare "unrecognized
    arguments". Both are refused before anything is made, saying what to give."""
    from benchmarks import cluster as emulated
    from tests.refusals import assert_refused

    with pytest.raises(emulated.ClusterError, match=r"--rate must be at least 8bit .*, got '4bit'"):
        emulated.Cluster(2, "4bit")
    assert emulated.Cluster(2, "8bit").rate_bits == 8
    assert_refused(
        emulated.main, ["--hosts", "2", "-m", "examples.cnn"], "the worker's torchrun arguments go after --", capsys
    )


def test_a_host_killed_by_a_signal_ends_the_run_with_the_shells_status(tmp_path, namespaces_left):
    """A host whose torchrun was killed by a signal (the OOM killer's SIGKILL) made the cluster
    return Popen's -9, which sys.exit turned into status 247, and say "exited with status -9"."""
    tag = f"{5000 + os.getpid() % 1000}.{time.monotonic_ns() % 10**6}"
    env = environment()
    command = [sys.executable, "-m", "benchmarks.cluster", "--hosts", "2", "--", "--no-python", "sleep", tag]
    try:
        with open(tmp_path / "stderr", "w") as stderr:
            started = subprocess.Popen(command, env=env, cwd=ROOT, stderr=stderr)
        assert wait_for(lambda: len(processes_running(tag, "sleep")) == 2, 120), (tmp_path / "stderr").read_text()
        (agent,) = set(processes_running(tag)) & set(processes_running("is_host=0"))  # host 1's torchrun
        os.kill(agent, signal.SIGKILL)
        assert started.wait(timeout=60) == 128 + signal.SIGKILL
        assert "host 1 was killed by SIGKILL; stopping the others" in (tmp_path / "stderr").read_text()
        assert wait_for(lambda: not processes_running(tag), 10) and namespaces_left() == []
    finally:
        for pid in processes_running(tag):
            os.kill(pid, signal.SIGKILL)
        for name in namespaces_left():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_a_burst_below_one_frame_is_refused():
    """tbf drops every packet larger than its bucket: with --burst 1000 the hosts could not reach
    each other, and the run failed after a minute of socket errors."""
    from benchmarks import cluster as emulated

    with pytest.raises(emulated.ClusterError, match="--burst must hold one full Ethernet frame, at least 1514 bytes"):
        emulated.Cluster(2, "50mbit", burst=1000)
    assert emulated.Cluster(2, "50mbit", burst=0).burst == 16000
    assert emulated.default_burst(10**14) == 2**32 - 1  # tc reads 32 bits


def test_stale_namespaces_are_a_gone_runs_and_only_the_clusters():
    """A killed run's namespaces are stale when its pid runs no more or was reused since (in a
    container, often by the next run itself: it counted as alive, and every later run failed on
    "File exists", or a killed run's workers went on as long as another process held its pid).
    Another tool's namespaces are never touched: `gsc<digits>-...`, the old short form, was taken
    for a cluster's and deleted with every process in it."""
    from benchmarks import cluster as emulated

    pid, start = emulated.process_tag(os.getpid()).split(".")
    live = f"{emulated.PREFIX}{pid}.{start}-h0"  # this process's, as a Cluster made here names it
    stale = [f"{emulated.PREFIX}{pid}.{int(start) + 1}-sw", f"{emulated.PREFIX}{pid}.{start}0-h1"]  # pid reused
    foreign = ["gsc99999-mydev", f"{emulated.PREFIX}{pid}.{int(start) + 1}-mine", f"{emulated.PREFIX}notes-sw"]
    for name in [live, *stale, *foreign]:
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        found = set(emulated.stale_namespaces())
        assert set(stale) <= found and not found & {live, *foreign}, found
        assert emulated.Cluster(2, "50mbit").switch == f"{emulated.PREFIX}{pid}.{start}-sw"
    finally:
        for name in [live, *stale, *foreign]:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_a_rate_is_given_to_tc_as_it_was_checked():
    """--rate '100mbit ' passed the check (which strips it) and reached tc as given, which refused
    it once the namespaces were made."""
    from benchmarks import cluster as emulated

    assert emulated.Cluster(2, " 100mbit ").rate == "100mbit"


def test_a_host_killed_by_a_real_time_signal_is_reported_by_its_number(capsys):
    """signal.Signals has no name for SIGRTMIN+1: the cluster ended in a ValueError traceback and
    status 1."""
    from benchmarks import cluster as emulated

    class Hosts:  # run() needs the hosts' commands only
        hosts = 1

        def torchrun(self, *_):
            return ["sh", "-c", f"kill -s {signal.SIGRTMIN + 1} $$"]

    assert emulated.run(Hosts(), []) == 128 + signal.SIGRTMIN + 1
    assert f"host 0 was killed by signal {signal.SIGRTMIN + 1}; stopping" in capsys.readouterr().err


def test_a_stop_while_ip_makes_a_namespace_leaves_none(tmp_path, namespaces_left):
    """A Ctrl-C while `ip netns add` ran killed ip after it had made the namespace, which the
    cluster had not recorded yet, so its clean-up left it behind."""
    real = subprocess.run(["which", "ip"], capture_output=True, text=True, check=True).stdout.strip()
    added = tmp_path / "added"
    (tmp_path / "ip").write_text(  # ip, slow after it adds a namespace; it says when it has added one
        f'#!/bin/bash\n{real} "$@"; rc=$?\nif [ "$1 $2" = "netns add" ]; then touch {added}; sleep 3; fi\nexit $rc\n'
    )
    (tmp_path / "ip").chmod(0o755)
    env = environment(PATH=f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    command = [sys.executable, "-m", "benchmarks.cluster", "--hosts", "2", "--", "--no-python", "true"]
    started = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_for(added.exists, 60)
        started.send_signal(signal.SIGINT)
        assert started.wait(timeout=60) == 130, started.stderr.read()[-2000:]
        assert "stopped by SIGINT; the hosts' namespaces and processes are removed" in started.stderr.read()
        assert namespaces_left() == []
    finally:
        started.kill()
        for name in namespaces_left():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


@pytest.mark.parametrize("missing", ["ip", "tc"])
def test_a_machine_without_iproute2_is_told_so(tmp_path, namespaces_left, missing):
    """The cluster needs ip and tc (iproute2), as its docstring says; without ip it ended in a
    FileNotFoundError traceback before anything was made, and without tc in one after the first
    namespace was made. Now a one-line error says what to install, and nothing is left."""
    real = subprocess.run(["which", "ip", "tc"], capture_output=True, text=True, check=True).stdout.split()
    for path in real:  # a PATH holding the tool that is not missing
        name = os.path.basename(path)
        if name != missing:
            os.symlink(path, tmp_path / name)
    env = environment(PATH=str(tmp_path))
    command = [sys.executable, "-m", "benchmarks.cluster", "--hosts", "2", "--", "--no-python", "true"]
    try:
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 1, done.stderr[-2000:]
        assert "Traceback" not in done.stderr, done.stderr[-2000:]
        assert f"needs `{missing}`" in done.stderr and "iproute2" in done.stderr, done.stderr[-2000:]
        assert namespaces_left() == []
    finally:
        for name in namespaces_left():
            subprocess.run(["ip", "netns", "delete", name], capture_output=True)


def test_a_burst_above_32_bits_is_refused_before_anything_is_made():
    """tc reads tbf's burst as 32 bits (default_burst stops there): --burst 5000000000 passed the
    checks and failed in tc ("illegal value for burst") once the namespaces had been made."""
    from benchmarks import cluster as emulated

    with pytest.raises(emulated.ClusterError, match=r"--burst must be at most 4294967295 bytes .*got 5000000000"):
        emulated.Cluster(2, "50mbit", burst=5_000_000_000)
    assert emulated.Cluster(2, "50mbit", burst=2**32 - 1).burst == 2**32 - 1


def test_slow_network_takes_relative_paths_from_the_callers_directory(tmp_path):
    """benchmarks/slow_network.sh run from another directory with a relative PYTHON and --output:
    both mean what they say there (it changed to the repository root first, so the interpreter was
    not found and the report went into the repository)."""
    python_at(tmp_path / "bin" / "python")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON="bin/python")
    before = cluster_namespaces("gs-rank")
    script = os.path.join(ROOT, "benchmarks", "slow_network.sh")
    command = ["bash", script, "--rate", "200mbit", "--methods", "dense,topk", "--steps", "2", "--width", "32",
               "--depth", "1", "--output", "reports/overlap.md"]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "| topk |" in (tmp_path / "reports" / "overlap.md").read_text()
    assert cluster_namespaces("gs-rank") - before == set()


def test_slow_network_runs_the_interpreter_setup_installed_into(tmp_path):
    """benchmarks/slow_network.sh on a machine whose python3 is externally managed: its ranks run
    the virtual environment's interpreter that scripts/setup.sh installed into, as scripts/env.sh
    chooses it (they ran python3, which has no torch there)."""
    python_at(tmp_path / "venv" / "bin" / "python")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=externally_managed_python(tmp_path / "managed"),
               GRADSPARSE_VENV="venv")  # fmt: skip
    script = os.path.join(ROOT, "benchmarks", "slow_network.sh")
    command = ["bash", script, "--rate", "200mbit", "--methods", "dense", "--steps", "2", "--width", "32", "--depth",
               "1", "--output", "reports/overlap.md"]  # fmt: skip
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "| dense |" in (tmp_path / "reports" / "overlap.md").read_text()
