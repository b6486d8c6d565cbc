"""gradsparse.config's checks: values that Python's conversions refuse in their own words (an
int past float's range, a numpy array compared with a string) are refused naming the option,
the value and the fix, like every other bad option (the rest: tests/python/test_state.py)."""

import datetime
import enum

import numpy as np
import pytest

import gradsparse as gs

HUGE = 10**400  # an int that float() refuses with an OverflowError


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: gs.TopK(density=HUGE), f"TopK: density must be in (0, 1], got {HUGE!r}; for example density=0.01"),
        (lambda: gs.TopK(density=-HUGE), f"TopK: density must be in (0, 1], got {-HUGE!r}"),
        (
            lambda: gs.Threshold(threshold=HUGE),
            f"Threshold: threshold must be a finite number >= 0, got {HUGE!r}; for example threshold=1e-3",
        ),
        (
            lambda: gs.SIDCo(density=0.01, first_ratio=HUGE),
            f"SIDCo: first_ratio must be in (0, 1), got {HUGE!r}; for example first_ratio=0.25",
        ),
        (
            lambda: gs.SAGE(density=0.01, initial_threshold=HUGE),
            f"SAGE: initial_threshold must be a finite number > 0, got {HUGE!r}; for example initial_threshold=4.73e-3",
        ),
        (lambda: gs.TopK(density=0.01, momentum=HUGE), f"TopK: momentum must be in [0, 1), got {HUGE!r}"),
        (lambda: gs.TopK(density=0.01, timeout=HUGE), "TopK: timeout must be a positive number of seconds"),
    ],
    ids=["density", "negative density", "threshold", "first_ratio", "initial_threshold", "momentum", "timeout"],
)
def test_a_number_past_floats_range_is_refused_naming_the_option(make, message):
    """float() of such an int raised an OverflowError that named neither the option nor the fix."""
    with pytest.raises(ValueError) as info:
        make()
    assert message in str(info.value)


def test_a_choice_given_as_an_array_is_refused_naming_the_option():
    """``value in choices`` compared the array with each string element by element, and numpy
    raised its ambiguous-truth-value ValueError, which names no option."""
    with pytest.raises(
        ValueError, match=r"TopK: exchange must be one of 'gather', 'reduce_scatter', 'auto', got array"
    ):
        gs.TopK(density=0.01, exchange=np.array(["gather", "auto"]))
    with pytest.raises(ValueError, match=r"MiCRO: exchange must be one of 'union', 'gather', got \['union'\]"):
        gs.MiCRO(density=0.01, exchange=["union"])


class Exchange(str, enum.Enum):
    GATHER = "gather"
    REDUCE_SCATTER = "reduce_scatter"


@pytest.mark.parametrize("value", [np.str_("reduce_scatter"), Exchange.REDUCE_SCATTER])
def test_a_choice_given_as_a_string_subclass_is_taken_as_the_choice(value):
    """A str Enum member was kept as str(member), "Exchange.REDUCE_SCATTER": config() showed
    that, and the C++ constructor refused it ('exchange must be "gather" or "reduce_scatter",
    got "Exchange.REDUCE_SCATTER"'), naming a value the caller never wrote."""
    state = gs.TopK(density=0.01, exchange=value)
    assert type(state.config()["exchange"]) is str and state.config()["exchange"] == "reduce_scatter"
    assert state._make_method([1000]).exchange == "reduce-scatter + all-gather"


@pytest.mark.parametrize(
    "timeout",
    [1e10, datetime.timedelta(days=200 * 365), datetime.timedelta.max, datetime.timedelta.max.total_seconds()],
    ids=["1e10 s", "200 years", "timedelta.max", "its seconds"],
)
def test_a_timeout_past_what_the_collectives_can_wait_is_refused_naming_the_bound(timeout):
    """The bound was a datetime.timedelta's range (86400000000000 s). c10d and Gloo add the timeout
    to their clock in 64-bit nanoseconds, so timeout=1e10 (317 years) was taken, and then every
    exchange failed at once with Gloo's "Operation timed out!"; timedelta.max and the bound
    itself raised an OverflowError (days=1000000000) rebuilding the timedelta."""
    with pytest.raises(ValueError) as info:
        gs.TopK(density=0.01, timeout=timeout)
    assert "TopK: timeout must be a positive number of seconds, from 0.001" in str(info.value)
    assert "to 4611686018 (146 years: c10d adds it to its clock in 64-bit nanoseconds)" in str(info.value)


def test_a_timeout_up_to_146_years_is_taken():
    assert gs.TopK(density=0.01, timeout=4611686018).config()["timeout"] == 4611686018
    assert gs.TopK(density=0.01, timeout=datetime.timedelta(hours=2)).config()["timeout"] == 7200
