// AdapterBank: what `loom import-adapter` and `loom export` read a PEFT
// adapter directory against: a one-slot CPU SlotBank over the LoRA targets
// of the model at model_dir, at the adapter's own rank (so its memory is the
// adapter's size, twice), so that ReadPeft checks the adapter's target
// modules and every tensor's shape exactly as the server's sampler would.
// The rank is checked first: adapter_config.json's r must be in [1, max_rank].
//
// The targets come from the loaded model (Transformer::LoraTargets), so the
// base weights are read once, on the CPU in bf16, and freed before this
// returns: seconds for a small model, about a minute and its bf16 size in
// RAM for a large one.
//
// Threading: any thread; the bank is the caller's.
#pragma once
#include <memory>
#include <string>

#include "common/status.h"
#include "engine/lora/slot_bank.h"

namespace loom::cli {

Result<std::unique_ptr<engine::SlotBank>> AdapterBank(const std::string& model_dir, const std::string& adapter_dir,
                                                      int max_rank);

}  // namespace loom::cli
