#!/usr/bin/env python3
"""How far HF+PEFT's own logprobs move from a golden's when HF runs in another
precision: the fair bound for loom's bf16 parity on that family.

    python3 tools/reference/golden_drift.py --loom build-gpu/loom --golden tests/golden/ARCH \
        [--device cuda] [--dtype bf16]

Regenerates the golden's base model with `loom make-model` (its batch.json
names arch, preset and seed), loads it as make_golden.py does (eager
attention and experts), loads the golden's three PEFT adapters from its
adapters/ folder, runs each sequence alone under its adapter in --dtype on
--device, and prints the largest |logprob - golden logprob| (the golden is
HF+PEFT in fp32 on the CPU). loom's CUDA parity test holds loom's bf16 run to
the same golden; where HF's own bf16 run lands far from it (an ill-conditioned
tiny model), that is the figure to compare loom's with.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from peft import PeftModel
from safetensors.torch import load_file

from make_golden import add_precision_args, load_base, precision, seq_logprobs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--loom", required=True)
    ap.add_argument("--golden", required=True)
    add_precision_args(ap)
    args = ap.parse_args()
    dtype = precision(args)
    with open(os.path.join(args.golden, "batch.json")) as f:
        batch = json.load(f)
    ident = batch["model"]
    golden = load_file(os.path.join(args.golden, "golden.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([args.loom, "make-model", "--arch", ident["arch"], "--preset", ident["preset"], "--seed",
                        str(ident["seed"]), "--out", tmp], check=True, capture_output=True)
        base = load_base(tmp, args.device, dtype)
        names = list(batch["adapters"])
        model = PeftModel.from_pretrained(base, os.path.join(args.golden, batch["adapters"][names[0]]["dir"]),
                                          adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(os.path.join(args.golden, batch["adapters"][name]["dir"]), adapter_name=name)
        model.eval()
        worst, per_seq = 0.0, []
        with torch.no_grad():
            for i, seq in enumerate(batch["sequences"]):
                model.set_adapter(seq["adapter"])
                lp = seq_logprobs(model, seq, args.device).float().cpu()
                d = (lp - golden[f"seq{i}.logprobs"]).abs().max().item()
                per_seq.append(d)
                worst = max(worst, d)
    print(f"golden {args.golden} ({ident['arch']}): HF+PEFT {args.device} {args.dtype} against the golden: "
          f"max |logprob diff| {worst:.3g}; per sequence " + " ".join(f"{d:.2g}" for d in per_seq))
    if args.dtype == "fp32" and worst > args.tol:
        sys.exit(f"fp32 difference {worst:.3g} exceeds tolerance {args.tol}: the golden does not reproduce")


if __name__ == "__main__":
    main()
