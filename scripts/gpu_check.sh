#!/usr/bin/env bash
# The GPU check, one command on a machine with an NVIDIA GPU, torch (a CUDA build) and nvcc:
#
#   bash scripts/gpu_check.sh
#
# 1. cpp:    the core and its GoogleTest suites built with CUDA for this GPU's architecture;
#            ctest runs them all, the CUDA kernels against the CPU kernels included.
# 2. build:  the extension built with CUDA (GRADSPARSE_CUDA=1) into $PYTHON, editable.
# 3. pytest: `pytest -m cuda`: the ops on CUDA tensors against the CPU, every method training with
#            CUDA buckets over Gloo (2 ranks on one GPU) and over NCCL (1 rank), and the take-back of
#            a step that overflowed under nonfinite="propagate" with CUDA buckets.
# 4. train:  the CNN example, every method, 2 processes sharing the GPU over Gloo, then 1 over NCCL;
#            dense, Top-k and MiCRO under float16 loss scaling (--amp fp16, a GradScaler), 2 over Gloo.
# 5. bench:  benchmarks.select on the GPU: threshold and top-k selection against torch.topk, a
#            residual add and a device-to-device copy of the same bytes; every method's whole step
#            (engine, one-rank NCCL group) against the add.
# A stage that fails (or skips a test) fails the check; the others still run. The Markdown report
# lands in $GPU_CHECK_OUT/report.md (default build/gpu), each stage's log beside it; it is
# rewritten after every stage, so a check stopped part-way leaves the stages it ended.
#
# Variables: PYTHON and GRADSPARSE_VENV (the interpreter, as scripts/env.sh chooses it: the one
# scripts/setup.sh installed into), GPU_CHECK_OUT, GRADSPARSE_DATA_DIR (Fashion-MNIST's folder,
# default /usr/share/datasets/fashion-mnist; without it the training stage runs on random inputs of
# its shapes), GTEST_SOURCE (a GoogleTest source tree, for machines
# without libgtest-dev), GPU_CHECK_STEPS (training steps per method, default 20).
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# A relative PYTHON, GRADSPARSE_VENV (env.sh) or GPU_CHECK_OUT is a path from the caller's
# directory; the default report folder is the repository's build/gpu.
source "$ROOT/scripts/env.sh"
require_python gpu_check
OUT_DIR=$(mkdir -p "${GPU_CHECK_OUT:-$ROOT/build/gpu}" && cd "${GPU_CHECK_OUT:-$ROOT/build/gpu}" && pwd)
cd "$ROOT"
REPORT=$OUT_DIR/report.md
STEPS=${GPU_CHECK_STEPS:-20}
DATA=(${GRADSPARSE_DATA_DIR:+--data-dir "$GRADSPARSE_DATA_DIR"})
JOBS=$(nproc)
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MAX_JOBS=$JOBS

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: $PYTHON's torch sees no CUDA device (torch.cuda.is_available() is False); run this on a" \
    "machine with an NVIDIA GPU and a CUDA build of torch" >&2
  exit 2
fi
CAPABILITY=$("$PYTHON" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")

failed=()
stage() {  # stage NAME COMMAND...: runs COMMAND, its output in NAME.log, one line in the table
  local name=$1 start=$SECONDS status=passed
  shift
  echo "== $name: $*"
  if ! "$@" > "$OUT_DIR/$name.log" 2>&1; then
    status=FAILED
    failed+=("$name")
    tail -n 40 "$OUT_DIR/$name.log"
  fi
  echo "| $name | $status | $((SECONDS - start)) s |" >> "$OUT_DIR/stages.md"
  echo "== $name: $status ($((SECONDS - start)) s)"
  report
}

no_skips() {  # no_skips LOG: fails when the log reports a skipped test
  if grep -Eiq '(\*\*\*Skipped|[0-9]+ skipped)' "$1"; then
    echo "tests were skipped (a skipped test is not a passed one):"
    grep -Ei '(\*\*\*Skipped|SKIPPED|[0-9]+ skipped)' "$1" | head -20
    return 1
  fi
}

cpp() {
  cmake -S . -B build/gpu-cmake -G Ninja -DGRADSPARSE_CUDA=ON -DGRADSPARSE_CUDA_ARCHS="${CAPABILITY/./}" \
    -DGRADSPARSE_MPI=OFF ${GTEST_SOURCE:+-DGRADSPARSE_GTEST_SOURCE="$GTEST_SOURCE"} &&
    cmake --build build/gpu-cmake -j "$JOBS" &&
    (cd build/gpu-cmake && ctest --no-tests=error -j "$JOBS" --output-on-failure) | tee "$OUT_DIR/ctest.txt" &&
    no_skips "$OUT_DIR/ctest.txt"
}

build() {
  GRADSPARSE_CUDA=1 GRADSPARSE_MPI=0 TORCH_CUDA_ARCH_LIST=$CAPABILITY \
    "$PYTHON" -m pip install --no-build-isolation --no-deps -e . &&
    "$PYTHON" -c "import gradsparse as gs; assert gs.built_with_cuda(), 'gradsparse was built without CUDA'"
}

tests() {
  "$PYTHON" -m pytest -m cuda -p no:cacheprovider -rs tests/python/test_cuda.py tests/python/test_state.py | tee "$OUT_DIR/pytest.txt" &&
    no_skips "$OUT_DIR/pytest.txt"
}

train() {
  local every synthetic=""
  every=$("$PYTHON" -c "from examples import driver; print(','.join(driver.METHODS))") || return 1
  rm -rf "$OUT_DIR/train-gloo" "$OUT_DIR/train-nccl" "$OUT_DIR/train-fp16"
  # A GPU machine lent for the check often lacks the dataset: then random inputs of its shapes,
  # which exercise the same GPU paths (the accuracy column is then NaN).
  if ! "$PYTHON" -c "import sys; from examples.cnn import data; sys.exit(1 if data.fashion_mnist_missing(sys.argv[1] or None) else 0)" \
    "${GRADSPARSE_DATA_DIR:-}"; then
    synthetic="Fashion-MNIST was not found (GRADSPARSE_DATA_DIR, default /usr/share/datasets/fashion-mnist): the runs train on random inputs of its shapes (--synthetic-data), so their accuracy is NaN."
    echo "gpu_check: $synthetic"
    DATA+=(--synthetic-data)
  fi
  "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=2 -m examples.cnn --preset demo --backend gloo \
    --method "$every" --max-steps "$STEPS" --out "$OUT_DIR/train-gloo" --no-progress "${DATA[@]}" &&
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=1 -m examples.cnn --preset demo --backend nccl \
      --method "$every" --max-steps "$STEPS" --out "$OUT_DIR/train-nccl" --no-progress "${DATA[@]}" &&
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node=2 -m examples.cnn --preset demo --backend gloo \
      --method dense,topk,micro --amp fp16 --max-steps "$STEPS" --out "$OUT_DIR/train-fp16" --no-progress \
      "${DATA[@]}" &&
    "$PYTHON" scripts/gpu_train_table.py "$OUT_DIR/train-gloo" "$OUT_DIR/train-nccl" "$every" > "$OUT_DIR/train.md" &&
    if [ -n "$synthetic" ]; then printf '\n%s\n' "$synthetic" >> "$OUT_DIR/train.md"; fi
}

bench() {
  "$PYTHON" -m benchmarks.select --device cuda --sizes 1e6,25e6 --densities 0.01,0.001 --methods \
    --output "$OUT_DIR/select.md"
}

# The git tree of the files as they are here (tracked, and untracked but not ignored), hashed into
# a scratch index: names the contents exactly even where the checkout's .git is out of date (a
# copy of a working tree sent to a GPU machine).
files_tree() {
  local index
  index=$(mktemp -u)
  GIT_INDEX_FILE=$index git add -A . > /dev/null 2>&1 && GIT_INDEX_FILE=$index git write-tree 2> /dev/null || echo unknown
  rm -f "$index"
}

report() {  # the report as the stages so far left it: a check killed part-way keeps them
  {
  echo "# gradsparse GPU check"
  echo
  echo "- GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
  echo "- $("$PYTHON" -c "import torch, sys; print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), Python {sys.version.split()[0]}')")"
  echo "- nvcc: $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || echo 'not found')"
  echo "- files: git tree $(files_tree) (equals \`git rev-parse HEAD^{tree}\` of the commit with these contents;" \
    "the copy's own HEAD, $(git rev-parse --short HEAD 2>/dev/null || echo unknown), can be stale)"
  echo
  echo "| stage | result | time |"
  echo "|---|---|---|"
  cat "$OUT_DIR/stages.md"
  echo
  echo "ctest: $(grep -E 'tests passed|tests failed' "$OUT_DIR/ctest.txt" 2>/dev/null || echo 'no summary')"
  echo "pytest -m cuda: $(tail -n 1 "$OUT_DIR/pytest.txt" 2>/dev/null || echo 'not run')"
  echo
  [ -s "$OUT_DIR/train.md" ] && cat "$OUT_DIR/train.md" && echo
  [ -s "$OUT_DIR/select.md" ] && sed 's/^# /## /' "$OUT_DIR/select.md"
  } > "$REPORT"
}

: > "$OUT_DIR/stages.md"
rm -f "$OUT_DIR"/{ctest.txt,pytest.txt,train.md,select.md}  # an earlier check's, which the report would show
stage cpp cpp
stage build build
if [ -z "$(printf '%s\n' "${failed[@]}" | grep -x build)" ]; then
  stage pytest tests
  stage train train
  stage bench bench
else
  echo "| pytest, train, bench | not run (build failed) | |" >> "$OUT_DIR/stages.md"
  failed+=(pytest train bench)
  report
fi

echo "report: $REPORT"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: FAILED stages: ${failed[*]} (logs in $OUT_DIR)" >&2
  exit 1
fi
echo "gpu_check: every stage passed"
