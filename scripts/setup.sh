#!/usr/bin/env bash
# Installs what gradsparse needs on a Debian/Ubuntu machine, then builds and installs it
# (editable) into the Python environment that scripts/env.sh chooses: $PYTHON (default python3),
# or, when that is externally managed (PEP 668, as Debian's own python3 is), a virtual
# environment made from it at $GRADSPARSE_VENV (default .venv), created here.
#
#   bash scripts/setup.sh demo   # PyTorch (CPU), the offline datasets, the package: enough for the demo
#   bash scripts/setup.sh test   # + CMake, Ninja, GoogleTest, OpenMPI and pytest: the test suite
#
# The offline datasets of the examples: Fashion-MNIST (dataset-fashion-mnist), the King James
# Bible (bible-kjv, examples.lstm) and MovieLens-100K (inside the recbole package, examples.ncf).
#
# A torch already installed in the supported range (2.13 to 2.15, CPU or CUDA build) is kept;
# gradsparse is then built against it.
#
# Variables: PYTHON (default python3), GRADSPARSE_VENV (see above), GRADSPARSE_TORCH (torch to
# install when none in the supported range is present; default torch==2.13.0),
# GRADSPARSE_REBUILD=1 (build even when the installed build is newer than the sources), and the
# build variables of setup.py (GRADSPARSE_CUDA, GRADSPARSE_DEBUG, TORCH_CUDA_ARCH_LIST, MAX_JOBS; see
# the README).
set -euo pipefail
mode="${1:-demo}"
case "$mode" in demo | test) ;; *) echo "usage: $0 [demo|test]" >&2; exit 2 ;; esac
source "$(dirname "$0")/env.sh"  # from the caller's directory: a relative PYTHON is a path from there
cd "$(dirname "$0")/.."

apt_packages=(dataset-fashion-mnist bible-kjv g++)
if [ "$mode" = test ]; then
  apt_packages+=(cmake ninja-build libgtest-dev openmpi-bin libopenmpi-dev)
fi
if [ -n "$GRADSPARSE_VENV" ]; then
  apt_packages+=(python3-venv)
fi
if ! dpkg -s "${apt_packages[@]}" > /dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
fi
# Made again where a run was interrupted while making it (an interpreter there, but no pip).
if [ -n "$GRADSPARSE_VENV" ] && ! "$PYTHON" -m pip --version > /dev/null 2>&1; then
  echo "$GRADSPARSE_BASE_PYTHON is externally managed (PEP 668): installing into a virtual environment at $GRADSPARSE_VENV"
  "$GRADSPARSE_BASE_PYTHON" -m venv --clear "$GRADSPARSE_VENV"
fi

pip=("$PYTHON" -m pip install -q --disable-pip-version-check)
# Keep a torch that is already installed in the supported range (for example a CUDA build).
if ! "$PYTHON" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(not ((2, 13) <= v < (2, 16)))' 2> /dev/null; then
  "${pip[@]}" "${GRADSPARSE_TORCH:-torch==2.13.0}"
fi
"${pip[@]}" numpy tqdm tensorboard matplotlib ninja "setuptools>=77" wheel
if [ "$mode" = test ]; then
  # The versions the Lightning, Accelerate and Transformers tests were written against (the extras
  # allow newer); Accelerate 1.16 and Transformers 5 need Python 3.11.
  "${pip[@]}" "pytest>=8" "pytest-timeout>=2.3" scipy lightning==2.6.6 \
    "accelerate==1.16.0; python_version >= '3.11'" "accelerate==1.15.0; python_version < '3.11'" \
    "transformers==5.25.0; python_version >= '3.11'" "transformers==4.57.6; python_version < '3.11'"
fi
# MovieLens-100K for examples.ncf: only the data file shipped in the package is used, so none of
# recbole's own dependencies are needed. Last: pip reports the dependencies it lacks (in red) at
# every later install of a package it depends on (scipy, the test extras).
"${pip[@]}" --no-deps recbole==1.2.1
# torch's BuildExtension looks for ninja on PATH (else it builds one file at a time): pip put it
# beside the interpreter.
PATH="$(python_bin):$PATH"
# Build (a few minutes) unless this checkout's build is installed and newer than every source
# file; GRADSPARSE_REBUILD=1 always builds (for example after changing a build variable).
if [ "${GRADSPARSE_REBUILD:-0}" = 1 ] || ! "$PYTHON" -c 'import glob, os, sys
import gradsparse  # raises ImportError when built against another torch
built = gradsparse._C.__file__
if os.path.dirname(os.path.realpath(built)) != os.path.realpath("python/gradsparse"):
    sys.exit(1)  # another copy of gradsparse is installed
sources = glob.glob("csrc/**/*", recursive=True) + ["setup.py", "pyproject.toml"]
sys.exit(0 if os.path.getmtime(built) >= max(map(os.path.getmtime, sources)) else 1)' 2> /dev/null; then
  "${pip[@]}" --no-build-isolation -e .
fi
"$PYTHON" -c 'import gradsparse, sys; print("gradsparse", gradsparse.__version__, "installed into", sys.prefix, "- CUDA kernels:", gradsparse.built_with_cuda())'
