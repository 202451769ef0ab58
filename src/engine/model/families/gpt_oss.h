// gpt_oss (GPT-OSS-20B, transformers 5.17's modeling_gpt_oss): the family
// (family.h; its config fields, weights and presets in gpt_oss.cpp) and its
// mapping from Hugging Face tensors onto loom's shared blocks. Everything
// else about the family is a setting of those blocks:
//   attention  AttentionVariant (attention.h): per-head sinks, and a sliding
//              window on the layers config.layer_types marks sliding;
//   RoPE       YaRN (rope.h);
//   RMSNorm    weights kept in fp32, scaled in fp32 then cast (lean_ops.h);
//   MLP        every layer MoE (moe.h): biased top-k-then-softmax router,
//              clamped SwiGLU experts with biases.
// HF stores the experts transposed ([E, in, out]) with gate and up columns
// interleaved (even = gate, odd = up); the loader permutes them into moe.h's
// [E, out, in] with the gate rows first, so the grouped GEMMs and the
// expert LoRA are the qwen3_moe code path.
//
// Pure functions; any thread.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "engine/model/attention.h"
#include "engine/model/config.h"
#include "engine/model/moe.h"

namespace loom::engine {

// HF's interleaved gate_up [E, H, 2I] as [E, 2I, H], gate rows then up rows
// (row j < I is HF column 2j, row I + j is column 2j + 1); the same
// permutation of a bias [E, 2I] along its last dimension. Their inverses
// (for writing a checkpoint or a PEFT file in HF's order).
at::Tensor GateUpFromInterleaved(const at::Tensor& w);
at::Tensor GateUpBiasFromInterleaved(const at::Tensor& b);
at::Tensor InterleaveGateUp(const at::Tensor& halves, int64_t dim);  // halves [.., 2I, ..] along dim

// MXFP4 expert tensors (HF integrations/mxfp4.py): blocks [.., R, G, 16]
// uint8, each byte two FP4 (E2M1) codes, the low nibble the even element;
// scales [.., R, G] uint8, one E8M0 exponent (bias 127) per 32 elements.
// Returns the dequantized [.., R, G * 32] in dtype (exact in bf16), rows as
// stored (out rows); the checkpoint's [E, in, out] param is its transpose(-1, -2).
at::Tensor DequantizeMxfp4(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype);

}  // namespace loom::engine
