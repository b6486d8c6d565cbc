"""This test run's interpreter at another path, as the scripts under test are told to run it."""

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
