"""The link as exchange="auto"'s first pick sees it (before it times the exchanges themselves),
and the time each kind of collective takes on it.

    torchrun --standalone --nproc-per-node=4 -m benchmarks.link
    sudo python -m benchmarks.cluster --hosts 4 --rate 50mbit -- -m benchmarks.link

Prints gradsparse.simulate.measure_link's (alpha, beta) and the median time of an 8-byte and a
256 KB all-reduce, all-gather and ring send-receive on the default group, each beside the time
the alpha-beta model predicts for it, so that one sees where the model is off on this network.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks.utils import end_process_group, require_launcher
from gradsparse import simulate


def _median(run, repeat: int = 7) -> float:
    times = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.link", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.parse_args(argv)
    require_launcher(parser, "benchmarks.link", least_ranks=2)  # measure_link: one rank has no link
    dist.init_process_group("gloo")
    rank, p = dist.get_rank(), dist.get_world_size()
    alpha, beta = simulate.measure_link()
    rows = []
    for size in (8, 262144):
        data = torch.zeros(size // 8, dtype=torch.float64)
        out = [torch.zeros_like(data) for _ in range(p)]
        recv = torch.zeros_like(data)

        def sendrecv(data=data, recv=recv):
            ops = [dist.P2POp(dist.isend, data, (rank + 1) % p), dist.P2POp(dist.irecv, recv, (rank - 1) % p)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        measured = {
            "all-reduce": _median(lambda data=data: dist.all_reduce(data)),
            "all-gather": _median(lambda data=data, out=out: dist.all_gather(out, data)),
            "send-receive": _median(sendrecv),
        }
        model = {
            "all-reduce": simulate.Collective("allreduce", size).seconds(p, alpha, beta),
            "all-gather": simulate.Collective("allgather", size).seconds(p, alpha, beta),
            "send-receive": simulate.Collective("sendrecv", size, size).seconds(p, alpha, beta),
        }
        rows += [(name, size, measured[name], model[name]) for name in measured]
    if rank == 0:
        print(f"{p} ranks; measure_link: alpha {alpha * 1e6:.1f} us, beta {beta * 1e9:.3f} ns/byte")
        print(f"{'collective':<14} {'bytes':>8} {'measured ms':>12} {'model ms':>10}")
        for name, size, got, want in rows:
            print(f"{name:<14} {size:>8} {got * 1e3:>12.3f} {want * 1e3:>10.3f}")
    end_process_group()


if __name__ == "__main__":
    main()
