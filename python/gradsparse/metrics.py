"""Per-bucket and total statistics of a gradsparse state, updated from each bucket's report."""

from __future__ import annotations

import math
import threading
from dataclasses import asdict, dataclass, fields


@dataclass
class BucketStats:
    """Counters of one bucket since the last reset (see State.stats for their meaning)."""

    steps: int = 0
    dense_steps: int = 0
    skipped_steps: int = 0
    numel: int = 0  # elements of the bucket (last step)
    elements: int = 0  # elements reduced, summed over steps
    sparse_elements: int = 0  # elements of sparse steps (not skipped ones: the densities leave them out)
    selected: int = 0  # pairs this rank sent in sparse steps
    selected_all: int = 0  # pairs all ranks sent in sparse steps
    union: int = 0  # elements the sparse steps' exchanges wrote (gather-and-add: every rank's pairs, each counted)
    elements_sent: int = 0  # selected + every element of dense steps
    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0  # what a ring all-reduce of the same elements would send
    select_seconds: float = 0.0
    exchange_seconds: float = 0.0
    threshold: float = math.nan  # last threshold of a threshold-based method
    imbalance_sum: float = 0.0  # partitioned methods: sum over sparse steps of the load imbalance
    imbalance_steps: int = 0
    exchange: str = ""  # the exchange of the last step (its glossary name, or "dense all-reduce")

    def record(self, report, world_size: int, element_size: int) -> None:
        self.steps += 1
        self.numel = report.numel
        self.exchange = report.exchange
        self.elements += report.numel
        if report.dense:
            self.dense_steps += 1
            self.elements_sent += 0 if report.skipped else report.numel  # a skipped warm-up step sent its count only
        elif not report.skipped:  # a skipped step applied nothing: its selection went back to the residual
            self._count_sparse(report, 1)
        self.skipped_steps += int(report.skipped)
        self.bytes_sent += report.bytes_sent
        self.bytes_received += report.bytes_received
        self.dense_bytes += 2 * (world_size - 1) * report.numel * element_size // world_size
        self.select_seconds += report.select_seconds
        self.exchange_seconds += report.exchange_seconds
        if not math.isnan(report.threshold):
            self.threshold = report.threshold
        if not math.isnan(report.imbalance):
            self.imbalance_sum += report.imbalance
            self.imbalance_steps += 1

    def withdraw(self, report) -> None:
        """A sparse step recorded before and then taken back (nonfinite="propagate": another bucket
        of its step overflowed): it counts as skipped, in no density; its bytes were sent."""
        self._count_sparse(report, -1)
        self.skipped_steps += 1

    def _count_sparse(self, report, sign: int) -> None:
        """Adds (sign 1) or takes out (-1) a sparse step's elements and pairs."""
        self.sparse_elements += sign * report.numel
        self.selected += sign * report.selected
        self.selected_all += sign * report.selected_all
        self.union += sign * report.union_size
        self.elements_sent += sign * report.selected

    def add(self, other: BucketStats) -> None:
        for f in fields(self):
            if f.name in ("numel", "threshold", "exchange"):
                continue
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.numel += other.numel

    def summary(self, world_size: int) -> dict:
        out = asdict(self)
        out["density"] = self.selected / self.sparse_elements if self.sparse_elements else math.nan
        denominator = self.sparse_elements * world_size
        out["global_density"] = self.selected_all / denominator if denominator else math.nan
        out["union_density"] = self.union / self.sparse_elements if self.sparse_elements else math.nan
        out["bytes_ratio"] = self.bytes_sent / self.dense_bytes if self.dense_bytes else math.nan
        out["imbalance"] = self.imbalance_sum / self.imbalance_steps if self.imbalance_steps else math.nan
        del out["imbalance_sum"], out["imbalance_steps"]
        return out


class Metrics:
    """All buckets' statistics of one state, each bucket's kept by the names of its parameters (a
    frozenset), as its method state is: DDP's buckets change (its first step reduces in another
    layout than the steps after it, and a run resumed with another ``bucket_cap_mb`` has other
    buckets), and by index a bucket's counters took in those of whichever bucket had its index.
    The engine thread records while the training thread (or a monitor's) reads: one lock keeps
    each from seeing the other half-way (a read met "dictionary changed size during iteration")."""

    def __init__(self) -> None:
        self.buckets: dict[frozenset[str], BucketStats] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:  # a state not set up yet is pickled (mp.spawn's arguments); a lock is not
        return {"buckets": self.buckets}

    def __setstate__(self, state: dict) -> None:
        self.buckets, self._lock = state["buckets"], threading.Lock()

    def record(self, bucket: frozenset[str], report, world_size: int, element_size: int) -> None:
        with self._lock:
            self.buckets.setdefault(bucket, BucketStats()).record(report, world_size, element_size)

    def withdraw(self, bucket: frozenset[str], report) -> None:
        with self._lock:
            if bucket in self.buckets:  # else reset since it was recorded
                self.buckets[bucket].withdraw(report)

    def summary(self, world_size: int, layout: dict[int, frozenset[str]], global_target: bool = False) -> dict:
        """The buckets of ``layout`` (index -> its parameters' names: DDP's buckets now) by index,
        and the total of every bucket counted, those of earlier layouts too. ``global_target``: the
        method's density counts all ranks' pairs (MiCRO, ExDyna, SparDL), so ``achieved_density``
        is the union's; otherwise this rank's."""
        with self._lock:
            return self._summary(world_size, layout, global_target)

    def _summary(self, world_size: int, layout: dict[int, frozenset[str]], global_target: bool) -> dict:
        current = {i: self.buckets[names] for i, names in sorted(layout.items()) if names in self.buckets}
        total = BucketStats()
        for stats in self.buckets.values():
            total.add(stats)
        out = total.summary(world_size)
        out["numel"] = sum(b.numel for b in current.values())  # the buckets of earlier layouts hold the same elements
        out["achieved_density"] = out["union_density" if global_target else "density"]
        # The most of any parameter, each counted in every bucket that held it: the steps of a
        # bucket of an earlier layout count for its parameters as the later buckets' do.
        for counter in ("steps", "dense_steps", "skipped_steps"):
            by_name: dict[str, int] = {}
            for names, stats in self.buckets.items():
                for name in names:
                    by_name[name] = by_name.get(name, 0) + getattr(stats, counter)
            out[counter] = max(by_name.values(), default=0)
        del out["threshold"], out["exchange"]
        return {"total": out, "buckets": {i: b.summary(world_size) for i, b in current.items()}}

    def reset(self) -> None:
        with self._lock:
            self.buckets.clear()

    def rename(self, renamed: dict[str, str]) -> None:
        """Keeps each bucket's statistics under its parameters' names as ``renamed`` maps them."""
        with self._lock:
            self.buckets = {frozenset(renamed.get(n, n) for n in names): b for names, b in self.buckets.items()}

    def state_dict(self) -> list[dict]:
        """Each bucket's counters with its parameters' names (sorted)."""
        with self._lock:
            return [{"names": sorted(names), "counters": asdict(b)} for names, b in self.buckets.items()]

    def load_state_dict(self, stats: list[dict]) -> None:
        """``stats`` as state_dict() gives them (gradsparse.checkpoint.saved_stats reads those of
        older state dicts so)."""
        buckets = {frozenset(entry["names"]): BucketStats(**entry["counters"]) for entry in stats}
        with self._lock:
            self.buckets = buckets


#: The statistics that the framework integrations log (Lightning's Sparsify, the Hugging Face
#: Trainer's), as ``<prefix><name>``: per step, averaged over the steps since the last log.
LOGGED = ("achieved_density", "bytes_sent", "bytes_ratio", "select_seconds", "exchange_seconds")
_PER_STEP = ("bytes_sent", "select_seconds", "exchange_seconds")  # sums in State.stats


def logged_figures(total: dict, prefix: str) -> dict[str, float]:
    """The LOGGED figures of ``State.stats()["total"]``, each per step (the densities and the byte
    ratio are ratios already); none where no step was counted, and none that is NaN (a dense
    step has no achieved density)."""
    steps = total["steps"]
    if not steps:
        return {}
    figures = {name: float(total[name]) / (steps if name in _PER_STEP else 1) for name in LOGGED}
    return {prefix + name: value for name, value in figures.items() if not math.isnan(value)}
