"""What the tests of the command lines share: a bad value is refused with argparse's usage error
before any work starts (the work replaced by ``never``, which fails the test if it is reached)."""

from collections.abc import Callable, Sequence

import pytest


def never(what: str) -> Callable:
    """A stand-in for a step that must not run before the arguments are checked."""

    def reached(*args, **kwargs):
        raise AssertionError(f"{what} before the arguments were checked")

    return reached


def assert_refused(main: Callable[[Sequence[str]], object], argv: Sequence[str], message: str, capsys) -> None:
    """``main(argv)`` exits with argparse's code 2 and ``message`` on stderr."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err
