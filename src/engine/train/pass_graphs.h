// PassGraphs: small forward_backward passes as CUDA graphs.
//
// Why: a pass of a few hundred tokens needs milliseconds of GPU work but
// ~10,000 kernel launches and ~80,000 ATen calls through autograd, so the
// host, not the GPU, sets its time (docs/benchmarks.md: the GPU was 8% busy
// in a traced 1 x 128 step). A graph replays all of them in one call.
//
// How: a pass that fits UniformShapeFor(max_tokens) runs in the uniform
// layout (uniform_pass.h), whose inputs, LoRA routing and outputs are
// device tensors at fixed addresses. The first pass of each UniformKey runs
// eagerly (its own result, and the warm-up of every kernel and cuBLAS
// workspace), then the forward and the backward are captured as two graphs
// into one private memory pool that all keys share; later passes of that key
// copy their inputs in and replay. Between the two replays the host reads
// the per-sequence losses: if one is not finite, the backward is not
// replayed and the caller runs the pass its usual way (which fails that
// call alone and adds nothing for it).
//
// Invariants: graphs write the bank's gradients in place into .grad tensors
// that exist before the capture and are never replaced (SlotBank and AdamW
// only zero them in place); all graph work runs on this object's own stream,
// ordered after the caller's stream's earlier work and before its later
// work. Without capture (the CPU, or capture off) the uniform pass runs
// eagerly every time: the same values, which is how CI tests the layout.
//
// Threading: engine thread only.
#pragma once
#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/api.h"
#include "engine/lora/slot_bank.h"
#include "engine/model/transformer.h"
#include "engine/train/loss_spec.h"
#include "engine/train/uniform_pass.h"

namespace loom::engine::train {

struct UniformResult {
  at::Tensor logprobs, elementwise;  // host fp32 [S * L]; datum i's rows start at i * len
  std::vector<double> loss;          // per datum: the sum of its per-token losses
  int64_t len = 0;
};

class PassGraphs {
 public:
  struct Options {
    int64_t max_tokens = 0;  // passes of at most this many padded tokens (0: none)
    bool capture = false;    // CUDA graphs (CUDA devices only); else the uniform pass runs eagerly
    // Whether the device has room now for a new shape of this many padded
    // tokens: its eager first pass and the pool's growth by about that
    // pass's activations, every layer kept. Asked before a shape is first
    // run for capture; no (or unset: always yes) leaves the pass to the
    // packed path and its own memory plan.
    std::function<bool(int64_t tokens)> room;
  };
  struct Stats {
    int64_t passes = 0;     // passes run in the uniform layout
    int64_t captures = 0;   // keys captured
    int64_t replays = 0;    // passes run by replaying graphs
    int64_t not_finite = 0; // passes handed back because a loss was not finite
    int64_t pool_bytes = 0; // device memory the graphs' pool holds
  };

  explicit PassGraphs(Options options);
  ~PassGraphs();

  // The pass of these datums (validated, 1-D targets, one loss, all with a
  // backward; datum i on slots[i]) in the uniform layout, or nothing when
  // it does not fit max_tokens or a loss is not finite (then nothing was
  // accumulated into any gradient).
  std::optional<UniformResult> Run(const Transformer& model, SlotBank& bank, const LossSpec& spec,
                                   const std::vector<const Datum*>& data, const std::vector<int>& slots);

  const Options& options() const { return options_; }
  const Stats& stats() const { return stats_; }

 private:
  struct Entry;
  std::optional<UniformResult> RunEntry(Entry& e, const Transformer& model, SlotBank& bank,
                                        const std::vector<const Datum*>& data, const std::vector<int>& slots);
  void Capture(Entry& e, const Transformer& model, SlotBank& bank);
  Options options_;
  Stats stats_;
  std::map<std::string, std::unique_ptr<Entry>> entries_;
  struct Cuda;  // stream and pool (CUDA builds)
  std::unique_ptr<Cuda> cuda_;
};

}  // namespace loom::engine::train
