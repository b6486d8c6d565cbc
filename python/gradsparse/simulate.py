"""Bytes and time per step of each exchange at any scale, from an alpha-beta model.

    python -m gradsparse.simulate --world-size 8,64,512,1024 --params 25e6 --density 0.001 \\
        --bandwidth 10Gbit --latency 5us [--teams 1] [--plot exchanges.png]

Each exchange is written down as the sequence of collectives one rank issues in one step, with
the exact message sizes of the library (csrc/core/include/gradsparse/message.h: a header, or
none where the count travelled first, then indices and values), so the byte counts follow the
transports' accounting rule (csrc/core/include/gradsparse/transport.h):

    allgather of b bytes per rank    sent = (P - 1) b
    all-reduce of b bytes            sent = floor(2 (P - 1) b / P)        (ring)
    sendrecv of s bytes out          sent = s

and the tests check them against what ThreadTransport counts for every world size up to 16. Time
uses the same ring algorithms: an allgather costs (P - 1)(alpha + b beta), an all-reduce
2 (P - 1) alpha + 2 (P - 1) / P b beta, a sendrecv alpha + max(out, in) beta, where alpha is the
latency and beta the seconds per byte of one link. Computation (selection, scatter) is not
modelled; docs/benchmarks.md measures it.

What each rank selects is an input: the command line assumes the methods hit their target, k =
floor(density * params) pairs in all (Top-k: k per rank; MiCRO/ExDyna: k split evenly over the
disjoint partitions; SparDL: k per block of each team, its own rule).
"""

from __future__ import annotations

import argparse
import math
import numbers
import os
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from gradsparse.config import is_link

HEADER_BYTES = 32  # sparse message header (bare messages, whose count travelled first, have none)
FLOAT64 = 8


def _pad8(b: int) -> int:
    return (b + 7) // 8 * 8


def index_bytes(numel: int) -> int:
    """Index width of a message for a bucket (or block) of ``numel`` elements."""
    return 4 if numel <= 2**32 else 8


def count_bytes(most: int) -> int:
    """Bytes of one count on the wire (control words, part and kept counts) where none exceeds ``most``."""
    return 4 if most < 2**32 else 8


def control_bytes(numel: int, digest: bool = False) -> int:
    """One rank's control word: its count and non-finite count, or with the index digest (shared
    indices) those and the digest, 8 bytes each."""
    return 24 if digest else 2 * count_bytes(numel)


def message_bytes(count: int, numel: int, value_bytes: int = 4, bare: bool = False) -> int:
    """Size of a sparse message of ``count`` pairs: header (none when ``bare``), padded indices, padded values."""
    return (0 if bare else HEADER_BYTES) + _pad8(count * index_bytes(numel)) + _pad8(count * value_bytes)


def index_part_bytes(count: int, numel: int) -> int:
    """The indices of a bare message: what the union exchange all-gathers."""
    return _pad8(count * index_bytes(numel))


@dataclass(frozen=True)
class Collective:
    """One collective as one rank issues it. ``size`` is the per-rank block (allgather), this
    rank's block (allgatherv, with the other ranks' blocks summed in ``incoming``), the buffer
    (all-reduce) or the outgoing bytes (sendrecv, with ``incoming``)."""

    kind: str  # "allgather", "allgatherv", "allreduce" or "sendrecv"
    size: int
    incoming: int = 0

    def bytes_sent(self, world_size: int) -> int:
        if self.kind == "allgather":
            return (world_size - 1) * self.size
        if self.kind == "allgatherv":  # a ring forwards every block but one
            return self.incoming
        if self.kind == "allreduce":
            return 2 * (world_size - 1) * self.size // world_size
        return self.size

    def seconds(self, world_size: int, latency: float, seconds_per_byte: float) -> float:
        p = world_size
        if p == 1:
            return 0.0
        if self.kind == "allgather":
            return (p - 1) * (latency + self.size * seconds_per_byte)
        if self.kind == "allgatherv":
            return (p - 1) * latency + self.incoming * seconds_per_byte
        if self.kind == "allreduce":
            return 2 * (p - 1) * latency + 2 * (p - 1) / p * self.size * seconds_per_byte
        return latency + max(self.size, self.incoming) * seconds_per_byte


# --------------------------------------------------------------------------------------------
# The exchanges, collective by collective (mirrors csrc/core/exchange and csrc/core/method/spardl.cpp)
# --------------------------------------------------------------------------------------------


def dense(numel: int, value_bytes: int = 4) -> list[Collective]:
    """Dense ring all-reduce of the bucket."""
    return [Collective("allreduce", numel * value_bytes)] if numel > 0 else []


def variable_blocks(sizes: Sequence[int], rank: int) -> list[Collective]:
    """The all-gather of one block per rank, unpadded (every rank's size known from the control
    words); none where every block is empty."""
    return [Collective("allgatherv", sizes[rank], sum(sizes) - sizes[rank])] if any(sizes) else []


def gather_and_add(counts: Sequence[int], numel: int, value_bytes: int = 4, rank: int = 0) -> list[Collective]:
    """Control words, then every rank's bare message, unpadded (as rank ``rank`` sees it)."""
    sizes = [message_bytes(c, numel, value_bytes, bare=True) for c in counts]
    return [Collective("allgather", control_bytes(numel)), *variable_blocks(sizes, rank)]


def fixed_gather(k: int, numel: int, value_bytes: int = 4) -> list[Collective]:
    """Gather-and-add when every rank sends exactly k pairs (Top-k): one allgather, no control word."""
    return [Collective("allgather", message_bytes(k, numel, value_bytes))]


def exclusive_gather(counts: Sequence[int], numel: int, value_bytes: int = 4, rank: int = 0) -> list[Collective]:
    """Gather-and-add of selections from disjoint partitions (MiCRO, ExDyna): the same collectives."""
    return gather_and_add(counts, numel, value_bytes, rank)


def union_allreduce(
    counts: Sequence[int], union: int, numel: int, value_bytes: int = 4, rank: int = 0
) -> list[Collective]:
    """Control words, the index lists (bare, unpadded), then one all-reduce of the values on the
    union (skipped when the union is empty)."""
    sizes = [index_part_bytes(c, numel) for c in counts]
    steps = [Collective("allgather", control_bytes(numel)), *variable_blocks(sizes, rank)]
    if union > 0:
        steps.append(Collective("allreduce", union * value_bytes))
    return steps


def shared_indices(count: int, value_bytes: int = 4) -> list[Collective]:
    """Random-k: control words (with the index digest), then an all-reduce of the values."""
    steps = [Collective("allgather", control_bytes(0, digest=True))]
    if count > 0:
        steps.append(Collective("allreduce", count * value_bytes))
    return steps


def sparse_reduce_scatter(
    counts: Sequence[Sequence[int]], numel: int, value_bytes: int = 4, rank: int = 0
) -> list[Collective]:
    """FSDP's sparse reduce-scatter (P equal shards; ``counts[r][o]``: rank r's pairs in the shard
    of owner o): every rank's P + 1 counts (all-gather), then P - 1 send-receive rounds, in round
    s each rank sending the pairs of owner rank + s and receiving those of rank - s for its own
    (bare)."""
    p = len(counts)
    shard = numel // p
    steps = [Collective("allgather", (p + 1) * count_bytes(numel))]
    for s in range(1, p):
        dst, src = (rank + s) % p, (rank - s) % p
        steps.append(
            Collective(
                "sendrecv",
                message_bytes(counts[rank][dst], shard, value_bytes, bare=True),
                message_bytes(counts[src][rank], shard, value_bytes, bare=True),
            )
        )
    return steps


HISTOGRAM_BINS = 1024  # reduce-scatter + all-gather: the magnitude bins of its global threshold


def reduce_scatter_allgather(
    parts_out: Sequence[int],
    parts_in: Sequence[int],
    kept: Sequence[int],
    numel: int,
    value_bytes: int = 4,
    rank: int = 0,
) -> list[Collective]:
    """Reduce-scatter + all-gather on rank ``rank``: control words; P - 1 rounds of part counts
    and P - 1 rounds of parts (bare), in round s to the owner rank + s (``parts_out[o]``: this
    rank's pairs in shard o) and from rank - s (``parts_in[r]``: rank r's pairs in this rank's
    shard); the histogram all-reduce; every owner's kept count (all-gather); every owner's kept
    pairs (``kept[o]``, bare, all-gatherv). Shards of ceil(numel / P) elements."""
    p = len(parts_out)
    chunk = -(-numel // p)
    width = count_bytes(chunk)

    def shard(o: int) -> int:
        return min(numel, (o + 1) * chunk) - min(numel, o * chunk)

    steps = [Collective("allgather", control_bytes(numel))] + [Collective("sendrecv", width, width)] * (p - 1)
    mine = shard(rank)
    for s in range(1, p):
        dst, src = (rank + s) % p, (rank - s) % p
        steps.append(
            Collective(
                "sendrecv",
                message_bytes(parts_out[dst], shard(dst), value_bytes, bare=True),
                message_bytes(parts_in[src], mine, value_bytes, bare=True),
            )
        )
    steps.append(Collective("allreduce", HISTOGRAM_BINS * FLOAT64))
    steps.append(Collective("allgather", width))
    steps += variable_blocks([message_bytes(c, numel, value_bytes, bare=True) for c in kept], rank)
    return steps


BAND_BINS = 257  # MiCRO/ExDyna's band counts
SAMPLE_BINS = 2838  # the bins of their sampled prediction's histogram (band_agreement's first_step)


def band_agreement_folded(world_size: int, numel: int) -> bool:
    """Whether the band counts travel with the control words: where one all-gather of every
    rank's counts sends no more bytes than the all-reduce and the control words it replaces (up
    to 4 ranks)."""
    folded = Collective("allgather", (2 + BAND_BINS) * count_bytes(numel))
    apart = [Collective("allreduce", BAND_BINS * FLOAT64), Collective("allgather", control_bytes(numel))]
    return folded.bytes_sent(world_size) <= sum(c.bytes_sent(world_size) for c in apart)


def band_agreement(
    exchange: list[Collective], world_size: int, numel: int, first_step: bool = False
) -> list[Collective]:
    """A default-mode MiCRO/ExDyna step: a 2838-bin sampled histogram (float64 all-reduce) where
    the step predicts its threshold from a sample (``first_step``), the agreement on the threshold
    from the 257 band counts, then ``exchange`` (its plan, which starts with the control words).
    Folded (band_agreement_folded): one all-gather of every rank's counts with its non-finite and
    below-band counts, from which every rank knows every control word, so the exchange sends none;
    else a float64 all-reduce of the counts.

    A step samples at the first step and wherever the step before left no estimate (its method
    state's "estimate" not a finite number > 0: csrc/core/method/partitioned.cpp, select_default),
    as after a step of zeros or a jump in scale, and in buckets of a few elements, where the band
    counts can leave none at any step; ``first_step`` is that flag, named for the common case."""
    steps = [Collective("allreduce", SAMPLE_BINS * FLOAT64)] if first_step else []
    if band_agreement_folded(world_size, numel):
        assert exchange[0] == Collective("allgather", control_bytes(numel)), exchange[0]
        return [*steps, Collective("allgather", (2 + BAND_BINS) * count_bytes(numel)), *exchange[1:]]
    return [*steps, Collective("allreduce", BAND_BINS * FLOAT64), *exchange]


def srs_schedule(size: int, rank: int) -> list[tuple[int, int, int, int]]:
    """SparDL's Spar-Reduce-Scatter: (dest, source, send_block, recv_block) per step, P - 1 steps,
    as csrc/core/exchange/spardl.cpp's srs_schedule: step j of the round with gap g sends block
    rank + g + j to rank + g and receives block rank + j from rank - g, so the last step receives
    the rank's own block."""
    if size <= 1:
        return []
    rounds = math.ceil(math.log2(size))
    sizes = [size - 2 ** (rounds - 1)] + [2**i for i in range(rounds - 2, -1, -1)]
    steps = []
    for i in range(rounds):
        gap = 2 ** (rounds - 1 - i)
        for j in range(sizes[i]):
            steps.append(((rank + gap) % size, (rank - gap) % size, (rank + gap + j) % size, (rank + j) % size))
    return steps


def bruck_rounds(size: int, rank: int) -> list[tuple[list[int], list[int]]]:
    """Bruck all-gather: per round, the blocks sent and the blocks received."""
    rounds = []
    gap = 1
    while gap < size:
        count = min(gap, size - gap)
        rounds.append(([(rank + b) % size for b in range(count)], [(rank + gap + b) % size for b in range(count)]))
        gap *= 2
    return rounds


def spardl(
    world_size: int,
    rank: int,
    numel: int,
    density: float,
    *,
    teams: int = 1,
    h: int | None = None,
    final_counts: Sequence[int] | None = None,
    value_bytes: int = 4,
    float16: bool = False,
) -> list[Collective]:
    """SparDL on one rank. Team size P' = P / teams; blocks of ceil(numel / P') elements; k =
    max(1, floor(block * density)) pairs per list. ``h`` is the current top-h of the
    Spar-All-Gather (teams > 1; default the first step's floor(block * density / teams)), and
    ``final_counts[b]`` the pairs of block b's final list (default min(k, block length): every
    list is full). A ``float16`` bucket with error feedback (value_bytes 2; bfloat16 is not) ends
    with one more all-gather: each rank's count of the sums it kept that float16 cannot hold
    (docs/methods.md)."""
    if isinstance(teams, bool) or not isinstance(teams, numbers.Integral) or teams < 1 or world_size % teams:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ValueError(
            f"gradsparse.simulate.spardl: teams={teams!r} does not divide the world size {world_size}; SparDL's ranks "
            f"form teams of equal size: choose teams among {', '.join(map(str, divisors))}"
        )
    team_size = world_size // teams
    me = rank % team_size
    chunk = -(-numel // team_size)

    def length(b: int) -> int:
        return min(numel, (b + 1) * chunk) - min(numel, b * chunk)

    k = max(1, math.floor(chunk * density)) if chunk > 0 else 0
    if h is None:
        h = max(1, math.floor(chunk * density / teams)) if teams > 1 else k
    if final_counts is None:
        final_counts = [min(k, length(b)) for b in range(team_size)]

    def message(b: int, pairs: int) -> int:
        return message_bytes(min(pairs, length(b)), length(b), value_bytes)

    steps = [Collective("allgather", control_bytes(numel))]
    steps += [
        Collective("sendrecv", message(send, k), message(recv, k)) for _, _, send, recv in srs_schedule(team_size, me)
    ]
    if teams > 1:
        own = message(me, h)
        steps += [
            Collective("sendrecv", len(send) * own, len(recv) * own)
            for send, recv in bruck_rounds(teams, rank // team_size)
        ]
    for send, recv in bruck_rounds(team_size, me):
        if teams > 1:  # merged lists vary in size: theirs travel first
            steps.append(Collective("sendrecv", 8 * len(send), 8 * len(recv)))
        steps.append(
            Collective(
                "sendrecv",
                sum(message(b, final_counts[b]) for b in send),
                sum(message(b, final_counts[b]) for b in recv),
            )
        )
    if float16:
        steps.append(Collective("allgather", 8))
    return steps


#: Every exchange's model, under its name in the library's glossary (gradsparse._C.exchanges(),
#: docs/architecture.md "Exchanges and transports").
EXCHANGES = {
    "gather-and-add": gather_and_add,
    "fixed-size gather": fixed_gather,
    "exclusive gather": exclusive_gather,
    "union + all-reduce": union_allreduce,
    "shared indices": shared_indices,
    "sparse reduce-scatter": sparse_reduce_scatter,
    "reduce-scatter + all-gather": reduce_scatter_allgather,
    "SparDL": spardl,
}

#: The link assumed where none was measured (a 10 Gbit/s network with 5 us of latency).
DEFAULT_LINK = (5e-6, 1 / 1.25e9)


def even_plan(world_size: int, numel: int, k: int, value_bytes: int = 4) -> list[Collective]:
    """Reduce-scatter + all-gather on rank 0 when every rank selects k pairs spread evenly over
    the shards and the owners keep k in all."""
    split = even_split(k, world_size)
    return reduce_scatter_allgather(split, [split[0]] * world_size, split, numel, value_bytes)


def faster_exchange(
    world_size: int,
    numel: int,
    density: float,
    link: tuple[float, float] = DEFAULT_LINK,
    *,
    fixed: bool = False,
    value_bytes: int = 4,
) -> str:
    """The option value ("gather" or "reduce_scatter") of the exchange the model finds faster for
    a bucket of ``numel`` elements of ``value_bytes`` bytes each (2 for float16 and bfloat16) of
    which every rank selects k = floor(density * numel): gather-and-add (the fixed-size gather
    with ``fixed``, Top-k's) or reduce-scatter + all-gather. ``link`` is (latency alpha in
    seconds, seconds per byte beta). The value width matters: reduce-scatter + all-gather's
    histogram all-reduce is float64 whatever the bucket's dtype, so narrower pairs move the
    break-even to more ranks."""
    where = "gradsparse.simulate.faster_exchange"
    if isinstance(world_size, bool) or not isinstance(world_size, numbers.Integral) or world_size < 1:
        raise ValueError(
            f"{where}: world_size must be an integer >= 1 (the number of ranks), got {world_size!r}; for example "
            "dist.get_world_size()"
        )
    if isinstance(numel, bool) or not isinstance(numel, numbers.Integral) or numel < 0:
        raise ValueError(
            f"{where}: numel must be an integer >= 0 (the bucket's elements), got {numel!r}; for example 25_000_000"
        )
    if isinstance(density, bool) or not isinstance(density, numbers.Real) or not 0 < density <= 1:
        raise ValueError(f"{where}: density must be a number in (0, 1], got {density!r}; for example 0.001")
    if not is_link(link):
        raise ValueError(
            f"{where}: link must be the pair (alpha, beta) of finite numbers >= 0 (latency in seconds, seconds per "
            f"byte), got {link!r}; measure it with gradsparse.simulate.measure_link() on the group, or pass "
            "gradsparse.simulate.DEFAULT_LINK"
        )
    if world_size <= 1 or numel == 0:
        return "gather"
    k = max(1, math.floor(density * numel))
    alpha, beta = link
    gather = fixed_gather(k, numel, value_bytes) if fixed else gather_and_add([k] * world_size, numel, value_bytes)
    seconds = {
        name: sum(c.seconds(world_size, alpha, beta) for c in plan)
        for name, plan in (("gather", gather), ("reduce_scatter", even_plan(world_size, numel, k, value_bytes)))
    }
    return min(seconds, key=lambda name: (seconds[name], name != "gather"))


def _link_device(backend: str):
    """Where measure_link's all-reduces run: on the GPU where the group sends CUDA tensors through
    NCCL, "nccl" or the group torch makes by default on a machine with GPUs, "cpu:gloo,cuda:nccl"
    (measured on the CPU, that one's link was Gloo's over TCP, not the one CUDA gradients cross)."""
    import torch

    nccl = backend == "nccl" or "cuda:nccl" in backend.split(",")
    return torch.device("cuda", torch.cuda.current_device()) if nccl and torch.cuda.is_available() else None


def measure_link(group=None) -> tuple[float, float]:
    """The link of a torch.distributed group as the model sees it: latency alpha and seconds per
    byte beta, fitted to the median time of small (8 bytes) and large (256 KB) all-reduces with
    the ring model, and the largest over the ranks, so that every rank holds the same figures.
    Collective: call it on every rank of the group (of 2 or more ranks; one rank has no link)."""
    import time

    import torch
    import torch.distributed as dist

    p = dist.get_world_size(group)
    if p < 2:  # the fit divides by P - 1: at one rank no byte crosses a link
        raise ValueError(
            "gradsparse.simulate.measure_link: the group has 1 rank, where no byte crosses a link and the model "
            "costs every collective 0 s; measure the link on a group of 2 or more ranks"
        )
    device = _link_device(dist.get_backend(group))

    def median_seconds(numel: int) -> float:
        data = torch.zeros(numel, dtype=torch.float64, device=device)
        times = []
        for _ in range(5):
            dist.barrier(group=group)
            start = time.perf_counter()
            dist.all_reduce(data, group=group)
            if data.is_cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    small, large, large_bytes = median_seconds(1), median_seconds(32768), 32768 * 8
    fitted = torch.tensor(
        [small / (2 * (p - 1)), max(large - small, 0.0) / (2 * (p - 1) / p * large_bytes)],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(fitted, op=dist.ReduceOp.MAX, group=group)
    return float(fitted[0]), float(fitted[1])


# --------------------------------------------------------------------------------------------
# The command line: every exchange at every world size, assuming the targets are hit
# --------------------------------------------------------------------------------------------


def even_split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if r < total % parts else 0) for r in range(parts)]


def exchanges_at_scale(world_size: int, numel: int, density: float, teams: int = 1) -> dict[str, list[Collective]]:
    """Rank 0's collectives in one steady-state step of each exchange (float32 values)."""
    k = max(1, math.floor(density * numel))
    split = even_split(k, world_size)
    plans = {
        "dense all-reduce": dense(numel),
        "fixed-size gather (Top-k)": fixed_gather(k, numel),
        "gather-and-add (counts exchanged)": gather_and_add([k] * world_size, numel),
        "union + all-reduce (MiCRO/ExDyna)": band_agreement(union_allreduce(split, k, numel), world_size, numel),
        "exclusive gather (MiCRO/ExDyna)": band_agreement(exclusive_gather(split, numel), world_size, numel),
        "reduce-scatter + all-gather (Top-k)": even_plan(world_size, numel, k),
    }
    if world_size % teams == 0:
        plans[f"SparDL (teams={teams})"] = spardl(world_size, 0, numel, density, teams=teams)
    return plans


def minimum_bytes(world_size: int, numel: int, density: float) -> dict[str, int]:
    """Rank 0's payload lower bound per step of each exchange's algorithm (the bytes of the
    pairs, indices or values themselves, no headers, control words or padding), for the exchanges
    of ``exchanges_at_scale`` that have one in closed form."""
    p, k = world_size, max(1, math.floor(density * numel))
    pair = index_bytes(numel) + 4
    others = sum(even_split(k, p)[1:])  # the pairs of ranks 1..P-1 under an even split of k
    allreduce = 2 * (p - 1) * k * 4 // p
    return {
        "dense all-reduce": 2 * (p - 1) * numel * 4 // p,
        "fixed-size gather (Top-k)": (p - 1) * k * pair,
        "gather-and-add (counts exchanged)": (p - 1) * k * pair,
        "union + all-reduce (MiCRO/ExDyna)": others * index_bytes(numel) + (allreduce if p > 1 else 0),
        "exclusive gather (MiCRO/ExDyna)": others * pair,
        # the parts go to their shard's owner, indexed within the shard (narrower past 2^32 elements)
        "reduce-scatter + all-gather (Top-k)": others * (index_bytes(-(-numel // p)) + 4) + others * pair,
    }


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}


def parse_bandwidth(text: str) -> float:
    """'10Gbit', '10Gbit/s', '25gbps', '1.25GB/s', '100Mbit' -> bytes per second."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKmMgGtT]?)(bit/s|bit|bps|b/s|B/s|B|Bps)?\s*", text)
    if not m:
        raise ValueError(f"--bandwidth: cannot read {text!r}; write for example 10Gbit, 100Mbit or 1.25GB/s")
    try:
        value = float(m.group(1)) * _UNITS[m.group(2).lower()]
    except ValueError:  # the pattern lets through what is no number, such as "1.2.3"
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            f"--bandwidth: {text!r} is not a finite bandwidth above 0; write for example 10Gbit, 100Mbit or 1.25GB/s"
        )
    unit = m.group(3) or "bit"
    return value if unit in ("B/s", "B", "Bps") else value / 8


def parse_latency(text: str) -> float:
    """'5us', '2ms', '0.5s', '1e-6' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(ns|us|µs|ms|s)?\s*", text)
    if not m:
        raise ValueError(f"--latency: cannot read {text!r}; write for example 5us, 2ms or 1e-6")
    scale = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1.0}[m.group(2)]
    try:
        value = float(m.group(1)) * scale
    except ValueError:  # the pattern lets through what is no number, such as "1.2.3"
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"--latency: {text!r} is not a finite latency >= 0; write for example 5us, 2ms or 1e-6")
    return value


def _human(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(b) < 1000 or unit == "TB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.2f} {unit}"
        b /= 1000
    return f"{b:.2f} TB"


#: The largest world size the command line models (2^20).
MOST_RANKS = 2**20


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gradsparse.simulate",
        description="Per-step bytes and time of each exchange from an alpha-beta model.",
    )
    parser.add_argument("--world-size", default="8,64,512,1024", help="comma-separated world sizes")
    parser.add_argument("--params", type=float, default=25e6, help="elements reduced per step")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--bandwidth", default="10Gbit", help="per-link bandwidth, e.g. 10Gbit, 1.25GB/s")
    parser.add_argument("--latency", default="5us", help="per-message latency alpha, e.g. 5us")
    parser.add_argument("--teams", type=int, default=1, help="SparDL teams (must divide the world size)")
    parser.add_argument("--plot", metavar="PNG", help="also draw time per step against world size")
    args = parser.parse_args(argv)

    try:
        worlds = [int(w) for w in args.world_size.split(",") if w.strip()]
        if not worlds or min(worlds) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--world-size: expected positive integers separated by commas, got {args.world_size!r}")
    if max(worlds) > MOST_RANKS:  # each plan lists its P - 1 rounds: 10^8 ranks filled the memory
        parser.error(
            f"--world-size: at most {MOST_RANKS:,} ranks, got {max(worlds):,}; the model lists every round of every "
            f"exchange (P - 1 of them), which at {MOST_RANKS:,} ranks takes about 10 s and 0.7 GB"
        )
    if not 0 < args.density <= 1:
        parser.error(f"--density must be in (0, 1], got {args.density}")
    if not (math.isfinite(args.params) and args.params >= 1 and args.params == int(args.params)):
        parser.error(f"--params must be a whole number of elements, at least 1 (for example 25e6), got {args.params}")
    if args.teams < 1:
        parser.error(f"--teams must be at least 1, got {args.teams}")
    undivided = [w for w in worlds if w % args.teams]
    if undivided:  # SparDL's row would be left out there without a word
        parser.error(
            f"--teams {args.teams} does not divide the world size(s) {', '.join(map(str, undivided))}: SparDL's ranks "
            "form teams of equal size; give --teams a divisor of every --world-size (1 always is)"
        )
    try:
        bandwidth = parse_bandwidth(args.bandwidth)
        latency = parse_latency(args.latency)
    except ValueError as e:
        parser.error(str(e))
    if args.plot and max(worlds) < 2:  # at one rank every time is 0, which a log axis cannot show
        parser.error("--plot: at one rank nothing crosses a link (every time is 0); add a world size of 2 or more")
    if args.plot:
        try:
            import matplotlib
        except ImportError:
            parser.error("--plot needs matplotlib: pip install matplotlib (or gradsparse[examples])")
        if os.path.splitext(args.plot)[1].lower() != ".png":  # else savefig picks the format from the name
            parser.error(f"--plot {args.plot}: the plot is a PNG; give a file name ending in .png")
        folder = os.path.dirname(os.path.abspath(args.plot))
        if not os.path.isdir(folder):  # else savefig's FileNotFoundError, after the table
            parser.error(
                f"--plot {args.plot}: the folder {folder} does not exist; create it or write the PNG elsewhere"
            )
    numel = int(args.params)
    beta = 1.0 / bandwidth

    print(
        f"{numel:,} float32 elements per step, density {args.density} (k = {max(1, math.floor(args.density * numel)):,}),"
        f" {args.bandwidth} per link ({_human(bandwidth)}/s), latency {args.latency}"
    )
    header = f"{'P':>6}  {'exchange':<36} {'sent/rank':>12} {'x minimum':>10} {'time':>11} {'vs dense':>9}"
    print(header)
    print("-" * len(header))
    rows: dict[str, list[tuple[int, float]]] = {}
    for p in worlds:
        plans = exchanges_at_scale(p, numel, args.density, args.teams)
        minimum = minimum_bytes(p, numel, args.density)
        dense_time = sum(c.seconds(p, latency, beta) for c in plans["dense all-reduce"])
        for name, plan in plans.items():
            sent = sum(c.bytes_sent(p) for c in plan)
            seconds = sum(c.seconds(p, latency, beta) for c in plan)
            speedup = f"{dense_time / seconds:8.1f}x" if seconds > 0 else f"{'-':>9}"
            ratio = f"{sent / minimum[name]:9.3f}x" if minimum.get(name) else f"{'-':>10}"
            print(f"{p:>6}  {name:<36} {_human(sent):>12} {ratio} {seconds * 1e3:9.3f}ms {speedup}")
            if seconds > 0:  # P = 1: no time, and no point on the log axis
                rows.setdefault(name, []).append((p, seconds))
        print()
    if args.plot:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, points in rows.items():
            ax.plot([p for p, _ in points], [s * 1e3 for _, s in points], marker="o", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("world size P")
        ax.set_ylabel("time per step (ms, model)")
        ax.set_title(f"{numel:.3g} elements, density {args.density}, {args.bandwidth}, {args.latency}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
