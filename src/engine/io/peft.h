// peft: one SlotBank slot <-> a Hugging Face PEFT LoRA adapter directory
// (what PeftModel.save_pretrained writes and PeftModel.from_pretrained reads):
//   adapter_config.json         peft_type LORA, task_type CAUSAL_LM, r,
//                               lora_alpha, target_modules (short names of
//                               the trained groups' modules, e.g. "q_proj",
//                               "lm_head"), bias "none", base_model_name_or_path
//   adapter_model.safetensors   base_model.model.<module>.lora_A.weight [r, d_in]
//                               base_model.model.<module>.lora_B.weight [d_out, r]
//                               fp32, trimmed to the slot's own rank r.
//   MoE experts (slot_bank.h's expert targets) go as PEFT's target_parameters
//   ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"): lora_A [E * r,
//   d_in], lora_B [d_out, r * E] under the experts module's nested wrappers
//   (gate_up_proj's key has ".base_layer"), with loom's shared factor written
//   once per expert; reading one back requires those copies to be equal.
//   A target whose HF parameter interleaves its out halves (gpt_oss's
//   gate_up, [E, in, out] with gate/up columns alternating) has PEFT's
//   lora_B rows interleaved the same way: row 2j is loom's gate row j,
//   2j + 1 its up row j.
// PEFT's scale is lora_alpha / r, the bank's too (rsLoRA and DoRA are refused).
//
// PeftAdapter is that content in memory. Every way in and out goes through
// it: a slot is copied out (CopyPeft) and written (WritePeft), or read
// (ReadPeft) and installed into a slot (InstallPeft); SavePeft and LoadPeft
// are those two chains.
//
// Threading: the functions that take a SlotBank run on the thread that owns
// it (the engine or the decode thread); a PeftAdapter is a value of its own
// (its tensors alias no bank), so WritePeft and To() may run on any thread.
// Each file is written atomically (temp + fsync + rename); making the
// directory as a whole appear atomically is the caller's job.
#pragma once
#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "common/status.h"
#include "engine/lora/slot_bank.h"

namespace loom::engine {

// One adapter as a PEFT directory holds it: its config (rank, alpha, the
// trained groups) and, for every target of a trained group in bank order,
// A [r, d_in] and B [d_out, r] (expert targets: SlotBank's shapes at rank r), fp32 (B a strided view when CopyPeft took
// it from a bank of max rank R > r).
struct PeftAdapter {
  struct Factor {
    std::string module;  // HF module path, e.g. "model.layers.0.self_attn.q_proj"
    at::Tensor A, B;     // loom's layout (for an expert target: B's rows gate then up)
    bool hf_interleaved = false;  // the target's LoraTargetSpec::hf_interleaved (PEFT's B rows interleaved)
  };
  LoraConfig config;
  std::vector<Factor> factors;
  // When CopyPeft made it: the one buffer every factor views, a copy of
  // columns [flat_begin, flat_begin + storage.numel()) of a bank row (the
  // slot's factors at max rank flat_rank, rows flat_width wide; SlotBank::flat).
  // Else undefined.
  at::Tensor storage;
  int64_t flat_begin = 0, flat_rank = 0, flat_width = 0;

  // The same adapter on `device`: one copy of storage where there is one.
  // Runs on the caller's current stream.
  PeftAdapter To(at::Device device) const;
  // The same adapter over `copy`, a copy of storage (same sizes) made by
  // the caller: each factor at the same place in it. Needs storage.
  PeftAdapter WithStorage(at::Tensor copy) const;
  int64_t bytes() const;
};

// Where CopyPeft's factors lie in its storage: plain numbers and names, so
// that their views can be made later, on another thread (ViewFactors).
struct PeftPlaces {
  struct Place {
    std::string module;
    bool hf_interleaved = false;
    int64_t a_offset = 0, b_offset = 0;  // into the storage
    std::vector<int64_t> a_shape, b_shape;  // at the bank's max rank
  };
  std::vector<Place> places;
  int64_t rank = 0;  // the slot's
};

// A copy of bound slot s of bank on the bank's device: one copy of the span
// of its flat row that holds the trained groups (no host sync). Later
// changes to the slot leave it as it is. With `deferred`, the factors'
// views are left unmade (each is two or three tensor ops, some 2-4 ms of
// host time for the 253 targets of a 36-layer model: a save's whole cost
// on the engine thread) and their places written there instead.
Result<PeftAdapter> CopyPeft(const SlotBank& bank, int slot, PeftPlaces* deferred = nullptr);
// Makes adapter's factors as views of its storage at `places` (CopyPeft's deferred ones).
void ViewFactors(PeftAdapter& adapter, const PeftPlaces& places);

// Writes adapter into dir (created if missing), from any device.
Status WritePeft(const PeftAdapter& adapter, const std::string& dir, const std::string& base_model_name);

// Reads dir for a bank of bank's targets and max rank, onto the bank's
// device: rank and alpha from adapter_config.json (r must be <= the bank's
// max rank), groups from target_modules, weights from the safetensors file.
// Every module named in target_modules must have both tensors with the
// right shape; an unknown, missing, extra, mis-shaped or non-finite tensor
// is Status::Invalid naming it.
Result<PeftAdapter> ReadPeft(const SlotBank& bank, const std::string& dir);

// Binds slot s of bank to adapter's config and values (every other entry of
// the slot zero). Each factor must name a target of the bank with A
// [r, d_in] and B [d_out, r], r <= the bank's max rank, on any device; on
// error the slot is unchanged. A CopyPeft of a bank of the same layout (the
// same model and max rank) is one copy into the slot's row; anything else
// one copy per factor. Its values are not checked for finiteness: CopyPeft's
// are a trainer slot's (always finite), ReadPeft checked its own.
Status InstallPeft(SlotBank& bank, int slot, const PeftAdapter& adapter);

// WritePeft(CopyPeft(bank, slot)). The slot must be bound.
Status SavePeft(const SlotBank& bank, int slot, const std::string& dir, const std::string& base_model_name);

// InstallPeft(ReadPeft(bank, dir)): everything is checked before the bank
// is touched, so on error the slot is unchanged.
Status LoadPeft(SlotBank& bank, int slot, const std::string& dir);

// "model.layers.3.self_attn.q_proj" -> "q_proj"; "lm_head" -> "lm_head".
std::string PeftShortName(const std::string& module);

}  // namespace loom::engine
