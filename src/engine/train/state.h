// Training state of one slot on disk: the adapter at the slot's own rank,
// both AdamW moments, the step counter and the LoraConfig. Being stored at
// rank r (not the bank's R), a state loads into any bank whose max_rank ≥ r
// and whose slot count differs.
//
// Layout of a state directory (published atomically, durable::PublishDirectory):
//   state.json                 {"format": "loom-training-state", "version": 1,
//                               "lora": {rank, alpha, seed, train_attn, train_mlp, train_unembed},
//                               "step": K, "has_optimizer": true, "targets": [module, ...]}
//   adapter_state.safetensors  F32 "<module>.lora_A" [r, d_in], "<module>.lora_B" [d_out, r]
//                              and, with the optimizer, the same names + ".exp_avg" / ".exp_avg_sq",
//                              for every target of a group the adapter trains.
//
// Threading: Save/Load run on the engine thread (they read/write the bank);
// ReadStateInfo touches no tensors and may run anywhere.
#pragma once
#include <string>

#include "common/status.h"
#include "engine/api.h"
#include "engine/lora/slot_bank.h"
#include "engine/train/adamw.h"

namespace loom::engine::train {

inline constexpr const char* kStateJson = "state.json";
inline constexpr const char* kStateTensors = "adapter_state.safetensors";

// Writes slot s's state into dir atomically. The slot must be bound.
Status SaveSlotState(const SlotBank& bank, const SlotOptimizer& optimizer, int s, const std::string& dir);

// Restores slot s (already bound with the checkpoint's rank, alpha and train
// groups, else Invalid naming the field) from dir. Without the optimizer the
// moments are zeroed and the step is 0. The slot's accumulated gradients are
// zeroed either way.
Status LoadSlotState(SlotBank& bank, SlotOptimizer& optimizer, int s, const std::string& dir, bool with_optimizer);

// The config and step stored in dir, reading state.json only.
Result<StateInfo> ReadStateInfo(const std::string& dir);

}  // namespace loom::engine::train
