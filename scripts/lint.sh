#!/usr/bin/env bash
# Lint checks run by CI: ruff (lint and format) on Python, clang-format on C++/CUDA.
# `bash scripts/lint.sh --fix` rewrites the files instead of checking them.
set -euo pipefail
source "$(dirname "$0")/env.sh"  # from the caller's directory: a relative PYTHON is a path from there
require_python lint.sh
cd "$(dirname "$0")/.."
"$PYTHON" -m pip install -q --disable-pip-version-check "ruff>=0.6" "clang-format>=18"
bin="$(python_bin)"
ruff() { "$bin/ruff" "$@"; }
clang-format() { "$bin/clang-format" "$@"; }
mapfile -t cxx < <(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')
if [ "${1:-}" = "--fix" ]; then
  ruff check --fix .
  ruff format .
  clang-format -i "${cxx[@]}"
else
  ruff check .
  ruff format --check .
  clang-format --dry-run --Werror "${cxx[@]}"
fi
