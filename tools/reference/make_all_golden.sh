#!/usr/bin/env bash
# Regenerates tests/golden/{qwen2,qwen3,qwen3_moe,gpt_oss,deepseek_v2,deepseek_v3,glm4_moe,mimo_v2_flash,glm_moe_dsa,qwen3_5_moe_text}
# with HF transformers + PEFT.
# Needs: a built `loom` (for make-model) and python3 with torch, transformers,
# peft, safetensors, numpy. Usage, from the repository root:
#   tools/reference/make_all_golden.sh [path/to/loom] [cpu|cuda] [arch ...]
# The archs default to all ten; e.g. `... build/loom cpu deepseek_v2 deepseek_v3`
# regenerates only those two.
set -euo pipefail
cd "$(dirname "$0")/../.."
loom=${1:-build/loom}
device=${2:-cpu}
shift $(( $# < 2 ? $# : 2 ))
archs=("$@")
if [ ${#archs[@]} -eq 0 ]; then
  archs=(qwen2 qwen3 qwen3_moe gpt_oss deepseek_v2 deepseek_v3 glm4_moe mimo_v2_flash glm_moe_dsa qwen3_5_moe_text)
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for arch in "${archs[@]}"; do
  "$loom" make-model --arch "$arch" --preset tiny --seed 1 --out "$tmp/$arch"
  rm -rf "tests/golden/$arch"
  python3 tools/reference/make_golden.py --model "$tmp/$arch" --out "tests/golden/$arch" --device "$device"
done
