"""``exchange="auto"``: per bucket, the faster of gather-and-add and reduce-scatter + all-gather,
chosen by timing both on the training's own steps.

The first pick is gradsparse.simulate's alpha-beta model on the link measured at set-up. The
model counts bytes and one latency per round; it does not see the exchanges' CPU work (the
owners' sorting and merging in reduce-scatter + all-gather, the packing of messages) nor what
each round costs when the workers' cores are busy with the backward pass. On the emulated
cluster it chose reduce-scatter + all-gather for the LSTM's bucket where that exchange took 1.8x
gather-and-add's time (docs/results.md, "Top-k's exchanges on the LSTM"). So the state then
measures:

1. From the second sparse step on (the first pays for allocations that would weigh on whichever
   exchange ran it), ``STEPS_EACH`` steps per exchange, alternating, every bucket alike.
2. At the next step, before its first bucket, every rank's median exchange time per bucket and
   exchange is averaged over the ranks: one small all-reduce through the engine, queued like a
   bucket, so every rank holds the same figures and takes the same decision.
3. Each bucket keeps the exchange with the lower mean (gather-and-add on a tie) for the rest of
   the run. A bucket that some rank did not time at every step (a step skipped for NaN/Inf, as
   a loss scaler's first steps often are) is timed again from that step, at most ``ROUNDS``
   rounds in all; one still missing a time then keeps the model's pick. The decision is saved
   in the state dict; a resumed run keeps it (one saved during the trial times again, and so
   does a trial during which DDP rebuilt its buckets).
4. A decision belongs to the bucket's parameters, not to its index: where DDP's buckets hold
   other parameters than those decided on (a run resumed with another ``bucket_cap_mb``, or
   DDP's rebuild after a resume), a bucket of the same parameters as a decided one keeps its
   exchange, and the others are timed as above, from the step after the first of them appears.

Both exchanges complete a step's state (residual, method state), so switching between steps
changes nothing but the exchange. At one rank nothing is timed: the model's pick stays.
"""

from __future__ import annotations

import statistics

import torch

__all__ = ["CHOICES", "ROUNDS", "STEPS_EACH", "ExchangeTrial"]

#: The option values that exchange="auto" chooses between, gather-and-add first (the tie's pick).
CHOICES = ("gather", "reduce_scatter")
#: Timed steps per exchange and bucket.
STEPS_EACH = 3
#: Rounds of timed steps at most, for a bucket whose times some skipped step left incomplete.
ROUNDS = 3


class ExchangeTrial:
    """The trial of one state: when it runs, what it measured, what it decided (see the module).
    A bucket is named by its parameters' names (a frozenset), as parked method states are: a bucket
    index names other parameters in another layout (DDP's rebuild, another ``bucket_cap_mb``)."""

    def __init__(self, first_sparse_step: int, chosen: dict[frozenset[str], str] | None = None) -> None:
        self.first_step = first_sparse_step + 1  # the first step of the trial's current round
        self.rounds = 1
        self.seconds: dict[frozenset[str], dict[str, list[float]]] = {}  # bucket -> exchange -> this rank's times
        self.chosen = dict(chosen or {})  # bucket -> exchange
        self.means: dict[frozenset[str], dict[str, float]] = {}  # bucket -> exchange -> mean over the ranks
        self.decided = chosen is not None

    def exchange_at(self, bucket: frozenset[str], step: int) -> str | None:
        """The exchange ``bucket`` runs at ``step``: the trial's alternation, the decision, or None
        (the method's own: the model's pick)."""
        if self.decided or bucket in self.chosen:
            return self.chosen.get(bucket)
        t = step - self.first_step
        return CHOICES[t % 2] if 0 <= t < 2 * STEPS_EACH else None

    def timed(self, bucket: frozenset[str]) -> bool:
        """Whether ``bucket`` is still being timed (its exchange at a step of the current round is
        one of the trial's)."""
        return not self.decided and bucket not in self.chosen

    def due(self, step: int) -> bool:
        """Whether the ranks agree now (at the first bucket of the step after a round)."""
        return not self.decided and step >= self.first_step + 2 * STEPS_EACH

    def reopen(self, step: int) -> ExchangeTrial:
        """A trial that keeps this one's decisions and times the buckets without one, in new
        rounds from the step after ``step`` (DDP's buckets changed: the times so far, or the
        decision, cover other parameters). The times of this step's buckets reduced before the
        change still arrive at this one, and are dropped with it."""
        trial = ExchangeTrial(step)
        trial.chosen, trial.means = dict(self.chosen), dict(self.means)
        return trial

    def rename(self, renamed: dict[str, str]) -> None:
        """Keeps each bucket's times, means and decision under its parameters' names as
        ``renamed`` maps them."""
        for by_bucket in ("seconds", "chosen", "means"):
            held = getattr(self, by_bucket)
            setattr(self, by_bucket, {frozenset(renamed.get(n, n) for n in names): v for names, v in held.items()})

    def record(self, bucket: frozenset[str], exchange: str, seconds: float) -> None:
        """One timed step of ``bucket`` (called when its exchange completed)."""
        self.seconds.setdefault(bucket, {name: [] for name in CHOICES})[exchange].append(seconds)

    def medians(self, buckets: list[frozenset[str]]) -> torch.Tensor:
        """This rank's figures for ``buckets`` (the same list on every rank): per bucket the median
        time of each exchange, and a flag that is 1 where some time is missing (a step skipped or
        failed, or the bucket is new) and 0 where all are there, so that its average over the
        ranks is exactly 0 only where every rank timed every step."""
        rows = []
        for bucket in buckets:
            times = self.seconds.get(bucket, {})
            complete = all(len(times.get(name, ())) >= STEPS_EACH for name in CHOICES)
            medians = [statistics.median(times[name]) if complete else 0.0 for name in CHOICES]
            rows.append([*medians, 0.0 if complete else 1.0])
        return torch.tensor(rows, dtype=torch.float32).reshape(-1)

    def decide(self, averaged: torch.Tensor, buckets: list[frozenset[str]], step: int) -> None:
        """Takes the ranks' averaged figures (``medians(buckets)`` after the all-reduce) at
        ``step``: each bucket timed on every rank keeps the faster exchange; where some are
        missing, another round starts at ``step`` (up to ``ROUNDS``), else the trial ends."""
        rows = averaged.reshape(-1, len(CHOICES) + 1).tolist()
        for bucket, (*means, missing) in zip(buckets, rows, strict=True):
            if missing == 0.0 and bucket not in self.chosen:
                self.means[bucket] = dict(zip(CHOICES, means, strict=True))
                self.chosen[bucket] = min(CHOICES, key=lambda name: self.means[bucket][name])
        self.seconds.clear()
        if any(bucket not in self.chosen for bucket in buckets) and self.rounds < ROUNDS:
            self.rounds += 1
            self.first_step = step
        else:
            self.decided = True
