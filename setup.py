"""Builds gradsparse._C from csrc/ with torch.utils.cpp_extension.

Every build variable is read here, in BuildOptions (documented in the README):

    GRADSPARSE_CUDA       "1" builds the CUDA kernels, "0" does not; unset: build them when
                          torch is a CUDA build (torch.version.cuda) and CUDA_HOME is found.
                          A GPU is never needed at build time (login nodes have none).
    GRADSPARSE_MPI        "1" builds MpiTransport (transport="mpi"), "0" does not; unset: when
                          `mpicxx` (or $MPICXX) is found. Its compile and link flags come from
                          `mpicxx --showme:compile` (Open MPI) or `mpicxx -compile_info` (MPICH).
    GRADSPARSE_DEBUG      "1" compiles with -O0 -g (otherwise -O3 -g0).
    TORCH_CUDA_ARCH_LIST  CUDA architectures; default "8.0;9.0" (sm_80 and sm_90).
    MAX_JOBS              parallel compile jobs (ninja), as for any PyTorch extension.
"""

import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name):
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    if value not in ("0", "1"):
        raise SystemExit(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


class BuildOptions:
    """All build flags in one place, with their defaults."""

    def __init__(self):
        import torch
        from torch.utils.cpp_extension import CUDA_HOME

        forced = _flag("GRADSPARSE_CUDA")
        toolkit = CUDA_HOME is not None and os.path.exists(os.path.join(CUDA_HOME, "include", "cuda_runtime_api.h"))
        auto_cuda = bool(torch.version.cuda) and toolkit
        if forced is True and not torch.version.cuda:
            raise SystemExit(
                "GRADSPARSE_CUDA=1 but the installed torch is a CPU build "
                f"({torch.__version__}); install a CUDA build of torch first, or unset GRADSPARSE_CUDA."
            )
        if forced is True and not toolkit:
            raise SystemExit(
                f"GRADSPARSE_CUDA=1 but no CUDA toolkit was found (CUDA_HOME={CUDA_HOME}); set CUDA_HOME to the "
                "toolkit root, the folder holding bin/nvcc and include/cuda_runtime_api.h, or unset GRADSPARSE_CUDA."
            )
        self.cuda = auto_cuda if forced is None else forced
        self.mpi_flags = _mpi_flags(_flag("GRADSPARSE_MPI"))
        self.debug = bool(_flag("GRADSPARSE_DEBUG"))
        if self.cuda:
            os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")


def _mpi_flags(forced):
    """(compile flags, link flags) of the MPI compiler wrapper, or None to build without MPI."""
    import shlex
    import shutil
    import subprocess

    if forced is False:
        return None
    wrapper = os.environ.get("MPICXX") or shutil.which("mpicxx")
    if wrapper is not None:
        for compile_args, link_args in ((["--showme:compile"], ["--showme:link"]), (["-compile_info"], ["-link_info"])):
            try:
                compile_flags = subprocess.run([wrapper, *compile_args], capture_output=True, text=True, check=True)
                link_flags = subprocess.run([wrapper, *link_args], capture_output=True, text=True, check=True)
            except (OSError, subprocess.CalledProcessError):
                continue
            keep = [f for f in shlex.split(compile_flags.stdout) if f.startswith(("-I", "-D", "-pthread"))]
            link = [f for f in shlex.split(link_flags.stdout) if f.startswith(("-L", "-l", "-Wl", "-pthread"))]
            return keep, link
    if forced:
        raise SystemExit(
            "GRADSPARSE_MPI=1 but no MPI compiler wrapper was found; install an MPI (for example "
            "apt-get install libopenmpi-dev) or set MPICXX to its mpicxx"
        )
    return None


def _sources(*patterns):
    found = []
    for pattern in patterns:
        found += sorted(glob.glob(os.path.join(ROOT, pattern)))
    return [os.path.relpath(p, ROOT) for p in found]


def extensions():
    from torch.utils.cpp_extension import CppExtension, CUDAExtension

    options = BuildOptions()
    cpu_sources = _sources(
        "csrc/core/kernels/cpu/*.cpp",
        "csrc/core/method/*.cpp",
        "csrc/core/exchange/*.cpp",
        "csrc/core/transport/*.cpp",
        "csrc/torch/*.cpp",
    )
    cuda_only = {os.path.join("csrc", "torch", "engine_cuda.cpp")}
    opt = ["-O0", "-g"] if options.debug else ["-O3"]
    # The C++ standard is left to torch.utils.cpp_extension: C++17 for torch 2.13, C++20 from 2.14.
    # -ffp-contract=off: no fused multiply-add, so the CPU kernels compute what the GPU's and the
    # tests' re-statements compute (numeric.h scale_add), on every -march.
    # -g0 (not a debug build): no debug information, which Python's CFLAGS (passed on by
    # torch.utils.cpp_extension) ask for with -g; the C++ compiles take about a third less time,
    # the pybind11 bindings 62 s instead of 97 s here.
    cxx = [*opt, *([] if options.debug else ["-g0"]), "-fopenmp", "-fvisibility=hidden", "-ffp-contract=off"]
    link = ["-fopenmp"]
    if options.mpi_flags is not None:
        cxx += [*options.mpi_flags[0], "-DGRADSPARSE_WITH_MPI"]
        link += options.mpi_flags[1]
    kwargs = dict(
        name="gradsparse._C",
        include_dirs=[os.path.join(ROOT, "csrc", "core", "include")],
        extra_link_args=link,
    )
    if not options.cuda:
        sources = [s for s in cpu_sources if s not in cuda_only]
        return [CppExtension(sources=sources, extra_compile_args={"cxx": cxx}, **kwargs)]
    sources = cpu_sources + _sources("csrc/core/kernels/cuda/*.cu", "csrc/torch/*.cu")
    nvcc = [*opt, "-DGRADSPARSE_WITH_CUDA", "--expt-relaxed-constexpr"]
    if options.mpi_flags is not None:
        nvcc += [*[f for f in options.mpi_flags[0] if not f.startswith("-pthread")], "-DGRADSPARSE_WITH_MPI"]
    return [
        CUDAExtension(
            sources=sources,
            extra_compile_args={"cxx": [*cxx, "-DGRADSPARSE_WITH_CUDA"], "nvcc": nvcc},
            **kwargs,
        )
    ]


def _check_shared_libstdcxx(path):
    """Fails the build when the compiler linked its own copy of libstdc++ into _C (a toolchain
    that links it statically, such as some CXX=/opt/... compilers): torch uses the system's shared
    libstdc++, and two copies in one process crash on the first error message or exception."""
    import sys

    if not sys.platform.startswith("linux") or not os.path.exists(path):
        return
    with open(path, "rb") as f:
        if b"libstdc++.so" in f.read():
            return
    os.remove(path)
    compiler = os.environ.get("CXX", "c++")
    raise SystemExit(
        f"gradsparse: {compiler} linked libstdc++ statically into {os.path.basename(path)}, but torch loads the "
        "shared libstdc++: two copies in one process crash at the first exception. Build with a compiler that "
        "links it dynamically, e.g. CXX=/usr/bin/g++ CC=/usr/bin/gcc (and check that "
        "`ldd` on the built module lists libstdc++.so.6)."
    )


def build_ext_command():
    """torch's BuildExtension, which also writes gradsparse/_build.py beside the built _C: the torch
    _C is compiled against, compared with the running torch when gradsparse is imported (a
    mismatch raises a clear ImportError instead of an undefined symbol). Beside _C rather than in
    the source tree, so that builds against two torches (an editable install and a wheel) from
    one checkout each keep their own record."""
    import torch
    from torch.utils.cpp_extension import BuildExtension

    class BuildWithRecord(BuildExtension):
        def run(self):
            super().run()
            for ext in self.extensions:
                module = self.get_ext_fullpath(ext.name)
                _check_shared_libstdcxx(module)
                path = os.path.join(os.path.dirname(module), "_build.py")
                with open(path, "w") as f:
                    f.write(
                        '"""Written when gradsparse._C was built: the torch it was compiled against."""\n\n'
                        f"TORCH_VERSION = {torch.__version__!r}\n"
                    )

    return BuildWithRecord.with_options(use_ninja=True)


def _check_setuptools():
    """pyproject.toml's license is an SPDX expression, which setuptools reads from version 77 on; an
    older one (a new virtual environment of Python 3.10 or 3.11 has 65) fails on it with a schema
    error that names neither. --no-build-isolation builds with the environment's own setuptools."""
    import setuptools

    if int(setuptools.__version__.split(".")[0]) < 77:
        raise SystemExit(
            f"gradsparse: building needs setuptools>=77 (pyproject.toml's license field), this environment has "
            f'setuptools {setuptools.__version__}; run pip install "setuptools>=77" wheel ninja, then the '
            "pip install --no-build-isolation command again."
        )


def main():
    _check_setuptools()
    setup(
        packages=find_packages("python"),
        package_dir={"": "python"},
        ext_modules=extensions(),
        cmdclass={"build_ext": build_ext_command()},
    )


if __name__ == "__main__":
    main()
