"""What the tests' child processes (torchrun, mpirun, the examples and benchmarks) run with."""

import os

#: The repository's root, the child processes' working folder.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def environment(**changes: str) -> dict[str, str]:
    """This process's environment with ``changes``, and the repository root first on PYTHONPATH, so
    that a child imports ``examples``, ``benchmarks`` and ``tests`` from this checkout."""
    env = dict(os.environ, **changes)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    return env
