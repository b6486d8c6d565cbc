"""Validation of user-facing options: every error names the option, the value and the fix."""

from __future__ import annotations

import datetime
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _describe(value: object) -> str:
    kind = type(value)
    module = kind.__module__.split(".")[0]
    # numpy's and torch's scalars name themselves like the builtins ("bool", "float"): say whose
    return f"{value!r} ({kind.__name__ if module == 'builtins' else f'{module}.{kind.__name__}'})"


def _as_float(value: numbers.Real) -> float:
    """``float(value)``, or an infinity of its sign where it is past float's range (an int such as
    10**400, a Fraction), so that the range checks refuse it naming the option; float() raised an
    OverflowError that named nothing."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_real(owner: str, name: str, value: object, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a number, got {_describe(value)}; for example {example}")
    return _as_float(value)


def check_density(owner: str, name: str, value: object) -> float:
    """A fraction of elements in (0, 1]."""
    example = f"{name}=0.01 sends 1% of each bucket"
    v = check_real(owner, name, value, example)
    if not (0.0 < v <= 1.0):  # also rejects NaN
        raise ValueError(f"{owner}: {name} must be in (0, 1], got {value!r}; for example {example}")
    return v


def check_threshold(owner: str, name: str, value: object) -> float:
    """A finite magnitude >= 0."""
    example = f"{name}=1e-3 sends every element with |value| >= 1e-3"
    v = check_real(owner, name, value, example)
    if not (math.isfinite(v) and v >= 0.0):
        raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}; for example {example}")
    return v


def is_link(link: object) -> bool:
    """Whether ``link`` is a pair (alpha, beta) gradsparse.simulate can price collectives with: two
    finite real numbers >= 0 (a NaN made every plan's time NaN, and so every pick gather-and-add; a
    negative one made the plan with the most rounds or bytes the fastest)."""
    return (
        isinstance(link, (tuple, list))
        and len(link) == 2
        and all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in link)
    )


def check_int(owner: str, name: str, value: object, minimum: int, example: str, maximum: int | None = None) -> int:
    """An integer from ``minimum`` to ``maximum`` (None: no bound; the C++ options' types have one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{owner}: {name} must be an integer >= {minimum}, got {_describe(value)}; for example {example}"
        )
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value!r}; for example {example}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{owner}: {name} must be at most {maximum}, got {value!r}; for example {example}")
    return int(value)


def check_momentum(owner: str, name: str, value: object) -> float:
    """A momentum factor in [0, 1)."""
    example = f"{name}=0.9, with the optimizer's momentum set to 0"
    v = check_real(owner, name, value, example)
    if not (0.0 <= v < 1.0):  # also rejects NaN
        raise ValueError(f"{owner}: {name} must be in [0, 1), got {value!r}; for example {example}")
    return v


def check_bool(owner: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False, got {_describe(value)}")
    return value


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    # Only a string is compared: ``in`` compares with ==, which a numpy array answers element by
    # element (an ambiguous truth value, raised as numpy's ValueError that names no option).
    if not (isinstance(value, str) and value in choices):
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{owner}: {name} must be one of {options}, got {value!r}")
    # The choice itself: str() of a str subclass need not be its value (an Enum with a str
    # mixin gives "E.member", which the C++ constructor then refused naming neither).
    return choices[choices.index(value)]


def check_timeout(owner: str, name: str, value: object) -> datetime.timedelta | None:
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = _as_float(value)
    else:
        raise TypeError(
            f"{owner}: {name} must be seconds or a datetime.timedelta, got {_describe(value)}; for example {name}=300"
        )
    # c10d and Gloo add the timeout to a steady clock in 64-bit nanoseconds: past about 2^63 ns
    # (292 years) the deadline overflows and every collective times out at once ("Operation
    # timed out!" at the first bucket). 2^62 ns (146 years) leaves the clock the other half.
    most = 2**62 / 1e9
    # The exchanges wait in whole milliseconds, and a wait of 0 ms is c10d's "no timeout"; a
    # timedelta of 0 would also read as "not given" (the 30 min default).
    if not (math.isfinite(seconds) and 0.001 <= seconds <= most):
        raise ValueError(
            f"{owner}: {name} must be a positive number of seconds, from 0.001 (the exchanges wait in whole milliseconds) "
            f"to {most:.0f} (146 years: c10d adds it to its clock in 64-bit nanoseconds), got {value!r}; for example "
            f"{name}=300"
        )
    return datetime.timedelta(seconds=seconds)


# ----------------------------------------------------------------------------------------------
# Declared options: each method's options are written once, as a tuple of Option
# ----------------------------------------------------------------------------------------------

#: The default of an option that must be given.
REQUIRED = inspect.Parameter.empty


@dataclass(frozen=True)
class Option:
    """One option of a method, declared once. The method's Python signature and docstring, its
    validation and ``config()``, the keyword its C++ constructor receives and the examples'
    command-line flag all follow from it (docs/adding-a-method.md).

    ``check(owner, name, value)`` returns the normalised value or raises an error that names the
    owner, the option, the value and a fix; ``flag`` holds the argparse keywords of the
    examples' ``--name`` flag (its ``type`` or ``choices``). A default of None means "chosen by
    the method", so None is then accepted without a check."""

    name: str
    default: Any
    check: Callable[[str, str, Any], Any]
    doc: str
    positional: bool = False
    flag: dict = field(default_factory=dict)

    def validate(self, owner: str, value: Any) -> Any:
        """``value`` (the default when not given) checked and normalised."""
        return None if value is None and self.default is None else self.check(owner, self.name, value)


def _open_interval(low: float, high: float, example: str) -> Callable[[str, str, Any], float]:
    def check(owner: str, name: str, value: object) -> float:
        v = check_real(owner, name, value, example)
        if not low < v < high:
            raise ValueError(f"{owner}: {name} must be in ({low:g}, {high:g}), got {value!r}; for example {example}")
        return v

    return check


def _positive(example: str) -> Callable[[str, str, Any], float]:
    def check(owner: str, name: str, value: object) -> float:
        v = check_real(owner, name, value, example)
        if not (math.isfinite(v) and v > 0):
            raise ValueError(f"{owner}: {name} must be a finite number > 0, got {value!r}; for example {example}")
        return v

    return check


def density_option(doc: str, default: Any = REQUIRED) -> Option:
    """The fraction of elements to send, in (0, 1]."""
    return Option("density", default, check_density, doc, positional=default is REQUIRED, flag={"type": float})


def threshold_option(doc: str, default: Any = REQUIRED) -> Option:
    """A finite magnitude >= 0."""
    return Option("threshold", default, check_threshold, doc, positional=True, flag={"type": float})


def choice_option(name: str, default: str | None, choices: tuple[str, ...], doc: str) -> Option:
    """One of ``choices``."""

    def check(owner: str, option: str, value: object) -> str:
        return check_choice(owner, option, value, choices)

    return Option(name, default, check, doc, flag={"choices": choices})


#: The largest value of the C++ options' types: int (stages, teams), uint64_t (seed) and int64_t
#: (element counts).
INT32_MAX = 2**31 - 1
UINT64_MAX = 2**64 - 1
INT64_MAX = 2**63 - 1


def int_option(name: str, default: int, minimum: int, example: str, doc: str, maximum: int = INT32_MAX) -> Option:
    """An integer from ``minimum`` to ``maximum`` (the C++ constructor's type: int unless said)."""

    def check(owner: str, option: str, value: object) -> int:
        return check_int(owner, option, value, minimum, example, maximum)

    return Option(name, default, check, doc, flag={"type": int})


def ratio_option(name: str, default: float | None, example: str, doc: str) -> Option:
    """A number in (0, 1)."""
    return Option(name, default, _open_interval(0.0, 1.0, example), doc, flag={"type": float})


def positive_option(name: str, default: float | None, example: str, doc: str) -> Option:
    """A finite number > 0."""
    return Option(name, default, _positive(example), doc, flag={"type": float})


def seed_option() -> Option:
    return int_option(
        "seed", 0, 0, "seed=0", "seed of the method's random draws (the same on every rank)", maximum=UINT64_MAX
    )
