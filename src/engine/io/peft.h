// peft: one SlotBank slot <-> a Hugging Face PEFT LoRA adapter directory
// (what PeftModel.save_pretrained writes and PeftModel.from_pretrained reads):
//   adapter_config.json         peft_type LORA, task_type CAUSAL_LM, r,
//                               lora_alpha, target_modules (short names of
//                               the trained groups' modules, e.g. "q_proj",
//                               "lm_head"), bias "none", base_model_name_or_path
//   adapter_model.safetensors   base_model.model.<module>.lora_A.weight [r, d_in]
//                               base_model.model.<module>.lora_B.weight [d_out, r]
//                               fp32, trimmed to the slot's own rank r.
// PEFT's scale is lora_alpha / r, the bank's too (rsLoRA and DoRA are refused).
//
// Engine thread only (reads or writes the bank's tensors). Each file is
// written atomically (temp + fsync + rename); making the directory as a whole
// appear atomically (temp dir + rename) is the caller's job.
#pragma once
#include <string>

#include "common/status.h"
#include "engine/lora/slot_bank.h"

namespace loom::engine {

// Writes slot s of bank into dir (created if missing). The slot must be bound.
Status SavePeft(const SlotBank& bank, int slot, const std::string& dir, const std::string& base_model_name);

// Binds slot s of bank from dir: rank and alpha from adapter_config.json
// (r must be <= the bank's max rank), groups from target_modules, weights
// from the safetensors file. Every module named in target_modules must have
// both tensors with the right shape; an unknown, missing, extra or
// mis-shaped tensor is Status::Invalid naming it. Everything is checked
// before the bank is touched: on error the slot is unchanged.
Status LoadPeft(SlotBank& bank, int slot, const std::string& dir);

// "model.layers.3.self_attn.q_proj" -> "q_proj"; "lm_head" -> "lm_head".
std::string PeftShortName(const std::string& module);

}  // namespace loom::engine
