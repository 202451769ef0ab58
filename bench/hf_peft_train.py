# The training anchor: a plain Hugging Face + PEFT LoRA loop on the same model directory and the
# same LoRA targets as `loom bench train` (q, k, v, o, gate, up, down and lm_head), bf16, SDPA
# attention, fused torch AdamW, random tokens, cross-entropy on every next token. Prints one JSON
# line: tokens/s, MFU and the caching allocator's peak memory.
#
#   python3 bench/hf_peft_train.py MODEL_DIR BATCH SEQLEN RANK [--compile] [--steps N]
#                                  [--micro-batch M] [--grad-ckpt]
#
# A step is always BATCH x SEQLEN tokens and one optimizer step. Where that does not fit the card
# (4 x 2048 of qwen3-4b needs about 87 GiB), --micro-batch M runs it as BATCH/M forward/backward
# passes of M sequences, each loss scaled by M/BATCH (gradient accumulation: the same update), and
# --grad-ckpt turns on transformers' gradient checkpointing (each layer's forward again in the
# backward), as a user of a smaller card would.
#
# MFU convention (the same as `loom bench train`): 4 N FLOPs per trained token, N = the base
# model's parameters a token runs through (a tied embedding counted once; for MoE the active
# parameters: k of E experts), against 989 TFLOP/s (dense bf16, H100/H200).
#
# MoE models (config num_experts > 0, e.g. qwen3_moe, deepseek_v2, qwen3_5_moe_text): the experts are
# fused 3-D tensors in transformers 5, so their LoRA is PEFT's target_parameters (mlp.experts.gate_up_proj
# and down_proj, rank r each), with attention (qwen3_5_moe_text: also its Gated DeltaNet layers'
# linear_attn projections) and lm_head as modules; naming gate_proj/up_proj in target_modules would
# make PEFT's v5 shim retarget them at rank 2r.
# A frozen base does no weight-gradient matmuls, so forward (2N) + input gradients (2N); attention
# and the LoRA factors are left out.
import argparse, json, sys, time

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

PEAK_FLOPS = 989e12
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("batch", type=int)
    ap.add_argument("seqlen", type=int)
    ap.add_argument("rank", type=int)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--alpha", type=float, default=32.0)  # loom serve's default lora_alpha
    ap.add_argument("--micro-batch", type=int, default=0, help="sequences a forward/backward (0: BATCH)")
    ap.add_argument("--grad-ckpt", action="store_true", help="transformers' gradient checkpointing")
    a = ap.parse_args()
    micro = a.micro_batch or a.batch
    if micro < 1 or a.batch % micro:
        ap.error(f"--micro-batch {micro} must divide BATCH {a.batch}")
    out = {"system": "hf+peft", "compile": a.compile, "batch": a.batch, "seqlen": a.seqlen, "rank": a.rank,
           "micro_batch": micro, "grad_ckpt": a.grad_ckpt,
           "flop_convention": "4*N per token, N = base parameters (tied embedding once), peak 989 TFLOP/s"}
    try:
        # transformers 5.17 has no SDPA path for gpt_oss (its sinks): eager attention there.
        with open(f"{a.model_dir}/config.json") as f:
            attn = "eager" if json.load(f).get("model_type") == "gpt_oss" else "sdpa"
        out["attn_implementation"] = attn
        model = AutoModelForCausalLM.from_pretrained(a.model_dir, torch_dtype=torch.bfloat16,
                                                     attn_implementation=attn).cuda()
        params_by_name = {id(p): (n, p) for n, p in model.named_parameters()}.values()
        n_base = sum(p.numel() for _, p in params_by_name)
        experts = (getattr(model.config, "num_experts", 0) or getattr(model.config, "num_local_experts", 0)
                   or getattr(model.config, "n_routed_experts", 0) or 0)
        if experts:
            k = model.config.num_experts_per_tok
            n_expert = sum(p.numel() for n, p in params_by_name if ".mlp.experts." in n)
            n_base = n_base - n_expert + n_expert * k // experts
            # loom's targets: the attention's projections (MLA's q_a/q_b, kv_a_proj_with_mqa and
            # kv_b_proj where the model has them; the Gated DeltaNet layers' linear_attn in_proj_qkv,
            # in_proj_z, in_proj_b, in_proj_a and out_proj), lm_head; the experts; and, by full name
            # (the v5 shim again), any dense-MLP layer's and shared experts' gate/up/down weights
            # (qwen3_5_moe_text's mlp.shared_expert too; its shared_expert_gate is frozen).
            # (glm_moe_dsa's sparse-attention indexer, self_attn.indexer.*, is frozen in loom: no target).
            attention = sorted({n.split(".")[-1] for n, m in model.named_modules()
                                if (".self_attn." in n or ".linear_attn." in n)
                                and ".indexer." not in n and isinstance(m, torch.nn.Linear)})
            dense = [f"{n}.weight" for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                     and n.split(".")[-1] in ("gate_proj", "up_proj", "down_proj") and ".experts." not in n]
            lora = LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0,
                              target_modules=attention + ["lm_head"],
                              target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] + dense)
            out["targets"] = {"modules": attention + ["lm_head"], "dense_mlp_weights": len(dense)}
        else:
            lora = LoraConfig(r=a.rank, lora_alpha=a.alpha, lora_dropout=0.0, target_modules=TARGETS)
        out["moe_experts"] = experts
        model = get_peft_model(model, lora)
        if a.grad_ckpt:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.enable_input_require_grads()
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
        step_fn = torch.compile(model) if a.compile else model
        vocab = model.config.vocab_size

        def step():
            ids = torch.randint(0, vocab, (a.batch, a.seqlen), device="cuda")
            for part in ids.split(micro):
                loss = step_fn(input_ids=part, labels=part).loss
                (loss * (micro / a.batch)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(a.warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        t = time.time()
        for _ in range(a.steps):
            step()
        torch.cuda.synchronize()
        dt = time.time() - t
        tok_s = a.batch * a.seqlen * a.steps / dt
        out.update(tokens_per_s=round(tok_s, 1), step_ms=round(dt / a.steps * 1e3, 2), base_params=n_base,
                   mfu=round(4 * n_base * tok_s / PEAK_FLOPS, 4),
                   peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    except torch.cuda.OutOfMemoryError:
        out.update(error="out of memory", peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2))
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
