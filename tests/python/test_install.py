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


def _import_with(env_changes: dict[str, str], code: str = "import gradsparse") -> subprocess.CompletedProcess:
    env = dict(os.environ, **env_changes)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize(
    "variable, value, fix",
    [
        ("GRADSPARSE_SIMD", "avx512", "set it to 1 (the widest the CPU has, the default), avx2 (no AVX-512) or 0"),
        ("GRADSPARSE_NUM_THREADS", "0", "set it to, for example, 2, or unset it"),
        ("GRADSPARSE_NUM_THREADS", "two", "set it to, for example, 2, or unset it"),
        # digits of other scripts: one passed the check and the kernels ignored it, the other raised int()'s error
        ("GRADSPARSE_NUM_THREADS", "\u0664", "set it to, for example, 2, or unset it"),
        ("GRADSPARSE_NUM_THREADS", "\u00b2", "set it to, for example, 2, or unset it"),
    ],
)
def test_a_bad_kernel_variable_is_refused_at_import_naming_it_its_value_and_the_fix(variable, value, fix):
    """The kernels read these once, deep inside a step, where a typo would pass unnoticed."""
    out = _import_with({variable: value})
    assert out.returncode != 0
    assert f"ValueError: {variable}={value!r}" in out.stderr, out.stderr
    assert fix in out.stderr, out.stderr


# One rank's TopK and SAGE steps (the scan without moments) and Gaussian-k's (with them), with
# momentum correction and masking, on a bucket holding zeros, the second step also a non-finite
# gradient (skipped): a digest of what each step sends and leaves behind.
_STEPS = """
import hashlib
import torch
from gradsparse import _C
from gradsparse.methods import core_method

gen = torch.Generator().manual_seed(0)
n = 3 * 32768 + 77
digest = hashlib.sha256()
for name in ("topk", "sage", "gaussiank"):
    method = core_method(name, density=0.01)
    residual, velocity = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    residual[::5] = 0.0
    group = _C.ThreadGroup(1, 600.0)
    for step in range(3):
        grad = torch.randn(n, generator=gen)
        if step == 1:  # a skipped step: the residual keeps its value there, the others take theirs
            grad[7] = float("inf")
        out = grad.clone()
        group.reduce(
            0, out, residual, method, nonfinite="skip", record=False, velocity=velocity, momentum=0.9,
            momentum_masking=True,
        )
        for t in (out, residual, velocity):
            digest.update(t.numpy().tobytes())
print(_C.simd_paths(), digest.hexdigest())
"""


def test_every_simd_path_of_the_kernels_gives_the_same_steps_to_the_bit():
    """GRADSPARSE_SIMD chooses the kernels' paths (the widest the CPU has, AVX2, portable code):
    gs.simd_paths() names the one taken, and the same steps, through the installed extension,
    give the same bytes on each."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    widest = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "portable"
    expected = {"1": widest, "avx2": "portable" if widest == "portable" else "avx2", "0": "portable"}
    digests = {}
    for simd in ("1", "avx2", "0"):
        out = _import_with({"GRADSPARSE_SIMD": simd}, _STEPS)
        assert out.returncode == 0, out.stderr
        paths, digests[simd] = out.stdout.split()
        assert paths == expected[simd], (simd, paths, expected[simd])
    assert len(digests["1"]) == 64
    assert digests["avx2"] == digests["1"] and digests["0"] == digests["1"], digests
