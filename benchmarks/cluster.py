"""An emulated cluster on one machine: N hosts as network namespaces on one bridge, every link
rate-limited in both directions, one worker per host started by torchrun's multi-node c10d
rendezvous, exactly as on a real cluster.

    sudo python -m benchmarks.cluster [--hosts 4] [--rate 50mbit] [--delay 0] -- -m examples.cnn [ARGS...]
    sudo python -m benchmarks.cluster --hosts 2 -- -m examples.cnn --method topk --max-steps 5

Layout: a switch namespace holding a bridge, and per host a namespace whose eth0 (10.214.0.h/24,
h = 1..N) is one end of a veth pair whose other end is a bridge port. tbf shapes both directions
of every link: eth0's egress (host to switch) and the port's egress (switch to host), so a
host's sends and receives each go at --rate, as through one full-duplex NIC. --delay adds a
netem delay on both ends where the kernel has netem (not everywhere: without it the run stops
with a clear error rather than silently measuring no latency).

On every host, in its namespace:

    torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 10.214.0.1:29400
             --rdzv-id <run> <the arguments after -->

with GLOO_SOCKET_IFNAME=eth0, so every collective crosses the shaped links (host 1 also serves
the rendezvous store: `--rdzv-conf is_host=1`, since the machine's hostname resolves outside
the namespaces). The first host to fail ends the run. Namespaces, links and processes
are removed on every exit path (normal end, failure, Ctrl-C, SIGTERM, a closed terminal's SIGHUP);
namespaces left behind by a run that was killed with SIGKILL are removed by the next run, with the
processes still running in them (a namespace is named after the process that made it, its pid and
its start time, so a pid reused since is no run's, and no namespace of another tool is touched). Needs root, ip and tc
(iproute2).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence

PREFIX = "gradsparse-cluster-"  # namespaces: <PREFIX><pid>.<start>-sw and -h<i> (process_tag)
SUBNET = "10.214.0"
RDZV_PORT = 29400
MIN_BURST = 1514  # one full frame on the 1500-byte-MTU veth links (with its 14-byte Ethernet header)
#: The signals that end a run with its clean-up: Ctrl-C, kill's default, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ClusterError(RuntimeError):
    """Setting up or running the emulated cluster failed (the message says what and how to fix it)."""


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        error = done.stderr.strip() or done.stdout.strip()
        if "Operation not permitted" in error:  # root in name only: a user namespace, or capabilities dropped
            error += (
                "; the emulated cluster needs CAP_SYS_ADMIN and CAP_NET_ADMIN of the machine's own namespaces (a "
                "container: --privileged, or --cap-add SYS_ADMIN --cap-add NET_ADMIN); without them run the workers "
                "on this machine: torchrun --standalone --nproc-per-node=N ARGS"
            )
        raise ClusterError(f"`{shlex.join(command)}` failed: {error}")


def _parse_rate(rate: str) -> int:
    """A tc rate such as 100mbit or 1gbit, in bits per second."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    text = rate.strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit) and text[: -len(unit)].replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * scale)
    raise ClusterError(f"--rate must be a tc rate such as 100mbit or 1gbit, got {rate!r}")


def default_burst(rate_bits: int) -> int:
    """tbf's bucket: 2 ms at the rate, at least 16 KB (see benchmarks/slow_network.sh)."""
    return min(2**32 - 1, max(16_000, rate_bits // 8 // 500))  # tc reads the burst as 32 bits


def delete_namespace(namespace: str) -> str:
    """Kills every process still running in ``namespace``, then deletes it (its links go with it);
    returns ip's error, empty when it was deleted. A namespace deleted while a process runs in it
    loses its name but lives on, links and process with it (a worker whose torchrun was killed, or
    the workers of a run killed with SIGKILL)."""
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
    for pid in listed:
        if pid.isdigit():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
    done = subprocess.run(["ip", "netns", "delete", namespace], capture_output=True, text=True)
    if done.returncode == 0:
        return ""
    return done.stderr.strip() or f"ip netns delete exited with {done.returncode}"


def process_tag(pid: int) -> str | None:
    """``<pid>.<start time>`` of a running process (its start in clock ticks since boot, field 22
    of /proc/<pid>/stat), which no later process with the same pid shares; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
    except (OSError, IndexError):
        return None
    return f"{pid}.{fields[19]}"


def stale_namespaces() -> list[str]:
    """Namespaces of earlier runs whose process is gone: named after a pid and start time that no
    running process has (a pid reused since, this process's own included, has another start).
    Only names of this tool's exact form count: another tool's namespaces are not touched."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    stale = []
    for name in listed:
        tag, _, role = name.removeprefix(PREFIX).rpartition("-")
        pid, _, start = tag.partition(".")
        owned = name.startswith(PREFIX) and pid.isdigit() and start.isdigit()
        if owned and (role == "sw" or (role[:1] == "h" and role[1:].isdigit())) and process_tag(int(pid)) != tag:
            stale.append(name)
    return stale


class Cluster:
    """The namespaces and links of one emulated cluster; a context manager that removes them."""

    def __init__(self, hosts: int, rate: str, burst: int | None = None, delay_ms: float = 0.0) -> None:
        if hosts < 2 or hosts > 200:
            raise ClusterError(f"--hosts must be between 2 and 200, got {hosts}")
        if not (math.isfinite(delay_ms) and delay_ms >= 0):  # a negative one was no delay, NaN netem's error
            raise ClusterError(f"--delay must be a finite number of ms >= 0 (0: none), got {delay_ms}")
        if burst is not None and burst < 0:  # else tc's error, once the namespaces were made
            raise ClusterError(f"--burst must be a number of bytes >= 0 (0: 2 ms at --rate), got {burst}")
        if burst is not None and burst > 2**32 - 1:  # tc reads 32 bits: else its error, after set-up began
            raise ClusterError(f"--burst must be at most {2**32 - 1} bytes (tc reads 32 bits), got {burst}")
        if burst and burst < MIN_BURST:  # tbf drops every packet larger than its bucket: the run hung, then failed
            raise ClusterError(
                f"--burst must hold one full Ethernet frame, at least {MIN_BURST} bytes (0: 2 ms at --rate), got {burst}"
            )
        self.hosts = hosts
        self.rate = rate = rate.strip()  # as checked, so tc gets it as checked
        self.rate_bits = _parse_rate(rate)
        if self.rate_bits < 1:
            raise ClusterError(f"--rate must be above 0, got {rate!r}")
        if self.rate_bits < 8:  # tc's rate is whole bytes a second: below one, its own error once the links are made
            raise ClusterError(f"--rate must be at least 8bit (tc counts whole bytes a second), got {rate!r}")
        self.burst = burst or default_burst(self.rate_bits)
        self.delay_ms = delay_ms
        tag = f"{PREFIX}{process_tag(os.getpid())}"
        self.switch = f"{tag}-sw"
        self.namespaces = [f"{tag}-h{i}" for i in range(hosts)]
        self.created: list[str] = []

    def address(self, host: int) -> str:
        return f"{SUBNET}.{host + 1}"

    def __enter__(self) -> Cluster:
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _shape(self, namespace: str, device: str) -> None:
        tbf = ["tbf", "rate", self.rate, "burst", str(self.burst), "latency", "20ms"]
        if self.delay_ms <= 0:
            _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", *tbf)
            return
        try:
            _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "handle", "1:", "netem", "delay",
                 f"{self.delay_ms}ms")  # fmt: skip
        except ClusterError as e:
            if "unknown" not in str(e):  # netem is there and refused the value (tc's time is at most 4294 s)
                raise ClusterError(
                    f"--delay {self.delay_ms}: tc refused it ({e}); give a delay of at most a few seconds"
                ) from None
            raise ClusterError(
                f"--delay {self.delay_ms}ms needs tc's netem, which this kernel refused ({e}); run without --delay "
                "(rate-limited links only) or on a kernel with sch_netem"
            ) from None
        _run("tc", "-n", namespace, "qdisc", "add", "dev", device, "parent", "1:1", "handle", "10:", *tbf)

    def _add_namespace(self, name: str) -> None:
        """``ip netns add`` and its record in ``created`` as one step: a stop signal between them
        (or one that killed ip after it made the namespace) left the namespace behind."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            _run("ip", "netns", "add", name)
            self.created.append(name)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def _create(self) -> None:
        for name in stale_namespaces():
            delete_namespace(name)
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            self._add_namespace(ns)
            port = f"p{i}"
            _run("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch)
            _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", self.switch, "link", "set", port, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            self._shape(ns, "eth0")  # host -> switch
            self._shape(self.switch, port)  # switch -> host

    def remove(self) -> None:
        """Kills what still runs in every namespace this cluster created and deletes them (their
        links go with them). A second Ctrl-C or SIGTERM waits until it is done."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            for name in reversed(self.created):
                error = delete_namespace(name)
                if error:
                    print(f"benchmarks.cluster: could not delete namespace {name}: {error}", file=sys.stderr)
            self.created.clear()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def torchrun(self, host: int, run_id: str, arguments: Sequence[str], python: str) -> list[str]:
        """The command that starts host `host`'s worker inside its namespace."""
        return [
            "ip", "netns", "exec", self.namespaces[host],
            "env", "GLOO_SOCKET_IFNAME=eth0", f"GRADSPARSE_CLUSTER={self.hosts}x{self.rate}",
            # The hosts share this process's CPUs (unless the caller chose); the examples' driver
            # takes its threads from here.
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS') or max(1, len(os.sched_getaffinity(0)) // self.hosts)}",
            # c10d warns of client hostnames that do not resolve inside the namespaces, and at the
            # end of every run of agents that close the rendezvous after host 0's store has gone:
            # expected here, so only errors print (unless the caller chose).
            f"TORCH_CPP_LOG_LEVEL={os.environ.get('TORCH_CPP_LOG_LEVEL') or 'ERROR'}",
            f"LOGLEVEL={os.environ.get('LOGLEVEL') or 'ERROR'}",
            python, "-m", "torch.distributed.run",
            "--nnodes", str(self.hosts), "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.address(0)}:{RDZV_PORT}", "--rdzv-id", run_id,
            # The machine's hostname resolves outside the namespaces: say who serves the store, and
            # which address each node is known by.
            "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", self.address(host),
            "--max-restarts", "0",
            *arguments,
        ]  # fmt: skip


def _stop(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in processes:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run(cluster: Cluster, arguments: Sequence[str], python: str = sys.executable) -> int:
    """Starts one worker per host and waits; the first failure stops the others. Returns the
    exit status (0 when every host succeeded)."""
    run_id = uuid.uuid4().hex[:12]
    processes: list[subprocess.Popen] = []
    try:
        for host in range(cluster.hosts):
            processes.append(
                subprocess.Popen(cluster.torchrun(host, run_id, arguments, python), start_new_session=True)
            )
        while True:
            codes = [p.poll() for p in processes]
            failed = [(h, c) for h, c in enumerate(codes) if c not in (None, 0)]
            if failed:
                host, code = failed[0]
                if code < 0:  # killed by a signal (the OOM killer's SIGKILL, say): the shell's 128 + N
                    try:
                        name = signal.Signals(-code).name
                    except ValueError:  # a real-time signal, which has no name in Python
                        name = f"signal {-code}"
                    how, code = f"was killed by {name}", 128 - code
                else:
                    how = f"exited with status {code}"
                print(f"benchmarks.cluster: host {host} {how}; stopping the others", file=sys.stderr)
                return code
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.2)
    finally:
        _stop(processes)


class Stopped(SystemExit):
    """A stop signal arrived (SIGINT, SIGTERM, SIGHUP): the exit status is the shell's 128 + N."""

    def __init__(self, signum: int) -> None:
        super().__init__(128 + signum)
        self.signal = signal.Signals(signum)


def _raise_on_signal(signum: int, _frame: object) -> None:
    raise Stopped(signum)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The cluster's options (shared with the benchmarks that run on it)."""
    parser.add_argument("--hosts", type=int, default=4, help="hosts (network namespaces), one worker each")
    parser.add_argument(
        "--rate",
        type=str.strip,
        default="50mbit",
        help="rate of every link, each direction (tc rate; docs/benchmarks.md says why 50mbit)",
    )
    parser.add_argument(
        "--burst",
        type=int,
        default=None,
        help="tbf bucket in bytes, at least one frame (1514; default: 2 ms at --rate, at least 16000)",
    )
    parser.add_argument("--delay", type=float, default=0.0, help="one-way delay in ms per link end (needs netem)")


@contextlib.contextmanager
def session(args: argparse.Namespace, prog: str = "benchmarks.cluster"):
    """The cluster the parsed options describe, removed on every exit path (SIGINT, SIGTERM and
    SIGHUP included: their handlers are replaced for the session and put back after it). Raises
    ClusterError without root."""
    if os.geteuid() != 0:
        raise ClusterError(
            "the emulated cluster needs root to create network namespaces, veth links and tc qdiscs: run "
            f"{prog} with sudo (or as root in a container with CAP_SYS_ADMIN and CAP_NET_ADMIN)."
        )
    for tool in ("ip", "tc"):  # else a FileNotFoundError traceback, for tc after namespaces were made
        if shutil.which(tool) is None:
            raise ClusterError(
                f"the emulated cluster needs `{tool}`, which is not on PATH ({os.environ.get('PATH', '')}): install "
                "iproute2 (apt-get install iproute2), or run as root with a PATH that holds /usr/sbin and /sbin"
            )
    replaced = {signum: signal.signal(signum, _raise_on_signal) for signum in STOP_SIGNALS}
    try:
        with Cluster(args.hosts, args.rate, args.burst, args.delay) as cluster:
            print(
                f"{prog}: {args.hosts} hosts on one bridge, every link {args.rate} each way (tbf burst "
                f"{cluster.burst} B)" + (f", {args.delay} ms delay per end" if args.delay else ""),
                file=sys.stderr,
                flush=True,
            )
            yield cluster
    finally:  # the caller's handlers again (a program that runs several sessions, or goes on after one)
        for signum, handler in replaced.items():
            signal.signal(signum, handler)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        own, arguments = argv[:split], argv[split + 1 :]
    else:
        own, arguments = argv, []
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_arguments(parser)
    args, unknown = parser.parse_known_args(own)
    if unknown:  # most often the worker's arguments, given without the -- before them
        parser.error(
            f"unrecognized arguments: {' '.join(unknown)}; the worker's torchrun arguments go after --, for "
            "example: python -m benchmarks.cluster --hosts 2 -- -m examples.cnn --max-steps 20"
        )
    if not arguments:
        parser.error("give the worker's torchrun arguments after --, for example: -- -m examples.cnn --max-steps 20")
    try:
        with session(args) as cluster:
            return run(cluster, arguments)
    except ClusterError as e:
        print(f"benchmarks.cluster: {e}", file=sys.stderr)
        return 1
    except Stopped as stop:  # the last word after the hosts' torchrun tracebacks
        print(f"benchmarks.cluster: stopped by {stop.signal.name}; the hosts' namespaces and processes are removed",
              file=sys.stderr)  # fmt: skip
        raise


if __name__ == "__main__":
    sys.exit(main())
