#!/usr/bin/env bash
# Builds (installing dependencies if needed) and runs every test through ctest.
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh --build
(cd build && ctest --output-on-failure -j 2 "$@")
# The decoders' libFuzzer targets (tests/fuzz/), built with clang into a
# build dir of their own, each run briefly from its committed seeds.
cmake -S . -B build-fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DLOOM_FUZZ=ON -DCMAKE_BUILD_TYPE=RelWithDebInfo
cmake --build build-fuzz -j "$(nproc)"
cd build-fuzz
ctest --output-on-failure -j 2
