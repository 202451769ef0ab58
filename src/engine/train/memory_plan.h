// MemoryPlan: what a training pass of T tokens costs in device memory, and
// so how many of its decoder layers to recompute (recompute.h) and how many
// tokens one pass may hold at most. Limits are found here, before a pass
// runs, never by running out of memory.
//
// The cost model is measured, not derived: Engine::Open on a GPU runs four
// probe passes (P and 2P tokens, every layer kept and every layer
// recomputed) on a scratch slot and reads the caching allocator's peak over
// each. Activation memory is linear in T for a fixed number k of recomputed
// layers (flash attention, chunked logits), and the L layers of a dense
// model cost the same, so
//
//   bytes(T, k) = fixed + T * (recomputed + (L - k) / L * (kept - recomputed))
//
// with `kept` and `recomputed` the per-token slopes at k = 0 and k = L,
// each term a tenth above the line through the probes (the allocator's
// rounding and splitting of blocks grows with the pass).
//
// Threading: pure values and functions; any thread.
#pragma once
#include <cstdint>

namespace loom::engine::train {

struct ActivationCost {
  int64_t layers = 0;          // L
  double fixed = 0;            // bytes whatever T (logit chunks, workspaces)
  double kept = 0;             // bytes per token with every layer's activations kept
  double recomputed = 0;       // bytes per token with every layer recomputed
  bool known() const { return layers > 0 && kept > 0; }
  double Bytes(int64_t tokens, int64_t recompute_layers) const;
  // From the probes' peaks: m[t][k] for tokens {P, 2P} and k {0 (kept), L}.
  static ActivationCost FromProbes(int64_t layers, int64_t probe_tokens, const double m[2][2]);
  // Each term the larger of a's and b's (the costs of two ways a pass may
  // run, e.g. the LoRA orders); the other where one is unknown.
  static ActivationCost Dearest(const ActivationCost& a, const ActivationCost& b);
};

struct PassPlan {
  bool fits = false;
  int64_t recompute_layers = 0;  // the fewest that fit (L when none fits)
  double bytes = 0;              // the model's estimate at that count
};

// The fewest recomputed layers with which `tokens` fit in `available` bytes.
PassPlan PlanPass(const ActivationCost& cost, int64_t tokens, double available);

// The most tokens one pass can hold in `available` bytes with
// `recompute_layers` of its layers recomputed: every layer by default, the
// most a pass can hold at all (0 when not even one fits).
int64_t MaxPassTokens(const ActivationCost& cost, double available, int64_t recompute_layers = -1);

}  // namespace loom::engine::train
