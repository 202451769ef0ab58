#!/usr/bin/env python3
"""Loads a loom save_weights_for_sampler snapshot with HF PEFT and compares its
per-token logprobs with what `loom forward --adapter` prints for the same tokens.

    python3 tools/reference/check_snapshot.py --loom build/loom --model MODEL_DIR \
        --adapter SNAPSHOT_DIR [--device cpu|cuda] [--dtype fp32|bf16]

Prints the largest |logprob difference| between loom and HF+PEFT, and how far
the adapter moves HF's logprobs away from the base model's (so a match is not
the trivial one of an adapter that does nothing). Exits non-zero when the
snapshot does not load cleanly, PEFT loads it with other targets than its
adapter_config.json names (transformers v5's MoE shim rewrites some), or the
difference exceeds --tol. The base model loads as make_golden.py loads it
(eager attention and, for qwen3_moe, eager experts; no missing weights), so
snapshots of MoE models with target_parameters load the same way.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np
import torch
from peft import PeftModel

from make_golden import add_precision_args, config_drift, load_base, precision


def loom_logprobs(args, tokens):
    text = ";".join(",".join(str(t) for t in seq) for seq in tokens)
    cmd = [args.loom, "forward", "--model", args.model, "--adapter", args.adapter, "--tokens", text,
           "--device", args.device, "--dtype", args.dtype]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    got = {}
    for line in out.splitlines()[1:]:
        seq, pos, _tok, lp = line.split("\t")
        if lp != "-":
            got[(int(seq), int(pos))] = float(lp)
    return got


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--adapter", required=True)
    add_precision_args(ap)
    args = ap.parse_args()
    dtype = precision(args)
    rng = np.random.default_rng(3)
    base = load_base(args.model, args.device, dtype)
    vocab = base.config.vocab_size
    tokens = [rng.integers(0, vocab, size=n).tolist() for n in (9, 17, 5)]

    def hf_logprobs(model):
        res = {}
        for s, seq in enumerate(tokens):
            ids = torch.tensor([seq], device=args.device)
            with torch.no_grad():
                logits = model(input_ids=ids).logits.float()[0]
            lp = torch.log_softmax(logits, dim=-1)
            for i in range(1, len(seq)):
                res[(s, i)] = lp[i - 1, seq[i]].item()
        return res

    base_lp = hf_logprobs(base)
    peft_model = PeftModel.from_pretrained(base, args.adapter).eval()
    with open(os.path.join(args.adapter, "adapter_config.json")) as f:
        drift = config_drift(peft_model.peft_config["default"], json.load(f))
    if drift:
        sys.exit(f"PEFT loaded {args.adapter} with other targets than its adapter_config.json: {drift}")
    ref = hf_logprobs(peft_model)
    got = loom_logprobs(args, tokens)
    assert set(got) == set(ref), "loom forward printed different positions"
    diff = max(abs(got[k] - ref[k]) for k in ref)
    moved = max(abs(base_lp[k] - ref[k]) for k in ref)
    print(f"snapshot {args.adapter}: {len(ref)} tokens, device {args.device} {args.dtype}: "
          f"max |loom - HF+PEFT| = {diff:.3g}; the adapter moves HF logprobs by up to {moved:.3g}")
    if moved == 0:
        sys.exit("the adapter does not change the model: the check would be vacuous")
    if diff > args.tol:
        sys.exit(f"difference {diff:.3g} exceeds tolerance {args.tol}")


if __name__ == "__main__":
    main()
