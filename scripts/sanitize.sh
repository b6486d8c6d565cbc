#!/usr/bin/env bash
# The C++ core under sanitizers, and its fuzzers (CI runs all three; docs/architecture.md, "Faults"):
#   asan  the whole C++ suite (ctest, the engine's test included) under AddressSanitizer and
#         UndefinedBehaviorSanitizer (gcc);
#   tsan  the tests that run ranks, engines and transports on threads (exchanges, SparDL, the
#         engine) and the estimators (whose special functions ranks call at once) under
#         ThreadSanitizer (gcc; OpenMP off, since libgomp is not instrumented);
#   fuzz  each libFuzzer target of fuzz/ for FUZZ_SECONDS seconds (default 60) under ASan and
#         UBSan (clang); a finding leaves its input in build/fuzz/ and fails the script.
# Usage: bash scripts/sanitize.sh [--build-only] [asan] [tsan] [fuzz]   (all three when none is named)
#   --build-only  configure and build the steps' executables without running them (CI builds them
#                 in the background while the main test suite runs, then runs this script again)
# Needs the interpreter scripts/setup.sh installed torch into (for the engine's test), and
# clang with libFuzzer (installed here with apt-get when missing and running as root).
set -euo pipefail
source "$(dirname "$0")/env.sh"  # from the caller's directory: a relative PYTHON is a path from there
require_python sanitize.sh
cd "$(dirname "$0")/.."
build_only=0
steps=()
for arg in "$@"; do  # all checked before any build: a misspelt step ended the run after the others
  case "$arg" in
    --build-only) build_only=1 ;;
    asan | tsan | fuzz) steps+=("$arg") ;;
    *) echo "unknown step \"$arg\": choose asan, tsan or fuzz (and --build-only)" >&2; exit 2 ;;
  esac
done
[ ${#steps[@]} -gt 0 ] || steps=(asan tsan fuzz)
torch_prefix=$("$PYTHON" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
# Debug (assertions on) at -O1, with line tables only (-g1: enough for the sanitizers' stack traces,
# and a third less compile time than -g).
common=(-G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS=-O1 -DCMAKE_CXX_FLAGS_DEBUG=-g1 -DGRADSPARSE_TORCH_TESTS=ON
  "-DCMAKE_PREFIX_PATH=$torch_prefix")

# Waits for every one of the jobs, then fails if any failed (a failure does not leave the others running).
wait_all() {
  local status=0 pid
  for pid in "$@"; do wait "$pid" || status=1; done
  return $status
}

has_libfuzzer() {  # in a file of its own: a fixed path left by another user could not be written
  local probe status=0
  probe="$(mktemp)"
  echo 'extern "C" int LLVMFuzzerTestOneInput(const char*, unsigned long) { return 0; }' |
    clang++ -x c++ -fsanitize=fuzzer,address - -o "$probe" > /dev/null 2>&1 || status=1
  rm -f "$probe"
  return $status
}

for step in "${steps[@]}"; do
  case "$step" in
    asan)
      echo "== the C++ suite under AddressSanitizer + UndefinedBehaviorSanitizer"
      cmake -S . -B build/asan "${common[@]}" -DGRADSPARSE_SANITIZE=address,undefined > /dev/null
      cmake --build build/asan
      [ "$build_only" = 0 ] || continue
      (cd build/asan && ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1 \
        ctest --no-tests=error --output-on-failure -j2)
      ;;
    tsan)
      echo "== exchanges, SparDL, the engine and the estimators under ThreadSanitizer"
      cmake -S . -B build/tsan "${common[@]}" -DGRADSPARSE_SANITIZE=thread -DGRADSPARSE_OPENMP=OFF \
        -DGRADSPARSE_MPI=OFF > /dev/null
      cmake --build build/tsan --target test_exchange test_spardl test_engine test_estimators
      [ "$build_only" = 0 ] || continue
      # Side by side: test_exchange's fault tests mostly wait, while test_spardl keeps both cores busy.
      tests=()
      for t in test_exchange test_spardl test_engine test_estimators; do
        (TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1 "build/tsan/$t" --gtest_brief=1 2>&1 | sed "s/^/$t: /") &
        tests+=($!)
      done
      wait_all "${tests[@]}"
      ;;
    fuzz)
      echo "== libFuzzer targets, ${FUZZ_SECONDS:-60} s each, under ASan + UBSan"
      if ! has_libfuzzer; then
        apt_install_as_root clang libclang-rt-14-dev || true  # (checked next)
        has_libfuzzer || { echo "clang with libFuzzer is needed: apt-get install clang libclang-rt-14-dev" >&2; exit 1; }
      fi
      cmake -S . -B build/fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" \
        -DCMAKE_CXX_COMPILER=clang++ \
        -DGRADSPARSE_FUZZ=ON -DGRADSPARSE_SANITIZE=address,undefined -DGRADSPARSE_TESTS=OFF -DGRADSPARSE_BENCHMARKS=OFF -DGRADSPARSE_MPI=OFF \
        -DGRADSPARSE_OPENMP=OFF > /dev/null
      cmake --build build/fuzz --target fuzz_message fuzz_exchange
      [ "$build_only" = 0 ] || continue
      # The targets run side by side (each is one process on one core); a finding fails the wait.
      fuzzers=()
      for fuzzer in fuzz_message fuzz_exchange; do
        mkdir -p "build/fuzz/corpus/$fuzzer"
        # -malloc_limit_mb: no allocation beyond what a bucket's layout needs (buckets here are small).
        (cd build/fuzz && "./$fuzzer" -max_total_time="${FUZZ_SECONDS:-60}" -rss_limit_mb=2048 -malloc_limit_mb=256 \
          -print_final_stats=1 "corpus/$fuzzer" 2>&1 |
          grep -E "^stat::number_of_executed_units|ERROR|SUMMARY|Test unit written" | sed "s/^/$fuzzer: /") &
        fuzzers+=($!)
      done
      wait_all "${fuzzers[@]}"
      ;;
  esac
done
