"""Every selection method of the library side by side with its plain re-statement
(tests/python/restatements.py, written from docs/method-spec.md only).

For every method and option set, on a drifting stream of gradients and on world sizes 1 to 4,
every step and every rank must agree exactly: the selected index set, the reported threshold
(1e-6 relative; NaN where the method reports none), the averaged output, the residual; the
library must conserve gradient mass (spec §3) and run the same number of collectives on every
rank. Degenerate inputs (docs/method-spec.md ruling 4) are compared the same way.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
import os

import pytest
import torch

import gradsparse as gs
from gradsparse.methods import core_method
from gradsparse.testing.thread_ranks import run_steps
from tests.python import restatements as rs

EPS32 = torch.finfo(torch.float32).eps


def chosen_worlds(default=(1, 2, 3, 4)) -> list[int]:
    """The world sizes the comparisons run on: ``default``, or those of them that
    GRADSPARSE_TEST_WORLDS names (comma-separated; CI's second torch runs 3)."""
    text = os.environ.get("GRADSPARSE_TEST_WORLDS", "").strip()
    if not text:
        return list(default)
    try:
        chosen = {int(w) for w in text.split(",")}
    except ValueError:
        chosen = set()
    if not chosen or not chosen <= {1, 2, 3, 4}:
        raise ValueError(
            f"GRADSPARSE_TEST_WORLDS={text!r}: name world sizes from 1 to 4, comma-separated "
            "(for example GRADSPARSE_TEST_WORLDS=1,3), or unset it to run all four"
        )
    return [w for w in default if w in chosen]


WORLDS = chosen_worlds()


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """The re-statements' small tensor ops run faster on one ATen thread, and do not compete with
    the thread ranks of the simulation for the cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ----------------------------------------------------------------------------------------------
# Gradient streams


def split_sizes(n: int, parts: int = 5) -> list[int]:
    """Parameter sizes of a bucket: a few tensors of uneven sizes (every one non-empty)."""
    if n == 0:
        return []
    parts = min(parts, n)
    weights = [0.45, 0.02, 0.38, 0.005, 0.145][:parts]
    sizes = [max(1, int(n * w / sum(weights))) for w in weights]
    sizes[0] += n - sum(sizes)
    if sizes[0] < 1:  # tiny n: one element each
        sizes = [1] * n
    return sizes


def unit_values(shape: str, count: int, g: torch.Generator) -> torch.Tensor:
    """Unit-scale values of one of the shapes gradients take: normal, Student-t(3), Laplace, and
    the light-tailed uniform."""
    if shape == "normal":
        return torch.randn(count, generator=g, dtype=torch.float64)
    if shape == "student":
        z = torch.randn(count, generator=g, dtype=torch.float64)
        chi2 = (torch.randn(count, 3, generator=g, dtype=torch.float64) ** 2).sum(1)
        return z / torch.sqrt(chi2 / 3)
    if shape == "uniform":
        return (torch.rand(count, generator=g, dtype=torch.float64) * 2 - 1) * math.sqrt(3)
    u = torch.rand(count, generator=g, dtype=torch.float64).clamp_min(1e-300)
    sign = torch.randint(0, 2, (count,), generator=g, dtype=torch.float64) * 2 - 1
    return -torch.log(u) * sign


SHAPES = ["normal", "student", "laplace"]


@functools.cache
def gradient_stream(
    n: int, steps: int, seed: int, world: int = 4, kind: str = "drift"
) -> tuple[tuple[torch.Tensor, ...], ...]:
    """``grads[t][r]``, float32. The bucket holds a few tensors (``split_sizes``), each with a scale
    that drifts by up to ~10% a step and a shape (normal, Student-t, Laplace) that changes now and
    then; every rank sees a shared component plus its own part; one tensor is frozen (all zero)
    when the bucket has at least 5.

    kind "phases": every 10 steps the whole bucket switches between light-tailed (uniform) and
    heavy-tailed values and its scale jumps by 3x (densities of the statistical estimators swing).
    kind "quantized": values on a grid of 2^-7 (ties, and values exactly at a threshold).
    kind "skewed": the first 5% of the bucket 30x larger (ExDyna's rebalancing moves blocks).
    kind "signs": every value ±2^-7 (all magnitudes equal, as with saturated or sign gradients).
    kind "light": uniform values of one scale everywhere (lighter tails than a normal: the
    Gaussian estimates select too few)."""
    g = torch.Generator().manual_seed(seed)
    sizes = split_sizes(n)
    log_scale = [math.log(10 ** (-3 + 2 * torch.rand(1, generator=g).item())) for _ in sizes]
    shape = [SHAPES[int(torch.randint(0, 3, (1,), generator=g))] for _ in sizes]
    frozen = 3 if len(sizes) >= 5 and kind != "light" else -1
    if kind == "light":
        log_scale = [math.log(1e-2)] * len(sizes)
    position_scale = torch.ones(n, dtype=torch.float64)
    if kind == "skewed":
        position_scale[: int(0.05 * n)] = 30
    out = []
    for t in range(steps):
        for j in range(len(sizes)):
            log_scale[j] += (torch.rand(1, generator=g).item() * 2 - 1) * 0.095
            if torch.rand(1, generator=g).item() < 0.08:
                shape[j] = SHAPES[int(torch.randint(0, 3, (1,), generator=g))]
            if kind == "light":
                log_scale[j] = math.log(1e-2)
        phase, light = 1.0, kind == "light"
        if kind == "phases":
            light = (t // 10) % 2 == 0
            phase = 3.0 ** ((t // 10) % 3 - 1)
        step = []
        common = [unit_values(shape[j], s, g) for j, s in enumerate(sizes)]
        for r in range(world):
            parts = []
            for j, s in enumerate(sizes):
                own_shape = SHAPES[(SHAPES.index(shape[j]) + r) % 3]
                if kind in ("phases", "light"):
                    own_shape = "uniform" if light else "student"
                    common[j] = unit_values(own_shape, s, g) if r == 0 else common[j]
                own = unit_values(own_shape, s, g)
                part = (0.6 * common[j] + (0.5 + 0.25 * r) * own) * math.exp(log_scale[j]) * phase
                parts.append(torch.zeros(s, dtype=torch.float64) if j == frozen else part)
            values = (torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)) * position_scale
            if kind == "quantized":
                values = torch.round(values * 2**7) / 2**7
            if kind == "signs":
                values = torch.sign(values) * 2**-7
            step.append(values.to(torch.float32))
        out.append(tuple(step))
    return tuple(out)


def zero_stream(n: int, steps: int, world: int = 4):
    return tuple(tuple(torch.zeros(n) for _ in range(world)) for _ in range(steps))


def rows_stream(n: int, steps: int, seed: int, world: int = 4, share: float = 0.005):
    """Zeros but at a fixed `share` of the positions (an embedding's rows that a batch touched):
    a 1% sample's top quantiles are often zero there."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randperm(n, generator=g)[: max(1, int(share * n))]

    def grad() -> torch.Tensor:
        out = torch.zeros(n)
        out[rows] = torch.randn(rows.numel(), generator=g) * 1e-2
        return out

    return tuple(tuple(grad() for _ in range(world)) for _ in range(steps))


# ----------------------------------------------------------------------------------------------
# Side-by-side driver


def run_both(name: str, kwargs: dict, grads, world: int):
    """Runs the library and the re-statement on ``grads[t][:world]``. Returns the library's steps and
    method objects, the re-statement's steps and group, and the gradients used."""
    grads = [list(step[:world]) for step in grads]
    options = {k: v for k, v in kwargs.items() if k != "segments"}
    lib_methods = [core_method(name, kwargs.get("segments", ()), **options) for _ in range(world)]
    lib = run_steps(world, lambda r: lib_methods[r], grads)
    group = rs.ReferenceGroup(world, [getattr(rs, name)(**kwargs) for _ in range(world)])
    ref = [group.step(step) for step in grads]
    return lib, lib_methods, ref, group, grads


def describe_difference(a: torch.Tensor, b: torch.Tensor) -> str:
    sa, sb = set(a.tolist()), set(b.tolist())
    return (
        f"library {len(sa)} indices, re-statement {len(sb)}; only library: {sorted(sa - sb)[:8]}, "
        f"only re-statement: {sorted(sb - sa)[:8]}"
    )


def thresholds_agree(got: float, want: float) -> bool:
    """1e-6 relative; NaN only matches NaN, +-inf only the same infinity."""
    if math.isnan(got) or math.isnan(want):
        return math.isnan(got) and math.isnan(want)
    return math.isclose(got, want, rel_tol=1e-6, abs_tol=0.0)


@dataclasses.dataclass
class Outcome:
    """What check_mass needs of one rank's step."""

    output: torch.Tensor
    residual: torch.Tensor


def compare(name: str, kwargs: dict, grads, world: int, *, partitioned: bool = False):
    """Runs both sides and requires agreement at every step on every rank; returns the library's
    method objects and the re-statement's group for further checks of their state.

    Everything but the reported threshold is asserted at once; threshold mismatches are collected
    and asserted after the last step, so that a case whose only difference is the threshold still
    has its selections, outputs, residuals and mass checked at every step."""
    lib, lib_methods, ref, group, grads = run_both(name, kwargs, grads, world)
    reports_threshold = getattr(rs, name).reports_threshold
    threshold_errors: list[str] = []
    old_residuals = [torch.zeros_like(g) for g in grads[0]]
    for t, (lib_step, ref_step) in enumerate(zip(lib, ref, strict=True)):
        where = f"{name}({kwargs}) P={world} step {t}"
        earlier = f" (after threshold mismatches: {threshold_errors[0]})" if threshold_errors else ""
        # the same number of collectives on every rank (ruling 4: nobody waits alone)
        assert len({s.collectives for s in lib_step}) == 1, f"{where}: collectives {[s.collectives for s in lib_step]}"
        counts = ref_step[0]["counts"]
        for r in range(world):
            got, want = lib_step[r], ref_step[r]
            at = f"{where} rank {r}"
            assert torch.equal(got.indices, want["indices"]), (
                f"{at}: {describe_difference(got.indices, want['indices'])}{earlier}"
            )
            want_threshold = want["threshold"] if reports_threshold else math.nan
            if not thresholds_agree(got.threshold, want_threshold):
                threshold_errors.append(f"{at}: threshold {got.threshold!r} != {want_threshold!r}")
            assert got.selected_all == sum(counts), f"{at}: selected_all {got.selected_all} != {sum(counts)}"
            if partitioned:
                # max_r c_r P / sum_r c_r - 1; 0 when nothing was selected (the formula is 0/0 there,
                # docs/methods.md, "Rulings beyond the specification")
                total = sum(counts)
                want_imbalance = max(counts) * world / total - 1 if total else 0.0
                assert math.isclose(got.imbalance, want_imbalance, rel_tol=1e-9, abs_tol=1e-12), (
                    f"{at}: imbalance {got.imbalance} != {want_imbalance}{earlier}"
                )
            # Exact: the gather exchange adds v / P in rank order (spec §3) and the all-reduce of the
            # union and shared exchanges sums in rank order too (docs/methods.md, "Rulings beyond the specification"), all in float32.
            assert torch.equal(got.output, want["output"]), (
                f"{at}: output differs at {torch.nonzero(got.output != want['output']).flatten()[:8].tolist()}{earlier}"
            )
            assert torch.equal(got.residual, want["residual"]), (
                f"{at}: residual differs at "
                f"{torch.nonzero(got.residual != want['residual']).flatten()[:8].tolist()}{earlier}"
            )
        check_mass(lib_step, grads[t], old_residuals, where)
        check_mass([Outcome(s["output"], s["residual"]) for s in ref_step], grads[t], old_residuals, where + " (re)")
        old_residuals = [s.residual for s in lib_step]
    assert not threshold_errors, f"{len(threshold_errors)} threshold mismatches, first: {threshold_errors[0]}"
    return lib_methods, group


def check_mass(step, grads, old_residuals, where: str) -> None:
    """docs/method-spec.md 3 / ruling 6: sum_r residual_r(new) + P out = sum_r (grad_r + residual_r(old)).

    Rounding: a = residual + grad is rounded once to float32 (eps/2 |a|), each value is divided by P
    and summed in float32 (at most P + 1 roundings of at most eps/2 of the partial sums), so the
    difference is below (P + 1) eps sum_r (|grad_r| + |residual_r|) per element; twice that is the
    tolerance, a few float32 ulps of the inputs, in float64."""
    world = len(grads)
    lhs = sum(s.residual.double() for s in step) + world * step[0].output.double()
    rhs = sum(g.double() + e.double() for g, e in zip(grads, old_residuals, strict=True))
    scale = sum(g.double().abs() + e.double().abs() for g, e in zip(grads, old_residuals, strict=True))
    tol = 2 * (world + 1) * EPS32 * scale
    bad = (lhs - rhs).abs() > tol
    assert not bool(bad.any()), f"{where}: mass not conserved at {torch.nonzero(bad).flatten()[:8].tolist()}"
    for s in step[1:]:
        assert torch.equal(s.output, step[0].output), f"{where}: ranks received different outputs"


# ----------------------------------------------------------------------------------------------
# Method configurations

N = 4000  # most methods
N_LARGE = 70_000  # ExDyna: 1024 blocks of 64 elements plus 4464 in the last partition
STEPS = 50
SEED = 20240611


def method_configs(
    n: int, density: float, threshold: float = 0.02, full: bool = True, sidco_stages=(1, 3, 0, -1, -2, -3)
) -> list:
    """(id, class name, kwargs, partitioned): every method, both modes where a method has them;
    ``full`` adds the other option sets."""
    segments = split_sizes(n)
    out = [
        ("topk", "TopK", dict(density=density), False),
        ("threshold-fixed", "Threshold", dict(threshold=threshold), False),
        ("threshold-density", "Threshold", dict(density=density), False),
        ("randomk", "RandomK", dict(density=density), False),
        ("randomblock", "RandomBlock", dict(density=density), False),
    ]
    for ref in (True, False):  # the estimators' original rules, and their default density control
        mode = "-ref" if ref else ""
        out += [
            (f"gaussiank-spardl{mode}", "GaussianK", dict(density=density, variant="spardl", reference=ref), False),
            (f"gaussiank-sidco{mode}", "GaussianK", dict(density=density, variant="sidco", reference=ref), False),
            (f"dgc{mode}", "DGC", dict(density=density, reference=ref), False),
            (f"redsync{mode}", "RedSync", dict(density=density, reference=ref), False),
        ]
    if full:
        out += [
            ("topk-dense", "TopK", dict(density=0.3), False),
            ("randomk-seed-most", "RandomK", dict(density=0.7, seed=12345), False),  # drawn as the 30% left out
            ("randomblock-wraps", "RandomBlock", dict(density=0.7, seed=5), False),  # most starts wrap
            ("dgc-seed", "DGC", dict(density=0.05, seed=99), False),
            # reduce-scatter + all-gather: the owners keep the global top K of the average
            ("topk-reduce-scatter", "TopK", dict(density=density, exchange="reduce_scatter"), False),
            ("threshold-reduce-scatter", "Threshold", dict(density=density, exchange="reduce_scatter"), False),
            ("dgc-reduce-scatter", "DGC", dict(density=density, exchange="reduce_scatter"), False),
            ("redsync-reduce-scatter", "RedSync", dict(density=density, exchange="reduce_scatter"), False),
            ("gaussiank-reduce-scatter", "GaussianK", dict(density=density, exchange="reduce_scatter"), False),
            ("sidco-reduce-scatter", "SIDCo", dict(density=density, stages=-1, exchange="reduce_scatter"), False),
            ("sage-reduce-scatter", "SAGE", dict(density=density, exchange="reduce_scatter"), False),
        ]
    for ref in (True, False):
        mode = "ref" if ref else "default"
        out.append((f"sage-flat-{mode}", "SAGE", dict(density=density, reference=ref), False))
        if n > 0:
            per_tensor = dict(density=density, sampling="per_tensor", segments=segments, reference=ref)
            out.append((f"sage-per_tensor-{mode}", "SAGE", per_tensor, False))
        if full:
            options = dict(seed=7, initial_threshold=0.01, exchange="gather")
            out.append((f"sage-flat-{mode}-options", "SAGE", dict(density=0.02, reference=ref, **options), False))
            union = dict(density=density, sampling="per_tensor", segments=segments, reference=ref, exchange="union")
            out.append((f"sage-per_tensor-{mode}-union", "SAGE", union, False))
            out.append((f"micro-seed-{mode}", "MiCRO", dict(density=density / 2, reference=ref, seed=3), True))
        for exchange in ("union", "gather"):
            kwargs = dict(density=density, exchange=exchange, reference=ref)
            out.append((f"micro-{exchange}-{mode}", "MiCRO", kwargs, True))
            out.append((f"exdyna-{exchange}-{mode}", "ExDyna", kwargs, True))
    for fit in ("exp", "gpareto", "gamma_gpareto"):
        for stages in sidco_stages:
            kwargs = dict(density=density, fit=fit, stages=stages, reference=True)
            out.append((f"sidco-{fit}-stages{stages}-ref", "SIDCo", kwargs, False))
            if stages in (1, 3, -1):  # the default mode's control after the stages
                kwargs = dict(density=density, fit=fit, stages=stages)
                out.append((f"sidco-{fit}-stages{stages}", "SIDCo", kwargs, False))
    if full:
        out += [
            (
                "sidco-exp-options",
                "SIDCo",
                dict(density=density, fit="exp", stages=0, first_ratio=0.1, iratio=0.3, reference=True),
                False,
            ),
            # δ >= first_ratio: the later stages lower the threshold, so max(η_1, ...) is not the last η
            ("sidco-gpareto-dense", "SIDCo", dict(density=0.3, fit="gpareto", stages=3, reference=True), False),
            ("sidco-exp-dense", "SIDCo", dict(density=0.3, fit="exp", stages=4, reference=True), False),
            (
                "sidco-gamma-options",
                "SIDCo",
                dict(density=0.002, fit="gamma_gpareto", stages=-2, first_ratio=0.4, reference=True),
                False,
            ),
        ]
    return out


# (id prefix, n, steps, seed, stream kind, density, which methods, SIDCo's stages)
STATISTICAL = {"GaussianK", "DGC", "RedSync", "SIDCo"}
ALL_STAGES = (1, 3, 0, -1, -2, -3)
STREAMS = [
    ("drift", N, STEPS, SEED, "drift", 0.01, None, ALL_STAGES),
    ("drift", N_LARGE, STEPS, SEED, "drift", 0.01, {"ExDyna"}, ()),
    # the statistical estimators and the controllers on swinging shapes and scales
    ("phases", N, STEPS, SEED + 1, "phases", 0.01, STATISTICAL | {"SAGE", "MiCRO"}, ALL_STAGES),
    # light tails: the Gaussian estimates start below their target
    ("light", N, 30, SEED + 3, "light", 0.05, STATISTICAL, (1, 0)),
]


def main_cases() -> list:
    out = []
    for prefix, n, steps, seed, kind, density, names, stages in STREAMS:
        configs = method_configs(n, density, full=prefix == "drift", sidco_stages=stages)
        for method_id, name, kwargs, partitioned in configs:
            if names is None and name == "ExDyna":
                continue  # ExDyna's blocks are trivial below 32768 elements: the large stream
            if names is None or name in names:
                out.append((f"{prefix}-{method_id}", name, kwargs, partitioned, (n, steps, seed, kind)))
    return out


def params(cases, worlds=WORLDS):
    return [pytest.param(case, world, id=f"{case[0]}-P{world}") for case in cases for world in worlds]


@pytest.mark.parametrize(("case", "world"), params(main_cases()))
def test_method_matches_restatement(case, world):
    _, name, kwargs, partitioned, (n, steps, seed, kind) = case
    compare(name, kwargs, gradient_stream(n, steps, seed, kind=kind), world, partitioned=partitioned)


@pytest.mark.parametrize(("world", "steps"), [(3, 275), (4, 210)])
def test_exdyna_rebalancing_reaches_the_minimum_partition(world, steps):
    """A bucket whose first 5% is 30x larger, for long enough that ExDyna moves a block out of the
    overloaded partition at every step until the guard cnt - 1 < 1024 / (4P) stops it: P = 3 at 86
    blocks (min_blk = 85.33 is a real number), P = 4 at 64 (cnt - 1 = 63 < 64); then it holds."""
    kwargs = dict(density=0.01, exchange="union")
    grads = gradient_stream(32 * 1024, steps, SEED + 2, kind="skewed")
    lib_methods, group = compare("ExDyna", kwargs, grads, world, partitioned=True)
    want = group.methods[0].cnt
    assert min(want) == {3: 86, 4: 64}[world], want  # the stream drives the layout to the guard
    got = [int(lib_methods[0].state()[f"blocks.{p}"]) for p in range(world)]
    assert got == want


# ----------------------------------------------------------------------------------------------
# Momentum correction (docs/method-spec.md section 1), fused into every method's first pass


MOMENTUM = 0.9
MOMENTUM_STEPS = 12


def momentum_cases() -> list:
    """Every method and mode (SIDCo's fits with one and with adaptive stages), ExDyna on the large
    bucket, and SparDL."""
    out = []
    for method_id, name, kwargs, _ in method_configs(N, 0.01, sidco_stages=(1, -1)):
        n = N_LARGE if name == "ExDyna" else N
        out.append((method_id, name, kwargs, n))
    out.append(("spardl", "SparDL", dict(density=0.01), N))
    return out


HALF_MOMENTUM_CASES = {"topk", "dgc", "sage-flat-default", "micro-gather-default"}


@pytest.mark.parametrize(
    ("case", "world", "dtype"),
    [pytest.param(c, w, torch.float32, id=f"{c[0]}-P{w}") for c in momentum_cases() for w in chosen_worlds((2, 3))]
    + [
        pytest.param(c, w, dtype, id=f"{c[0]}-P{w}-{str(dtype)[6:]}")
        for c in momentum_cases()
        if c[0] in HALF_MOMENTUM_CASES
        for w in chosen_worlds((2,))
        for dtype in (torch.float16, torch.bfloat16)
    ],
)
def test_momentum_correction_in_the_first_pass_equals_a_pass_of_its_own(case, world, dtype):
    """Each rank's velocity u = 0.9 (emptied ? 0 : u) + g, emptied where the previous step left the
    residual at zero, then the method on u: the library fuses the velocity into its first pass;
    the same method handed u, computed here with torch's operations (in float32, then rounded once
    to the bucket's dtype), must agree at every step and rank to the bit (selection, threshold,
    output, residual, velocity)."""
    method_id, name, kwargs, n = case
    grads = [[g.to(dtype) for g in step[:world]] for step in gradient_stream(n, MOMENTUM_STEPS, SEED + 5)]
    options = {k: v for k, v in kwargs.items() if k != "segments"}

    def make(_rank):
        return core_method(name, kwargs.get("segments", ()), **options)

    fused = run_steps(world, make, grads, momentum=MOMENTUM)
    velocities = [[torch.zeros(n, dtype=dtype) for _ in range(world)]]  # velocities[t + 1][r]: after step t

    def corrected(t, r, grad, residual):
        if r == 0:
            velocities.append(list(velocities[-1]))
        emptied = residual == 0 if t > 0 else torch.zeros(n, dtype=torch.bool)
        u = (torch.where(emptied, 0.0, velocities[t][r].float()) * MOMENTUM + grad.float()).to(dtype)
        velocities[t + 1][r] = torch.where(torch.isfinite(u), u, velocities[t][r])
        return u

    separate = run_steps(world, make, grads, before_step=corrected)
    for t, (got_step, want_step) in enumerate(zip(fused, separate, strict=True)):
        masked = sum(int((s.residual == 0).sum()) for s in want_step)
        assert t == 0 or masked > 0, f"{method_id} step {t}: no residual emptied, the masking is not exercised"
        for r, (got, want) in enumerate(zip(got_step, want_step, strict=True)):
            at = f"{method_id} P={world} step {t} rank {r}"
            assert torch.equal(got.indices, want.indices), f"{at}: {describe_difference(got.indices, want.indices)}"
            assert thresholds_agree(got.threshold, want.threshold), f"{at}: {got.threshold} != {want.threshold}"
            for what in ("output", "residual"):
                a, b = getattr(got, what), getattr(want, what)
                assert torch.equal(a, b), f"{at}: {what} differs at {torch.nonzero(a != b).flatten()[:8].tolist()}"
            assert torch.equal(got.velocity, velocities[t + 1][r]), f"{at}: velocity differs"


# ----------------------------------------------------------------------------------------------
# Degenerate inputs (docs/method-spec.md ruling 4) and awkward values


EDGE_STEPS = 8
EDGE_INPUTS = {
    # name: (n, density, stream)
    "n0": (0, 0.01, lambda n: gradient_stream(n, EDGE_STEPS, 11)),
    "n1": (1, 0.01, lambda n: gradient_stream(n, EDGE_STEPS, 12)),
    "n2": (2, 0.01, lambda n: gradient_stream(n, EDGE_STEPS, 13)),  # n < P for P = 3, 4
    "n3": (3, 0.5, lambda n: gradient_stream(n, EDGE_STEPS, 14)),  # n < P for P = 4
    "zeros": (1000, 0.01, lambda n: zero_stream(n, EDGE_STEPS)),
    # ten all-zero steps (two windows of SIDCo's adaptive stages), then gradients
    "zeros-then-grads": (1000, 0.01, lambda n: zero_stream(n, 10) + gradient_stream(n, 6, 18)),
    "embedding-rows": (20_000, 0.01, lambda n: rows_stream(n, EDGE_STEPS, 21)),  # zero sample quantiles
    "tiny-density": (3000, 1e-5, lambda n: gradient_stream(n, EDGE_STEPS, 15)),  # floor(δ n) = 0
    # ties at every selection boundary, values exactly at the fixed threshold 2^-5
    "quantized": (3000, 0.01, lambda n: gradient_stream(n, 12, 19, kind="quantized")),
    "equal-magnitudes": (3000, 0.01, lambda n: gradient_stream(n, EDGE_STEPS, 20, kind="signs")),
    "small-exdyna": (20_000, 0.01, lambda n: gradient_stream(n, EDGE_STEPS, 16)),  # n < 32 * 1024
    "just-below-blocks": (32_767, 0.01, lambda n: gradient_stream(n, EDGE_STEPS, 17)),
}


def edge_cases() -> list:
    out = []
    for input_name, (n, density, _) in EDGE_INPUTS.items():
        methods = method_configs(n, density, threshold=2**-5, full=False, sidco_stages=(1, 3, 0, -3))
        if input_name in ("small-exdyna", "just-below-blocks"):
            methods = [m for m in methods if m[1] == "ExDyna"]
        for method_id, name, kwargs, partitioned in methods:
            out.append((f"{input_name}-{method_id}", input_name, name, kwargs, partitioned))
    return out


@pytest.mark.parametrize(("case", "world"), params(edge_cases()))
def test_degenerate_input_matches_restatement(case, world):
    _, input_name, name, kwargs, partitioned = case
    n, _, make = EDGE_INPUTS[input_name]
    compare(name, kwargs, make(n), world, partitioned=partitioned)


def tied_stream(n: int, steps: int, world: int) -> list:
    """Each rank's gradient at each step: small random values, and three elements of magnitude 1
    exactly tied (a loss that is a plain sum gives identical gradients), which error feedback
    keeps tied and the largest."""
    g = torch.Generator().manual_seed(SEED + 9)
    out = []
    for _ in range(steps):
        step = []
        for _ in range(world):
            grad = torch.randn(n, generator=g) * 0.01
            grad[[0, n // 2, n - 1]] = 1.0
            step.append(grad)
        out.append(step)
    return out


@pytest.mark.parametrize(("n", "density"), [(10, 0.1), (1000, 0.001)])
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("GaussianK", {}), ("GaussianK", {"variant": "sidco"}), ("RedSync", {}), ("SIDCo", {"stages": -1}), ("DGC", {})],
)
def test_density_control_sends_tied_largest_magnitudes(name, kwargs, n, density):
    """k = 1, the three largest magnitudes tied: every count the density control (ruling 9) asks
    is 0 or at least 3, and it chose 0, nearer k, at every step: the bucket sent nothing for 30
    steps and its parameters stopped training. It sends the group at every step, k overshot by its
    ties; the restatement agrees."""
    kwargs = dict(density=density, **kwargs)
    grads = tied_stream(n, 30, 2)
    compare(name, kwargs, grads, 2)
    steps = run_steps(1, lambda r: core_method(name, **kwargs), [step[:1] for step in grads])
    sent = [step[0].indices.numel() for step in steps]
    # DGC's estimate at n = 10, the largest of a sample of one element, jumps between the group
    # and the rest: a step may start too far above the data to reach it in its counts.
    assert all(count == 0 or count >= 3 for count in sent), f"{name}({kwargs}): elements sent: {sent}"
    if name == "DGC" and n == 10:
        assert all(max(pair) >= 3 for pair in itertools.pairwise(sent)), f"{name}({kwargs}): elements sent: {sent}"
    else:
        assert min(sent) >= 3, f"{name}({kwargs}): elements sent at each step: {sent}"


@pytest.mark.parametrize(("reference", "sent"), [(True, 0), (False, 1000)])
@pytest.mark.parametrize(
    ("name", "kwargs"),
    [("DGC", {}), ("RedSync", {})]
    + [("SIDCo", {"fit": fit, "stages": -1}) for fit in ("exp", "gpareto", "gamma_gpareto")],
)
def test_reference_modes_send_nothing_where_every_magnitude_ties(name, kwargs, reference, sent):
    """A constant gradient (docs/methods.md, "Modes"): the originals' strict |v| > τ against a
    threshold at or above every value sends nothing at any step, the residual holding all of it;
    the default mode sends the whole bucket. The restatement agrees in both modes."""
    grads = [[torch.full((1000,), 2**-7)] * 2 for _ in range(6)]
    kwargs = dict(density=0.01, reference=reference, **kwargs)
    compare(name, kwargs, grads, 2)
    steps = run_steps(2, lambda r: core_method(name, **kwargs), grads)
    assert [[s.indices.numel() for s in step] for step in steps] == [[sent] * 2] * len(grads)


def test_sage_reference_threshold_stays_finite_from_a_huge_initial_threshold():
    """The reference mode keeps λ in float32 (method-spec 4.7): from an initial_threshold above
    its largest finite value (3.4e38) λ became Inf at the second step, which no step left: nothing
    was sent for good, and the saved state was refused ("threshold is inf"). λ saturates at the
    largest float32 and falls from there; the state loads."""
    n = 1000
    g = torch.Generator().manual_seed(SEED)
    grads = [[torch.randn(n, generator=g)] for _ in range(4)]
    options = dict(density=0.01, reference=True, initial_threshold=1e300)
    method = core_method("sage", **options)
    steps = run_steps(1, lambda r: method, grads)
    thresholds = [step[0].threshold for step in steps]
    assert all(math.isfinite(t) for t in thresholds), thresholds
    assert max(thresholds[1:]) <= torch.finfo(torch.float32).max, thresholds
    assert thresholds[-1] < thresholds[1], thresholds  # nothing selected: it falls
    core_method("sage", **options).load_state(method.state())
    compare("SAGE", options, grads, 1)


N_SAMPLED = 33 * rs.CPU_BLOCK + 5  # 34 blocks: SIDCo's default mode reads blocks 0, 2, 4, ...


@pytest.mark.parametrize("fit", ["exp", "gpareto", "gamma_gpareto"])
def test_sidco_default_mode_samples_large_buckets(fit):
    """From 32 blocks on, the default mode's later stages (and gamma's mean log) read a sample of
    at least 16 blocks spread over the bucket (rs.block_sample): the restatement reads the same
    blocks, and selections, thresholds, outputs and residuals agree at every step (with the whole
    bucket in the restatement instead, every fit's selection differs at the first step)."""
    grads = gradient_stream(N_SAMPLED, 3, SEED + 6, world=2)
    compare("SIDCo", dict(density=0.01, fit=fit, stages=3), grads, 2)


def test_sidco_adaptive_stages_move_towards_the_density():
    """On normal gradients one exponential stage (the original scripts' default) sends about 1%
    of the elements asked for; the adaptive stages (the default) add stages until the achieved
    density comes close to the target (it then moves between two stage counts). The default
    mode's density control then steers the last stage's threshold to k."""
    density, n, world = 0.01, 20_000, 2
    g = torch.Generator().manual_seed(SEED)
    grads = [[torch.randn(n, generator=g) for _ in range(world)] for _ in range(60)]

    def mean_ratio(**kwargs) -> float:
        steps = run_steps(world, lambda r: core_method("sidco", density=density, **kwargs), grads)
        achieved = [sum(rank.indices.numel() for rank in step) / (world * n) for step in steps[30:]]
        return sum(achieved) / len(achieved) / density

    assert mean_ratio(stages=1, reference=True) < 0.05
    assert 0.6 < mean_ratio(reference=True) < 1.3
    assert abs(mean_ratio(stages=1) - 1) < 0.02
    assert abs(mean_ratio() - 1) < 0.02
    assert inspect.signature(gs.SIDCo).parameters["stages"].default == -1  # the same default for users


# ----------------------------------------------------------------------------------------------
# The re-statements' own building blocks


def test_random_numbers_follow_the_spec_formulas():
    # mix(0) is the first output of splitmix64 seeded with 0 (a published constant).
    assert rs.mix(0) == 0xE220A8397B1DCDAF
    s = rs.stream(0, 2, 5, rs.SHARED_LANE)
    assert s == rs.mix(rs.mix(rs.mix(0 ^ 2) ^ 5) ^ (2**32 - 1))
    assert rs.draw(rs.MASK64, 1) == rs.mix(0)  # wrapping add
    picked = rs.sample_distinct(s, 10, 50)
    assert picked.tolist() == sorted(set(picked.tolist())) and len(picked) == 10
    most = rs.sample_distinct(s, 45, 50)  # drawn as the 5 left out
    assert len(most) == 45 and len(set(most.tolist())) == 45
    assert rs.sample_distinct(s, 60, 50).tolist() == list(range(50))


# ----------------------------------------------------------------------------------------------
# Loss scaling


LOSS_SCALES = (2.0**6, 2.0**10, 2.0**-4, 2.0**-4, 2.0**3, 2.0**12, 1.0)  # a GradScaler's scale, step by step


@pytest.mark.parametrize("case", [pytest.param(c, id=c[0]) for c in momentum_cases()])
def test_a_rescaled_method_selects_what_it_selects_without_loss_scaling(case):
    """Gradients times a loss scale that changes by powers of two from step to step (as a
    GradScaler's does), with the residual and the method moved to each step's scale before it
    (Method.rescale; what State does at a step's first bucket): every step selects the same
    elements as the unscaled run, and its output and residual are the unscaled ones times the
    scale, to the bit, from the first step on (its reported threshold too, to 1e-6 relative as in
    the comparisons with the re-statements: the estimators' are an ulp off). Without the rescale the carried residuals,
    thresholds (MiCRO, ExDyna, SAGE) and fixed magnitudes (Threshold's, the initial threshold
    1/(2 sqrt(k)), MiCRO's and ExDyna's sampling histogram) are off by the factor."""
    method_id, name, kwargs, n = case
    world = 2
    grads = [list(step[:world]) for step in gradient_stream(n, len(LOSS_SCALES), SEED + 9)]
    options = {k: v for k, v in kwargs.items() if k != "segments"}

    def make(_rank):
        return core_method(name, kwargs.get("segments", ()), **options)

    plain = run_steps(world, make, grads)
    methods = [make(r) for r in range(world)]

    def scaled(t, r, grad, residual):
        factor = LOSS_SCALES[t] / LOSS_SCALES[t - 1] if t > 0 else LOSS_SCALES[0]
        if factor != 1.0:
            residual.mul_(factor)
            methods[r].rescale(factor)
        return grad * LOSS_SCALES[t]

    loss_scaled = run_steps(world, lambda r: methods[r], grads, before_step=scaled)
    changed = False
    for t, (want_step, got_step) in enumerate(zip(plain, loss_scaled, strict=True)):
        for r, (want, got) in enumerate(zip(want_step, got_step, strict=True)):
            at = f"{method_id} step {t} (scale {LOSS_SCALES[t]}) rank {r}"
            assert torch.equal(got.indices, want.indices), f"{at}: {describe_difference(got.indices, want.indices)}"
            assert torch.equal(got.output, want.output * LOSS_SCALES[t]), at
            assert torch.equal(got.residual, want.residual * LOSS_SCALES[t]), at
            want_threshold = want.threshold * LOSS_SCALES[t]
            assert thresholds_agree(got.threshold, want_threshold), (
                f"{at}: threshold {got.threshold!r} != {want_threshold!r}"
            )
            changed |= bool(want.output.ne(0).any()) and LOSS_SCALES[t] != 1.0
    assert changed, f"{method_id}: nothing sent at a scale other than 1: the test shows nothing"


@pytest.mark.parametrize("reference", [True, False], ids=["reference", "default"])
def test_sage_from_a_huge_initial_threshold_selects_under_a_loss_scale_what_it_selects_without(reference):
    """SAGE from initial_threshold=1e308 under a GradScaler's scale (2^16, doubled for 200 steps
    now and then). The start times the scale was Inf, which the reference mode's load_state
    refused (as State loads a bucket's state after DDP rebuilds its buckets), and the reference
    mode saturated λ at the largest float32 in scaled units (3.4e38 / 2^16 of the gradient,
    method-spec 4.7), so it reached the gradients and selected about 200 steps before the same
    run without loss scaling. Every threshold stays finite, every saved state loads, and every
    step selects what the run without loss scaling selects."""
    n, steps = 1000, 1700
    g = torch.Generator().manual_seed(SEED)
    grads = [[torch.randn(n, generator=g)] for _ in range(steps)]
    scales = [2.0 ** (16 + t // 200 % 2) for t in range(steps)]
    options = dict(density=0.01, reference=reference, initial_threshold=1e308)
    plain = run_steps(1, lambda r: core_method("sage", **options), grads)
    method = core_method("sage", **options)

    def scaled(t, r, grad, residual):
        core_method("sage", **options).load_state(method.state())
        factor = scales[t] / scales[t - 1] if t > 0 else scales[0]
        if factor != 1.0:
            residual.mul_(factor)
            method.rescale(factor)
        return grad * scales[t]

    loss_scaled = run_steps(1, lambda r: method, grads, before_step=scaled)
    for t, ([want], [got]) in enumerate(zip(plain, loss_scaled, strict=True)):
        at = f"step {t} (scale {scales[t]})"
        assert torch.equal(got.indices, want.indices), f"{at}: {describe_difference(got.indices, want.indices)}"
        assert all(math.isfinite(v) for v in [got.threshold, *got.state.values()]), (
            f"{at}: {got.threshold}, {got.state}"
        )
    assert plain[-1][0].indices.numel() > 0, "nothing selected: the test shows nothing"
