#!/usr/bin/env bash
# Issue 17's table in one run: each `loom bench train` row with the HF+PEFT
# anchor of the same shape right after it, on the same model directory, then
# the rows that only have to fit, and a summary of loom / HF per row. With
# --cpu, the same commands on the tiny presets (no anchor: it needs CUDA), to
# check the script. With BEFORE=path/to/another/loom, each speed row also
# runs that binary right after this one (a before/after of one change, the
# same call; the summary gives both).
#
#   bench/train_table.sh [--cpu] [--fast]    (--fast: the four speed rows of qwen3-4b only)
#
# Env: LOOM (default build-gpu/loom, build/loom with --cpu), BEFORE, WORK
# (model directories, reused when present), STEPS (timed steps, default 3),
# HF_FIT=1: the anchor runs each step as passes of at most 2,048 tokens
# (`--micro-batch`, gradient accumulation: the same update) and a longer
# sequence with `--grad-ckpt`, for a card where the step does not fit at
# once (the H100: 4 x 2048 needs about 87 GiB); the summary names it hf-fit.
set -euo pipefail
cd "$(dirname "$0")/.."
CPU=0 FAST=0
for a in "$@"; do
  case "$a" in
    --cpu) CPU=1 ;;
    --fast) FAST=1 ;;
    *) echo "train_table.sh: unknown flag $a" >&2; exit 2 ;;
  esac
done
LOOM=${LOOM:-$([ $CPU = 1 ] && echo build/loom || echo build-gpu/loom)}
BEFORE=${BEFORE:-}
STEPS=${STEPS:-3}
WORK=${WORK:-/tmp/loom-train-table}
mkdir -p "$WORK"
if [ $CPU = 1 ]; then
  DEV=(--device cpu --threads 2); Q4=(qwen3 tiny); Q05=(qwen2 tiny); SCALE=16; LONG=1024
else
  DEV=(--device cuda); Q4=(qwen3 qwen3-4b); Q05=(qwen2 qwen2.5-0.5b); SCALE=1; LONG=32768
fi
model() {  # model NAME ARCH PRESET: the directory, made once
  local dir=$WORK/$1
  [ -f "$dir/config.json" ] || "$LOOM" make-model --arch "$2" --preset "$3" --seed 1 --out "$dir" >&2
  echo "$dir"
}
SUMMARY=$WORK/summary.txt
: > "$SUMMARY"
# The packed row's tokens/s (the one-tenant row where there is no packed one).
# On a GPU the row ends in tokens/s, MFU and peak GiB; on the CPU in tokens/s.
COL=$([ $CPU = 1 ] && echo 0 || echo 2)
tok_s() { awk -v c="$COL" '/tenants packed/ {p=$(NF-c)} /^1 tenant / {o=$(NF-c)} END {print (p != "" ? p : o)}'; }
loom_row() {  # loom_row LABEL BIN MODEL TENANTS TOKENS [flags...]
  local label=$1 bin=$2 m=$3 t=$4 l=$5; shift 5
  echo "+ $bin bench train --model $m ${DEV[*]} --rank 32 --tenants $t --tokens-per-tenant $l --steps $STEPS $*"
  local out
  out=$("$bin" bench train --model "$m" "${DEV[@]}" --rank 32 --tenants "$t" --tokens-per-tenant "$l" --steps "$STEPS" "$@" 2>&1) || true
  echo "$out" | grep -E "memory plan|tenant|ratio|error|loom bench" || true
  echo "$label $(echo "$out" | tok_s)" >> "$SUMMARY"
}
hf_row() {  # hf_row LABEL MODEL BATCH SEQLEN
  [ $CPU = 1 ] && return 0
  local fit=()
  if [ "${HF_FIT:-0}" = 1 ]; then
    local m=$(( $4 >= 2048 ? 1 : 2048 / $4 ))
    [ "$m" -gt "$3" ] && m=$3
    while [ $(( $3 % m )) -ne 0 ]; do m=$(( m - 1 )); done
    fit=(--micro-batch "$m")
    [ "$4" -gt 2048 ] && fit+=(--grad-ckpt)
  fi
  echo "+ python3 bench/hf_peft_train.py $2 $3 $4 32 --steps $STEPS --warmup 1 ${fit[*]}"
  local out
  out=$(python3 bench/hf_peft_train.py "$2" "$3" "$4" 32 --steps "$STEPS" --warmup 1 "${fit[@]}" 2>&1 | tail -1) || true
  echo "$out"
  echo "$1 $(echo "$out" | python3 -c 'import json,sys; print(json.loads(sys.stdin.read()).get("tokens_per_s", "error"))' 2>/dev/null || echo error)" >> "$SUMMARY"
}
speed() {  # speed NAME MODEL TENANTS TOKENS: loom (and BEFORE) then HF at batch TENANTS x TOKENS
  local l=$(( $4 / SCALE ))
  loom_row "$1 loom" "$LOOM" "$2" "$3" "$l"
  [ -n "$BEFORE" ] && loom_row "$1 before" "$BEFORE" "$2" "$3" "$l"
  hf_row "$1 $([ "${HF_FIT:-0}" = 1 ] && echo hf-fit || echo hf)" "$2" "$3" "$l"
}

M4=$(model q4 "${Q4[@]}")
speed 4x2048 "$M4" 4 2048
speed 1x8192 "$M4" 1 8192
speed 16x512 "$M4" 16 512
speed 1x128 "$M4" 1 $((128 * SCALE))
if [ $FAST = 0 ]; then
  M05=$(model q05 "${Q05[@]}")
  speed q05-8x2048 "$M05" 8 2048
  # Rows that only have to fit (no anchor: HF+PEFT runs out of memory or has one adapter).
  STEPS=2 loom_row "16x1024 fits" "$LOOM" "$M4" 16 $((1024 / SCALE)) --warmup 1
  STEPS=2 loom_row "64x128 fits" "$LOOM" "$M4" 64 $((128 / SCALE)) --warmup 1
  STEPS=1 loom_row "1x$LONG fits" "$LOOM" "$M4" 1 "$LONG" --warmup 1
fi

echo "== summary (tokens/s; loom / hf where both ran)"
python3 - "$SUMMARY" <<'EOF'
import sys
rows = {}
for line in open(sys.argv[1]):
    parts = line.split()
    if len(parts) == 3:
        rows.setdefault(parts[0], {})[parts[1]] = parts[2]
for name, r in rows.items():
    cells = [f"{k} {v}" for k, v in r.items()]
    try:
        for hf in ("hf", "hf-fit"):
            if hf in r:
                cells.append(f"loom/{hf} {float(r['loom']) / float(r[hf]):.2f}x")
        if "before" in r:
            cells.append(f"loom/before {float(r['loom']) / float(r['before']):.3f}x")
    except ValueError:
        pass
    print(f"{name}: " + ", ".join(cells))
EOF
