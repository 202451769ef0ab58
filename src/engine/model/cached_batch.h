// CachedBatch and KvCache: the inputs of Transformer::ForwardCached, the
// sampler's incremental forward over a paged KV cache.
//
// The cache is block-allocated (paged): per layer one K and one V pool of
// num_blocks * block_size rows, each row one token's [KVH, hd] keys or
// values in the model dtype. A sequence owns a list of blocks (its block
// table, kept by the sampler's BlockManager); token position p of the
// sequence lives at row table[p / block_size] * block_size + p % block_size.
// This file knows rows only; which rows belong to whom is the sampler's.
//
// Threading: the sampler's decode thread only.
#pragma once
#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace loom::engine {

// One token's row of a layer's pools: K [k_heads, k_dim] and V [v_heads,
// v_dim]. Plain attention: [KVH, hd] each. MLA (mla.h): the latent row
// [1, kv_lora_rank + qk_rope_head_dim] in K and nothing in V.
struct KvRowShape {
  int64_t k_heads = 0, k_dim = 0, v_heads = 0, v_dim = 0;
  int64_t elements() const { return k_heads * k_dim + v_heads * v_dim; }
};

struct KvCache {
  std::vector<at::Tensor> k, v;  // per layer [rows, k_heads, k_dim] and [rows, v_heads, v_dim], model dtype
  // Per layer, a Gated DeltaNet layer's recurrent state of each state slot
  // [slots, Hv, dk, dv] (fp32; gated_deltanet.h), undefined for the others
  // (and for every layer of a cache made without state slots).
  std::vector<at::Tensor> state;
  int64_t rows() const { return k.empty() ? 0 : k[0].size(0); }
  // Zero-filled pools of `rows` token rows, one layer per shape.
  static KvCache Allocate(const std::vector<KvRowShape>& layers, int64_t rows, at::Device device, at::ScalarType dtype) {
    KvCache c;
    const auto opts = at::TensorOptions().dtype(dtype).device(device);
    for (const KvRowShape& shape : layers) {
      c.k.push_back(at::zeros({rows, shape.k_heads, shape.k_dim}, opts));
      c.v.push_back(at::zeros({rows, shape.v_heads, shape.v_dim}, opts));
    }
    return c;
  }
  static KvCache Allocate(int64_t layers, int64_t rows, int64_t kv_heads, int64_t head_dim, at::Device device,
                          at::ScalarType dtype) {
    return Allocate(std::vector<KvRowShape>(layers, KvRowShape{kv_heads, head_dim, kv_heads, head_dim}), rows, device,
                    dtype);
  }
};

// S rows (sequences), each contributing its new tokens, packed on one axis.
// Two kinds of step (as nano-vllm): prefill, where every row's new tokens
// attend causally to themselves and to the row's cached prefix (a prefix
// reused from the sampler's prefix cache; none unless seq_cached says so);
// and decode, where every row has exactly one new token that attends to its
// whole context (cached rows plus itself) through context_rows.
struct CachedBatch {
  at::Tensor tokens;               // [T] int64
  at::Tensor positions;            // [T] int64
  std::vector<int64_t> seq_begin;  // S+1 offsets of the rows' new tokens
  std::vector<int> seq_slot;       // S adapter slots of the bank (-1 = base); rows of one slot adjacent
  at::Tensor write_rows;           // [T] int64: the cache row each new token's K/V goes to
  bool prefill = false;
  // Prefill only: per row, how many positions before its new tokens are
  // already cached (empty: none for every row), and the cache rows of those
  // positions, rows concatenated in order ([sum of seq_cached] int64).
  std::vector<int64_t> seq_cached;
  at::Tensor cached_rows;
  // Decode only: [S, Lmax] int64 cache rows of each row's context in
  // position order (padding: any valid row), and [S, Lmax] bool, true where
  // the column is part of the row's context.
  at::Tensor context_rows;
  at::Tensor context_mask;
  // Models with Gated DeltaNet layers: each row's slot in KvCache::state,
  // which a prefill writes (the state after its last token) and a decode
  // step reads and writes; empty: no slots, and such a layer mixes each
  // row's whole cached context again (the same values, O(context)).
  std::vector<int64_t> seq_state;
};

}  // namespace loom::engine
