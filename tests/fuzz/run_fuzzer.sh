#!/usr/bin/env bash
# Runs one fuzz target briefly (ctest's fuzz_* tests; see CMakeLists.txt):
#   run_fuzzer.sh BINARY SEED_DIR SECONDS ARTIFACT_DIR [libFuzzer flags...]
# Inputs it discovers go to a temporary first corpus dir; the committed seeds
# (the second dir) are only read. A crash, leak, UB, timeout or OOM exits
# non-zero and leaves the input in ARTIFACT_DIR. tests/fuzz/<seed dir name>.dict,
# when there is one, is the target's dictionary.
set -euo pipefail
bin=$1 seeds=$2 seconds=$3 artifacts=$4
shift 4
dict="$(dirname "$0")/$(basename "$seeds").dict"
if [ -f "$dict" ]; then set -- -dict="$dict" "$@"; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$artifacts"
"$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2560 -print_final_stats=1 \
       -artifact_prefix="$artifacts/" "$@" "$work" "$seeds"
