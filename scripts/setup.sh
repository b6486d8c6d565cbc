#!/usr/bin/env bash
# Installs what gradsparse needs on a Debian/Ubuntu machine, then builds and installs it
# (editable) into the current Python environment.
#
#   bash scripts/setup.sh demo   # PyTorch (CPU), the offline datasets, the package: enough for the demo
#   bash scripts/setup.sh test   # + CMake, Ninja, GoogleTest, OpenMPI and pytest: the test suite
#
# The offline datasets of the examples: Fashion-MNIST (dataset-fashion-mnist), the King James
# Bible (bible-kjv, examples.lstm) and MovieLens-100K (inside the recbole package, examples.ncf).
#
# Variables: PYTHON (default python3), GRADSPARSE_TORCH (torch to install when none in the
# supported range is present; default torch==2.13.0), and the build variables of setup.py
# (GRADSPARSE_CUDA, GRADSPARSE_DEBUG, TORCH_CUDA_ARCH_LIST, MAX_JOBS; see the README).
set -euo pipefail
mode="${1:-demo}"
case "$mode" in demo | test) ;; *) echo "usage: $0 [demo|test]" >&2; exit 2 ;; esac
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

apt_packages=(dataset-fashion-mnist bible-kjv g++)
if [ "$mode" = test ]; then
  apt_packages+=(cmake ninja-build libgtest-dev openmpi-bin libopenmpi-dev)
fi
if ! dpkg -s "${apt_packages[@]}" > /dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${apt_packages[@]}"
fi

pip=("$PYTHON" -m pip install -q --disable-pip-version-check)
# Keep a torch that is already installed in the supported range (for example a CUDA build).
if ! "$PYTHON" -c 'import sys, torch; v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]); sys.exit(not ((2, 13) <= v < (2, 15)))' 2> /dev/null; then
  "${pip[@]}" "${GRADSPARSE_TORCH:-torch==2.13.0}"
fi
"${pip[@]}" numpy tqdm tensorboard matplotlib ninja "setuptools>=64" wheel
# MovieLens-100K for examples.ncf: only the data file shipped in the package is used, so none of
# recbole's own dependencies are needed.
"${pip[@]}" --no-deps recbole==1.2.1
if [ "$mode" = test ]; then
  "${pip[@]}" "pytest>=8" "pytest-timeout>=2.3" scipy
fi
"${pip[@]}" --no-build-isolation -e .
"$PYTHON" -c 'import gradsparse; print("gradsparse", gradsparse.__version__, "installed; CUDA kernels:", gradsparse.built_with_cuda())'
