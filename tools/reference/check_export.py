#!/usr/bin/env python3
"""Checks `loom export` against Hugging Face transformers + PEFT.

    python3 tools/reference/check_export.py --model BASE_DIR --adapter SNAPSHOT_DIR \
        --merged MERGED_DIR [--vllm VLLM_DIR] [--device cpu|cuda] [--dtype fp32|bf16] [--tol T]

MERGED_DIR is `loom export --format merged` of SNAPSHOT_DIR on BASE_DIR, VLLM_DIR
(optional) its `--format vllm --drop-lm-head`. The script loads the merged
directory with transformers alone and the base with the snapshot through
PEFT (as make_golden.py loads them: eager attention and experts, no missing
or unexpected weights), runs both on a few random sequences and compares the
per-token logprobs. With --vllm on a dense model it also loads that
directory through PEFT and compares it with the snapshot whose lm_head LoRA
is zeroed (what --drop-lm-head leaves out); on an MoE model transformers
fuses the experts, so PEFT cannot place the per-expert modules vLLM reads,
and only the layout is checked (keys, target_modules, no lm_head).

Prints one JSON line: the largest |logprob difference| of each comparison
and how far the adapter moves the base's logprobs (so a match is not the
trivial one of an adapter that does nothing). Exits 1 on a mismatch above
--tol (default 1e-4 in fp32; pass a bf16 tolerance with --dtype bf16).
"""
import argparse
import json
import os
import re
import sys

import numpy as np
import torch
from peft import PeftModel
from safetensors import safe_open

from make_golden import add_precision_args, config_drift, config_model_type, load_base, precision

MOE_TYPES = ("qwen3_moe", "gpt_oss", "deepseek_v2", "deepseek_v3")
VLLM_KEY = re.compile(r"^base_model\.model\.model\.layers\.\d+\.(self_attn\.[qkvo]_proj|"
                      r"mlp\.(gate|up|down)_proj|mlp\.experts\.\d+\.(gate|up|down)_proj)\.lora_[AB]\.weight$")


def logprobs(model, tokens, device):
    out = []
    for seq in tokens:
        ids = torch.tensor([seq], device=device)
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float()[0], dim=-1)
        out.append(lp[:-1].gather(-1, ids[0, 1:, None])[:, 0].cpu())
    return torch.cat(out)


def vllm_layout_problems(vllm_dir):
    problems = []
    with open(os.path.join(vllm_dir, "adapter_config.json")) as f:
        config = json.load(f)
    if "lm_head" in (config.get("target_modules") or []):
        problems.append("target_modules names lm_head")
    if config.get("target_parameters"):
        problems.append("target_parameters is set")
    with safe_open(os.path.join(vllm_dir, "adapter_model.safetensors"), framework="pt") as f:
        problems += [f"key {k} is not a vLLM LoRA key" for k in f.keys() if not VLLM_KEY.match(k)]
    return problems


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--merged", required=True)
    ap.add_argument("--vllm")
    add_precision_args(ap)
    args = ap.parse_args()
    dtype = precision(args)
    rng = np.random.default_rng(5)

    merged = load_base(args.merged, args.device, dtype)
    tokens = [rng.integers(0, merged.config.vocab_size, size=n).tolist() for n in (9, 17, 5)]
    merged_lp = logprobs(merged, tokens, args.device)
    del merged

    base = load_base(args.model, args.device, dtype)
    base_lp = logprobs(base, tokens, args.device)
    peft_model = PeftModel.from_pretrained(base, args.adapter).eval()
    with open(os.path.join(args.adapter, "adapter_config.json")) as f:
        drift = config_drift(peft_model.peft_config["default"], json.load(f))
    if drift:
        sys.exit(f"PEFT loaded {args.adapter} with other targets than its adapter_config.json: {drift}")
    ref = logprobs(peft_model, tokens, args.device)
    report = {"merged_vs_peft": float((merged_lp - ref).abs().max()),
              "adapter_moves": float((base_lp - ref).abs().max()),
              "dtype": args.dtype, "tol": args.tol}
    ok = report["merged_vs_peft"] <= args.tol and report["adapter_moves"] > 10 * args.tol

    if args.vllm:
        problems = vllm_layout_problems(args.vllm)
        report["vllm_layout_problems"] = problems
        ok = ok and not problems
        if config_model_type(args.model) in MOE_TYPES:
            report["vllm_vs_peft"] = "layout only (transformers fuses the experts)"
        else:
            for name, module in peft_model.named_modules():  # what --drop-lm-head leaves out
                if name.endswith("lm_head") and hasattr(module, "lora_B"):
                    torch.nn.init.zeros_(module.lora_B["default"].weight)
            no_head = logprobs(peft_model, tokens, args.device)
            base = peft_model.unload()
            vllm_model = PeftModel.from_pretrained(base, args.vllm).eval()
            report["vllm_vs_peft"] = float((logprobs(vllm_model, tokens, args.device) - no_head).abs().max())
            ok = ok and report["vllm_vs_peft"] <= args.tol
    report["ok"] = bool(ok)
    print(json.dumps(report))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
