"""What an installed gradsparse checks about its environment."""

import os
import shutil
import subprocess
import sys

import pytest
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


def test_a_build_that_carries_its_own_libstdcxx_is_refused(tmp_path, monkeypatch):
    """setup.py's check after building _C: a module that does not load the shared libstdc++ (its
    compiler linked a static copy) is removed and the build fails naming the compiler and the fix;
    the installed _C passes the same check."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location("gradsparse_setup", os.path.join(root, "setup.py"))
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # defines the functions; setup() runs only as __main__

    setup_py._check_shared_libstdcxx(gradsparse._C.__file__)  # the real module: loads libstdc++.so.6
    static = tmp_path / "_C.so"
    static.write_bytes(b"\x7fELF" + b"\0" * 64 + b"libgomp.so.1\0libc.so.6\0")
    monkeypatch.setenv("CXX", "/opt/gcc/bin/g++")
    with pytest.raises(SystemExit, match=r"/opt/gcc/bin/g\+\+ linked libstdc\+\+ statically.*CXX=/usr/bin/g\+\+"):
        setup_py._check_shared_libstdcxx(str(static))
    assert not static.exists()
