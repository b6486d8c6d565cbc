#!/usr/bin/env bash
# The C++ core on a 64-bit Arm CPU (aarch64, such as Grace or Graviton nodes) without one: the core
# and its GoogleTest suite cross-compiled with Debian's aarch64 toolchain (warnings are errors),
# the suite run under qemu-user (CMake's CMAKE_CROSSCOMPILING_EMULATOR; cmake_consumer runs its
# program through it too). There the CPU kernels take their portable code (kernels/cpu/simd.h), and
# what C++ leaves to the platform differs from x86-64: char is unsigned, a float converted out of
# an integer's range saturates. CI runs it (.ci/run). Not covered: MPI, the engine's test against
# libtorch, and weak memory ordering (qemu on an x86-64 host keeps the host's stronger ordering).
# Usage: bash scripts/cross_check.sh [--install-only | --build-only]
#   --install-only  install what it needs and stop (CI does so before its background jobs, so that
#                   no two apt-get runs overlap)
#   --build-only    configure and build, without running the suite
# Needs g++-aarch64-linux-gnu, qemu-user and googletest's sources (/usr/src/googletest), installed
# here with apt-get when missing and running as root.
set -euo pipefail
source "$(dirname "$0")/env.sh"  # apt_install_as_root
cd "$(dirname "$0")/.."
mode="$*"
case "$mode" in
  "" | --install-only | --build-only) ;;
  *) echo "cross_check.sh: unknown options \"$mode\": give --install-only, --build-only or nothing" >&2; exit 2 ;;
esac

missing=()
command -v aarch64-linux-gnu-g++ > /dev/null || missing+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 > /dev/null || missing+=(qemu-user)
[ -f /usr/src/googletest/CMakeLists.txt ] || missing+=(googletest)
command -v ninja > /dev/null || missing+=(ninja-build)
if [ ${#missing[@]} -gt 0 ] && ! apt_install_as_root "${missing[@]}"; then
  echo "cross_check.sh needs: apt-get install ${missing[*]}" >&2
  exit 1
fi
[ "$mode" != --install-only ] || exit 0

echo "== the C++ core and its suite for aarch64"
cmake -S . -B build/aarch64 -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_SYSTEM_NAME=Linux \
  -DCMAKE_SYSTEM_PROCESSOR=aarch64 -DCMAKE_CXX_COMPILER=aarch64-linux-gnu-g++ -DCMAKE_CXX_FLAGS=-Werror \
  -DGRADSPARSE_GTEST_SOURCE=/usr/src/googletest -DGRADSPARSE_MPI=OFF \
  "-DCMAKE_CROSSCOMPILING_EMULATOR=qemu-aarch64;-L;/usr/aarch64-linux-gnu" > /dev/null
cmake --build build/aarch64
[ "$mode" != --build-only ] || exit 0

echo "== the suite under qemu-aarch64"
(cd build/aarch64 && ctest --no-tests=error --output-on-failure -j2)
