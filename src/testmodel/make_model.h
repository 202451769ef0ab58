// make_model: writes a randomly initialised Qwen-family or GPT-OSS model in Hugging Face
// layout (config.json, generation_config.json, tokenizer.json, safetensors).
//
// Determinism: the bytes written depend only on (arch, preset, seed, dtype,
// shard size): the generator is a plain C++ PRNG (splitmix64 seeding a
// xoshiro256**, Box-Muller normals), never torch's, so the files are
// bit-identical on every machine and libtorch version.
// Torch-free. Thread: any (no shared state).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"
#include "engine/model/config.h"

namespace loom::testmodel {

struct MakeModelOptions {
  std::string arch = "qwen3";     // an HF model_type (FamilyNames(): qwen2, qwen3, qwen3_moe, gpt_oss, deepseek_v2, deepseek_v3)
  std::string preset = "tiny";    // tiny | small | qwen2.5-0.5b | qwen3-4b (dense);
                                  // tiny | small | qwen3-30b-a3b (qwen3_moe); tiny | gpt-oss-20b | gpt-oss-120b (gpt_oss)
  uint64_t seed = 0;
  std::string dtype;              // bf16 | fp32; "" = preset default (fp32 for tiny/small, bf16 otherwise)
  uint64_t shard_bytes = 2000000000;  // a new shard starts when the next tensor would exceed this
  int64_t layers = 0;  // > 0: this many decoder layers instead of the preset's (real shapes on a small disk)
  // The routed experts' weights (names with ".experts.") all zero, written
  // as holes: the whole model's shapes on a small disk, with a sparse file
  // system. Everything else stays random, so routing, the memory plan and
  // the kernels' work are a real model's; the experts' outputs are zero.
  bool zero_experts = false;
};

// The config a preset stands for (torch_dtype set from dtype, "" = default).
// Invalid names the flag: "arch", "preset" or "dtype".
Result<engine::ModelConfig> PresetConfig(const std::string& arch, const std::string& preset, const std::string& dtype = "");

// The config MakeModel writes: the preset's, with options.layers decoder
// layers when set, each per-layer list (layer_types, indexer_types) the
// preset's pattern from its first layer on (repeated past its end).
Result<engine::ModelConfig> MakeModelConfig(const MakeModelOptions& options);

// The names, shapes and order of the base weights written for config
// (HF names: model.embed_tokens.weight, model.layers.{i}.self_attn.q_proj.weight, ...;
// lm_head.weight only when embeddings are not tied).
struct WeightSpec {
  std::string name;
  std::vector<int64_t> shape;
};
std::vector<WeightSpec> BaseWeightSpecs(const engine::ModelConfig& config);

// Writes the model into out_dir (created if missing; existing files of the
// same names are replaced). One shard → model.safetensors; more →
// model-0000i-of-0000n.safetensors + model.safetensors.index.json.
Status MakeModel(const MakeModelOptions& options, const std::string& out_dir);

// tokenizer.json text for a byte-level BPE vocabulary of vocab_size ids:
// ids 0..255 are the 256 byte symbols (GPT-2 byte→unicode mapping, in byte
// order), the rest distinct deterministic multi-byte strings; the last id is
// the end-of-text token "<|endoftext|>" (vocab_size - 1 = eos_token_id).
std::string MakeTokenizerJson(int64_t vocab_size);

}  // namespace loom::testmodel
