#!/usr/bin/env bash
# Issue 23's figures on a machine with several GPUs, in one run (or, with
# --cpu, the same commands on tiny models on the CPU, to check the script):
#   1. training scaling: Qwen3-30B-A3B shapes at one GPU, then at TP 2 + EP 2
#      (the target: at least 1.8x the one-GPU tokens/s at 2 GPUs);
#   2. GPT-OSS-120B and GLM-4.5-Air shapes over 2 (or 4) GPUs;
#   3. sampling throughput on 1, 2 and 4 sampler replicas, one GPU each.
# The whole 120B and Air models (234 and 214 GB) do not fit the disk beside a
# build, so those run with fewer layers (LAYERS, default 12): the per-layer
# cost and the slots scale from there.
#
#   bench/multi_gpu.sh [--cpu] [GPUS]    (GPUS: 2, 4 or 8; default: all of them)
# Prints each command and its output; results go to stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
CPU=0
if [ "${1:-}" = "--cpu" ]; then CPU=1; shift; fi
LOOM=${LOOM:-$([ $CPU = 1 ] && echo build/loom || echo build-gpu/loom)}
GPUS=${1:-$([ $CPU = 1 ] && echo 2 || nvidia-smi -L | wc -l)}
LAYERS=${LAYERS:-12}
WORK=${WORK:-$(mktemp -d /tmp/loom-multi-gpu-XXXX)}
if [ $CPU = 1 ]; then
  DEV="--device cpu"; MOE=(qwen3_moe tiny); OSS=(gpt_oss tiny); AIR=(glm4_moe tiny); DENSE=(qwen3 tiny)
  TOKENS=64; TENANTS=4; STEPS=2; LAYER_FLAG=()
else
  DEV="--device cuda"; MOE=(qwen3_moe qwen3-30b-a3b); OSS=(gpt_oss gpt-oss-120b); AIR=(glm4_moe glm-4.5-air)
  DENSE=(qwen3 qwen3-4b); TOKENS=1024; TENANTS=8; STEPS=5; LAYER_FLAG=(--layers "$LAYERS")
fi
run() { echo "+ $*"; "$@"; }
model() {  # model NAME ARCH PRESET [make-model flags...]
  local dir=$WORK/$1; shift
  [ -f "$dir/config.json" ] || run "$LOOM" make-model --arch "$1" --preset "$2" --seed 1 --out "$dir" "${@:3}" >&2
  echo "$dir"
}

echo "== 1. Qwen3-30B-A3B shapes: one GPU against TP 2 + EP 2 ($TENANTS tenants x $TOKENS tokens, rank 16)"
M=$(model moe "${MOE[@]}")
run "$LOOM" bench train --model "$M" $DEV --tenants $TENANTS --tokens-per-tenant $TOKENS --rank 16 --steps $STEPS
run "$LOOM" bench train --model "$M" $DEV --tenants $TENANTS --tokens-per-tenant $TOKENS --rank 16 --steps $STEPS --tp 2 --ep 2
if [ "$GPUS" -ge 4 ]; then
  run "$LOOM" bench train --model "$M" $DEV --tenants $TENANTS --tokens-per-tenant $TOKENS --rank 16 --steps $STEPS --ep 4
fi

echo "== 2. GPT-OSS-120B and GLM-4.5-Air shapes (${LAYER_FLAG[*]:-all layers}) over 2 and, with 4 GPUs, 4"
for m in OSS AIR; do
  eval "spec=(\"\${$m[@]}\")"
  D=$(model "$m" "${spec[@]}" "${LAYER_FLAG[@]}")
  run "$LOOM" bench train --model "$D" $DEV --tenants $TENANTS --tokens-per-tenant $TOKENS --rank 16 --steps $STEPS --tp 2 --ep 2
  if [ "$GPUS" -ge 4 ]; then
    run "$LOOM" bench train --model "$D" $DEV --tenants $TENANTS --tokens-per-tenant $TOKENS --rank 16 --steps $STEPS --tp 4 --ep 4
  fi
done

echo "== 3. sampling on 1, 2 and 4 replicas (qwen3-4b shapes, 8 adapters)"
S=$(model dense "${DENSE[@]}")
PIDS=(); PORTS=()
N=$([ "$GPUS" -ge 4 ] && echo 4 || echo "$GPUS")
for i in $(seq 0 $((N - 1))); do
  port=$((18100 + i))
  dev=$([ $CPU = 1 ] && echo cpu || echo "cuda:$i")
  "$LOOM" serve --role sampler --model "$S" --device "$dev" --port "$port" --data-dir "$WORK/replica$i" \
    --max-rank 16 > "$WORK/replica$i.log" 2>&1 &
  PIDS+=($!); PORTS+=("127.0.0.1:$port")
done
trap 'kill "${PIDS[@]}" 2>/dev/null || true' EXIT
for p in "${PORTS[@]}"; do  # each replica's banner
  until curl -sf "http://$p/replica/v1/health" > /dev/null 2>&1; do sleep 1; done
done
for n in 1 2 4; do
  [ "$n" -le "$N" ] || continue
  list=$(IFS=,; echo "${PORTS[*]:0:$n}")
  run "$LOOM" bench sample --model "$S" --replicas "$list" --rank 16 --adapters 8 \
    --batch $([ $CPU = 1 ] && echo 8 || echo 256) --prompt-len 32 --new-tokens $([ $CPU = 1 ] && echo 8 || echo 128)
done
