"""The selection methods of gradsparse: one State class each (docs/methods.md explains them,
docs/method-spec.md pins down every detail). Every class takes its own options plus the options
shared by all states (:class:`gradsparse.State`: ``process_group``, ``warmup_steps``,
``error_feedback``, ``nonfinite``, ``timeout``, ``reference``).

Example::

    >>> state = gradsparse.MiCRO(density=0.01)
    >>> ddp_model.register_comm_hook(state, gradsparse.hook)
"""

from __future__ import annotations

from typing import Any

from gradsparse import _C
from gradsparse.config import (
    check_choice,
    check_density,
    check_int,
    check_real,
    check_threshold,
)
from gradsparse.state import State

__all__ = [
    "DGC",
    "SAGE",
    "Dense",
    "ExDyna",
    "GaussianK",
    "MiCRO",
    "RandomK",
    "RedSync",
    "SIDCo",
    "SparDL",
    "Threshold",
    "TopK",
]


def _seed(owner: str, value: object) -> int:
    return check_int(owner, "seed", value, 0, "seed=0")


class Dense(State):
    """Dense all-reduce through the gradsparse engine: the baseline, with the same statistics as
    the sparse methods."""


class TopK(State):
    """Top-k: each rank sends the ``density`` fraction of each bucket with the largest magnitudes
    (after error feedback); ties go to the lowest index. Exchange: gather-and-add.

    Args:
        density: fraction of each bucket's elements to send, in (0, 1]; k = floor(density * n),
            at least 1 (ALGORITHMS.md decision 4).
    """

    _METHOD_OPTIONS = ("density",)

    def __init__(self, density: float, **options: Any) -> None:
        super().__init__(density=density, **options)

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"density": check_density("TopK", "density", options["density"])}

    def _make_method(self, numels: list[int]):
        return _C.TopK(self._method_config["density"])


class Threshold(State):
    """Hard threshold: each rank sends every element with |value| >= threshold (after error
    feedback), compared in the bucket's dtype. Exchange: gather-and-add.

    Args:
        threshold: the magnitude threshold; or
        density: instead of a threshold, use the kljp initial threshold 1 / (2 sqrt(k)) with
            k = floor(density * n) per bucket.
    """

    _METHOD_OPTIONS = ("threshold", "density")

    def __init__(self, threshold: float | None = None, *, density: float | None = None, **options: Any) -> None:
        super().__init__(threshold=threshold, density=density, **options)

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        threshold, density = options.get("threshold"), options.get("density")
        if (threshold is None) == (density is None):
            raise ValueError(
                "Threshold: give exactly one of threshold (for example threshold=1e-3) and density "
                "(for example density=0.01, which uses threshold 1/(2 sqrt(k)) per bucket)"
            )
        if threshold is not None:
            return {"threshold": check_threshold("Threshold", "threshold", threshold), "density": None}
        return {"threshold": None, "density": check_density("Threshold", "density", density)}

    def _make_method(self, numels: list[int]):
        return _C.Threshold(threshold=self._method_config["threshold"], density=self._method_config["density"])


class RandomK(State):
    """Random-k: every rank sends the same k = floor(density * n) random elements, drawn from a
    stream seeded by ``seed`` and the step, so no indices need to be exchanged: the values are
    all-reduced (exchange "shared")."""

    _METHOD_OPTIONS = ("density", "seed")

    def __init__(self, density: float, *, seed: int = 0, **options: Any) -> None:
        super().__init__(density=density, seed=seed, **options)

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        return {
            "density": check_density("RandomK", "density", options["density"]),
            "seed": _seed("RandomK", options.get("seed", 0)),
        }

    def _make_method(self, numels: list[int]):
        return _C.RandomK(self._method_config["density"], self._method_config["seed"])


class GaussianK(State):
    """Gaussian-k: a threshold from a normal fit of the values, corrected by rescaling towards k
    elements. ``variant="spardl"`` (SparDL's compressor: signed values, up to 20 rescalings by
    1.02) or ``"sidco"`` (SIDCo's gaussianksgd: normalised magnitudes, up to 3 evaluations
    rescaled by 0.5 or 1.5). Exchange: gather-and-add."""

    _METHOD_OPTIONS = ("density", "variant")

    def __init__(self, density: float, *, variant: str = "spardl", **options: Any) -> None:
        super().__init__(density=density, variant=variant, **options)

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        return {
            "density": check_density("GaussianK", "density", options["density"]),
            "variant": check_choice("GaussianK", "variant", options.get("variant", "spardl"), ("spardl", "sidco")),
        }

    def _make_method(self, numels: list[int]):
        return _C.GaussianK(self._method_config["density"], self._method_config["variant"])


class DGC(State):
    """DGC's sampled threshold (SIDCo's dgcsampling): the top-density quantile of a 1% random
    sample; exceedances beyond 4k/3 are trimmed to the exact top k. Exchange: gather-and-add."""

    _METHOD_OPTIONS = ("density", "seed")

    def __init__(self, density: float, *, seed: int = 0, **options: Any) -> None:
        super().__init__(density=density, seed=seed, **options)

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        return {
            "density": check_density("DGC", "density", options["density"]),
            "seed": _seed("DGC", options.get("seed", 0)),
        }

    def _make_method(self, numels: list[int]):
        return _C.DGC(self._method_config["density"], self._method_config["seed"])


class RedSync(State):
    """RedSync: bisection of the threshold between the mean and the maximum magnitude, at most
    three evaluations. Exchange: gather-and-add."""

    _METHOD_OPTIONS = ("density",)

    def __init__(self, density: float, **options: Any) -> None:
        super().__init__(density=density, **options)

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        return {"density": check_density("RedSync", "density", options["density"])}

    def _make_method(self, numels: list[int]):
        return _C.RedSync(self._method_config["density"])


class SAGE(State):
    """SAGE: the threshold follows the gradient's scale, measured on a small random sample
    (Slovin's size). ``sampling="flat"`` samples the bucket uniformly, ``"per_tensor"`` picks a
    parameter first (the kljp/sage variant). Default mode: the sampled scale predicts the
    threshold and the exact top k is taken inside a band around it; ``reference=True``: SAGE's own
    α β γ ratio scaling. Exchange: union + all-reduce for flat, gather-and-add for per_tensor
    (``exchange=`` overrides)."""

    _METHOD_OPTIONS = ("density", "sampling", "initial_threshold", "exchange", "seed")

    def __init__(
        self,
        density: float,
        *,
        sampling: str = "flat",
        initial_threshold: float | None = None,
        exchange: str | None = None,
        seed: int = 0,
        **options: Any,
    ) -> None:
        super().__init__(
            density=density,
            sampling=sampling,
            initial_threshold=initial_threshold,
            exchange=exchange,
            seed=seed,
            **options,
        )

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        initial = options.get("initial_threshold")
        if initial is not None:
            initial = check_real("SAGE", "initial_threshold", initial, "initial_threshold=4.73e-3")
            if not initial > 0:
                raise ValueError(f"SAGE: initial_threshold must be > 0, got {initial!r}")
        exchange = options.get("exchange")
        if exchange is not None:
            exchange = check_choice("SAGE", "exchange", exchange, ("union", "gather"))
        return {
            "density": check_density("SAGE", "density", options["density"]),
            "sampling": check_choice("SAGE", "sampling", options.get("sampling", "flat"), ("flat", "per_tensor")),
            "initial_threshold": initial,
            "exchange": exchange,
            "seed": _seed("SAGE", options.get("seed", 0)),
        }

    def _make_method(self, numels: list[int]):
        c = self._method_config
        return _C.SAGE(
            c["density"],
            sampling=c["sampling"],
            segments=list(numels),
            reference=self._reference,
            seed=c["seed"],
            initial_threshold=c["initial_threshold"],
            exchange=c["exchange"],
        )


class _Partitioned(State):
    _METHOD_OPTIONS = ("density", "exchange", "seed")
    _GLOBAL_TARGET = True
    _CLASS: Any = None

    def __init__(self, density: float, *, exchange: str = "union", seed: int = 0, **options: Any) -> None:
        super().__init__(density=density, exchange=exchange, seed=seed, **options)

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        owner = type(self).__name__
        return {
            "density": check_density(owner, "density", options["density"]),
            "exchange": check_choice(owner, "exchange", options.get("exchange", "union"), ("union", "gather")),
            "seed": _seed(owner, options.get("seed", 0)),
        }

    def _make_method(self, numels: list[int]):
        c = self._method_config
        return self._CLASS(c["density"], exchange=c["exchange"], reference=self._reference, seed=c["seed"])


class MiCRO(_Partitioned):
    """MiCRO: each rank selects only inside its own partition of each bucket (static, contiguous,
    rotating every step), with one threshold for all ranks. Default mode: the ranks agree on the
    threshold every step so the total hits k = floor(density * n); ``reference=True``: the
    original 1.005 / 1.00125 / 0.995 scaling and the dummy element. ``exchange="union"``
    (default, the original's: every rank's own values on the union, all-reduced) or
    ``"gather"`` (owners send their pairs; cheaper, no value all-reduce)."""

    _CLASS = _C.MiCRO


class ExDyna(_Partitioned):
    """ExDyna: MiCRO with 1024-block partitions that are rebalanced every step so that each
    partition holds about the same number of selected elements (lower load imbalance when the
    large gradients sit in a few layers). Same options and modes as :class:`MiCRO`."""

    _CLASS = _C.ExDyna


class SIDCo(State):
    """SIDCo: thresholds from statistical fits of the normalised magnitudes, refined over stages.

    Args:
        density: target fraction.
        fit: ``"exp"`` (SIDCo-E), ``"gpareto"`` (SIDCo-P) or ``"gamma_gpareto"`` (SIDCo-GP).
        stages: -1 (default), -2, -3: the adaptive modes, which start with one stage and change
            the number of stages every 5 steps from the achieved density; >= 1: a fixed number
            of stages (1 is the original scripts' default, which sends far fewer elements than
            asked on real gradients: docs/methods.md); 0: a fixed per-stage ratio ``iratio``.
        first_ratio: the first stage's target when several stages are used (0.25).
        iratio: per-stage ratio for ``stages=0`` (default 0.2 for exp, 0.075 otherwise).
    """

    _METHOD_OPTIONS = ("density", "fit", "stages", "first_ratio", "iratio")

    def __init__(
        self,
        density: float,
        *,
        fit: str = "exp",
        stages: int = -1,
        first_ratio: float = 0.25,
        iratio: float | None = None,
        **options: Any,
    ) -> None:
        super().__init__(density=density, fit=fit, stages=stages, first_ratio=first_ratio, iratio=iratio, **options)

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        stages = check_int(
            "SIDCo", "stages", options.get("stages", -1), -3, "stages=-1 (adaptive) or a stage count >= 1"
        )
        first_ratio = check_real("SIDCo", "first_ratio", options.get("first_ratio", 0.25), "first_ratio=0.25")
        if not 0 < first_ratio < 1:
            raise ValueError(f"SIDCo: first_ratio must be in (0, 1), got {first_ratio!r}")
        iratio = options.get("iratio")
        if iratio is not None:
            iratio = check_real("SIDCo", "iratio", iratio, "iratio=0.2")
            if not 0 < iratio < 1:
                raise ValueError(f"SIDCo: iratio must be in (0, 1), got {iratio!r}")
        return {
            "density": check_density("SIDCo", "density", options["density"]),
            "fit": check_choice("SIDCo", "fit", options.get("fit", "exp"), ("exp", "gpareto", "gamma_gpareto")),
            "stages": stages,
            "first_ratio": first_ratio,
            "iratio": iratio,
        }

    def _make_method(self, numels: list[int]):
        c = self._method_config
        return _C.SIDCo(c["density"], c["fit"], c["stages"], c["first_ratio"], c["iratio"])


class SparDL(State):
    """SparDL: a sparse all-reduce in which selection is part of the communication. Each bucket
    is cut into one block per rank; a non-recursive Spar-Reduce-Scatter (P - 1 steps, any P)
    forwards the top k of each block, accumulated with what arrived for it, so every rank's own
    block ends with everybody's contribution; the final lists are all-gathered. With ``teams`` d >
    1, the ranks form d teams that reduce separately and exchange their top h lists (Spar-All-Gather,
    h adapted every step). Residuals keep what was accumulated but not sent on (global residual
    collection), so no gradient mass is lost.

    Args:
        density: k = floor(density * chunk) per block, chunk = ceil(n / (P / teams)).
        teams: number of teams d; the world size must be a multiple of it.
    """

    _METHOD_OPTIONS = ("density", "teams")
    _GLOBAL_TARGET = True

    def __init__(self, density: float, *, teams: int = 1, **options: Any) -> None:
        super().__init__(density=density, teams=teams, **options)

    def _validate_method(self, options: dict[str, Any]) -> dict[str, Any]:
        return {
            "density": check_density("SparDL", "density", options["density"]),
            "teams": check_int("SparDL", "teams", options.get("teams", 1), 1, "teams=1"),
        }

    def _check_world_size(self, world_size: int) -> None:
        teams = self._method_config["teams"]
        if world_size % teams:
            divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
            raise ValueError(
                f"SparDL: teams={teams} does not divide the world size {world_size}; the ranks form teams of equal "
                f"size: choose teams among {', '.join(map(str, divisors))}"
            )

    def _make_method(self, numels: list[int]):
        return _C.SparDL(self._method_config["density"], self._method_config["teams"])
