#!/usr/bin/env python3
"""Golden numbers for loom's parity test, computed with Hugging Face
transformers + PEFT (the reference implementation loom must match).

Input: a model directory written by `loom make-model` (tiny preset).
Output (OUT):
  adapters/<name>/adapter_config.json, adapter_model.safetensors
      three PEFT LoRA adapters with non-zero A and B (PeftModel.save_pretrained)
  batch.json
      the model's identity (arch, preset, seed, dtype from the safetensors
      metadata), the adapters' rank/alpha, and a packed batch of sequences:
      tokens, targets (next token; the last position's target is drawn from
      the seed) and the adapter of each sequence
  golden.safetensors
      seq{i}.logprobs       [len_i] fp32: log p(target_t | tokens_<=t) under the
                            sequence's adapter, each sequence run alone
      grad.<adapter>.<key>  gradient of L = sum over all sequences and
                            positions of -logprob (weights all 1) w.r.t. the
                            adapter tensor stored in adapter_model.safetensors
                            under <key> (base_model.model.<module>.lora_{A,B}.weight)

Usage (see README.md):
  python3 tools/reference/make_golden.py --model DIR --out tests/golden/qwen3
Self-checking: it fails (non-zero exit) if any LoRA weight is zero, any
gradient is non-finite or all-zero, the adapters do not change the
logprobs, or the output exceeds 1 MB.
"""
import argparse
import json
import os
import sys

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
# name, rank, alpha: distinct ranks and scales (alpha / r = 8, 2, 4).
ADAPTERS = [("a0", 4, 32), ("a1", 8, 16), ("a2", 8, 32)]
SEQ_LENGTHS = [7, 13, 5, 11]
SEQ_ADAPTERS = ["a0", "a1", "a0", "a2"]
SEED = 20240601
A_STD_SCALE = 1.0   # lora_A ~ N(0, A_STD_SCALE^2 / d_in)
B_STD = 0.01        # lora_B ~ N(0, B_STD^2)
MAX_BYTES = 1 << 20


def fail(msg):
    print("make_golden: FAILED: " + msg, file=sys.stderr)
    sys.exit(1)


def model_identity(model_dir):
    """loom.* metadata that make-model writes into every shard."""
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        path = single
    else:
        with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
            path = os.path.join(model_dir, sorted(set(json.load(f)["weight_map"].values()))[0])
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    ident = {k[len("loom."):]: v for k, v in meta.items() if k.startswith("loom.")}
    for key in ("arch", "preset", "seed", "dtype"):
        if key not in ident:
            fail(f"{path} has no loom.{key} metadata: is this a model written by `loom make-model`?")
    ident["seed"] = int(ident["seed"])
    return ident


def load_base(model_dir, device):
    import transformers
    from transformers import AutoModelForCausalLM

    major = int(transformers.__version__.split(".")[0])
    kwargs = {"attn_implementation": "eager", "output_loading_info": True}
    kwargs["dtype" if major >= 5 else "torch_dtype"] = torch.float32
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
    model, info = loaded if isinstance(loaded, tuple) else (loaded, {})
    cfg = model.config
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    missing = set(info.get("missing_keys", []))
    if tied:
        missing.discard("lm_head.weight")
    if missing or info.get("unexpected_keys") or info.get("mismatched_keys"):
        fail(f"loading {model_dir}: missing {sorted(missing)} unexpected {info.get('unexpected_keys')} "
             f"mismatched {info.get('mismatched_keys')}")
    if tied and model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr():
        fail("config says tie_word_embeddings but lm_head is not tied to embed_tokens")
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def make_batch(rng, vocab):
    seqs = []
    for length, adapter in zip(SEQ_LENGTHS, SEQ_ADAPTERS):
        tokens = rng.integers(0, vocab, size=length).tolist()
        last_target = int(rng.integers(0, vocab))
        seqs.append({"tokens": [int(t) for t in tokens],
                     "targets": [int(t) for t in tokens[1:]] + [last_target],
                     "adapter": adapter})
    return seqs


def lora_layers(peft_model):
    from peft.tuners.lora import LoraLayer
    return [(name, m) for name, m in sorted(peft_model.named_modules(), key=lambda x: x[0])
            if isinstance(m, LoraLayer)]


def seq_logprobs(peft_model, seq, device):
    ids = torch.tensor([seq["tokens"]], dtype=torch.long, device=device)
    tgt = torch.tensor(seq["targets"], dtype=torch.long, device=device)
    logits = peft_model(input_ids=ids, use_cache=False).logits[0].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, tgt[:, None])[:, 0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="model dir from `loom make-model --preset tiny`")
    ap.add_argument("--out", required=True, help="output dir, e.g. tests/golden/qwen3")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = ap.parse_args()

    import peft
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)
    device = torch.device(args.device)
    ident = model_identity(args.model)
    model = load_base(args.model, device)
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(SEED)
    seqs = make_batch(rng, vocab)

    # Base-only logprobs, to prove later that the adapters matter.
    with torch.no_grad():
        base_lp = [seq_logprobs(model, s, device) for s in seqs]

    configs = {name: LoraConfig(r=r, lora_alpha=alpha, target_modules=list(TARGET_MODULES), lora_dropout=0.0,
                                bias="none", task_type="CAUSAL_LM", use_rslora=False, use_dora=False)
               for name, r, alpha in ADAPTERS}
    peft_model = get_peft_model(model, configs["a0"], adapter_name="a0")
    for name, _, _ in ADAPTERS[1:]:
        peft_model.add_adapter(name, configs[name])
    peft_model.eval()

    # Non-zero A and B for every adapter, in a fixed order from the seed.
    layers = lora_layers(peft_model)
    seen_short = set()
    with torch.no_grad():
        for name, _, _ in ADAPTERS:
            for mod_name, m in layers:
                a = m.lora_A[name].weight
                b = m.lora_B[name].weight
                d_in = a.shape[1]
                a.copy_(torch.from_numpy(rng.normal(0.0, A_STD_SCALE / np.sqrt(d_in), size=tuple(a.shape))
                                         .astype(np.float32)))
                b.copy_(torch.from_numpy(rng.normal(0.0, B_STD, size=tuple(b.shape)).astype(np.float32)))
                if a.abs().max().item() == 0 or b.abs().max().item() == 0:
                    fail(f"{mod_name} {name}: zero LoRA weight")
                seen_short.add(mod_name.split(".")[-1])
    if seen_short != set(TARGET_MODULES):
        fail(f"PEFT adapted {sorted(seen_short)}, expected {sorted(TARGET_MODULES)}")

    # Forward each sequence alone under its adapter; backward right away so the
    # active adapter (the only one PEFT leaves trainable) accumulates its grad.
    logprobs = []
    for seq in seqs:
        peft_model.set_adapter(seq["adapter"])
        lp = seq_logprobs(peft_model, seq, device)
        (-lp.sum()).backward()
        logprobs.append(lp.detach().cpu())

    golden = {}
    for i, lp in enumerate(logprobs):
        if not torch.isfinite(lp).all() or (lp > 0).any():
            fail(f"seq{i} logprobs are not finite non-positive: {lp}")
        if (lp - base_lp[i].cpu()).abs().max().item() < 1e-3:
            fail(f"seq{i}: the adapter changes logprobs by less than 1e-3")
        golden[f"seq{i}.logprobs"] = lp.contiguous()

    os.makedirs(args.out, exist_ok=True)
    adapters_dir = os.path.join(args.out, "adapters")
    peft_model.save_pretrained(adapters_dir, selected_adapters=[n for n, _, _ in ADAPTERS],
                               save_embedding_layers=False, safe_serialization=True)

    for name, r, alpha in ADAPTERS:
        path = os.path.join(adapters_dir, name, "adapter_model.safetensors")
        if not os.path.exists(path):
            fail(f"save_pretrained did not write {path}")
        with safe_open(path, framework="pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}
        with open(os.path.join(adapters_dir, name, "adapter_config.json")) as f:
            acfg = json.load(f)
        if acfg.get("r") != r or float(acfg.get("lora_alpha")) != alpha:
            fail(f"{name}: adapter_config.json says r={acfg.get('r')} alpha={acfg.get('lora_alpha')}")
        expected_keys = set()
        for mod_name, m in layers:
            key_prefix = mod_name  # base_model.model.<module>
            for kind, sub in (("lora_A", m.lora_A[name]), ("lora_B", m.lora_B[name])):
                key = f"{key_prefix}.{kind}.weight"
                expected_keys.add(key)
                w = sub.weight
                g = w.grad
                if key not in saved:
                    fail(f"{name}: {key} missing from {path} (has {sorted(saved)[:4]} ...)")
                if not torch.equal(saved[key].float(), w.detach().cpu().float()):
                    fail(f"{name}: saved {key} differs from the live weight")
                if g is None or not torch.isfinite(g).all() or g.abs().max().item() == 0:
                    fail(f"{name}: gradient of {key} is missing, non-finite or zero")
                golden[f"grad.{name}.{key}"] = g.detach().cpu().float().contiguous()
        if set(saved) != expected_keys:
            fail(f"{name}: {path} has unexpected tensors {sorted(set(saved) - expected_keys)}")

    batch = {
        "model": ident,
        "adapters": {name: {"r": r, "alpha": alpha, "dir": f"adapters/{name}"} for name, r, alpha in ADAPTERS},
        "sequences": seqs,
        "seed": SEED,
        "loss": "sum over sequences and positions of -logprob(target), weights 1",
        "grad_key": "grad.<adapter>.<adapter_model.safetensors key>",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "numpy": np.__version__},
        "device": str(device),
    }
    with open(os.path.join(args.out, "batch.json"), "w") as f:
        json.dump(batch, f, indent=1)
        f.write("\n")
    save_file(golden, os.path.join(args.out, "golden.safetensors"),
              metadata={"format": "pt", "generator": "tools/reference/make_golden.py"})

    total = 0
    for root, _, files in os.walk(args.out):
        for fn in files:
            total += os.path.getsize(os.path.join(root, fn))
    if total > MAX_BYTES:
        fail(f"{args.out} holds {total} bytes, over {MAX_BYTES}")
    print(f"make_golden: wrote {args.out} ({total} bytes; arch {ident['arch']} preset {ident['preset']} "
          f"seed {ident['seed']}; torch {torch.__version__} transformers {transformers.__version__} "
          f"peft {peft.__version__})")


if __name__ == "__main__":
    main()
