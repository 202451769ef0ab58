#!/usr/bin/env bash
# Issue 19's sampler figures in one run, with a summary against its targets:
#  - contention: the light tenant's p99 beside the flood against idle (target
#    at most 2x), for each cap and riders setting in CAPS;
#  - the decode rows (base, 1 and 8 adapters at batch 1 and 64): the batch-1
#    step against the weights' memory floor (target at most 2x), 8 adapters
#    at batch 64 against the base (decode at least 0.85x, prefill at most 1.3x);
#  - a batch-1 prefill of a 2,048-token prompt, base and one adapter, beside
#    HF generate()'s time to the first token;
#  - the 10-turn multi-turn bench (the prefix cache on and off);
#  - HF generate() decode at batch 1 and 64.
# With --cpu, the loom commands on the embedded tiny model (no HF rows: they
# need CUDA), to check the script.
#
#   bench/sample_table.sh [--cpu]
#
# Env: LOOM (default build-gpu/loom, build/loom with --cpu), MODEL (a model
# directory; default: qwen3-4b made once under WORK), WORK (default
# /tmp/loom-sample-table), CAPS (default "32:on 32:off 0:on": cap:riders of
# --contended-prefill-tokens and --contended-prefill-riders; cap 0 = the
# device's default), LIGHT (light requests a contention row, default 20),
# PARTS (which parts run, default all: "contention decode prefill multiturn hf";
# a subset keeps the other parts' earlier outputs, so that one table can be
# measured over two calls of the same warm machine and summarised whole).
set -euo pipefail
cd "$(dirname "$0")/.."
CPU=0
for a in "$@"; do
  case "$a" in
    --cpu) CPU=1 ;;
    *) echo "sample_table.sh: unknown flag $a" >&2; exit 2 ;;
  esac
done
LOOM=${LOOM:-$([ $CPU = 1 ] && echo build/loom || echo build-gpu/loom)}
WORK=${WORK:-/tmp/loom-sample-table}
CAPS=${CAPS:-32:on 32:off 0:on}
LIGHT=${LIGHT:-20}
ALL_PARTS="contention decode prefill multiturn hf"
PARTS=${PARTS:-$ALL_PARTS}
for p in $PARTS; do
  case " $ALL_PARTS " in *" $p "*) ;; *) echo "sample_table.sh: unknown part $p (PARTS: $ALL_PARTS)" >&2; exit 2 ;; esac
done
want() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
mkdir -p "$WORK"
if [ $CPU = 1 ]; then
  SRC=(--threads 2); PREFILL=256
else
  if [ -z "${MODEL:-}" ]; then
    MODEL=$WORK/q4
    [ -f "$MODEL/config.json" ] || "$LOOM" make-model --arch qwen3 --preset qwen3-4b --seed 1 --out "$MODEL" >&2
  fi
  SRC=(--model "$MODEL" --device cuda); PREFILL=2048
fi
OUTS=$WORK/outputs
[ "$PARTS" = "$ALL_PARTS" ] && rm -rf "$OUTS"
mkdir -p "$OUTS"
run() {  # run NAME CMD...: the command's output to OUTS/NAME and to stdout
  local name=$1; shift
  echo "+ $*"
  "$@" > "$OUTS/$name" 2>&1 || echo "(exit $?)" >> "$OUTS/$name"
  cat "$OUTS/$name"
}

if want contention; then
  for c in $CAPS; do
    run "contention_${c%%:*}_${c##*:}" "$LOOM" bench sample "${SRC[@]}" --contention --light-requests "$LIGHT" \
      --contended-prefill-tokens "${c%%:*}" --contended-prefill-riders "${c##*:}"
  done
fi
want decode && run decode "$LOOM" bench sample "${SRC[@]}" --batch 1 64 --adapters 0 1 8
want prefill && run prefill "$LOOM" bench sample "${SRC[@]}" --batch 1 --adapters 0 1 --prompt-len "$PREFILL" --new-tokens 2
want multiturn && run multiturn "$LOOM" bench sample "${SRC[@]}" --multi-turn
if [ $CPU = 0 ] && want hf; then
  run hf_prefill python3 bench/hf_generate.py "$MODEL" --prefill "$PREFILL"
  run hf_decode python3 bench/hf_generate.py "$MODEL"
fi

echo "== summary (issue 19's targets, which it states for the H200)"
python3 - "$OUTS" <<'EOF'
import os, re, sys
d = sys.argv[1]
def text(name):
    p = os.path.join(d, name)
    return open(p).read() if os.path.exists(p) else ""
for name in sorted(os.listdir(d)):
    if not name.startswith("contention_"):
        continue
    _, cap, riders = name.split("_")
    m = re.search(r"p50 ([\d.]+)x, p99 ([\d.]+)x; flood generated (\d+) tokens/s", text(name))
    if not m:
        print(f"contention cap {cap} riders {riders}: no figures (see {name})")
        continue
    p99 = float(m.group(2))
    print(f"contention cap {cap} riders {riders}: light p50 {m.group(1)}x, p99 {p99:.2f}x idle "
          f"(target 2x: {'met' if p99 <= 2 else 'not met'}), flood {m.group(3)} tokens/s")
rows = {}
for line in text("decode").splitlines():
    f = line.split()
    if len(f) == 12 and f[1].isdigit():
        rows[(f[0], int(f[1]))] = f
floor = re.search(r"([\d.]+) ms for all weights", text("decode"))
if ("base", 1) in rows and floor:
    step = float(rows[("base", 1)][4])
    ratio = step / float(floor.group(1))
    print(f"batch-1 decode step {step:.3f} ms = {ratio:.2f}x the floor {floor.group(1)} ms "
          f"(target 2x: {'met' if ratio <= 2 else 'not met'})")
if ("8", 64) in rows:
    dec, pre = float(rows[("8", 64)][10].rstrip("x")), float(rows[("8", 64)][11].rstrip("x"))
    print(f"8 adapters at batch 64: decode {dec:.2f}x the base (target 0.85x: {'met' if dec >= 0.85 else 'not met'}), "
          f"prefill {pre:.2f}x the base (target 1.3x: {'met' if pre <= 1.3 else 'not met'})")
pre = {f[0]: f[6] for f in (l.split() for l in text("prefill").splitlines()) if len(f) == 12 and f[1] == "1"}
hf = re.search(r"([\d.]+) ms to the first token", text("hf_prefill"))
if pre:
    print(f"batch-1 prefill of the long prompt: loom base {pre.get('base', '?')} ms, one adapter {pre.get('1', '?')} ms"
          + (f"; HF generate() {hf.group(1)} ms to the first token" if hf else ""))
mt = re.search(r"prefill over the conversation: .*", text("multiturn"))
if mt:
    print("multi-turn: " + mt.group(0))
for line in text("hf_decode").splitlines():
    if line.startswith("hf generate batch"):
        print(line)
EOF
