// Transformer::Impl: the frozen base weights in the layout the forward
// passes use. Private to engine/model (transformer.cpp: the packed forward;
// transformer_decode.cpp: the KV-cached forward of the sampler).
//
// Threading: read-only after Load; any thread may read it.
#pragma once
#include <ATen/ATen.h>

#include <vector>

#include "engine/model/transformer.h"

namespace loom::engine {

// The frozen base weights. q/k/v and gate/up are stored fused (one matmul
// each per layer); their LoRA deltas are added to the matching slices.
struct Transformer::Impl {
  struct Layer {
    at::Tensor input_norm, post_norm;
    at::Tensor qkv_w, qkv_b;  // [(H + 2 KVH) * hd, hidden]; bias may be undefined
    at::Tensor q_norm, k_norm;  // [hd] (qwen3) or undefined
    at::Tensor o_w;             // [hidden, H * hd]
    at::Tensor o_b;             // [hidden] (qwen3 with attention_bias) or undefined
    at::Tensor gate_up_w;       // [2 * inter, hidden]
    at::Tensor down_w;          // [hidden, inter]
  };
  at::Tensor embed;    // [vocab, hidden]
  at::Tensor norm;     // [hidden]
  at::Tensor lm_head;  // [vocab, hidden]; aliases embed when tied
  at::Tensor inv_freq; // [hd / 2] fp32
  std::vector<Layer> layers;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, inter = 0;
};

}  // namespace loom::engine
