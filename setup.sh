#!/usr/bin/env bash
# Installs loom's dependencies from Debian's archive, then configures and
# builds Release into build/. Idempotent: re-running only rebuilds what changed.
#   ./setup.sh          CPU build (Debian libtorch 1.13), then runs `loom demo`
#   ./setup.sh --build  CPU build only
#   ./setup.sh --gpu    GPU build against the PyTorch wheel's libtorch (H200 machine), into build-gpu/
set -euo pipefail
cd "$(dirname "$0")"

mode=cpu
run_demo=1
for a in "$@"; do
  case "$a" in
    --gpu) mode=gpu ;;
    --build) run_demo=0 ;;
    *) echo "setup.sh: unknown flag $a" >&2; exit 2 ;;
  esac
done

PKGS="libtorch-dev libopenblas0-openmp libboost1.81-dev nlohmann-json3-dev libfmt-dev libspdlog-dev
      libcli11-dev libprotobuf-dev protobuf-compiler libzstd-dev libsqlite3-dev libgtest-dev libgmock-dev
      googletest libbenchmark-dev cmake ninja-build g++ pkg-config python3 clang libclang-rt-14-dev
      libgloo-dev chromium"  # chromium: the dashboard's browser test (tests/integration/dashboard_browser_test.cpp)
# libgloo-dev: the headers of libtorch's c10d Gloo process group (tensor parallel on the CPU, engine/model/parallel.h)

if [ "$mode" = cpu ]; then
  missing=$(dpkg-query -W -f='${Package} ${Status}\n' $PKGS 2>/dev/null | grep -vc "install ok installed" || true)
  if [ "$missing" != 0 ] || [ "$(dpkg-query -W -f='${Package}\n' $PKGS 2>/dev/null | wc -l)" -lt "$(echo $PKGS | wc -w)" ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends $PKGS
  fi
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
  cmake --build build -j "$(nproc)"
  if [ "$run_demo" = 1 ]; then
    exec ./build/loom demo
  fi
else
  # The GPU machine has no package archive; its toolchain, Boost, protobuf,
  # fmt, nlohmann and gtest are preinstalled. sqlite3.h is missing there, so
  # the registry is built only when a header is found (see docs/architecture.md).
  prefix=$(python3 -c 'import torch;print(torch.utils.cmake_prefix_path)')
  extra=()
  if [ -n "${LOOM_SQLITE_PREFIX:-}" ]; then
    extra+=("-DSQLite3_INCLUDE_DIR=$LOOM_SQLITE_PREFIX/usr/include" "-DSQLite3_LIBRARY=$LOOM_SQLITE_PREFIX/usr/lib/x86_64-linux-gnu/libsqlite3.so")
  fi
  cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
        -DTORCH_CUDA_ARCH_LIST=9.0a "${extra[@]}"
  cmake --build build-gpu -j "$(nproc)"
fi
