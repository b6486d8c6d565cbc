"""Validation of user-facing options: every error names the option, the value and the fix."""

from __future__ import annotations

import datetime
import math
import numbers


def _describe(value: object) -> str:
    return f"{value!r} ({type(value).__name__})"


def check_real(owner: str, name: str, value: object, example: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{owner}: {name} must be a number, got {_describe(value)}; for example {example}")
    return float(value)


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


def check_int(owner: str, name: str, value: object, minimum: int, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"{owner}: {name} must be an integer >= {minimum}, got {_describe(value)}; for example {example}"
        )
    if value < minimum:
        raise ValueError(f"{owner}: {name} must be >= {minimum}, got {value!r}; for example {example}")
    return int(value)


def check_bool(owner: str, name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False, got {_describe(value)}")
    return value


def check_choice(owner: str, name: str, value: object, choices: tuple[str, ...]) -> str:
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{owner}: {name} must be one of {options}, got {value!r}")
    return str(value)


def check_timeout(owner: str, name: str, value: object) -> datetime.timedelta | None:
    if value is None:
        return None
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise TypeError(
            f"{owner}: {name} must be seconds or a datetime.timedelta, got {_describe(value)}; for example {name}=300"
        )
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{owner}: {name} must be a positive number of seconds, got {value!r}")
    return datetime.timedelta(seconds=seconds)
