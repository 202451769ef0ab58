#!/usr/bin/env bash
# Builds (installing dependencies if needed) and runs every test through ctest.
set -euo pipefail
cd "$(dirname "$0")"
./setup.sh --build
cd build
ctest --output-on-failure -j 2 "$@"
