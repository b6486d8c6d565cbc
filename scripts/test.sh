#!/usr/bin/env bash
# Sets up everything and runs the whole test suite: GoogleTest through ctest (the C++ core),
# then pytest (ops, API, and multi-process Gloo tests). Exits non-zero on any failure.
set -euo pipefail
# setup.sh and env.sh from the caller's directory: a relative PYTHON is a path from there
bash "$(dirname "$0")/setup.sh" test
source "$(dirname "$0")/env.sh"  # the interpreter setup.sh installed into
cd "$(dirname "$0")/.."
torch_prefix=$("$PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
cmake -S . -B build/cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADSPARSE_TORCH_TESTS=ON \
  "-DCMAKE_PREFIX_PATH=$torch_prefix" > /dev/null
cmake --build build/cmake
(cd build/cmake && ctest --no-tests=error --output-on-failure -j2)  # in its folder: 3.18 and 3.19 ignore a folder given
"$PYTHON" -m pytest -ra --durations=15  # the slowest tests listed: where CI time goes
