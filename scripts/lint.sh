#!/usr/bin/env bash
# Lint checks run by CI: ruff (lint and format) on Python, clang-format on C++/CUDA.
# `bash scripts/lint.sh --fix` rewrites the files instead of checking them.
set -euo pipefail
case "$*" in
  "" | --fix) ;;
  *) echo "lint.sh: unknown arguments \"$*\": give --fix to rewrite the files, or nothing to check them" >&2; exit 2 ;;
esac
source "$(dirname "$0")/env.sh"  # from the caller's directory: a relative PYTHON is a path from there
require_python lint.sh
cd "$(dirname "$0")/.."
"$PYTHON" -m pip install -q --disable-pip-version-check "ruff>=0.6" "clang-format>=18"
bin="$(python_bin)"
ruff() { "$bin/ruff" "$@"; }
clang-format() { "$bin/clang-format" "$@"; }
# The C++ and CUDA files git tracks: outside a checkout none, and clang-format given no file read
# its standard input, passing without a check.
if ! listed="$(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')" || [ -z "$listed" ]; then
  echo "lint.sh: git lists no C++ file here: run it in a git checkout of gradsparse" >&2
  exit 2
fi
mapfile -t cxx <<< "$listed"
if [ "${1:-}" = "--fix" ]; then
  ruff check --fix .
  ruff format .
  clang-format -i "${cxx[@]}"
else
  ruff check .
  ruff format --check .
  clang-format --dry-run --Werror "${cxx[@]}"
fi
