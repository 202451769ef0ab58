// peft_config: the adapter_config.json half of peft.h (LoadPeft), without
// libtorch, so that tests/fuzz/ can feed it bytes. It reads what
// PeftModel.save_pretrained writes: peft_type LORA, r, lora_alpha,
// target_modules (short module names), and refuses what loom cannot honour
// (rsLoRA, DoRA, a bias, per-module rank or alpha patterns).
//
// Pure functions; any thread may call them.
#pragma once
#include <cstdint>
#include <set>
#include <string>

#include "common/status.h"
#include "engine/api.h"

namespace loom::engine {

struct PeftConfig {
  LoraConfig lora;                // rank, alpha; train_* from target_modules and target_parameters; seed 0
  std::set<std::string> modules;  // target_modules, short names ("q_proj", "lm_head")
  // target_parameters (PEFT's LoRA on fused expert tensors): "mlp.experts.gate_up_proj", "mlp.experts.down_proj";
  // and a dense MLP's weights by name, "model.layers.0.mlp.gate_proj.weight" (how an MoE model's
  // adapter names them: PEFT's transformers-v5 shim rewrites a gate_proj module target there).
  std::set<std::string> parameters;
};

// Whether a target_parameters entry names a dense MLP projection's weight
// ("<path>.gate_proj.weight", up_proj, down_proj; the path may be empty).
bool IsDenseMlpParameter(const std::string& name);
// Whether name is suffix or ends with "." + suffix: "layers.0.mlp.gate_proj.weight"
// ends so with "mlp.gate_proj.weight", not with "lp.gate_proj.weight".
bool EndsWithAtDot(const std::string& name, const std::string& suffix);

// Parses the text of an adapter_config.json; `path` names it in errors
// ("<path>: r 40 must be in [1, 32]"). r must be in [1, max_rank]; every
// target module must be one loom adapts (q/k/v/o_proj, MLA's q_a_proj,
// q_b_proj, kv_a_proj_with_mqa and kv_b_proj, gate/up/down_proj, lm_head),
// every target parameter an expert tensor loom adapts (both
// mlp.experts.gate_up_proj and mlp.experts.down_proj, or neither: the MLP
// group is trained as a whole) or a dense MLP weight (IsDenseMlpParameter). Any malformed text or wrong type is Status::Invalid, never a throw.
Result<PeftConfig> ParsePeftConfig(const std::string& text, int64_t max_rank, const std::string& path);

}  // namespace loom::engine
