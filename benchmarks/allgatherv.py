"""Three ways to all-gather equal blocks over torch.distributed, timed side by side: Gloo's
all-gather (a ring), an all-to-all with split sizes (what ProcessGroupTransport.allgatherv ran on
Gloo before 2026-11-28) and a ring of isend/irecv (what it runs now). Run it under a launcher,
for example on the emulated cluster:

    sudo python -m benchmarks.cluster --hosts 4 --rate 50mbit -- -m benchmarks.allgatherv

Rank 0 prints one line per block size: the best of two rounds of each, in ms per call.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from benchmarks.utils import end_process_group, number_list, require_launcher, whole


def _block(rank: int, size: int) -> torch.Tensor:
    return torch.randint(0, 255, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(rank))


def _ways(block: torch.Tensor, out: torch.Tensor) -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    blocks = list(out.chunk(p))

    def all_gather() -> None:
        dist.all_gather(blocks, block)

    def all_to_all() -> None:
        dist.all_to_all_single(out, block.repeat(p), [block.numel()] * p, [block.numel()] * p)

    def ring() -> None:
        blocks[rank].copy_(block)
        for step in range(p - 1):
            sent, received = (rank - step) % p, (rank - step - 1) % p
            works = [dist.isend(blocks[sent], (rank + 1) % p), dist.irecv(blocks[received], (rank - 1) % p)]
            for work in works:
                work.wait()

    return {"all_gather": all_gather, "all_to_all": all_to_all, "ring": ring}


def time_collectives(sizes: list[int], calls: int, rounds: int = 2) -> dict[int, dict[str, float]]:
    """Per block size (bytes per rank), the best of ``rounds`` mean ms per call of each way.
    Every way must deliver every rank's block: each is checked once before it is timed."""
    rank, p = dist.get_rank(), dist.get_world_size()
    figures: dict[int, dict[str, float]] = {}
    for size in sizes:
        block = _block(rank, size)
        expected = torch.cat([_block(r, size) for r in range(p)])
        out = torch.empty(size * p, dtype=torch.uint8)
        best: dict[str, float] = {}
        for name, way in _ways(block, out).items():
            out.zero_()
            way()
            if not torch.equal(out, expected):
                raise RuntimeError(f"benchmarks.allgatherv: {name} delivered wrong bytes at {size} bytes per rank")
        for _ in range(rounds):
            for name, way in _ways(block, out).items():
                dist.barrier()
                start = time.perf_counter()
                for _ in range(calls):
                    way()
                dist.barrier()
                ms = (time.perf_counter() - start) / calls * 1e3
                best[name] = min(best.get(name, ms), ms)
        figures[size] = best
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="2000,20000,100000,455000", help="bytes per rank, comma-separated")
    parser.add_argument("--calls", type=int, default=8, help="calls per timing")
    args = parser.parse_args(argv)
    # on every rank alike, before the process group
    sizes = number_list(
        parser,
        "--sizes",
        args.sizes,
        whole,
        "block size in bytes (at least 1)",
        "2000,20000",
    )
    sizes = [int(b) for b in sizes]
    if args.calls < 1:
        parser.error(f"--calls must be at least 1, got {args.calls}")
    require_launcher(parser, "benchmarks.allgatherv")
    dist.init_process_group("gloo")
    figures = time_collectives(sizes, args.calls)
    if dist.get_rank() == 0:
        for size, best in figures.items():
            cells = "  ".join(f"{name} {ms:8.2f} ms" for name, ms in best.items())
            print(f"{size:>8} B per rank, {dist.get_world_size()} ranks: {cells}", flush=True)
    end_process_group()


if __name__ == "__main__":
    main()
