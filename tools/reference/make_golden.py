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

qwen3_moe (model_type in config.json): attention and lm_head are module
targets as above; the experts' fused mlp.experts.gate_up_proj [E, 2I, H] and
down_proj [E, H, I] and the dense-MLP layers' gate/up/down_proj weights are
target_parameters (PEFT's ParamWrapper). The expert LoRA is loom's layout
(gate_up: one A shared by all experts, B per expert; down: A per expert, one
B shared) written in PEFT's per-expert form with the shared factor replicated
into every expert's slice. batch.json gains a "moe" block: the layers, the
adapter config's targets, which parameter and layer each expert key belongs
to, the saved key names, and HF's route (top-k experts) of every token.

gpt_oss: the same, with HF's own layout checked instead: every layer MoE,
router mlp.router (weight and bias), experts gate_up_proj [E, H, 2I] and
down_proj [E, I, H] transposed ([E, in, out], is_transposed) with the gate/up
columns interleaved (even = gate, odd = up), as make-model writes them under
the same names. PEFT's ParamWrapper then has lora_A [E*r, in], lora_B
[out, r*E] with gate_up's B rows in HF's interleaved order (loom's B rows are
gate then up: the parity test de-interleaves). Attention is eager (HF has no
SDPA for GPT-OSS), with the sinks; the run fails unless a sliding layer's
window is shorter than the longest sequence and some gate/up pre-activation
passes the +-7 clamp.

deepseek_v2, deepseek_v3: the qwen3_moe path with multi-head latent
attention and shared experts. Module targets are the attention's q_proj (or
q_a_proj and q_b_proj when q_lora_rank is set), kv_a_proj_with_mqa, kv_b_proj,
o_proj, and lm_head; target_parameters are the fused experts as for
qwen3_moe, the dense layers' (below first_k_dense_replace) gate/up/down_proj
weights, and each MoE layer's mlp.shared_experts gate/up/down_proj weights.
The router (mlp.gate; deepseek_v3's with e_score_correction_bias) and the
shared experts are checked against the checkpoint, and the batch has eight
sequences so that group-limited routing reaches every expert.

qwen3_5_moe_text (Qwen3.5/3.6-35B-A3B's text model): Gated DeltaNet and gated
full-attention layers (config.layer_types), every layer MoE. Module targets
are the linear layers' linear_attn in_proj_qkv, in_proj_z, in_proj_b,
in_proj_a and out_proj, the full layers' self_attn q/k/v/o_proj (each name
only in its own layers), and lm_head; target_parameters are the experts as
for qwen3_moe and each layer's mlp.shared_expert gate/up/down_proj weights by
full name. The checkpoint stores the experts fused, compared with HF's as
they are; the router (mlp.gate, a weight without bias) and
mlp.shared_expert_gate are checked and frozen. The batch is deepseek's eight
sequences.

Usage (see README.md):
  python3 tools/reference/make_golden.py --model DIR --out tests/golden/qwen3
Self-checking: it fails (non-zero exit) if any LoRA weight is zero, any
gradient is non-finite or all-zero, the adapters do not change the
logprobs, or the output exceeds 1 MB; for the MoE families also if any
assumption about HF's or PEFT's layout does not hold at run time (see README.md).
"""
import argparse
import inspect
import json
import os
import re
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

# The MoE families. Gate/up/down stay out of target_modules in every spelling:
# PEFT's transformers-v5 shim (peft/utils/transformers_weight_conversion.py;
# it maps deepseek_v2/v3 to qwen2_moe's conversion, as qwen3_moe)
# rewrites target_modules entries equal to or ending in ".gate_proj",
# ".up_proj", ".down_proj" (and a regex, after resolving it to leaf names)
# into target_parameters gate_up_proj/down_proj at rank 2r. So the dense-MLP
# layers' projections are targeted as parameters by full name: a ParamWrapper
# on a 2-D [out, in] weight is plain LoRA (A [r, in], B [out, r], the same
# saved keys as a module target).
# glm_moe_dsa (GLM-5.2) is MLA too, with deepseek_v3's router and a frozen
# sparse-attention indexer (self_attn.indexer: wq_b, wk, k_norm,
# weights_proj), no target; its dense layers are named by mlp_layer_types.
DEEPSEEK_TYPES = ("deepseek_v2", "deepseek_v3", "glm_moe_dsa")
# DeepSeek-style experts (router mlp.gate, shared experts, dense layers below
# first_k_dense_replace): the deepseek families and glm4_moe, whose attention
# is plain q/k/v/o (MOE_TARGET_MODULES) and whose router holds the
# correction bias as deepseek_v3's.
# mimo_v2_flash routes as they do, with no shared experts and its dense
# layers named by mlp_layer_types (its attention, q/k/v/o with sinks on the
# sliding layers, is plain module targets too).
DEEPSEEK_MOE_TYPES = DEEPSEEK_TYPES + ("glm4_moe", "mimo_v2_flash")
CORRECTION_BIAS_TYPES = ("deepseek_v3", "glm4_moe", "mimo_v2_flash", "glm_moe_dsa")
# qwen3_5_moe_text (Qwen3.5/3.6-35B-A3B's text model, Qwen3_5MoeForCausalLM):
# hybrid layers by config.layer_types, Gated DeltaNet ("linear_attention",
# module targets QWEN3_5_ATTENTION's linear_attn projections) or gated full
# attention ("full_attention", self_attn q/k/v/o); every layer MoE, with
# experts the checkpoint already stores fused (mlp.experts.gate_up_proj
# [E, 2I, H], down_proj [E, H, I], compared as they are), a router mlp.gate
# (Qwen3_5MoeTopKRouter: a weight Parameter, no bias), one shared expert
# mlp.shared_expert (an MLP of nn.Linear gate/up/down_proj, targeted as
# parameters by full name like deepseek's shared experts) and its sigmoid gate
# mlp.shared_expert_gate (nn.Linear [1, H]); the router and that gate are frozen.
QWEN3_5_MOE_TYPES = ("qwen3_5_moe_text",)
QWEN3_5_ATTENTION = {"linear_attention": ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"],
                     "full_attention": ["q_proj", "k_proj", "v_proj", "o_proj"]}
QWEN3_5_MIXER = {"linear_attention": "linear_attn", "full_attention": "self_attn"}
MOE_TYPES = ("qwen3_moe", "gpt_oss") + DEEPSEEK_MOE_TYPES + QWEN3_5_MOE_TYPES
MOE_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "lm_head"]
# deepseek's multi-head latent attention: q_proj when q_lora_rank is null,
# else q_a_proj and q_b_proj (q_a_layernorm between them is no target); the
# adapters target those of the model (DEEPSEEK_ATTENTION[q_lora_rank is set])
# and lm_head. The shared experts' gate/up/down are target_parameters by full
# name, as the dense-MLP layers' (see above).
DEEPSEEK_ATTENTION = {False: ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
                      True: ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]}
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
DENSE_MLP = ("gate_proj", "up_proj", "down_proj")
# Each expert target stores E slices of both factors, so ranks are halved
# against ADAPTERS to stay under MAX_BYTES; the scales stay 8, 2, 4.
MOE_ADAPTERS = [("a0", 2, 16), ("a1", 4, 8), ("a2", 4, 16)]
# Longer than SEQ_LENGTHS so that every expert of every MoE layer gets a token
# (checked); change these, not SEED, which would move the dense goldens too.
MOE_SEQ_LENGTHS = [9, 15, 7, 13]
# Eight sequences (adapters a0 a1 a0 a2 twice) for the deepseek families,
# whose group-limited routing needs more tokens for every expert of every MoE
# layer to be hit, and for qwen3_5_moe_text (every layer MoE, all checked).
# These four extra lengths were gpt_oss's
# GPT_OSS_SEQ_LENGTHS, but make_batch zipped them with the four SEQ_ADAPTERS,
# so gpt_oss's goldens have always had MOE_SEQ_LENGTHS' four sequences (its
# tiny embeddings were made larger instead, so that every expert is routed
# to); batch_plan keeps it so.
LONG_MOE_SEQ_LENGTHS = MOE_SEQ_LENGTHS + [11, 16, 6, 14]
LONG_SEQ_ADAPTERS = SEQ_ADAPTERS * 2
RELOAD_TOL = 1e-5   # |logprob| after PeftModel.from_pretrained of the saved adapter


def add_precision_args(ap):
    """The check scripts' --device, --dtype and --tol."""
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32")
    ap.add_argument("--tol", type=float, default=1e-4)


def precision(args):
    """The torch dtype of --dtype, with TF32 off (exact fp32 matmuls on a GPU)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    return torch.float32 if args.dtype == "fp32" else torch.bfloat16


def fail(msg):
    print(f"{os.path.basename(sys.argv[0])}: FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def safetensors_paths(model_dir):
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
        return [os.path.join(model_dir, p) for p in sorted(set(json.load(f)["weight_map"].values()))]


def model_identity(model_dir):
    """loom.* metadata that make-model writes into every shard."""
    path = safetensors_paths(model_dir)[0]
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    ident = {k[len("loom."):]: v for k, v in meta.items() if k.startswith("loom.")}
    for key in ("arch", "preset", "seed", "dtype"):
        if key not in ident:
            fail(f"{path} has no loom.{key} metadata: is this a model written by `loom make-model`?")
    ident["seed"] = int(ident["seed"])
    return ident


def config_model_type(model_dir):
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f).get("model_type")


def takes_experts_implementation():
    """Whether from_pretrained takes experts_implementation (transformers v5's
    experts backends; the default, grouped_mm, depends on the torch build on CPU)."""
    from transformers import PreTrainedModel

    fn = PreTrainedModel.from_pretrained
    if "experts_implementation" in inspect.signature(fn).parameters:
        return True
    try:
        return "experts_implementation" in inspect.getsource(fn)
    except (OSError, TypeError):
        return False


def load_base(model_dir, device, dtype=torch.float32):
    import transformers
    from transformers import AutoModelForCausalLM

    major = int(transformers.__version__.split(".")[0])
    kwargs = {"attn_implementation": "eager", "output_loading_info": True}
    kwargs["dtype" if major >= 5 else "torch_dtype"] = dtype
    moe = config_model_type(model_dir) in MOE_TYPES
    if moe and takes_experts_implementation():
        kwargs["experts_implementation"] = "eager"
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
    if moe:
        # A config without the attribute predates experts backends: its experts run their own (eager) loop.
        impl = {"attn": getattr(cfg, "_attn_implementation", "eager"),
                "experts": getattr(cfg, "_experts_implementation", "eager")}
        if set(impl.values()) != {"eager"}:
            fail(f"loading {model_dir}: implementations {impl}, wanted eager for both "
                 f"(experts_implementation passed: {'experts_implementation' in kwargs})")
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def batch_plan(model_type):
    """(lengths, adapters) of the golden batch's sequences for a model_type."""
    if model_type in DEEPSEEK_MOE_TYPES + QWEN3_5_MOE_TYPES:
        return LONG_MOE_SEQ_LENGTHS, LONG_SEQ_ADAPTERS
    if model_type in MOE_TYPES:
        return MOE_SEQ_LENGTHS, SEQ_ADAPTERS
    return SEQ_LENGTHS, SEQ_ADAPTERS


def make_batch(rng, vocab, lengths, adapters):
    if len(lengths) != len(adapters):
        fail(f"{len(lengths)} sequence lengths for {len(adapters)} sequence adapters")
    seqs = []
    for length, adapter in zip(lengths, adapters):
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


# ---- qwen3_moe -------------------------------------------------------------

def gpt_oss_layout(model, ckpt, mlps):
    """gpt_oss's layers as HF built them: every layer MoE, experts in the
    transposed interleaved layout holding the checkpoint's tensors as stored."""
    cfg = model.config
    E, K, I, H = int(cfg.num_local_experts), int(cfg.num_experts_per_tok), int(cfg.intermediate_size), int(cfg.hidden_size)
    moe = {"num_experts": E, "top_k": K, "moe_layers": [], "dense_layers": [], "mlp": {}, "experts": {},
           "transposed": True}
    for layer in sorted(mlps):
        name, mlp = mlps[layer]
        moe["mlp"][layer] = name
        experts, router = getattr(mlp, "experts", None), getattr(mlp, "router", None)
        params = {"gate_up_proj": (E, H, 2 * I), "gate_up_proj_bias": (E, 2 * I), "down_proj": (E, I, H),
                  "down_proj_bias": (E, H)}
        got = {k: tuple(getattr(experts, k).shape) for k in params if isinstance(getattr(experts, k, None), torch.nn.Parameter)}
        if got != params or not getattr(experts, "is_transposed", False):
            fail(f"{name}: experts {got}, is_transposed {getattr(experts, 'is_transposed', None)}; expected {params}")
        if tuple(getattr(router, "weight").shape) != (E, H) or tuple(getattr(router, "bias").shape) != (E,):
            fail(f"{name}: router is not weight [E, H] + bias [E]")
        with torch.no_grad():
            for k in params:
                key = f"{name}.experts.{k}"
                if key not in ckpt or not torch.equal(getattr(experts, k), ckpt[key].to(getattr(experts, k).dtype)):
                    fail(f"{name}: experts.{k} differs from {key} in the checkpoint (make-model writes HF's bf16 names)")
            for k in ("weight", "bias"):
                if not torch.equal(getattr(router, k), ckpt[f"{name}.router.{k}"].to(getattr(router, k).dtype)):
                    fail(f"{name}: router.{k} differs from the checkpoint")
        moe["moe_layers"].append(layer)
        moe["experts"][layer] = experts
    window = getattr(cfg, "sliding_window", None)
    sliding = [i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention"]
    longest = max(batch_plan(cfg.model_type)[0])
    if not sliding or not window or window >= longest:
        fail(f"layer_types {cfg.layer_types}, sliding_window {window}: no sliding layer whose window is "
             f"shorter than the longest sequence ({longest})")
    sinks = [m.sinks for n, m in model.named_modules() if hasattr(m, "sinks")]
    if len(sinks) != cfg.num_hidden_layers or min(s.abs().max().item() for s in sinks) < 0.1:
        fail("expected sinks of O(1) in every attention layer (make-model's tiny preset)")
    return moe


def module_targets(model, moe, names, absent=(), layer_names=None):
    """Sets moe["target_modules"] (names: the per-layer module targets, then
    lm_head) and moe["linear_targets"] (the nn.Linear modules they name),
    failing unless every layer holds each per-layer name once, there is one
    lm_head, and no module is named in `absent` (deepseek: the q projections
    of the other q_lora_rank). With layer_names (layer -> names; a hybrid
    model whose layers hold different targets, qwen3_5_moe_text) layer L must
    hold exactly layer_names[L], once each, and none of the other names."""
    per_layer = sorted(n for n in names if n != "lm_head")
    short = set(names) | set(absent)
    found = sorted(n for n, m in model.named_modules()
                   if isinstance(m, torch.nn.Linear) and n.split(".")[-1] in short)
    by_layer, outside = {}, []
    for n in found:
        hit = re.search(r"(?:^|\.)layers\.(\d+)\.", n)
        (by_layer.setdefault(int(hit.group(1)), []) if hit else outside).append(n.split(".")[-1])
    layers = list(range(model.config.num_hidden_layers))
    if layer_names is not None:
        want = {L: sorted(layer_names[L]) for L in layers}
        if sorted(by_layer) != layers or any(sorted(by_layer[L]) != want[L] for L in layers) \
                or outside != ["lm_head"]:
            fail(f"expected per layer {want} and one lm_head, found {found}")
    elif sorted(by_layer) != layers or any(sorted(by_layer[L]) != per_layer for L in layers) \
            or outside != ["lm_head"]:
        fail(f"expected {per_layer} in each of {len(layers)} layers and one lm_head, found {found}")
    moe["target_modules"] = list(names)
    moe["linear_targets"] = found


def deepseek_extras(moe, layer, name, mlp, stored, cfg):
    """deepseek's MoE layer beside the routed experts, checked against the
    checkpoint: the router mlp.gate (weight [E, H] and no bias, an nn.Linear
    or a router module; deepseek_v3's also holds e_score_correction_bias [E],
    a parameter or buffer, compared with the checkpoint wherever HF holds
    one), and the shared experts mlp.shared_experts, an MLP of nn.Linear
    gate/up/down_proj of width moe_intermediate_size * n_shared_experts
    (recorded in moe["shared_layers"])."""
    E, H, I = moe["num_experts"], int(cfg.hidden_size), int(cfg.moe_intermediate_size)
    router = mlp.gate
    if getattr(router, "bias", None) is not None:
        fail(f"{name}: the router mlp.gate has a bias; deepseek's has none")
    bias = getattr(router, "e_score_correction_bias", None)
    if cfg.model_type in CORRECTION_BIAS_TYPES and not torch.is_tensor(bias):
        fail(f"{name}: {cfg.model_type}'s router {type(router).__name__} holds no e_score_correction_bias")
    with torch.no_grad():
        if torch.is_tensor(bias):
            if tuple(bias.shape) != (E,):
                fail(f"{name}: gate.e_score_correction_bias is {tuple(bias.shape)}, expected ({E},)")
            if not torch.equal(bias, stored(f"{name}.gate.e_score_correction_bias", bias)):
                fail(f"{name}: gate.e_score_correction_bias differs from the checkpoint")
        # MiMoV2FlashConfig drops n_shared_experts (its class attribute is an AttributeError instance).
        shared_count = 0 if cfg.model_type == "mimo_v2_flash" else int(getattr(cfg, "n_shared_experts", 0) or 0)
        shared = getattr(mlp, "shared_experts", None)
        if shared_count == 0:
            if shared is not None:
                fail(f"{name}: config.json has n_shared_experts {cfg.n_shared_experts}, HF built shared_experts")
            return
        S = I * shared_count
        want = {"gate_proj": (S, H), "up_proj": (S, H), "down_proj": (H, S)}
        got = {p: tuple(getattr(shared, p).weight.shape) for p in DENSE_MLP
               if isinstance(getattr(shared, p, None), torch.nn.Linear)}
        if got != want:
            fail(f"{name}: shared_experts {got} (nn.Linear weights), expected {want} "
                 f"(moe_intermediate_size {I} * n_shared_experts {shared_count})")
        for p in DENSE_MLP:
            w = getattr(shared, p).weight
            if not torch.equal(w, stored(f"{name}.shared_experts.{p}.weight", w)):
                fail(f"{name}: shared_experts.{p}.weight differs from the checkpoint")
    moe["shared_layers"].append(layer)


def qwen3_5_extras(moe, layer, name, mlp, stored, cfg):
    """qwen3_5_moe_text's MoE layer beside the routed experts, checked against
    the checkpoint: the router mlp.gate has no bias (its weight is compared
    by moe_layout); the shared expert mlp.shared_expert, an MLP of nn.Linear
    gate/up/down_proj (no bias) of width shared_expert_intermediate_size; and
    its gate mlp.shared_expert_gate, an nn.Linear [1, H] with no bias
    (recorded in moe["shared_layers"])."""
    H, S = int(cfg.hidden_size), int(cfg.shared_expert_intermediate_size)
    if getattr(mlp.gate, "bias", None) is not None:
        fail(f"{name}: the router mlp.gate has a bias; Qwen3_5MoeTopKRouter has none")
    shared, gate = getattr(mlp, "shared_expert", None), getattr(mlp, "shared_expert_gate", None)
    want = {"gate_proj": (S, H), "up_proj": (S, H), "down_proj": (H, S)}
    got = {p: tuple(getattr(shared, p).weight.shape) for p in DENSE_MLP
           if isinstance(getattr(shared, p, None), torch.nn.Linear) and getattr(shared, p).bias is None}
    if got != want:
        fail(f"{name}: shared_expert {got} (nn.Linear weights without bias), expected {want} "
             f"(shared_expert_intermediate_size {S})")
    if not isinstance(gate, torch.nn.Linear) or tuple(gate.weight.shape) != (1, H) or gate.bias is not None:
        fail(f"{name}: shared_expert_gate is not an nn.Linear [1, {H}] without bias: {gate}")
    with torch.no_grad():
        for p in DENSE_MLP:
            w = getattr(shared, p).weight
            if not torch.equal(w, stored(f"{name}.shared_expert.{p}.weight", w)):
                fail(f"{name}: shared_expert.{p}.weight differs from the checkpoint")
        if not torch.equal(gate.weight, stored(f"{name}.shared_expert_gate.weight", gate.weight)):
            fail(f"{name}: shared_expert_gate.weight differs from the checkpoint")
    moe["shared_layers"].append(layer)


def qwen3_5_module_targets(model, moe):
    """qwen3_5_moe_text's module targets: each layer's token mixer by
    config.layer_types (linear_attn's in_proj_qkv/z/b/a and out_proj, or
    self_attn's q/k/v/o_proj), the names of both kinds (each only in its own
    layers), then lm_head. The golden must cover both kinds."""
    types = list(model.config.layer_types)
    if len(types) != model.config.num_hidden_layers or set(types) != set(QWEN3_5_ATTENTION):
        fail(f"layer_types {types}: wanted one entry a layer and both of {sorted(QWEN3_5_ATTENTION)} "
             f"(make-model's tiny preset)")
    names = [n for kind in QWEN3_5_ATTENTION for n in QWEN3_5_ATTENTION[kind]] + ["lm_head"]
    module_targets(model, moe, names, layer_names={L: QWEN3_5_ATTENTION[t] for L, t in enumerate(types)})
    for n in moe["linear_targets"]:
        hit = re.search(r"(?:^|\.)layers\.(\d+)\.(\w+)\.\w+$", n)
        if n != "lm_head" and (not hit or hit.group(2) != QWEN3_5_MIXER[types[int(hit.group(1))]]):
            fail(f"{n}: expected the targets of layer L under model.layers.L.linear_attn or .self_attn "
                 f"(loom's names), by layer_types {types}")


def moe_layout(model, model_dir):
    """An MoE model's layers as HF built them, checked against the config and
    the checkpoint: each MoE layer's fused experts must hold the hub's
    per-expert weights (gate rows first, then up; [E, out, in]); gpt_oss's
    its own layout (gpt_oss_layout); deepseek's also its router and shared
    experts (deepseek_extras); qwen3_5_moe_text's the checkpoint's fused
    experts as stored, and its shared expert and gate (qwen3_5_extras).
    None for a dense model."""
    cfg = model.config
    if cfg.model_type not in MOE_TYPES:
        return None
    deepseek = cfg.model_type in DEEPSEEK_MOE_TYPES
    qwen3_5 = cfg.model_type in QWEN3_5_MOE_TYPES
    if cfg.model_type == "gpt_oss":
        E = K = I = H = 0
    elif deepseek:
        E, K = int(cfg.n_routed_experts), int(cfg.num_experts_per_tok)
        I, H = int(cfg.moe_intermediate_size), int(cfg.hidden_size)
    else:
        E, K = int(cfg.num_experts), int(cfg.num_experts_per_tok)
        I, H = int(cfg.moe_intermediate_size), int(cfg.hidden_size)
    if deepseek:
        # HF's DeepseekV2/V3DecoderLayer: dense MLP below first_k_dense_replace, MoE from it on.
        if cfg.model_type in ("mimo_v2_flash", "glm_moe_dsa"):  # dense where mlp_layer_types says so
            is_dense = lambda layer: cfg.mlp_layer_types[layer] == "dense"  # noqa: E731
        else:
            first_dense = int(getattr(cfg, "first_k_dense_replace", 0) or 0)
            is_dense = lambda layer: layer < first_dense  # noqa: E731
    elif qwen3_5:  # HF's Qwen3_5MoeDecoderLayer: a Qwen3_5MoeSparseMoeBlock in every layer
        is_dense = lambda layer: False  # noqa: E731
    else:
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense_only = set(getattr(cfg, "mlp_only_layers", None) or [])
        is_dense = lambda layer: layer in dense_only or E == 0 or (layer + 1) % step != 0  # noqa: E731
    mlps = {}
    for name, m in model.named_modules():
        hit = re.fullmatch(r"(?:.*\.)?layers\.(\d+)\.mlp", name)
        if hit:
            mlps[int(hit.group(1))] = (name, m)
    if sorted(mlps) != list(range(cfg.num_hidden_layers)):
        fail(f"found the MLPs of layers {sorted(mlps)}, config.json has {cfg.num_hidden_layers} layers")
    ckpt = {}
    for path in safetensors_paths(model_dir):
        with safe_open(path, framework="pt") as f:
            ckpt.update({k: f.get_tensor(k) for k in f.keys()})

    if cfg.model_type == "gpt_oss":
        moe = gpt_oss_layout(model, ckpt, mlps)
        moe["model_type"] = cfg.model_type
        module_targets(model, moe, MOE_TARGET_MODULES)
        return moe

    def stored(key, like):
        if key not in ckpt:
            fail(f"{model_dir} has no tensor {key} (make-model should write the hub's names, "
                 f"per expert for the routed experts{' (qwen3_5_moe_text: fused)' if qwen3_5 else ''})")
        return ckpt[key].to(like.device, like.dtype)

    moe = {"model_type": cfg.model_type, "num_experts": E, "top_k": K, "moe_layers": [], "dense_layers": [],
           "mlp": {}, "experts": {}}
    if deepseek or qwen3_5:
        moe["shared_layers"] = []
    if qwen3_5:
        moe["shared_mlp"] = "shared_expert"  # deepseek's is shared_experts
    for layer in sorted(mlps):
        name, mlp = mlps[layer]
        moe["mlp"][layer] = name
        if is_dense(layer):
            if not all(isinstance(getattr(mlp, p, None), torch.nn.Linear) for p in DENSE_MLP) \
                    or getattr(mlp, "experts", None) is not None:
                fail(f"{name}: config.json makes layer {layer} dense, but HF built {type(mlp).__name__}")
            moe["dense_layers"].append(layer)
            continue
        experts, router = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
        gu, dn = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
        rw = getattr(router, "weight", None)
        if not all(isinstance(t, torch.nn.Parameter) for t in (gu, dn, rw)):
            fail(f"{name}: expected parameters experts.gate_up_proj, experts.down_proj and gate.weight "
                 f"(transformers v5 fused experts), HF built {mlp}")
        want = {"gate_up_proj": (E, 2 * I, H), "down_proj": (E, H, I), "gate.weight": (E, H)}
        got = {"gate_up_proj": tuple(gu.shape), "down_proj": tuple(dn.shape), "gate.weight": tuple(rw.shape)}
        transposed = getattr(experts, "is_transposed", False)
        if got != want or transposed:
            fail(f"{name}: shapes {got}, is_transposed {transposed}; expected {want}, [E, out, in]")
        with torch.no_grad():
            if qwen3_5:  # the checkpoint stores them fused already, in HF's layout: compare as stored
                for k, t in (("gate_up_proj", gu), ("down_proj", dn)):
                    if not torch.equal(t, stored(f"{name}.experts.{k}", t)):
                        fail(f"{name}: experts.{k} differs from {name}.experts.{k} in the checkpoint")
            else:
                for j in range(E):
                    hub = f"{name}.experts.{j}"
                    if not (torch.equal(gu[j, :I], stored(f"{hub}.gate_proj.weight", gu))
                            and torch.equal(gu[j, I:], stored(f"{hub}.up_proj.weight", gu))
                            and torch.equal(dn[j], stored(f"{hub}.down_proj.weight", dn))):
                        fail(f"{name}: fused expert {j} is not [gate_proj; up_proj] and down_proj of {hub}")
            if not torch.equal(rw, stored(f"{name}.gate.weight", rw)):
                fail(f"{name}: the router differs from {name}.gate.weight in the checkpoint")
        moe["moe_layers"].append(layer)
        moe["experts"][layer] = experts
        if deepseek:
            deepseek_extras(moe, layer, name, mlp, stored, cfg)
        elif qwen3_5:
            qwen3_5_extras(moe, layer, name, mlp, stored, cfg)
    if not moe["moe_layers"]:
        fail(f"config.json says {cfg.model_type} but no layer is MoE")
    if cfg.model_type in DEEPSEEK_TYPES:
        q_rank = getattr(cfg, "q_lora_rank", None)
        if q_rank is not None and int(q_rank) <= 0:
            fail(f"q_lora_rank {q_rank}: HF builds q_a_proj/q_b_proj for any non-null q_lora_rank; "
                 f"no q compression is null")
        module_targets(model, moe, DEEPSEEK_ATTENTION[q_rank is not None] + ["lm_head"],
                       absent=DEEPSEEK_ATTENTION[q_rank is None])
    elif qwen3_5:
        qwen3_5_module_targets(model, moe)
    else:
        module_targets(model, moe, MOE_TARGET_MODULES)
    return moe


def moe_targets(moe):
    """(target_modules, target_parameters) of an MoE adapter (see MOE_TYPES):
    the module targets moe_layout found; the experts' two fused parameters;
    every dense-MLP layer's and every shared-experts MLP's gate/up/down_proj
    weight by full name (the shared MLP is moe["shared_mlp"]: deepseek's
    shared_experts, qwen3_5_moe_text's shared_expert)."""
    shared = moe.get("shared_mlp", "shared_experts")
    params = [f"mlp.experts.{p}" for p in EXPERT_PARAMS]
    params += [f"{moe['mlp'][layer]}.{p}.weight" for layer in moe["dense_layers"] for p in DENSE_MLP]
    params += [f"{moe['mlp'][layer]}.{shared}.{p}.weight" for layer in moe.get("shared_layers", [])
               for p in DENSE_MLP]
    return list(moe["target_modules"]), params


def config_drift(got, want):
    """How PEFT's adapter config `got` (a LoraConfig, or adapter_config.json as
    a dict) differs from `want` (a dict) in its targets and rank/alpha
    patterns; "" if it does not. PEFT's transformers-v5 MoE shim rewrites
    these in place, on get_peft_model and again on from_pretrained."""
    def field(cfg, key):
        v = cfg.get(key) if isinstance(cfg, dict) else getattr(cfg, key, None)
        if key.endswith("_pattern"):
            return dict(v or {})
        return {v} if isinstance(v, str) else set(v or [])

    def show(v):
        return v if isinstance(v, dict) else sorted(v)

    return "; ".join(f"{key} {show(field(got, key))} (wanted {show(field(want, key))})"
                     for key in ("target_modules", "target_parameters", "rank_pattern", "alpha_pattern")
                     if field(got, key) != field(want, key))


def expert_parameter(m):
    """gate_up_proj or down_proj for PEFT's wrapper of a fused expert parameter, else None."""
    name = getattr(m, "parameter_name", None)
    return name if name in EXPERT_PARAMS and getattr(m, "num_experts", 1) > 1 else None


def layer_of(module_name):
    return int(re.search(r"layers\.(\d+)\.", module_name).group(1))


def check_wrapped(layers, moe, adapters):
    """Every intended target, and nothing else, carries every adapter at its
    rank and alpha: module LoRA on attention and lm_head; a ParamWrapper on
    both expert parameters of each MoE layer (E experts) and on each dense-MLP
    and shared-experts weight (one)."""
    from peft.tuners.lora import Linear, ParamWrapper

    want = {(n, None): 1 for n in moe["linear_targets"]}
    for layer in moe["moe_layers"]:
        want.update({(f"{moe['mlp'][layer]}.experts", p): moe["num_experts"] for p in EXPERT_PARAMS})
    for layer in moe["dense_layers"]:
        want.update({(f"{moe['mlp'][layer]}.{p}", "weight"): 1 for p in DENSE_MLP})
    shared = moe.get("shared_mlp", "shared_experts")
    for layer in moe.get("shared_layers", []):
        want.update({(f"{moe['mlp'][layer]}.{shared}.{p}", "weight"): 1 for p in DENSE_MLP})
    got = {}
    for mod_name, m in layers:
        path = mod_name.removeprefix("base_model.model.").replace(".base_layer", "")
        if isinstance(m, ParamWrapper):
            key, experts = (path, m.parameter_name), m.num_experts
        elif isinstance(m, Linear):
            key, experts = (path, None), 1
        else:
            fail(f"{mod_name}: unexpected LoRA layer {type(m).__name__}")
        if key in got:
            fail(f"{key} is wrapped twice")
        got[key] = experts
        for name, r, alpha in adapters:
            if m.r.get(name) != r or m.lora_alpha.get(name) != alpha or m.scaling.get(name) != alpha / r:
                fail(f"{mod_name} {name}: r {m.r.get(name)} alpha {m.lora_alpha.get(name)} scaling "
                     f"{m.scaling.get(name)}, wanted r {r} alpha {alpha}")
    if got != want:
        fail(f"PEFT wrapped {sorted(set(got.items()) - set(want.items()), key=str)} unasked and missed "
             f"{sorted(set(want.items()) - set(got.items()), key=str)} (((module, parameter), experts))")


def init_expert_lora(m, name, rng, transposed=False):
    """Draws loom's layout for one expert target and writes it in PEFT's.
    loom: gate_up has one A [r, H] for all experts and B_e [2I, r] per expert;
    down has A_e [r, I] per expert and one B [H, r]. PEFT (ParamWrapper): A
    [E*r, in] holds expert e in rows e*r+k, B [out, r*E] in columns k*E+e; so
    the shared factor is replicated into every expert's slice. gpt_oss
    (transposed: the parameter is [E, in, out]): gate_up's out rows are HF's
    interleaved columns, so loom's B rows (gate j, then up j) go to rows 2j
    and 2j+1. Checks that PEFT's own delta (get_delta_weight) is
    scale * B_e A_e for every expert, in the parameter's layout."""
    E, r = m.num_experts, m.r[name]
    a, b = m.lora_A[name].weight, m.lora_B[name].weight
    d_in, d_out = a.shape[1], b.shape[0]
    param = tuple(m.get_param().shape)
    want_param = (E, d_in, d_out) if transposed else (E, d_out, d_in)
    if tuple(a.shape) != (E * r, d_in) or tuple(b.shape) != (d_out, r * E) or param != want_param:
        fail(f"{m.parameter_name} {name}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}, parameter {param}; "
             f"expected [E*r, in], [out, r*E], {list(want_param)} with E={E} r={r}")
    a_std = A_STD_SCALE / np.sqrt(d_in)
    if m.parameter_name == "gate_up_proj":
        a_e = np.broadcast_to(rng.normal(0.0, a_std, size=(r, d_in)), (E, r, d_in))
        b_e = rng.normal(0.0, B_STD, size=(E, d_out, r))
    else:
        a_e = rng.normal(0.0, a_std, size=(E, r, d_in))
        b_e = np.broadcast_to(rng.normal(0.0, B_STD, size=(d_out, r)), (E, d_out, r))
    a_e, b_e = a_e.astype(np.float32), b_e.astype(np.float32)
    if transposed and m.parameter_name == "gate_up_proj":  # loom's [gate; up] rows -> HF's interleaved
        half = d_out // 2
        b_e = np.stack([b_e[:, :half], b_e[:, half:]], axis=2).reshape(E, d_out, r)
    a.copy_(torch.from_numpy(np.ascontiguousarray(a_e.reshape(E * r, d_in))))
    b.copy_(torch.from_numpy(np.ascontiguousarray(b_e.transpose(1, 2, 0).reshape(d_out, r * E))))
    want = m.scaling[name] * np.einsum("eok,eki->eoi", b_e.astype(np.float64), a_e.astype(np.float64))
    if transposed:
        want = want.transpose(0, 2, 1)
    got = m.get_delta_weight(name).detach().cpu().double().numpy()
    if got.shape != want.shape or np.abs(got - want).max() > 1e-5 * np.abs(want).max():
        fail(f"{m.parameter_name} {name}: PEFT's get_delta_weight is not scale * B_e A_e for the layout "
             f"written (rows e*r+k of A, columns k*E+e of B)")


def watch_clamp(moe):
    """gpt_oss: wraps each experts module's _apply_gate (the clamped SwiGLU)
    to record the largest |gate/up pre-activation| it sees."""
    seen = [0.0]
    for experts in moe["experts"].values():
        gate = experts._apply_gate

        def wrapped(gate_up, gate=gate):
            seen[0] = max(seen[0], gate_up.detach().abs().max().item())
            return gate(gate_up)
        experts._apply_gate = wrapped
    return seen


class RouteRecorder:
    """Forward pre-hooks on the experts modules: the top-k experts HF routes
    each token to in each MoE layer, and whether the routing weights carry a
    gradient (the router's path back into the hidden state). Records only
    between start() and stop()."""

    def __init__(self, moe):
        self.E, self.K = moe["num_experts"], moe["top_k"]
        self.routes = None
        self.weights_without_grad = set()
        for layer, experts in moe["experts"].items():
            experts.register_forward_pre_hook(self._hook(layer), with_kwargs=True)

    def _hook(self, layer):
        def hook(module, args, kwargs):
            if self.routes is None:
                return None
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            weights = args[2] if len(args) > 2 else kwargs.get("top_k_weights")
            if not (torch.is_tensor(index) and torch.is_tensor(weights)) or index.is_floating_point() \
                    or index.dim() != 2 or index.shape[1] != self.K or tuple(weights.shape) != tuple(index.shape):
                fail(f"layer {layer}: experts called without (hidden, top_k_index [T, {self.K}], top_k_weights)")
            if layer in self.routes:
                fail(f"layer {layer}: experts ran twice in one forward")
            rows = index.tolist()
            if any(len(set(row)) != self.K or not all(0 <= e < self.E for e in row) for row in rows):
                fail(f"layer {layer}: routes {rows} are not {self.K} distinct experts in [0, {self.E})")
            self.routes[layer] = rows
            if torch.is_grad_enabled() and not weights.requires_grad:
                self.weights_without_grad.add(layer)
            return None
        return hook

    def start(self):
        self.routes = {}

    def stop(self):
        routes, self.routes = self.routes, None
        return routes


def expert_hits(seqs, seq_routes, layer, adapter=None):
    return {e for seq, routes in zip(seqs, seq_routes) if adapter in (None, seq["adapter"])
            for row in routes[layer] for e in row}


def check_routes(moe, seqs, seq_routes, recorder):
    """Each sequence was routed in every MoE layer, every expert of every MoE
    layer is hit by some token of the batch, and the routing weights had a
    gradient (else HF's golden would lack the router's path)."""
    for i, (seq, routes) in enumerate(zip(seqs, seq_routes)):
        if sorted(routes) != moe["moe_layers"] or any(len(routes[L]) != len(seq["tokens"]) for L in routes):
            fail(f"seq{i}: routes recorded for layers {sorted(routes)}, wanted one per token in {moe['moe_layers']}")
    for layer in moe["moe_layers"]:
        hit = expert_hits(seqs, seq_routes, layer)
        if hit != set(range(moe["num_experts"])):
            fail(f"layer {layer}: the batch hits experts {sorted(hit)} of {moe['num_experts']}; "
                 f"lengthen the sequences of batch_plan({moe['model_type']!r}) so that every expert gets a token")
    if recorder.weights_without_grad:
        fail(f"layers {sorted(recorder.weights_without_grad)}: the routing weights have no gradient")


def check_expert_grads(layers, adapters, seqs, seq_routes):
    """An expert's slices of a gradient (A rows e*r.., B columns ..*E+e) are
    non-zero exactly when some token of the adapter's sequences hit it."""
    for name, _, _ in adapters:
        for mod_name, m in layers:
            if not expert_parameter(m):
                continue
            E, r = m.num_experts, m.r[name]
            ga, gb = m.lora_A[name].weight.grad, m.lora_B[name].weight.grad
            if ga is None or gb is None:
                fail(f"{mod_name} {name}: no gradient")
            ga, gb = ga.reshape(E, r, -1), gb.reshape(gb.shape[0], r, E)
            hit = expert_hits(seqs, seq_routes, layer_of(mod_name), name)
            for e in range(E):
                live = (ga[e].abs().max().item() > 0, gb[:, :, e].abs().max().item() > 0)
                if live != ((e in hit),) * 2:
                    fail(f"{mod_name} {name}: expert {e} (hit: {e in hit}) has gradient slices "
                         f"non-zero A {live[0]}, B {live[1]}")


def check_reload(model_dir, adapters_dir, adapters, seqs, logprobs, device, want):
    """Each saved adapter loads into a fresh base with PeftModel.from_pretrained
    (the v5 shim runs again there), keeps its config, and gives the golden
    logprobs: the golden adapters are loadable PEFT adapters."""
    from peft import PeftModel

    for name, _, _ in adapters:
        peft_model = PeftModel.from_pretrained(load_base(model_dir, device), os.path.join(adapters_dir, name),
                                               adapter_name=name)
        peft_model.eval()
        drift = config_drift(peft_model.peft_config[name], want)
        if drift:
            fail(f"{name}: PeftModel.from_pretrained changed the config: {drift}")
        with torch.no_grad():
            for i, seq in enumerate(seqs):
                if seq["adapter"] != name:
                    continue
                diff = (seq_logprobs(peft_model, seq, device).cpu() - logprobs[i]).abs().max().item()
                if diff > RELOAD_TOL:
                    fail(f"seq{i}: the reloaded {name} gives logprobs {diff:.3g} away from the golden")


def moe_record(moe, layers, targets, saved_keys, seq_routes):
    """batch.json's "moe" block: what loom's parity test needs to map PEFT's
    saved expert tensors onto its own layout."""
    if any(keys != saved_keys["a0"] for keys in saved_keys.values()):
        fail(f"the adapters saved different keys: {saved_keys}")
    shared = {"gate_up_proj": "lora_A", "down_proj": "lora_B"}
    expert_keys = {}
    for mod_name, m in layers:
        param = expert_parameter(m)
        for kind in ("lora_A", "lora_B") if param else ():
            expert_keys[f"{mod_name}.{kind}.weight"] = {"layer": layer_of(mod_name), "parameter": param,
                                                        "factor": kind, "shared": shared[param] == kind}
    record = {
        "num_experts": moe["num_experts"],
        "top_k": moe["top_k"],
        "moe_layers": moe["moe_layers"],
        "dense_mlp_layers": moe["dense_layers"],
    }
    if "shared_layers" in moe:  # deepseek and qwen3_5_moe_text only: the others' batch.json stays as it was
        record["shared_expert_layers"] = moe["shared_layers"]
    return {
        **record,
        "target_modules": targets["target_modules"],
        "target_parameters": targets["target_parameters"],
        "expert_lora": "lora_A [E*r, in]: expert e in rows e*r+k; lora_B [out, r*E]: expert e in columns k*E+e; "
                       "the shared factor (gate_up_proj lora_A, down_proj lora_B) is replicated into every "
                       "expert's slice, and its loom gradient is the sum of the slices' gradients"
                       + ("; gate_up_proj lora_B rows are HF's interleaved columns (2j gate j, 2j+1 up j)"
                          if moe.get("transposed") else ""),
        "gate_up_interleaved": bool(moe.get("transposed")),
        "expert_keys": expert_keys,
        "saved_keys": saved_keys["a0"],
        "routes": [{str(layer): routes[layer] for layer in moe["moe_layers"]} for routes in seq_routes],
    }


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
    moe = moe_layout(model, args.model)
    adapters = ADAPTERS if moe is None else MOE_ADAPTERS
    target_modules, target_parameters = (list(TARGET_MODULES), []) if moe is None else moe_targets(moe)
    targets = {"target_modules": target_modules, "target_parameters": target_parameters}
    vocab = int(model.config.vocab_size)
    rng = np.random.default_rng(SEED)
    seqs = make_batch(rng, vocab, *batch_plan(model.config.model_type))

    # Base-only logprobs, to prove later that the adapters matter.
    with torch.no_grad():
        base_lp = [seq_logprobs(model, s, device) for s in seqs]

    configs = {name: LoraConfig(r=r, lora_alpha=alpha, target_modules=list(target_modules),
                                target_parameters=list(target_parameters) or None, lora_dropout=0.0,
                                bias="none", task_type="CAUSAL_LM", use_rslora=False, use_dora=False)
               for name, r, alpha in adapters}
    peft_model = get_peft_model(model, configs["a0"], adapter_name="a0")
    for name, _, _ in adapters[1:]:
        peft_model.add_adapter(name, configs[name])
    peft_model.eval()
    for name, _, _ in adapters:
        drift = config_drift(peft_model.peft_config[name], targets)
        if drift:
            fail(f"{name}: PEFT rewrote the adapter config: {drift}")

    # Non-zero A and B for every adapter, in a fixed order from the seed.
    layers = lora_layers(peft_model)
    if moe is not None:
        check_wrapped(layers, moe, adapters)
    seen_short = set()
    with torch.no_grad():
        for name, _, _ in adapters:
            for mod_name, m in layers:
                a = m.lora_A[name].weight
                b = m.lora_B[name].weight
                d_in = a.shape[1]
                if moe is not None and expert_parameter(m):
                    init_expert_lora(m, name, rng, transposed=moe.get("transposed", False))
                else:
                    a.copy_(torch.from_numpy(rng.normal(0.0, A_STD_SCALE / np.sqrt(d_in), size=tuple(a.shape))
                                             .astype(np.float32)))
                    b.copy_(torch.from_numpy(rng.normal(0.0, B_STD, size=tuple(b.shape)).astype(np.float32)))
                if a.abs().max().item() == 0 or b.abs().max().item() == 0:
                    fail(f"{mod_name} {name}: zero LoRA weight")
                seen_short.add(mod_name.split(".")[-1])
    if moe is None and seen_short != set(TARGET_MODULES):
        fail(f"PEFT adapted {sorted(seen_short)}, expected {sorted(TARGET_MODULES)}")

    # Forward each sequence alone under its adapter; backward right away so the
    # active adapter (the only one PEFT leaves trainable) accumulates its grad.
    recorder = RouteRecorder(moe) if moe is not None else None
    clamp_seen = watch_clamp(moe) if moe is not None and moe.get("transposed") else None
    logprobs, seq_routes = [], []
    for seq in seqs:
        peft_model.set_adapter(seq["adapter"])
        if recorder:
            recorder.start()
        lp = seq_logprobs(peft_model, seq, device)
        if recorder:
            seq_routes.append(recorder.stop())
        (-lp.sum()).backward()
        logprobs.append(lp.detach().cpu())
    if clamp_seen is not None and clamp_seen[0] <= 7.0:
        fail(f"the largest gate/up pre-activation is {clamp_seen[0]:.3g}: the +-7 clamp never bites")
    if moe is not None:
        check_routes(moe, seqs, seq_routes, recorder)
        check_expert_grads(layers, adapters, seqs, seq_routes)

    golden = {}
    for i, lp in enumerate(logprobs):
        if not torch.isfinite(lp).all() or (lp > 0).any():
            fail(f"seq{i} logprobs are not finite non-positive: {lp}")
        if (lp - base_lp[i].cpu()).abs().max().item() < 1e-3:
            fail(f"seq{i}: the adapter changes logprobs by less than 1e-3")
        golden[f"seq{i}.logprobs"] = lp.contiguous()

    os.makedirs(args.out, exist_ok=True)
    adapters_dir = os.path.join(args.out, "adapters")
    peft_model.save_pretrained(adapters_dir, selected_adapters=[n for n, _, _ in adapters],
                               save_embedding_layers=False, safe_serialization=True)

    saved_keys = {}
    for name, r, alpha in adapters:
        path = os.path.join(adapters_dir, name, "adapter_model.safetensors")
        if not os.path.exists(path):
            fail(f"save_pretrained did not write {path}")
        with safe_open(path, framework="pt") as f:
            saved = {k: f.get_tensor(k) for k in f.keys()}
        with open(os.path.join(adapters_dir, name, "adapter_config.json")) as f:
            acfg = json.load(f)
        if acfg.get("r") != r or float(acfg.get("lora_alpha")) != alpha:
            fail(f"{name}: adapter_config.json says r={acfg.get('r')} alpha={acfg.get('lora_alpha')}")
        drift = config_drift(acfg, targets)
        if drift:
            fail(f"{name}: adapter_config.json differs from the asked config: {drift}")
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
        saved_keys[name] = sorted(saved)

    batch = {
        "model": ident,
        "adapters": {name: {"r": r, "alpha": alpha, "dir": f"adapters/{name}"} for name, r, alpha in adapters},
        "sequences": seqs,
        "seed": SEED,
        "loss": "sum over sequences and positions of -logprob(target), weights 1",
        "grad_key": "grad.<adapter>.<adapter_model.safetensors key>",
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "numpy": np.__version__},
        "device": str(device),
    }
    if moe is not None:
        check_reload(args.model, adapters_dir, adapters, seqs, logprobs, device, targets)
        batch["moe"] = moe_record(moe, layers, targets, saved_keys, seq_routes)
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
