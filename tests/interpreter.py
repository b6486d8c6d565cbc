"""This test run's interpreter at another path, as the scripts under test are told to run it, and
a stand-in for an externally managed one."""

import os
import sys


def python_at(path, environment: str = "") -> str:
    """Writes at ``path`` a script that runs this interpreter (with ``environment``, such as
    ``"CUDA_VISIBLE_DEVICES="``, set for it) and returns the path. Not a symlink: a virtual
    environment's python found through a link elsewhere no longer sees its environment (no torch)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\n{environment + " " if environment else ""}exec "{sys.executable}" "$@"\n')
    os.chmod(path, 0o755)
    return str(path)


def externally_managed_python(folder) -> str:
    """A stand-in for Debian's python3 as scripts/env.sh sees it: its PEP 668 check says yes, and
    anything else fails, as Debian's python3 without torch would (a script that runs it fails)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "python3")
    with open(path, "w") as f:
        f.write(
            '#!/bin/sh\ncase "$*" in *EXTERNALLY-MANAGED*) exit 0 ;; esac\necho "No module named torch" >&2\nexit 1\n'
        )
    os.chmod(path, 0o755)
    return path
