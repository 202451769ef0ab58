// SampleRequest and Sequence: the sampler's bookkeeping for one Submit()
// and for one of its num_samples rows (as nano-vllm's sequence.py).
//
// A request owns its sequences. Sequence 0 holds the prompt's KV blocks
// from the prefill; the others share its full prompt blocks (refcounted)
// and get a copy of the partial last one, so the prompt is computed once.
// With the prefix cache, sequence 0's first blocks may be reused from an
// earlier request (request.cached_prefix tokens); the prefill computes the
// rest, in one or more chunks: the request is prefilling while sequence 0's
// cached < prompt_len(), and only then do the other sequences get blocks.
// Invariant: seq.cached tokens of seq.tokens have K/V in the cache, at rows
// given by block_table; the last token of a running sequence is not cached;
// the first seq.published blocks were offered to the prefix cache.
//
// Threading: the decode thread only.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "engine/sample_api.h"

namespace loom::engine::sample {

struct SampleRequest;

struct Sequence {
  SampleRequest* request = nullptr;
  int index = 0;                   // sample index within the request (keys its PRNG)
  std::vector<int32_t> tokens;     // prompt followed by generated tokens
  int64_t cached = 0;              // tokens whose K/V is in the cache
  std::vector<int> block_table;    // KV blocks in position order
  int64_t published = 0;           // leading full blocks already offered to the prefix cache
  uint64_t last_step = 0;          // the scheduler step that last extended it (decode rotation)
  std::string text;                // generated text as bytes (kept only when stop strings are set)
  bool finished = false;
  int state = -1;                  // its Gated DeltaNet states' slot while running (ModelRunner::ReserveStates), or -1
};

struct SampleRequest {
  uint64_t id = 0;                 // arrival order
  SampleCall call;
  SampleCallback done;
  int64_t max_tokens = 0;          // resolved (unset -> context window - prompt)
  uint64_t seed = 0;               // resolved (unset -> fresh entropy)
  int slot = -1;                   // adapter slot while admitted (-1 = base)
  int64_t reserved_blocks = 0;     // KV blocks promised and not yet allocated
  int64_t kv_tokens = 0;           // its worst-case KV tokens while admitted (its tenant's load)
  uint64_t cache_root = 0;         // the prefix cache's root tag of the adapter identity
  int64_t cached_prefix = 0;       // prompt tokens reused from the prefix cache (whole blocks)
  std::vector<std::unique_ptr<Sequence>> sequences;
  SampleOutput output;
  int64_t prompt_len() const { return static_cast<int64_t>(call.prompt.size()); }
  bool prefilling() const { return sequences[0]->cached < prompt_len(); }
  // Prefilled whole, never in chunks: prompt logprobs need every position's hidden state.
  bool whole_prefill() const { return call.prompt_logprobs || call.topk_prompt_logprobs > 0; }
};

// One prefill row of a step: prompt positions [begin, end) of request's
// prompt, over its cached positions [0, begin) (reused from the prefix cache
// or computed by earlier chunks of the same prompt).
struct PrefillChunk {
  SampleRequest* request;
  int64_t begin, end;
};

}  // namespace loom::engine::sample
