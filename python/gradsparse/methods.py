"""The selection methods of gradsparse: one State class each (docs/methods.md explains them,
docs/method-spec.md pins down every detail). Every class takes its own options plus the options
shared by all states (:class:`gradsparse.State`: ``process_group``, ``warmup_steps``,
``error_feedback``, ``momentum``, ``nonfinite``, ``timeout``, ``reference``, ``transport``).

Example::

    >>> state = gradsparse.MiCRO(density=0.01)
    >>> ddp_model.register_comm_hook(state, gradsparse.hook)
"""

from __future__ import annotations

from typing import Any

from gradsparse.config import (
    INT64_MAX,
    _describe,
    check_int,
    choice_option,
    density_option,
    int_option,
    positive_option,
    ratio_option,
    seed_option,
    threshold_option,
)
from gradsparse.state import State

__all__ = [
    "DGC",
    "METHODS",
    "SAGE",
    "Dense",
    "ExDyna",
    "GaussianK",
    "MiCRO",
    "RandomBlock",
    "RandomK",
    "RedSync",
    "SIDCo",
    "SparDL",
    "Threshold",
    "TopK",
    "core_method",
]

_DENSITY = density_option(
    "fraction of each bucket's elements to send, in (0, 1]; k = floor(density * n), at least 1 "
    "(docs/method-spec.md ruling 4)"
)
_GLOBAL_DENSITY = density_option(
    "fraction of each bucket's elements to send in all ranks together, in (0, 1] (k = floor(density * n))"
)
_EXCHANGE = choice_option(
    "exchange",
    "gather",
    ("gather", "reduce_scatter", "auto"),
    '"gather" (gather-and-add: every rank receives every rank\'s pairs, so the bytes grow with the '
    'world size), "reduce_scatter" (reduce-scatter + all-gather: about 2 k pairs per rank at any world '
    "size; the owners keep the global top k of the average and the rest returns to the residuals) or "
    '"auto" (per bucket, the faster of the two as timed on the training\'s own steps: they alternate on the '
    "six sparse steps after the first, then every rank keeps the one with the lower mean time; until then "
    "the one gradsparse.simulate's alpha-beta model finds faster on the link measured at set-up; "
    "gradsparse.exchange_trial)",
)
_PARTITION_EXCHANGE = choice_option(
    "exchange",
    "union",
    ("union", "gather"),
    '"union" (the original\'s: every rank\'s own values on the union, all-reduced) or "gather" (owners '
    "send their pairs: fewer bytes, no value all-reduce, but training far slower: docs/methods.md)",
)


def _check_tail_density(owner: str, density: float, parts: int, quantile: str) -> None:
    """A fit whose threshold is the quantile 1 - density / ``parts`` needs it below 1; in float64
    it is 1 from density 2**-53 * parts down, where the C++ fit failed at the first backward
    ("p must be in (0, 1), got 1") naming no option."""
    if not 1.0 - density / parts < 1.0:
        raise ValueError(
            f"{owner}: density must be above {2.0**-54 * parts:.3g} (2**-{54 - parts.bit_length() + 1}), got "
            f"{density!r}: {quantile} is 1 in float64 there; k = floor(density * n) is at least 1 anyway, so "
            "density=1e-15 selects as few (1 element of any bucket below 10**15 elements)"
        )


class Dense(State):
    """Dense all-reduce through the gradsparse engine: the baseline, with the same statistics as
    the sparse methods."""


class TopK(State):
    """Top-k: each rank sends the ``density`` fraction of each bucket with the largest magnitudes
    (after error feedback); ties go to the lowest index. Exchange: fixed-size gather, or
    reduce-scatter + all-gather (``exchange``)."""

    OPTIONS = (_DENSITY, _EXCHANGE)
    _CORE = "TopK"


class Threshold(State):
    """Hard threshold: each rank sends every element with |value| >= threshold (after error
    feedback), compared in the bucket's dtype. Exchange: gather-and-add, or reduce-scatter +
    all-gather (``exchange``). Give exactly one of
    ``threshold`` and ``density``."""

    OPTIONS = (
        threshold_option("the magnitude threshold", default=None),
        density_option(
            "instead of a threshold, use the kljp initial threshold 1 / (2 sqrt(k)) with "
            "k = floor(density * n) per bucket",
            default=None,
        ),
        _EXCHANGE,
    )
    _CORE = "Threshold"

    def _check_options(self, config: dict[str, Any]) -> None:
        if (config["threshold"] is None) == (config["density"] is None):
            raise ValueError(
                "Threshold: give exactly one of threshold (for example threshold=1e-3) and density "
                "(for example density=0.01, which uses threshold 1/(2 sqrt(k)) per bucket)"
            )


class RandomK(State):
    """Random-k: every rank sends the same k = floor(density * n) random elements, drawn from a
    stream seeded by ``seed`` and the step, so no indices need to be exchanged: the values are
    all-reduced (exchange "shared indices")."""

    OPTIONS = (_DENSITY, seed_option())
    _CORE = "RandomK"


class RandomBlock(State):
    """Random-block: every rank sends the same k = floor(density * n) contiguous elements,
    starting at a position drawn from a stream seeded by ``seed`` and the step (wrapping past the
    end of the bucket): no indices to exchange, the values are all-reduced (exchange "shared
    indices"), and each rank reads one contiguous range."""

    OPTIONS = (_DENSITY, seed_option())
    _CORE = "RandomBlock"


class GaussianK(State):
    """Gaussian-k: a threshold from a normal fit of the values. Default mode: the fit's threshold
    steered to k elements by the density control (docs/methods.md); ``reference=True``: the
    variant's own rescalings towards k. Exchange: gather-and-add, or reduce-scatter + all-gather
    (``exchange``)."""

    OPTIONS = (
        _DENSITY,
        choice_option(
            "variant",
            "spardl",
            ("spardl", "sidco"),
            '"spardl" (SparDL\'s compressor: signed values, up to 20 rescalings by 1.02) or "sidco" '
            "(SIDCo's gaussianksgd: normalised magnitudes, up to 3 evaluations rescaled by 0.5 or 1.5)",
        ),
        _EXCHANGE,
    )
    _CORE = "GaussianK"
    _CORE_EXTRAS = ("reference",)

    def _check_options(self, config: dict[str, Any]) -> None:
        _check_tail_density("GaussianK", config["density"], 2, "its normal fit's quantile 1 - density / 2")


class DGC(State):
    """DGC's sampled threshold (SIDCo's dgcsampling): the top-density quantile of a 1% random
    sample. Default mode: steered to k elements by the density control; ``reference=True``:
    exceedances beyond 4k/3 are trimmed to the exact top k. Exchange: gather-and-add, or
    reduce-scatter + all-gather (``exchange``)."""

    OPTIONS = (
        density_option(
            "fraction of each bucket's elements to send, in (0, 1]; k = ceil(density * n) (SIDCo's "
            "dgcsampling; docs/method-spec.md 4.5)"
        ),
        seed_option(),
        _EXCHANGE,
    )
    _CORE = "DGC"
    _CORE_EXTRAS = ("reference",)


class RedSync(State):
    """RedSync: a threshold between the mean and the maximum magnitude. Default mode: the
    midpoint steered to k elements by the density control; ``reference=True``: RedSync's
    bisection, at most three evaluations. Exchange: gather-and-add, or reduce-scatter + all-gather
    (``exchange``)."""

    OPTIONS = (_DENSITY, _EXCHANGE)
    _CORE = "RedSync"
    _CORE_EXTRAS = ("reference",)


class SAGE(State):
    """SAGE: the threshold follows the gradient's scale, measured on a small random sample
    (Slovin's size). Default mode: the sampled scale predicts the threshold and the exact top k is
    taken inside a band around it; ``reference=True``: SAGE's own α β γ ratio scaling. Exchange:
    union + all-reduce for flat sampling, gather-and-add for per_tensor (``exchange`` overrides)."""

    OPTIONS = (
        _DENSITY,
        choice_option(
            "sampling",
            "flat",
            ("flat", "per_tensor"),
            '"flat" samples the bucket uniformly, "per_tensor" picks a parameter first (the kljp/sage variant)',
        ),
        positive_option(
            "initial_threshold",
            None,
            "initial_threshold=4.73e-3",
            "the first step's threshold (None: 1 / (2 sqrt(k)))",
        ),
        choice_option(
            "exchange",
            None,
            ("union", "gather", "reduce_scatter", "auto"),
            "None: union for flat sampling, gather for per_tensor; reduce_scatter and auto as for TopK",
        ),
        seed_option(),
    )
    _CORE = "SAGE"
    _CORE_EXTRAS = ("segments", "reference")


class _Partitioned(State):
    OPTIONS = (_GLOBAL_DENSITY, _PARTITION_EXCHANGE, seed_option())
    _CORE_EXTRAS = ("reference",)
    _GLOBAL_TARGET = True


class MiCRO(_Partitioned):
    """MiCRO: each rank selects only inside its own partition of each bucket (static, contiguous,
    rotating every step), with one threshold for all ranks. Default mode: the ranks agree on the
    threshold every step so the total hits k = floor(density * n); ``reference=True``: the
    original 1.005 / 1.00125 / 0.995 scaling and the dummy element."""

    _CORE = "MiCRO"


class ExDyna(_Partitioned):
    """ExDyna: MiCRO with 1024-block partitions that are rebalanced every step so that each
    partition holds about the same number of selected elements (lower load imbalance when the
    large gradients sit in a few layers). Same options and modes as :class:`MiCRO`."""

    _CORE = "ExDyna"


class SIDCo(State):
    """SIDCo: thresholds from statistical fits of the normalised magnitudes, refined over stages.
    Default mode: the last stage's threshold steered to k elements by the density control, and
    from about 1M elements on the later stages' statistics taken on a sample of the bucket's
    blocks (docs/method-spec.md 4.10); ``reference=True``: the fits' threshold as it is, every
    statistic over the whole bucket. Exchange: gather-and-add, or reduce-scatter + all-gather
    (``exchange``)."""

    OPTIONS = (
        _DENSITY,
        choice_option(
            "fit",
            "exp",
            ("exp", "gpareto", "gamma_gpareto"),
            '"exp" (SIDCo-E), "gpareto" (SIDCo-P) or "gamma_gpareto" (SIDCo-GP)',
        ),
        int_option(
            "stages",
            -1,
            -3,
            "stages=-1 (adaptive) or a stage count >= 1",
            "-1, -2, -3: the adaptive modes, which start with one stage and change the number of "
            "stages every 5 steps from the achieved density; >= 1: a fixed number of stages (1 is the "
            "original scripts' default, which sends far fewer elements than asked on real gradients: "
            "docs/methods.md); 0: a fixed per-stage ratio iratio",
        ),
        ratio_option("first_ratio", 0.25, "first_ratio=0.25", "the first stage's target when several stages are used"),
        ratio_option("iratio", None, "iratio=0.2", "per-stage ratio for stages=0 (None: 0.2 for exp, 0.075 otherwise)"),
        _EXCHANGE,
    )
    _CORE = "SIDCo"
    _CORE_EXTRAS = ("reference",)

    def _check_options(self, config: dict[str, Any]) -> None:
        if config["fit"] == "gamma_gpareto":  # its first stage's ratio is the density (or the larger first_ratio)
            _check_tail_density("SIDCo", config["density"], 1, 'fit="gamma_gpareto"\'s gamma quantile 1 - density')
        if config["iratio"] is not None and config["stages"] != 0:
            raise ValueError(
                f"SIDCo: iratio={config['iratio']!r} is the per-stage ratio of stages=0 only, but stages="
                f"{config['stages']!r}, which would ignore it; give stages=0 with it, or drop iratio"
            )


class SparDL(State):
    """SparDL: a sparse all-reduce in which selection is part of the communication. Each bucket
    is cut into one block per rank; a non-recursive Spar-Reduce-Scatter (P - 1 steps, any P)
    forwards the top k of each block, accumulated with what arrived for it, so every rank's own
    block ends with everybody's contribution; the final lists are all-gathered. With ``teams`` d >
    1, the ranks form d teams that reduce separately and exchange their top h lists (Spar-All-Gather,
    h adapted every step). Residuals keep what was accumulated but not sent on (global residual
    collection), so no gradient mass is lost."""

    OPTIONS = (
        density_option("k = floor(density * chunk) per block, chunk = ceil(n / (P / teams)), in (0, 1]"),
        int_option("teams", 1, 1, "teams=1", "number of teams d; the world size must be a multiple of it"),
    )
    _CORE = "SparDL"
    _GLOBAL_TARGET = True

    def _check_world_size(self, world_size: int) -> None:
        teams = self._method_config["teams"]
        if world_size % teams:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"SparDL: teams={teams} does not divide the world size {world_size}; the ranks form teams of equal "
                f"size: choose teams among {', '.join(map(str, divisors))}"
            )


#: Selection methods by name (the same names as in the docs and the examples' --method flag).
METHODS: dict[str, type[State]] = {
    "dense": Dense,
    "topk": TopK,
    "threshold": Threshold,
    "randomk": RandomK,
    "randomblock": RandomBlock,
    "gaussiank": GaussianK,
    "dgc": DGC,
    "redsync": RedSync,
    "sage": SAGE,
    "micro": MiCRO,
    "exdyna": ExDyna,
    "sidco": SIDCo,
    "spardl": SparDL,
}


def core_method(name: str, numels: list[int] | tuple[int, ...] = (), **options: Any):
    """The C++ method object of method ``name`` (a ``METHODS`` key such as ``"micro"``, or its
    class name) for one bucket of parameters holding ``numels`` elements, built from ``options``
    exactly as a state builds it: validated, with the defaults of the method's declaration. For
    driving methods without DDP (``gradsparse.testing.thread_ranks``, tests, benchmarks)."""
    names = ", ".join(m for m in METHODS if m != "dense")
    if not isinstance(name, str):  # a list was looked up in the dicts: "unhashable type: 'list'"
        raise TypeError(
            f"core_method: name must be a method's name (a str), got {_describe(name)}; choose from {names}"
        )
    cls = METHODS.get(name) or {c.__name__: c for c in METHODS.values()}.get(name)
    if cls is None or cls is Dense:
        raise ValueError(f"core_method: name must be a sparse method, got {name!r}; choose from {names}")
    example = "numels=[1000] for one parameter of 1000 elements"
    if not isinstance(numels, (list, tuple)):
        raise TypeError(
            f"core_method: numels must be a list of the bucket's parameters' element counts, got {_describe(numels)}; "
            f"for example {example}"
        )
    # Checked here as the states' buckets are (ints >= 0): a float, or a count past int64_t, reached
    # the C++ constructor as pybind11's list of signatures, and True counted as 1 element.
    counts = [check_int("core_method", f"numels[{i}]", n, 0, example, INT64_MAX) for i, n in enumerate(numels)]
    return cls(**options)._make_method(counts)
