"""gradsparse.config's checks: values that Python's conversions refuse in their own words (an
int past float's range, a numpy array compared with a string) are refused naming the option,
the value and the fix, like every other bad option (the rest: tests/python/test_state.py)."""

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


def test_a_choice_given_as_a_string_subclass_is_accepted():
    assert gs.TopK(density=0.01, exchange=np.str_("reduce_scatter")).config()["exchange"] == "reduce_scatter"
