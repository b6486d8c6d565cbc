"""What an installed gradsparse checks about its environment."""

import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

import gradsparse
from tests.interpreter import externally_managed_python, python_at
from tests.subprocesses import ROOT


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


def test_the_package_pyproject_the_cmake_package_and_the_header_name_one_version():
    """pip's version (pyproject.toml), gradsparse.__version__, the installed CMake package's
    (find_package(gradsparse 0.1)) and the C++ header's (gradsparse/version.h) are written in four
    places: they must agree."""
    import re

    def read(path, pattern):
        with open(os.path.join(ROOT, path)) as f:
            return re.findall(pattern, f.read(), re.M)

    (pip_version,) = read("pyproject.toml", r'^version = "(\S+)"')  # tomllib: Python 3.11 on
    (cmake_version,) = read("CMakeLists.txt", r"^project\(gradsparse VERSION (\S+)")
    header = "csrc/core/include/gradsparse/version.h"
    (header_version,) = read(header, r'^#define GRADSPARSE_VERSION_STRING "(\S+)"')
    parts = dict(read(header, r"^#define GRADSPARSE_VERSION_(MAJOR|MINOR|PATCH) (\d+)$"))
    assert pip_version == gradsparse.__version__ == cmake_version == header_version
    assert header_version == f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}"


def test_a_build_that_carries_its_own_libstdcxx_is_refused(tmp_path, monkeypatch):
    """setup.py's check after building _C: a module that does not load the shared libstdc++ (its
    compiler linked a static copy) is removed and the build fails naming the compiler and the fix;
    the installed _C passes the same check."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gradsparse_setup", os.path.join(ROOT, "setup.py"))
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


@pytest.mark.parametrize("managed", [False, True], ids=["python", "venv"])
def test_the_scripts_take_a_relative_python_and_venv_from_the_callers_directory(tmp_path, managed):
    """scripts/*.sh run from another directory: a relative PYTHON, or GRADSPARSE_VENV where PYTHON is
    externally managed, is a path from there (they changed to the repository's root first, so the
    interpreter was not found: exit 127, or the venv went into the repository)."""
    if managed:
        managed_python = externally_managed_python(tmp_path / "managed")
        python_at(tmp_path / "venvs" / "gs" / "bin" / "python")
        env = dict(os.environ, PYTHON=managed_python, GRADSPARSE_VENV="venvs/gs")
    else:
        python_at(tmp_path / "bin" / "python")
        env = dict(os.environ, PYTHON="bin/python")
        env.pop("GRADSPARSE_VENV", None)
    # sanitize.sh finds the interpreter (require_python), then refuses the unknown step
    script = os.path.join(ROOT, "scripts", "sanitize.sh")
    done = subprocess.run(["bash", script, "nostep"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert 'unknown step "nostep": choose asan, tsan or fuzz' in done.stderr, done.stderr
    assert not os.path.exists(os.path.join(ROOT, "venvs"))


def test_slurm_ci_runs_the_job_with_the_interpreter_setup_installed_into(tmp_path):
    """scripts/slurm_ci.sh after scripts/setup.sh on a machine whose python3 is externally managed:
    the job gets the virtual environment's interpreter, as the other scripts choose it (it ran
    python3, which has no gradsparse). SLURM and munge are stubs here; sbatch records PYTHON."""
    stubs = tmp_path / "stubs"
    externally_managed_python(stubs)
    commands = {
        "id": "echo 0",
        "dpkg": "exit 0",
        "hostname": "echo ci",
        "sinfo": "echo idle",
        "sbatch": 'echo "$PYTHON" > "$GRADSPARSE_SLURM_DIR/job-python"; echo 7',
        "scontrol": "echo JobState=FAILED ExitCode=1:0",
    }
    for name in ("munge", "unmunge", "slurmctld", "slurmd", "squeue", "scancel", *commands):
        (stubs / name).write_text(f"#!/bin/sh\n{commands.get(name, 'exit 0')}\n")
        (stubs / name).chmod(0o755)
    python_at(tmp_path / "venv" / "bin" / "python")
    env = dict(os.environ, PATH=f"{stubs}:{os.environ['PATH']}", GRADSPARSE_VENV="venv",
               GRADSPARSE_SLURM_DIR=str(tmp_path / "slurm"), GRADSPARSE_SLURM_TIMEOUT="5")  # fmt: skip
    env.pop("PYTHON", None)
    script = os.path.join(ROOT, "scripts", "slurm_ci.sh")
    done = subprocess.run(["bash", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, f"{done.stdout}\n{done.stderr}"  # the stub job failed
    assert (tmp_path / "slurm" / "job-python").read_text().strip() == str(tmp_path / "venv" / "bin" / "python")


def test_every_build_variable_setup_py_reads_is_in_the_readmes_table():
    """setup.py's docstring says its variables are documented in the README: GRADSPARSE_MPI (which
    decides whether transport="mpi" exists) and MPICXX were read but missing from the table."""
    import re

    with open(os.path.join(ROOT, "setup.py")) as f:
        setup_py = f.read()
    read = set(re.findall(r'_flag\("(\w+)"\)', setup_py))
    read |= set(re.findall(r'os\.environ(?:\.get|\.setdefault)?\(\s*"(\w+)"', setup_py))
    with open(os.path.join(ROOT, "README.md")) as f:
        section = f.read().split("## Build variables", 1)[1].split("\n## ", 1)[0]
    table = set(re.findall(r"^\| `(\w+)` \|", section, flags=re.MULTILINE))
    assert {"GRADSPARSE_CUDA", "GRADSPARSE_MPI", "GRADSPARSE_DEBUG", "MPICXX", "TORCH_CUDA_ARCH_LIST"} <= read
    assert read - {"CXX"} <= table, f"read by setup.py, not in README's build variables: {read - {'CXX'} - table}"
    assert "CXX=" in section  # the compiler: the paragraph below the table


def test_environment_yml_has_every_build_and_test_requirement_of_pyproject():
    """The conda environment is where `pip install --no-build-isolation .` builds and the tests run:
    it lacked scipy, lightning and accelerate (the test suite failed at collection or import) and
    setuptools>=77 (the SPDX license string) and wheel."""
    import re

    def name(requirement: str) -> str:
        return re.split(r"[<>=!~\[; ]", requirement.strip(), maxsplit=1)[0].lower()

    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        pyproject = f.read()
    wanted = {}
    for key in ("requires", "test"):
        listed = re.search(rf"^{key} = \[(.*?)\]", pyproject, flags=re.MULTILINE).group(1)
        for requirement in re.findall(r'"([^"]+)"', listed):
            wanted[{"torch": "pytorch"}.get(name(requirement), name(requirement))] = requirement
    with open(os.path.join(ROOT, "environment.yml")) as f:
        conda = {name(line.split("#")[0].strip()[2:]) for line in f if line.startswith("  - ")}
    assert {"setuptools", "pytorch", "pytest", "scipy", "lightning"} <= set(wanted)
    missing = sorted(requirement for package, requirement in wanted.items() if package not in conda)
    assert not missing, f"environment.yml lacks {missing}"


def _setup_py():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gradsparse_setup", os.path.join(ROOT, "setup.py"))
    setup_py = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup_py)  # defines the functions; setup() runs only as __main__
    return setup_py


def test_a_setuptools_too_old_for_pyproject_is_refused_naming_the_fix(monkeypatch):
    """pip install --no-build-isolation . in a new Python 3.11 virtual environment (setuptools 65):
    setuptools' schema error on project.license, which named neither setuptools nor the fix."""
    import setuptools

    setup_py = _setup_py()
    monkeypatch.setattr(setuptools, "__version__", "65.5.0")
    monkeypatch.setattr(sys, "argv", ["setup.py", "--version"])  # what setup() would do: print, return
    with pytest.raises(SystemExit, match=r'needs setuptools>=77 .* has setuptools 65\.5\.0; run pip install "setup'):
        setup_py.main()


def test_the_readme_install_installs_the_build_requirements_before_building():
    """--no-build-isolation builds with the environment's own setuptools, wheel and ninja: README's
    Install commands must install them (a new virtual environment of Python 3.11 has setuptools 65)."""
    import re

    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        requires = re.search(r"^requires = \[(.*?)\]", f.read(), flags=re.MULTILINE).group(1)
    with open(os.path.join(ROOT, "README.md")) as f:
        block = f.read().split("## Install", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    before = block.split("pip install --no-build-isolation .", 1)[0]
    for requirement in re.findall(r'"([^"]+)"', requires):
        assert requirement in before or (requirement.startswith("torch") and "pip install torch" in before), requirement


def test_gpu_check_takes_a_relative_python_and_report_folder_from_the_callers_directory(tmp_path):
    """scripts/gpu_check.sh from another directory: PYTHON=bin/python and GPU_CHECK_OUT=out are paths
    from there (it changed to the repository's root first: the interpreter was not found, and the
    report folder went into the repository). The interpreter here sees no GPU, so the check stops
    at its first test, naming it."""
    python_at(tmp_path / "bin" / "python", "CUDA_VISIBLE_DEVICES=")
    env = dict(os.environ, PYTHON="bin/python", GPU_CHECK_OUT="out")
    script = os.path.join(ROOT, "scripts", "gpu_check.sh")
    done = subprocess.run(["bash", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, f"{done.stdout}\n{done.stderr}"
    assert f"gpu_check: {tmp_path}/bin/python's torch sees no CUDA device" in done.stderr, done.stderr
    assert "not found" not in done.stderr, done.stderr
    assert (tmp_path / "out").is_dir() and not os.path.exists(os.path.join(ROOT, "out"))


def test_gpu_check_builds_into_and_tests_the_interpreter_setup_installed_into(tmp_path):
    """scripts/gpu_check.sh on a machine whose python3 is externally managed: it takes the virtual
    environment scripts/setup.sh installed into, as the other scripts do (it ran python3, which has
    no torch there, and pip would not install into it); one that is missing is named, with the fix
    (test_a_script_without_its_interpreter_names_the_fix)."""
    python_at(tmp_path / "venv" / "bin" / "python", "CUDA_VISIBLE_DEVICES=")
    env = dict(os.environ, PYTHON=externally_managed_python(tmp_path / "managed"), GRADSPARSE_VENV="venv",
               GPU_CHECK_OUT="out")  # fmt: skip
    script = os.path.join(ROOT, "scripts", "gpu_check.sh")
    done = subprocess.run(["bash", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, f"{done.stdout}\n{done.stderr}"
    assert f"gpu_check: {tmp_path}/venv/bin/python's torch sees no CUDA device" in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("script", "name"),
    [("scripts/gpu_check.sh", "gpu_check"), ("scripts/lint.sh", "lint.sh"), ("scripts/sanitize.sh", "sanitize.sh"),
     ("benchmarks/slow_network.sh", "slow_network.sh")],
)  # fmt: skip
def test_a_script_without_its_interpreter_names_the_fix(tmp_path, script, name):
    """The scripts that run the interpreter scripts/setup.sh installed into, where setup.sh has not
    made its virtual environment yet: each names it and the fix, before doing anything (they ended
    in bash's "No such file or directory", gpu_check.sh then in "sees no CUDA device")."""
    managed = externally_managed_python(tmp_path / "managed")
    env = dict(os.environ, PYTHON=managed, GRADSPARSE_VENV="none", GPU_CHECK_OUT="out")
    done = subprocess.run(["bash", os.path.join(ROOT, script)], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2, f"{done.stdout}\n{done.stderr}"
    assert done.stderr.startswith(
        f"{name}: no interpreter {tmp_path}/none/bin/python (the virtual environment for the externally managed "
        f"{managed}); run bash scripts/setup.sh test first"
    ), done.stderr


def _stand_ins(folder, **commands: str):
    """Commands on a PATH of their own: each runs its shell line."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, line in commands.items():
        (folder / name).write_text(f"#!/bin/sh\n{line}\n")
        (folder / name).chmod(0o755)
    return f"{folder}:{os.environ['PATH']}"


@pytest.mark.parametrize(
    ("script", "argv", "message"),
    [
        # ran the check and passed: the user thought the files had been rewritten
        ("lint.sh", ["fix"], 'lint.sh: unknown arguments "fix": give --fix to rewrite the files, or nothing'),
        ("lint.sh", ["--fix", "--check"], 'lint.sh: unknown arguments "--fix --check"'),
        # the ASan suite built and ran (minutes) before the misspelt step, and --build-only, were refused
        ("sanitize.sh", ["asan", "--build-only", "tsna"], 'unknown step "tsna": choose asan, tsan or fuzz'),
        ("cross_check.sh", ["--install-only", "--bogus"], 'unknown options "--install-only --bogus"'),
    ],
)
def test_the_scripts_refuse_arguments_they_do_not_take_before_any_work(tmp_path, script, argv, message):
    path = _stand_ins(tmp_path / "bin", **{name: 'echo "$0 ran" >&2; exit 1' for name in ("cmake", "apt-get", "pip")})
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", script), *argv], env=dict(os.environ, PATH=path),
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 2, f"{done.stdout}\n{done.stderr}"
    assert message in done.stderr and " ran" not in done.stderr, done.stderr


def test_lint_outside_a_git_checkout_says_so_instead_of_passing(tmp_path):
    """git ls-files failed outside a checkout and clang-format, given no file, read its standard
    input and passed."""
    (tmp_path / "scripts").mkdir()
    for name in ("lint.sh", "env.sh"):
        shutil.copy(os.path.join(ROOT, "scripts", name), tmp_path / "scripts" / name)
    done = subprocess.run(["bash", "scripts/lint.sh"], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          stdin=subprocess.DEVNULL, env=dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path.parent)))  # fmt: skip
    assert done.returncode == 2, f"{done.stdout}\n{done.stderr}"
    assert "lint.sh: git lists no C++ file here: run it in a git checkout of gradsparse" in done.stderr, done.stderr


def test_setup_makes_again_a_virtual_environment_left_without_pip(tmp_path):
    """A run interrupted while it made the virtual environment left an interpreter without pip
    there, and every later run skipped making it and ended in "No module named pip"."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text('#!/bin/sh\necho "No module named pip" >&2\nexit 1\n')
    (venv / "bin" / "python").chmod(0o755)
    managed = tmp_path / "managed" / "python3"  # Debian's python3: externally managed, and makes venvs
    managed.parent.mkdir()
    managed.write_text(
        '#!/bin/sh\ncase "$*" in *EXTERNALLY-MANAGED*) exit 0 ;; esac\n'
        'if [ "$1 $2 $3" = "-m venv --clear" ]; then\n'
        '  printf \'#!/bin/sh\\necho "$*" >> %s/calls\\nexit 3\\n\' "$4" > "$4/bin/python"; exit 0\nfi\nexit 1\n'
    )
    managed.chmod(0o755)
    path = _stand_ins(tmp_path / "bin", dpkg="exit 0")  # the Debian packages are there
    env = dict(os.environ, PATH=path, PYTHON=str(managed), GRADSPARSE_VENV=str(venv))
    done = subprocess.run(["bash", os.path.join(ROOT, "scripts", "setup.sh")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 3, f"{done.stdout}\n{done.stderr}"  # the new interpreter's first pip install
    assert "installing into a virtual environment at" in done.stdout, done.stdout
    assert "\n-m pip install -q --disable-pip-version-check torch" in (venv / "calls").read_text()


def test_ctest_runs_in_its_build_folder_on_the_declared_cmake():
    """`ctest --test-dir` is CMake 3.20's: the 3.18 and 3.19 that CMakeLists.txt accepts ignore it,
    run in the current folder, find no test and pass. Every script and doc runs ctest in its build
    folder instead, with --no-tests=error (3.17) so that an empty run fails."""
    import glob
    import re

    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        declared = re.search(r"cmake_minimum_required\(VERSION (\d+)\.(\d+)\)", f.read()).groups()
    assert tuple(map(int, declared)) < (3, 20)  # else --test-dir would be fine
    scripts = [".ci/run", *glob.glob("scripts/*.sh", root_dir=ROOT)]
    checked = 0
    for path in [*scripts, "CMakeLists.txt", "README.md"]:
        with open(os.path.join(ROOT, path)) as f:
            lines = f.read().splitlines()
        assert not any("--test-dir" in line for line in lines), path
        if path in scripts:
            runs = [
                line for line in lines if re.search(r"\bctest( -|\s*\\$)", line) and not line.lstrip().startswith("#")
            ]
            assert all("--no-tests=error" in line for line in runs), (path, runs)
            checked += len(runs)
    assert checked >= 4  # test.sh, sanitize.sh, gpu_check.sh, .ci/run


@pytest.mark.parametrize("script", ["cpu.sbatch", "gpu-node.sbatch", "multi-node.sbatch"])
def test_a_job_whose_venv_is_missing_stops_naming_it_where_it_looked_and_the_fix(tmp_path, script):
    """A relative VENV is taken from the checkout the job changes to: one that is not there ended
    the job in bash's bare "No such file or directory". Before any srun or torchrun."""
    job = subprocess.run(
        ["bash", os.path.join(ROOT, "slurm", script)],
        env={**os.environ, "GRADSPARSE_DIR": ROOT, "VENV": "venvs/none"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert job.returncode == 2, job.stderr
    assert f"VENV=venvs/none: no venvs/none/bin/activate from {ROOT} (a relative VENV is taken from" in job.stderr
    assert "VENV=$PWD/.venv sbatch" in job.stderr


def _job(script: str, tmp_path, **variables: str) -> subprocess.CompletedProcess:
    """slurm/<script> run as its batch script, with srun a stand-in that prints what it was given
    (and the rendezvous variables), on a job of SLURM_JOB_ID 4321 with 16 CPUs per task."""
    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir(exist_ok=True)
    srun.write_text('#!/bin/sh\necho "srun $* (MASTER_ADDR=${MASTER_ADDR:-} MASTER_PORT=${MASTER_PORT:-})"\n')
    srun.chmod(0o755)
    env = {**os.environ, "PATH": f"{srun.parent}:{os.environ['PATH']}", "GRADSPARSE_DIR": ROOT,
           "PYTHON": sys.executable, "SLURM_JOB_ID": "4321", "SLURM_CPUS_PER_TASK": "16", **variables}  # fmt: skip
    for name in ("NPROC", "MASTER_ADDR", "MASTER_PORT", "THREADS"):
        if name not in variables:
            env.pop(name, None)
    script = os.path.join(ROOT, "slurm", script)
    return subprocess.run(["bash", script], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("script", ["gpu-node.sbatch", "multi-node.sbatch"])
@pytest.mark.parametrize("nproc", ["abc", "2x", "auto", "-1"])
def test_a_job_given_nproc_that_is_no_whole_number_stops_naming_it(tmp_path, script, nproc):
    """NPROC=abc ended the job in bash's "integer expression expected" and "unbound variable", and
    NPROC=2x reached torchrun after "value too great for base"."""
    job = _job(script, tmp_path, NPROC=nproc, SLURM_JOB_NODELIST="node01", SLURM_JOB_NUM_NODES="1")
    assert job.returncode == 2, job.stdout + job.stderr
    assert job.stderr == f"NPROC={nproc}: give the number of workers per node as a whole number, such as NPROC=4\n"


def test_a_multi_node_job_meets_on_its_first_node_at_a_port_free_there(tmp_path):
    """The first host came from `scontrol show hostnames | head -n 1`: on a long node list head
    ended before scontrol, whose SIGPIPE then ended the job (pipefail) with nothing in its log. It
    comes from gradsparse.launch now, and the port is the first free one from the job id's
    (jobs whose ids differed by 15000 met at one port). NPROC=08 is eight workers."""
    job = _job("multi-node.sbatch", tmp_path, NPROC="08", SLURM_JOB_NODELIST="node[0001-2000]",
               SLURM_JOB_NUM_NODES="2000")  # fmt: skip
    assert job.returncode == 0, job.stderr
    srun = job.stdout.splitlines()[-1]
    port = int(srun.split("--rdzv-endpoint=node0001:")[1].split()[0])
    assert 19321 <= port < 19421, srun
    assert "--nodes=2000 --ntasks=2000" in srun and "--nproc-per-node=8 " in srun and "--threads 2 " in srun, srun
    with socket.socket() as taken:  # another job's rendezvous at that port on this node
        taken.bind(("", port))
        taken.listen()
        again = _job("multi-node.sbatch", tmp_path, NPROC="8", SLURM_JOB_NODELIST="node[0001-2000]",
                     SLURM_JOB_NUM_NODES="2000", SLURM_JOB_ID="19321")  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert f"--rdzv-endpoint=node0001:{port} " not in again.stdout, again.stdout


def test_a_cpu_job_exports_a_port_free_on_its_first_node_unless_given_one(tmp_path):
    given = _job("cpu.sbatch", tmp_path, SLURM_NTASKS="4", SLURM_JOB_NODELIST="node01", MASTER_PORT="12345")
    job = _job("cpu.sbatch", tmp_path, SLURM_NTASKS="4", SLURM_JOB_NODELIST="node01")
    assert "MASTER_PORT=12345)" in given.stdout.splitlines()[-1], given.stdout + given.stderr
    port = int(job.stdout.splitlines()[-1].split("MASTER_PORT=")[1].rstrip(")"))
    assert 19321 <= port < 19421, job.stdout + job.stderr


# What a source distribution must hold: the build files, and the folders whose files the builds read.
_SDIST_SOURCES = ("setup.py", "pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "CMakeLists.txt", "cmake",
                  "csrc", "python/gradsparse", "tests/cpp", "tests/cmake_consumer", "fuzz")  # fmt: skip


def _sources_an_sdist_needs():
    """The files of _SDIST_SOURCES in this checkout (paths from its root), without what a build or a
    run leaves among them (.gitignore: __pycache__, _C's .so and its build record)."""
    for entry in _SDIST_SOURCES:
        assert os.path.exists(os.path.join(ROOT, entry)), f"{entry} is gone: update _SDIST_SOURCES"
        if os.path.isfile(os.path.join(ROOT, entry)):
            yield entry
            continue
        for folder, subfolders, files in os.walk(os.path.join(ROOT, entry)):
            subfolders[:] = [d for d in subfolders if d != "__pycache__"]
            for name in files:
                if not name.endswith(".so") and name != "_build.py":
                    yield os.path.relpath(os.path.join(folder, name), ROOT)


# One step of TopK on one rank: the gradient it leaves, and which gradsparse ran it.
_ONE_STEP = """
import torch, torch.distributed as dist
import gradsparse as gs
dist.init_process_group("gloo", init_method="file://{store}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8))
gs.register(model, gs.TopK(density=0.1))
model(torch.randn(16, 64)).square().sum().backward()
print(gs.__file__)
print(*[v.hex() for p in model.parameters() for v in p.grad.flatten().tolist()])
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a full compile of _C, beside the other tests in CI
def test_the_source_distribution_holds_what_the_builds_read_and_pip_builds_it(tmp_path):
    """`pip install gradsparse-<version>.tar.gz` (python -m build --sdist, what a package index
    serves) must build: setuptools puts only the Python package and the sources setup.py names in
    a source distribution, so the headers, the CUDA files and the CMake build were missing and the
    compile failed on the first #include. The sdist made from the checkout's sources holds every
    file of csrc/, the CMake build with its C++ tests and the license; pip builds _C from it alone
    (CPU kernels), and that build computes the same step as the one under test, to the bit."""
    import tarfile

    sources = list(_sources_an_sdist_needs())
    tree = tmp_path / "tree"
    for name in sources:  # a clean tree: no build folders, no _C, no egg-info
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(os.path.join(ROOT, name), tree / name)
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    made = subprocess.run([sys.executable, "-c", code, str(tmp_path / "dist")], cwd=tree, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert made.returncode == 0, made.stderr
    sdist = tmp_path / "dist" / made.stdout.split()[-1]
    with tarfile.open(sdist) as archive:
        held = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert not set(sources) - held, f"missing from the sdist (MANIFEST.in): {sorted(set(sources) - held)}"

    site = tmp_path / "site"
    env = dict(os.environ, GRADSPARSE_CUDA="0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    built = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-build-isolation",
         "--no-deps", "--no-index", "--target", str(site), str(sdist)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert built.returncode == 0, built.stdout + built.stderr[-4000:]
    steps = {}
    for which, path in (("sdist", str(site)), ("tested", os.path.dirname(os.path.dirname(gradsparse.__file__)))):
        out = _import_with({"PYTHONPATH": path}, _ONE_STEP.format(store=tmp_path / f"store-{which}"))
        assert out.returncode == 0, out.stderr
        module, steps[which] = out.stdout.split("\n", 1)
        assert module.startswith(path), (which, module, path)
    assert steps["sdist"] == steps["tested"]
    assert len(steps["sdist"].split()) == 64 * 8 + 8
