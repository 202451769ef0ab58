#!/usr/bin/env bash
# The long fuzz run (not CI): every target at once, JOBS processes each
# sharing one corpus per target, for SECONDS, from the committed seeds.
#   tests/fuzz/long_run.sh BIN_DIR SECONDS JOBS OUT_DIR
# BIN_DIR holds the *_fuzz binaries (build-fuzz/tests/fuzz). Prints per target:
# executions (all jobs), crash/leak/timeout/OOM artifacts, and cov: of the
# union corpus (features and edges, one -runs=0 pass over it at the end).
set -uo pipefail
bins=$(cd "$1" && pwd) seconds=$2 jobs=$3 out=$(mkdir -p "$4" && cd "$4" && pwd)
here=$(cd "$(dirname "$0")" && pwd)
targets="json forward_backward zstd safetensors adapter_config"
mkdir -p "$out"
start=$(date +%s)
for t in $targets; do
  mkdir -p "$out/$t/corpus" "$out/$t/artifacts"
  dict=()
  [ -f "$here/$t.dict" ] && dict=(-dict="$here/$t.dict")
  (cd "$out/$t" && "$bins/${t}_fuzz" -jobs="$jobs" -workers="$jobs" -max_total_time="$seconds" -timeout=10 \
     -rss_limit_mb=2560 -print_final_stats=1 -artifact_prefix="$out/$t/artifacts/" "${dict[@]}" \
     corpus "$here/corpus/$t" > main.log 2>&1) &
done
wait
echo "wall $(( $(date +%s) - start )) s, $jobs jobs per target, -max_total_time=$seconds"
total=0
for t in $targets; do
  execs=$(cat "$out/$t"/fuzz-*.log 2>/dev/null | awk '/stat::number_of_executed_units/ {s += $2} END {print s + 0}')
  finished=$(cat "$out/$t"/fuzz-*.log 2>/dev/null | awk '/stat::number_of_executed_units/ {n++} END {print n + 0}')
  crashes=$(ls "$out/$t/artifacts" | wc -l)
  cov=$("$bins/${t}_fuzz" -runs=0 "$out/$t/corpus" "$here/corpus/$t" 2>&1 | grep -o 'INITED cov: [0-9]* ft: [0-9]* corp: [0-9]*' | tail -1)
  units=$(ls "$out/$t/corpus" | wc -l)
  echo "$t: executions $execs (jobs finished $finished/$jobs), artifacts $crashes, $cov, new corpus units $units"
  total=$((total + execs))
done
echo "total executions $total"
