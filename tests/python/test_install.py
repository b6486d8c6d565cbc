"""What an installed gradsparse checks about its environment."""

import os
import shutil
import subprocess
import sys

import torch

import gradsparse


def test_import_under_another_torch_raises_naming_both_versions_and_the_fix(tmp_path):
    """_C only runs under the torch it was built against: a copy of the package whose build record
    names another torch must refuse to import, before loading _C, with a message that helps."""
    package = os.path.dirname(gradsparse.__file__)
    copy = tmp_path / "gradsparse"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "_build.py").write_text("TORCH_VERSION = '2.99.0+other'\n")
    code = "import gradsparse"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0
    assert (
        f"ImportError: gradsparse was built against torch 2.99.0+other but torch {torch.__version__} is installed"
        in out.stderr
    ), out.stderr
    assert "pip install --no-build-isolation --no-deps --force-reinstall ." in out.stderr


def test_the_build_record_names_the_running_torch():
    from gradsparse._build import TORCH_VERSION

    assert torch.__version__ == TORCH_VERSION
