// peft_vllm: an adapter in the LoRA layout vLLM (and SGLang) load, for
// `loom export --format vllm`: a PEFT directory (WritePeft: adapter_config.json
// + adapter_model.safetensors, keys base_model.model.<module>.lora_A/B.weight)
// whose modules are the ones vLLM's loader maps onto its layers.
//  - Attention and dense MLP targets are written as loom's PEFT snapshots
//    write them (vLLM packs q/k/v and gate/up itself).
//  - lm_head: vLLM takes a LoRA on the head only for model classes that list
//    it among their embedding_modules, which neither its Qwen2/Qwen3 nor its
//    Qwen3-MoE class does, so an adapter that trains it is refused unless the
//    caller drops it (the exported adapter then is not the one trained).
//  - MoE experts (qwen3_moe) go as one plain LoRA per expert and projection,
//    model.layers.<l>.mlp.experts.<e>.{gate,up,down}_proj, the 2-D layout
//    vLLM's fused-MoE LoRA loads for Qwen3-MoE: gate and up take the shared A
//    and their half of expert e's B; down takes expert e's A and the shared B.
//    (PEFT's target_parameters layout of loom's snapshots is not used: vLLM
//    reads it with a different orientation in the versions seen.)
//  - gpt_oss experts (interleaved gate/up) are refused: no vLLM layout for
//    them is written yet.
//
// Pure function of its input; any thread.
#pragma once
#include "common/status.h"
#include "engine/io/peft.h"

namespace loom::engine {

// The adapter's factors renamed and split as above (copies, on the input's
// device); config.train_unembed is false when lm_head was dropped.
Result<PeftAdapter> VllmLayout(const PeftAdapter& adapter, bool drop_lm_head);

}  // namespace loom::engine
