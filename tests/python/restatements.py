"""Plain PyTorch re-statements of every selection method, written only from docs/method-spec.md.

They are deliberately independent of the C++ core (csrc/ was not read to write them): the tests in
test_methods.py run both side by side and require identical selections. "§" numbers below refer to
the sections of docs/method-spec.md.

Protocol (one object per rank, holding that rank's state, like the C++ method objects):

- ``select(v, rank, world)`` is a generator. ``v`` holds the selection values (§1: the residual
  after the error-feedback update). Whenever the method needs an all-reduce inside its selection
  (MiCRO/ExDyna default mode: the sampled histogram at t = 0, the 257 band counts every step) it
  yields its float64 contribution and receives the sum over all ranks. It finally returns
  ``(indices, threshold)``: int64 ascending indices and the reported threshold (NaN if none).
- ``exchange`` is "gather", "union" or "shared" (§3).
- ``observe(counts_by_rank)`` commits the step after the exchange: every rank's pair count.

``ReferenceGroup`` drives all ranks in lockstep and re-states the error feedback (§1) and the
exchanges (§3).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Generator, Sequence

import numpy as np
import torch
from scipy.special import gammaincinv

Selection = Generator[torch.Tensor, torch.Tensor, tuple[torch.Tensor, float]]

NAN = float("nan")

# ----------------------------------------------------------------------------------------------
# §1 Common definitions


def target(density: float, n: int) -> int:
    """§1: k = min(n, max(1, floor(δ n)))."""
    return min(n, max(1, math.floor(density * n)))


def to_dtype(x: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A float64 threshold rounded to the bucket dtype (§1 Precision), as a 0-d tensor."""
    return torch.tensor(x, dtype=torch.float64).to(dtype)


def at_least(v: torch.Tensor, tau: float) -> torch.Tensor:
    """Mask of |v| >= τ with τ rounded to the dtype first (§1)."""
    return v.abs() >= to_dtype(tau, v.dtype)


def above(v: torch.Tensor, tau: float) -> torch.Tensor:
    """Mask of |v| > τ with τ rounded to the dtype first (§1)."""
    return v.abs() > to_dtype(tau, v.dtype)


def where(mask: torch.Tensor) -> torch.Tensor:
    return torch.nonzero(mask).flatten().to(torch.int64)


def largest(v: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
    """The k candidates of largest |v|, ties to the lowest index (§4.1), ascending."""
    if k >= candidates.numel():
        return candidates
    mags = v[candidates].abs()
    # Stable sort on descending magnitude: equal magnitudes keep ascending index order.
    order = torch.sort(mags, descending=True, stable=True).indices[:k]
    return torch.sort(candidates[order]).values


def ieee_div(a: float, b: float) -> float:
    """a / b with IEEE semantics (x / 0 = ±inf, 0 / 0 = NaN), as the C++ doubles divide."""
    if b == 0:
        return NAN if a == 0 or math.isnan(a) else math.copysign(math.inf, a)
    return a / b


def kljp_initial(k: int) -> float:
    """λ0 = 1 / (2 sqrt(k)) (§4.2, §4.7, §4.8), with k at least 1: the project's ruling for an
    empty bucket (k = 0), documented in docs/methods.md ("Empty buckets")."""
    return 1.0 / (2 * math.sqrt(max(k, 1)))


def mean64(x: torch.Tensor) -> float:
    return float(x.double().sum()) / x.numel() if x.numel() else NAN


def var64(x: torch.Tensor) -> float:
    """Unbiased variance in float64 (NaN for fewer than two values)."""
    x = x.double()
    if x.numel() < 2:
        return NAN
    mu = float(x.sum()) / x.numel()
    return float(((x - mu) ** 2).sum()) / (x.numel() - 1)


def norm64(v: torch.Tensor) -> float:
    return math.sqrt(float((v.double() ** 2).sum()))


def phi_inv(p: float) -> float:
    """Φ⁻¹, the standard normal quantile."""
    return statistics.NormalDist().inv_cdf(p)


# ----------------------------------------------------------------------------------------------
# §2 Random numbers (uint64 wrapping arithmetic on Python ints)

MASK64 = 0xFFFF_FFFF_FFFF_FFFF
SHARED_LANE = 2**32 - 1
TAG_SAGE, TAG_RANDOMK, TAG_DGC, TAG_INITIAL, TAG_RANDOMBLOCK = 1, 2, 3, 4, 5


def mix(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def stream(seed: int, tag: int, t: int, lane: int) -> int:
    return mix(mix(mix((seed & MASK64) ^ tag) ^ t) ^ lane)


def draw(s: int, i: int) -> int:
    return mix((s + i) & MASK64)


def sample_with_replacement(s: int, count: int, n: int) -> list[int]:
    return [draw(s, i) % n for i in range(count)]


def sample_distinct(s: int, c: int, n: int) -> torch.Tensor:
    """§2 distinct sampling: c positions of [0, n), ascending."""
    if c >= n:
        return torch.arange(n, dtype=torch.int64)

    def walk(count: int) -> set[int]:
        taken: set[int] = set()
        i = 0
        while len(taken) < count:
            taken.add(draw(s, i) % n)
            i += 1
        return taken

    if c > n // 2:
        left_out = walk(n - c)
        return torch.tensor([i for i in range(n) if i not in left_out], dtype=torch.int64)
    return torch.tensor(sorted(walk(c)), dtype=torch.int64)


PERCENT_CUT = MASK64 // 100


def percent_sample(s: int, n: int) -> torch.Tensor:
    """§2 hashed sample: the positions p of [0, n) with draw(s, p) < PERCENT_CUT, ascending
    (mix on a numpy uint64 array, whose arithmetic wraps as the masks do: every position at once)."""
    drawn = mix(np.arange(n, dtype=np.uint64) + np.uint64(s))
    return torch.from_numpy(np.flatnonzero(drawn < PERCENT_CUT).astype(np.int64))


# ----------------------------------------------------------------------------------------------
# Base class


class Restatement:
    exchange = "gather"
    reports_threshold = True

    def __init__(self) -> None:
        self.t = 0  # §1: the step counter

    def select(self, v: torch.Tensor, rank: int, world: int) -> Selection:
        """Methods without collectives inside their selection: ``choose`` does the work."""
        return self.choose(v, rank, world)
        yield  # unreachable: makes this a generator like the collective methods' select

    def choose(self, v: torch.Tensor, rank: int, world: int) -> tuple[torch.Tensor, float]:
        raise NotImplementedError

    def observe(self, counts_by_rank: Sequence[int]) -> None:
        self.t += 1


# ----------------------------------------------------------------------------------------------
# §4.1 - §4.6


class TopK(Restatement):
    """§4.1."""

    reports_threshold = False

    def __init__(self, density: float, exchange: str = "gather") -> None:
        super().__init__()
        self.density, self.exchange = density, exchange

    def choose(self, v, rank, world):
        n = v.numel()
        k = target(self.density, n)
        return largest(v, torch.arange(n, dtype=torch.int64), k), NAN


class Threshold(Restatement):
    """§4.2."""

    def __init__(self, threshold: float | None = None, density: float | None = None, exchange: str = "gather") -> None:
        super().__init__()
        assert (threshold is None) != (density is None)
        self.threshold, self.density, self.exchange = threshold, density, exchange

    def choose(self, v, rank, world):
        fixed = self.threshold is not None
        tau = self.threshold if fixed else kljp_initial(target(self.density, v.numel()))
        return where(at_least(v, tau)), tau


class RandomK(Restatement):
    """§4.3: the same k distinct positions on every rank (shared stream)."""

    exchange = "shared"
    reports_threshold = False

    def __init__(self, density: float, seed: int = 0) -> None:
        super().__init__()
        self.density, self.seed = density, seed

    def choose(self, v, rank, world):
        n = v.numel()
        s = stream(self.seed, TAG_RANDOMK, self.t, SHARED_LANE)
        return sample_distinct(s, target(self.density, n), n), NAN


class RandomBlock(RandomK):
    """docs/method-spec.md 4.12: k positions from a shared random start, wrapping at n."""

    def choose(self, v, rank, world):
        n = v.numel()
        if n == 0:
            return torch.zeros(0, dtype=torch.int64), NAN
        start = draw(stream(self.seed, TAG_RANDOMBLOCK, self.t, SHARED_LANE), 0) % n
        positions = sorted((start + j) % n for j in range(target(self.density, n)))
        return torch.tensor(positions, dtype=torch.int64), NAN


class DensityControl:
    """Ruling 9: the estimating methods' default mode steers an estimate to k elements."""

    TOLERANCE, STEPS, MARGIN, TIE_SPREAD = 0.02, 8, 1e-9, 1e-3

    def __init__(self) -> None:
        self.scale, self.slope = 1.0, 2.0

    def threshold(self, v: torch.Tensor, estimate: float, k: int) -> float:
        if not (estimate > 0 and math.isfinite(estimate)):
            return estimate

        def count(tau: float) -> float:
            return float(above(v, tau).sum())

        def log_count(c: float) -> float:
            return math.log(max(c, 0.5))

        tau = estimate * self.scale
        if not (tau > 0 and math.isfinite(tau)):  # the product overflowed or underflowed
            tau = estimate
        c = count(tau)
        best_tau, best_c = tau, c
        held, none = 0.0, math.inf  # the highest threshold with a positive count, the lowest with 0

        def seen(at: float, count_at: float) -> None:
            nonlocal held, none
            if count_at > 0:
                held = max(held, at)
            else:
                none = min(none, at)

        seen(tau, c)
        low, high = 0.0, math.inf  # thresholds known to hold too many, too few
        for _ in range(self.STEPS):
            if abs(c - k) <= self.TOLERANCE * k:
                break
            if c > k:
                low = max(low, tau)
            if c < k:
                high = min(high, tau)
            nxt = tau * math.exp((log_count(c) - math.log(k)) / self.slope)
            inside = low * (1 + self.MARGIN) < nxt < high * (1 - self.MARGIN)
            if not inside and low > 0 and math.isfinite(high):
                nxt = math.sqrt(low * high)  # outside what is known: the middle in log space
            if not (nxt > 0 and math.isfinite(nxt)) or abs(nxt - tau) <= self.MARGIN * tau:
                break
            c_next = count(nxt)
            if c_next != c:
                slope = (log_count(c) - log_count(c_next)) / (math.log(nxt) - math.log(tau))
                self.slope = min(max(slope, 0.25), 64.0)
            elif not (low > 0 and math.isfinite(high)):
                self.slope = max(0.25, self.slope / 2)  # a flat stretch: the next step twice as long
            tau, c = nxt, c_next
            seen(tau, c)
            if abs(c - k) <= abs(best_c - k):  # of equal counts the latest
                best_tau, best_c = tau, c
        # Nothing chosen, though a threshold held some (ties of 2k or more at the top): bisection
        # down to the largest magnitudes, whose group is sent unless a count as near k turns up.
        while best_c == 0 and held > 0 and none > held * (1 + self.TIE_SPREAD):
            mid = math.sqrt(held) * math.sqrt(none)
            if not held < mid < none:
                break
            c_mid = count(mid)
            seen(mid, c_mid)
            if abs(c_mid - k) <= abs(best_c - k):
                best_tau, best_c = mid, c_mid
        if best_c == 0 and held > 0:
            best_tau = held
        scale = best_tau / estimate
        if scale > 0 and math.isfinite(scale):
            self.scale = scale
        return best_tau


class Estimating(Restatement):
    """A method whose default mode steers its estimate with the density control (ruling 9)."""

    def __init__(self, reference: bool) -> None:
        super().__init__()
        self.reference = reference
        self.control = DensityControl()

    def steered(self, v: torch.Tensor, estimate: float, k: int) -> tuple[torch.Tensor, float]:
        tau = self.control.threshold(v, estimate, k)
        return where(above(v, tau)), tau

    def steered_fit(self, v: torch.Tensor, estimate: float, k: int) -> tuple[torch.Tensor, float]:
        """steered() from a fit, which starts from the mean magnitude where it is no positive
        number and v is not zero (§4.4)."""
        total = float(v.double().abs().sum())
        if not (estimate > 0 and math.isfinite(estimate)) and total > 0:
            estimate = total / v.numel()
        return self.steered(v, estimate, k)


class GaussianK(Estimating):
    """§4.4."""

    def __init__(
        self, density: float, variant: str = "spardl", exchange: str = "gather", reference: bool = False
    ) -> None:
        super().__init__(reference)
        assert variant in ("spardl", "sidco")
        self.density, self.variant, self.exchange = density, variant, exchange

    def choose(self, v, rank, world):
        return self.spardl(v) if self.variant == "spardl" else self.sidco(v)

    def spardl(self, v):
        k = target(self.density, v.numel())
        # 1. statistics of the signed values
        mu, sigma = mean64(v), math.sqrt(var64(v))
        tau = mu + phi_inv(1 - self.density / 2) * sigma
        if not self.reference:
            return self.steered_fit(v, tau, k)

        def count(tau: float) -> int:
            return int(above(v, tau).sum())

        # 2. at most 20 rescalings towards [floor(3k/4), floor(5k/4)]
        low, high = (3 * k) // 4, (5 * k) // 4
        if count(tau) < low:
            for _ in range(20):
                if count(tau) < low:
                    tau = tau / 1.02
                else:
                    break
        elif count(tau) > high:
            for _ in range(20):
                if count(tau) > high:
                    tau = tau * 1.02
                else:
                    break
        # 3.
        return where(above(v, tau)), tau

    def sidco(self, v):
        n = v.numel()
        k = target(self.density, n)
        norm = norm64(v)
        if norm == 0:
            return torch.zeros(0, dtype=torch.int64), NAN  # a zero vector selects nothing (no τ exists)
        x = v.double().abs() / norm
        mu, sigma = mean64(x), math.sqrt(var64(x))
        rho = mu + phi_inv(1 - self.density / 2) * sigma
        if not self.reference:
            return self.steered_fit(v, rho * norm, k)
        for _ in range(3):  # at most 3 evaluations; the last one's set is the selection
            tau = rho * norm
            selected = where(above(v, tau))
            c = selected.numel()
            if c < 2 * k / 3:
                rho = rho * 0.5
            elif c > 4 * k / 3:
                rho = rho * 1.5
            else:
                break
        return selected, tau


class DGC(Estimating):
    """§4.5."""

    def __init__(self, density: float, seed: int = 0, exchange: str = "gather", reference: bool = False) -> None:
        super().__init__(reference)
        self.density, self.seed, self.exchange = density, seed, exchange

    def choose(self, v, rank, world):
        n = v.numel()
        k = math.ceil(self.density * n)
        norm = norm64(v)
        if norm == 0:
            return torch.zeros(0, dtype=torch.int64), NAN  # a zero vector selects nothing (no τ exists)
        f = math.ceil(0.01 * n)
        s = math.ceil(f * self.density)
        st = stream(self.seed, TAG_DGC, self.t, SHARED_LANE)
        # The default mode's hashed 1% sample, unless it holds fewer than s; f distinct draws else.
        samples = None if self.reference else percent_sample(st, n)
        if samples is None or samples.numel() < s:
            samples = sample_distinct(st, f, n)
        # rho ||v||, with rho the s-th largest x = |v| / ||v|| among the samples: the s-th largest
        # |v| itself in the default mode (ruling 9); in the reference mode divided and multiplied
        # again (a division rounds monotonically, so rho is the s-th largest x to the bit)
        kth = float(torch.sort(v[samples].double().abs(), descending=True).values[s - 1])
        if not self.reference:
            return self.steered(v, kth, k)
        tau = kth / norm * norm
        candidates = where(above(v, tau))
        if candidates.numel() > 4 * k / 3:
            return largest(v, candidates, k), tau
        return candidates, tau


class RedSync(Estimating):
    """§4.6."""

    def __init__(self, density: float, exchange: str = "gather", reference: bool = False) -> None:
        super().__init__(reference)
        self.density, self.exchange = density, exchange

    def choose(self, v, rank, world):
        k = target(self.density, v.numel())
        mags = v.double().abs()
        m, big = mean64(mags), float(mags.max()) if mags.numel() else NAN
        if not self.reference:
            if v.numel() == 0:
                return torch.zeros(0, dtype=torch.int64), NAN
            return self.steered(v, m + 0.5 * (big - m), k)  # the bisection's first midpoint
        low, high = 0.0, 1.0
        selected, tau = torch.zeros(0, dtype=torch.int64), NAN
        while high - low > 0.2:
            mid = low + (high - low) / 2
            tau = m + mid * (big - m)
            selected = where(above(v, tau))
            c = selected.numel()
            if k < c < 2 * k:
                break
            if c < k / 2:
                high = mid
            else:
                low = mid
        return selected, tau


# ----------------------------------------------------------------------------------------------
# §4.7 SAGE


def f32(x: float) -> float:
    """float32(x), saturating at its largest finite value (§4.7)."""
    return float(to_dtype(min(x, torch.finfo(torch.float32).max), torch.float32))


class SAGE(Restatement):
    def __init__(
        self,
        density: float,
        sampling: str = "flat",
        segments: Sequence[int] = (),
        reference: bool = False,
        seed: int = 0,
        initial_threshold: float | None = None,
        exchange: str | None = None,
    ) -> None:
        super().__init__()
        assert sampling in ("flat", "per_tensor")
        self.density, self.sampling, self.segments = density, sampling, list(segments)
        self.reference, self.seed, self.initial_threshold = reference, seed, initial_threshold
        self.exchange = exchange or ("union" if sampling == "flat" else "gather")
        self.lam = NAN  # λ of the last step
        self.s_prev = NAN  # s_{t-1}
        self.s_cur = NAN
        self.restart = False  # default mode: the last band held fewer than k, so predict from the sample
        self.band = 1.25  # default mode: the band factor of the next step that does not sample

    def sample(self, v: torch.Tensor, rank: int) -> torch.Tensor:
        """The sampled |a| (§4.7), with repeats, in the order drawn."""
        n = v.numel()
        size = max(1, math.floor(n / (1 + 0.0025 * n)))  # Slovin, e = 0.05
        s = stream(self.seed, TAG_SAGE, self.t, rank)
        if self.sampling == "flat":
            positions = sample_with_replacement(s, size, n)
        else:
            # empty tensors take no part (§4.7): they have no position to sample
            offsets = [sum(self.segments[:j]) for j in range(len(self.segments)) if self.segments[j] > 0]
            sizes = [m for m in self.segments if m > 0]
            positions = []
            for i in range(size):
                j = draw(s, 2 * i) % len(sizes)
                positions.append(offsets[j] + draw(s, 2 * i + 1) % sizes[j])
        return v[torch.tensor(positions, dtype=torch.int64)].abs()

    def choose(self, v, rank, world):
        n = v.numel()
        k = target(self.density, n)
        restart, self.restart = self.restart, False
        if n == 0:  # nothing to sample, nothing to estimate (docs/methods.md, "Empty buckets")
            self.s_cur = NAN
            return where(at_least(v, 0.0)), NAN
        sample = self.sample(v, rank)
        self.s_cur = mean64(sample)
        alpha = 1.0
        if self.t >= 1:
            alpha = self.s_cur / self.s_prev if self.s_prev != 0 else NAN
            if not (math.isfinite(alpha) and alpha > 0):
                alpha = 1.0
        initial = self.initial_threshold if self.initial_threshold is not None else kljp_initial(k)
        if self.reference:
            if self.t == 0:
                self.lam = initial
            else:
                d = ieee_div(int(at_least(v, self.lam * alpha).sum()), n)
                beta = 2 / (1 + math.exp(self.density - d))
                ratio = d / self.density
                gamma = 0.95 if ratio < 0.1 else 1.05 if ratio > 10 else 1.0
                lam1 = f32(self.lam * alpha)
                lam2 = f32(lam1 * beta)
                self.lam = f32(lam2 * gamma)
            return where(at_least(v, self.lam)), self.lam
        # default mode: prediction, then the band [λ̂ / w, ...)
        predicted = initial if self.t == 0 else self.lam * alpha
        sampled = self.t == 0 or restart
        positive = sorted((m for m in sample.double().tolist() if 0 < m < math.inf), reverse=True)
        if sampled and not (self.t == 0 and self.initial_threshold is not None) and positive:
            share = math.ceil(k * sample.numel() / n)  # the sample's share of k
            predicted = positive[min(max(share, 1), len(positive)) - 1]
        w = 2.0 if sampled else self.band
        # the band from predicted / w; at a step that did not sample, once more from predicted / w^2
        lows = [predicted / w] if sampled else [predicted / w, predicted / (w * w)]
        for low in lows:
            candidates = where(at_least(v, low))
            if candidates.numel() >= k:
                chosen = largest(v, candidates, k)
                # the k-th largest |v| of C (none exists when k = 0, i.e. n = 0)
                self.lam = float(v[chosen].abs().min()) if k > 0 else NAN
                # the next band: §4.8's rule, from the widest after a sampled step
                self.band = 1.25 if sampled else Partitioned.next_band(w, predicted, self.lam)
                return chosen, self.lam
        self.lam = lows[-1]
        self.restart = True
        self.band = 1.25  # the next step samples; the one after it starts from the widest
        return candidates, self.lam

    def observe(self, counts_by_rank):
        self.s_prev = self.s_cur
        super().observe(counts_by_rank)


# ----------------------------------------------------------------------------------------------
# §4.8 MiCRO and §4.9 ExDyna: partitioned thresholds (shared code)

# §4.8: the sampled prediction's histogram, lower edges 2^(-40 + 50 b / 512) for b = -1117..1720 (2838 bins)
SAMPLE_EDGES = [2.0 ** (-40 + 50 * b / 512) for b in range(-1117, 1721)]
BAND_BINS = 257


def histogram_bin(value: float, edges: list[float] = SAMPLE_EDGES) -> int:
    """§4.8: bin b with edge_b <= value < edge_{b+1}; below the first edge -> 0, above the last -> the last."""
    lo, hi = 0, len(edges) - 1
    while lo < hi:  # the largest b with edge_b <= value (0 if none)
        mid = (lo + hi + 1) // 2
        if edges[mid] <= value:
            lo = mid
        else:
            hi = mid - 1
    return lo


class Partitioned(Restatement):
    """The threshold machinery shared by MiCRO and ExDyna (§4.8, §4.9 "exactly as MiCRO")."""

    def __init__(self, density: float, exchange: str = "union", reference: bool = False, seed: int = 0) -> None:
        super().__init__()
        assert exchange in ("union", "gather")
        self.density, self.exchange, self.reference, self.seed = density, exchange, reference, seed
        self.lam = NAN  # reference mode: the running threshold
        self.k_prev = 0  # total count of the previous step
        self.estimates: list[float] = []  # default mode: λ̃ of the past steps
        self.band = 1.25  # default mode: the band factor of the next step (t >= 1)
        self.trend_miss = self.mean_miss = 0.0  # default mode: each prediction's decayed misses

    def partition_range(self, n: int, world: int, p: int) -> tuple[int, int]:
        raise NotImplementedError

    def select(self, v, rank, world):
        n = v.numel()
        big_k = target(self.density, n)
        p = (self.t + rank) % world
        lo, hi = self.partition_range(n, world, p)
        if self.reference:
            return self.reference_select(v, lo, hi, big_k)
        return (yield from self.default_select(v, rank, lo, hi, big_k))

    def reference_select(self, v, lo, hi, big_k):
        if self.t == 0:
            self.lam = kljp_initial(big_k)
        else:
            rho = ieee_div(self.k_prev, big_k)
            self.lam *= 1.005 if rho > 1.1 else 1.00125 if rho > 0.909 else 0.995
        selected = lo + where(at_least(v[lo:hi], self.lam))
        if selected.numel() == 0 and hi > lo:
            selected = torch.tensor([lo + self.t % (hi - lo)], dtype=torch.int64)  # the dummy index
        return selected, self.lam

    def default_select(self, v, rank, lo, hi, big_k):
        # Prediction λ̂
        # a sample at t = 0, and again after a step whose counts put the threshold far off (no estimate)
        sampled = self.t == 0 or not (0 < self.estimates[-1] < math.inf)
        if sampled:
            hist = torch.zeros(len(SAMPLE_EDGES), dtype=torch.float64)
            size = min(4096, hi - lo)
            if size > 0:
                weight = (hi - lo) / size
                s = stream(self.seed, TAG_INITIAL, self.t, rank)
                for pos in sample_with_replacement(s, size, hi - lo):
                    hist[histogram_bin(abs(float(v[lo + pos])), SAMPLE_EDGES)] += weight
            hist = yield hist  # all-reduce (sum over ranks)
            predicted = SAMPLE_EDGES[0]
            cumulative = 0.0
            for b in range(len(SAMPLE_EDGES) - 1, 0, -1):
                cumulative += float(hist[b])
                if cumulative >= big_k:
                    predicted = SAMPLE_EDGES[b]
                    break
        elif self.t == 1 or not (0 < self.estimates[-2] < math.inf):
            predicted = by_trend = by_mean = self.estimates[-1]
        else:
            trend = min(max(self.estimates[-1] / self.estimates[-2], 1 / 1.2), 1.2)
            by_trend = self.estimates[-1] * trend
            by_mean = math.sqrt(self.estimates[-1] * self.estimates[-2])
            predicted = by_trend if self.trend_miss <= self.mean_miss else by_mean
        # Band and its 257 counts
        w = 2.0 if sampled else self.band
        # zero is never a candidate: the band's lowest edge at least the dtype's least positive value
        predicted = max(predicted, w * torch.finfo(v.dtype).smallest_normal * torch.finfo(v.dtype).eps)
        base = predicted / w
        edges = torch.tensor([base * w ** (2 * b / 256) for b in range(BAND_BINS)], dtype=torch.float64)
        part = v[lo:hi]
        candidates = where(at_least(part, edges[0].item()))
        mags = part[candidates].double().abs()
        # bin = how many of e_1..e_256 are <= |v| (candidates below e_0 in exact arithmetic: bin 0)
        bins = torch.searchsorted(edges[1:], mags, right=True)
        counts = torch.bincount(bins, minlength=BAND_BINS).to(torch.float64)
        counts = yield counts  # all-reduce (sum over ranks)
        global_counts = [int(c) for c in counts.tolist()]
        above_b = [0] * (BAND_BINS + 1)  # G(b) = global count in bins b..256
        for b in range(BAND_BINS - 1, -1, -1):
            above_b[b] = above_b[b + 1] + global_counts[b]
        best = min(range(BAND_BINS), key=lambda b: (abs(above_b[b] - big_k), -b))  # ties: larger b
        lam = edges[best].item()
        selected = lo + candidates[bins >= best]
        self.estimates.append(self.estimate(lam, edges.tolist(), above_b, big_k))
        self.band = w if sampled else self.next_band(w, predicted, self.estimates[-1])  # wide after a sample
        if not sampled:  # a sampled prediction is neither's: the misses stay as they were

            def miss(p: float) -> float:  # no estimate (far off): no miss
                return abs(math.log(self.estimates[-1] / p)) if 0 < self.estimates[-1] < math.inf else 0.0

            self.trend_miss = 0.8 * self.trend_miss + miss(by_trend)
            self.mean_miss = 0.8 * self.mean_miss + miss(by_mean)
        return selected, lam

    @staticmethod
    def next_band(w, predicted, estimate):
        """§4.8 "Band": twice the prediction's miss, or 0.9 of the last band in log scale."""
        if not (0 < predicted < math.inf and 0 < estimate < math.inf):
            return 1.25
        miss = abs(math.log(estimate / predicted))
        return min(max(math.exp(max(2 * miss, 0.9 * math.log(w))), 1.05), 1.25)

    @staticmethod
    def estimate(lam, e, g, big_k):
        """λ̃ for the next prediction (§4.8 "Estimate")."""

        def slope(lo: int, hi: int) -> float:
            if g[lo] > g[hi] > 0:
                return max(0.5, math.log(g[lo] / g[hi]) / math.log(e[hi] / e[lo]))
            return 1.0

        width = e[256] / e[0]
        if g[256] > big_k:
            if math.log(g[0] / g[256]) / math.log(e[256] / e[0]) < 0.5:
                return NAN  # far off: the counts barely fall across the band, far below the tail
            return e[256] * min(width, (g[256] / big_k) ** (1 / slope(0, 256)))
        if g[0] < big_k:
            if g[0] == 0:
                return NAN  # far off: nothing counted
            return e[0] * max(1 / width, (g[0] / big_k) ** (1 / slope(0, 128)))
        return lam

    def observe(self, counts_by_rank):
        self.k_prev = sum(counts_by_rank)
        super().observe(counts_by_rank)


class MiCRO(Partitioned):
    """§4.8: P contiguous partitions, fixed."""

    def partition_range(self, n, world, p):
        q, m = divmod(n, world)
        lo = p * q + min(p, m)
        return lo, lo + q + (1 if p < m else 0)


class ExDyna(Partitioned):
    """§4.9: 1024 blocks in P partitions, rebalanced from the previous step's counts."""

    BLOCKS = 1024

    def __init__(self, density, exchange="union", reference=False, seed=0) -> None:
        super().__init__(density, exchange, reference, seed)
        self.n = -1
        self.world = 0
        self.cnt: list[int] = []
        self.pos: list[int] = []

    def layout(self, n: int, world: int) -> None:
        if self.n == n and self.world == world:
            return
        self.n, self.world = n, world
        self.sz = (n // self.BLOCKS) // 32 * 32
        self.rem = n - self.BLOCKS * self.sz
        q, m = divmod(self.BLOCKS, world)
        self.cnt = [q + 1 if p < m else q for p in range(world)]
        self.pos = [sum(self.cnt[:p]) for p in range(world)]

    def partition_range(self, n, world, p):
        self.layout(n, world)
        lo = self.pos[p] * self.sz
        hi = (self.pos[p] + self.cnt[p]) * self.sz
        if p == world - 1:
            hi += self.rem
        return lo, hi

    def observe(self, counts_by_rank):
        world = len(counts_by_rank)
        self.rebalance(counts_by_rank, world)
        super().observe(counts_by_rank)

    def rebalance(self, counts_by_rank, world):
        """docs/method-spec.md 4.9, applied to the layout of the step just completed (step
        self.t), giving the layout of the next step."""
        k_prev = sum(counts_by_rank)
        load = [0] * world
        for i, c in enumerate(counts_by_rank):  # in step t rank i handled partition (t + i) mod P
            load[(self.t + i) % world] = c
        k_avg = k_prev // world
        if k_avg == 0:
            return
        k_move = (self.sz * k_prev) // self.n
        min_blk = self.BLOCKS / (4 * world)
        for i in range(world - 1):
            r0, r1 = load[i] / k_avg, load[i + 1] / k_avg
            if r0 > 1.05 and r1 < 0.95238:
                if self.cnt[i] - 1 < min_blk:
                    continue
                self.cnt[i] -= 1
                self.cnt[i + 1] += 1
                self.pos[i + 1] -= 1
                load[i] -= k_move
                load[i + 1] += k_move
            elif r0 < 0.95238 and r1 > 1.05:
                if self.cnt[i + 1] - 1 < min_blk:
                    continue
                self.cnt[i + 1] -= 1
                self.cnt[i] += 1
                self.pos[i + 1] += 1
                load[i] += k_move
                load[i + 1] -= k_move


# ----------------------------------------------------------------------------------------------
# §4.10 SIDCo

TINY = 2.0**-52
CPU_BLOCK = 1 << 15  # elements per block of the core's CPU passes
SAMPLE_BLOCKS = 16  # the default mode's later statistics read at least this many blocks


def block_sample(n: int) -> torch.Tensor:
    """The positions the default mode's later statistics read (§4.10 ruling): the blocks of
    CPU_BLOCK elements numbered 0, e, 2e, ... with e = max(1, blocks // SAMPLE_BLOCKS)."""
    every = max(1, -(-n // CPU_BLOCK) // SAMPLE_BLOCKS)
    return (torch.arange(n) // CPU_BLOCK) % every == 0


def gpareto_eta(mu: float, var: float, ratio: float) -> float:
    """§4.10 gpareto threshold from mean μ and unbiased variance for the exceedance ratio."""
    if not (var > 0):  # not positive or not a number
        return mu
    r2 = mu * mu / var
    kappa = (r2 - 1) / 2
    sigma = mu * (r2 + 1) / 2
    if abs(kappa) < 1e-12:
        return -sigma * math.log(ratio)
    return sigma * (1 - ratio**kappa) / kappa


class SIDCo(Estimating):
    def __init__(
        self,
        density: float,
        fit: str = "exp",
        stages: int = 1,
        first_ratio: float = 0.25,
        iratio: float | None = None,
        exchange: str = "gather",
        reference: bool = False,
    ) -> None:
        super().__init__(reference)
        assert fit in ("exp", "gpareto", "gamma_gpareto")
        self.density, self.fit, self.stages, self.first_ratio = density, fit, stages, first_ratio
        self.exchange = exchange
        self.iratio = iratio if iratio is not None else (0.2 if fit == "exp" else 0.075)
        # adaptive stages (stages < 0)
        self.m = 1 if stages < 0 else stages
        self.sum = 0.0
        self.calls = 0
        self.direction = 1
        self.e_prev = 0.0
        self.last_count = 0

    def first_stage(self, x: torch.Tensor, ratio: float, held: torch.Tensor) -> float:
        mu = mean64(x)
        if self.fit == "exp":
            return -mu * math.log(ratio)
        if self.fit == "gpareto":
            return gpareto_eta(mu, var64(x), ratio)
        big_l = math.log(mu) - mean64(torch.log(x[held] + TINY)) if mu > 0 else NAN
        if not (math.isfinite(big_l) and big_l > 0):
            return mu
        a = (3 - big_l + math.sqrt((big_l - 3) ** 2 + 24 * big_l)) / (12 * big_l)
        b = mu / a
        return b * float(gammaincinv(a, 1 - ratio))

    def later_stage(self, y: torch.Tensor, ratio: float) -> float:
        m = float(y.min())
        if self.fit == "exp":
            return m - (mean64(y) - m) * math.log(ratio)
        return m + gpareto_eta(mean64(y) - m, var64(y), ratio)

    def choose(self, v, rank, world):
        norm = norm64(v)
        if norm == 0:
            return torch.zeros(0, dtype=torch.int64), NAN  # a zero vector selects nothing (no τ exists)
        inv = 1 / norm
        mags = v.double().abs()
        x = mags * inv
        # the sample that the stages after the moments read (the whole vector for the reference)
        held = torch.ones_like(v, dtype=torch.bool) if self.reference else block_sample(v.numel())
        big_m, fr, delta = self.m, self.first_ratio, self.density
        first = delta if (big_m == 1 or delta >= fr) else fr
        eta = self.first_stage(x, first, held)
        etas = [eta]
        loops, ratios = 0, []
        if big_m > 1:
            loops = big_m - 1
            ratios = [(delta / fr) ** (1 / (big_m - 1))] * loops
        elif big_m == 0:
            rho = self.iratio
            loops = max(0, math.ceil(math.log(delta / fr) / math.log(rho)))
            ratios = [rho] * loops
            if loops:
                ratios[-1] = (delta / fr) / rho ** (loops - 1)
        for ratio in ratios:
            tau = max(etas) * norm
            y = mags[above(v, tau) & held] * inv
            if y.numel() == 0:
                break
            eta = self.later_stage(y, ratio)
            etas.append(eta)
        if self.reference:
            tau = eta * norm
            selected = where(above(v, tau))
        else:
            selected, tau = self.steered_fit(v, eta * norm, target(delta, v.numel()))
        self.last_count = selected.numel()
        return selected, tau

    def observe(self, counts_by_rank):
        if self.stages < 0:
            self.adapt(self.last_count, self.last_n)
        super().observe(counts_by_rank)

    def select(self, v, rank, world):
        self.last_n = v.numel()
        self.last_count = 0
        return (yield from super().select(v, rank, world))

    def adapt(self, count: int, n: int) -> None:
        """Adaptive stages (docs/method-spec.md 4.10)."""
        self.sum += ieee_div(count, self.density * n)
        self.calls += 1
        if self.calls < 5:
            return
        e = self.sum / 5
        mode = self.stages
        if mode == -1:
            if e > 1.2:
                self.m -= 1
            elif e < 0.8:
                self.m += 1
        else:
            if mode == -2:
                flip = abs(e - 1) > abs(self.e_prev - 1) and self.e_prev > 0
            else:
                keep = (e > self.e_prev and self.e_prev < 0.8) or (e < self.e_prev and self.e_prev > 1.2)
                flip = not keep and self.e_prev > 0
            if flip:
                self.direction = -self.direction
            if e > 1.2:
                self.m -= self.direction
            elif e < 0.8:
                self.m += self.direction
            self.e_prev = e
        self.m = min(max(self.m, 1), math.ceil(math.log(self.density) / math.log(0.5)))
        self.sum = 0.0
        self.calls = 0


# ----------------------------------------------------------------------------------------------
# Driver: all ranks in lockstep, error feedback (§1) and exchanges (§3)


class ReferenceGroup:
    """Runs P ranks' re-statements in lockstep on one bucket."""

    def __init__(self, world: int, methods: Sequence[Restatement]) -> None:
        assert len(methods) == world
        self.world, self.methods = world, list(methods)
        self.residuals: list[torch.Tensor] | None = None
        self.collectives_in_selection = 0

    def select_all(self, values: Sequence[torch.Tensor]) -> list[tuple[torch.Tensor, float]]:
        """Every rank's selection; the all-reduces inside are sums over ranks in rank order."""
        gens = [m.select(v, r, self.world) for r, (m, v) in enumerate(zip(self.methods, values, strict=True))]
        results: list = [None] * self.world
        replies: list = [None] * self.world
        while True:
            contributions = []
            for r, gen in enumerate(gens):
                try:
                    contributions.append(gen.send(replies[r]))
                except StopIteration as stop:
                    results[r] = stop.value
                    contributions.append(None)
            done = [c is None for c in contributions]
            if all(done):
                return results
            assert not any(done), "ranks left the selection at different collectives"
            self.collectives_in_selection += 1
            total = contributions[0].clone()
            for c in contributions[1:]:
                total += c
            replies = [total.clone() for _ in range(self.world)]

    def step(self, grads: Sequence[torch.Tensor]) -> list[dict]:
        """One step: error feedback, selection, exchange, residual update, state commit."""
        world, n = self.world, grads[0].numel()
        if self.residuals is None:
            self.residuals = [torch.zeros(n, dtype=grads[0].dtype) for _ in range(world)]
        # §1 Selection values: a = residual + grad in the dtype; keep the old residual where not finite
        values = []
        for r in range(world):
            a = self.residuals[r] + grads[r]
            self.residuals[r] = torch.where(torch.isfinite(a), a, self.residuals[r])
            values.append(self.residuals[r].clone())
        selections = self.select_all(values)
        kind = self.methods[0].exchange
        out, zeroed = exchange(kind, [s[0] for s in selections], values)
        for r in range(world):
            self.residuals[r][zeroed[r]] = 0
        counts = [s[0].numel() for s in selections]
        for m in self.methods:
            m.observe(counts)
        return [
            {
                "indices": selections[r][0],
                "threshold": selections[r][1],
                "output": out.clone(),
                "residual": self.residuals[r].clone(),
                "counts": counts,
            }
            for r in range(world)
        ]


def exchange(
    kind: str, selections: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """§3: the averaged output and the indices each rank zeroes in its residual."""
    world = len(values)
    n = values[0].numel()
    out = torch.zeros(n, dtype=values[0].dtype)
    if kind == "gather":
        for r in range(world):  # rank order; out[i] += v / P
            idx = selections[r]
            out[idx] += values[r][idx] / world
        return out, list(selections)
    if kind == "reduce_scatter":
        return reduce_scatter_allgather(selections, values)
    if kind == "shared":
        for s in selections[1:]:
            assert torch.equal(s, selections[0]), "shared exchange: ranks selected different indices"
        union = selections[0]
    else:
        assert kind == "union"
        union = torch.unique(torch.cat(list(selections))) if world else torch.zeros(0, dtype=torch.int64)
    total = values[0][union].clone()
    for r in range(1, world):
        total += values[r][union]
    out[union] = total / world
    return out, [union] * world


def reduce_scatter_allgather(
    selections: Sequence[torch.Tensor], values: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Reduce-scatter + all-gather: gather-and-add's average, kept on its global top K (K: the
    largest selection) by whole magnitude bins (the top 10 bits of the float32 magnitude's bits,
    1024 bins); a rank zeroes only its kept pairs (the others stay in its residual)."""
    average, _ = exchange("gather", selections, values)
    support = torch.unique(torch.cat(list(selections)))
    budget = max(s.numel() for s in selections)
    bins = average[support].float().abs().view(torch.int32) >> 21
    histogram = torch.bincount(bins, minlength=1024).tolist()
    first, above = 0, 0
    for b in range(1023, 0, -1):
        above += histogram[b]
        if above >= budget:
            first = b
            break
    kept = support[bins >= first]
    out = torch.zeros_like(average)
    out[kept] = average[kept]
    return out, [s[torch.isin(s, kept)] for s in selections]
