// peft_merge: a base model directory with one adapter folded into its
// weights, written as a Hugging Face model directory (`loom export --format
// merged`) that transformers loads as a plain model, no PEFT needed.
//
// Every adapted weight W becomes W + (alpha / r) B A, computed in fp32 from
// the base's own values and stored in the base's dtype; every other tensor
// is copied byte for byte, in the same shard files under the same names.
// Per target:
//   plain linear  <module>.weight [d_out, d_in]
//   lm_head       lm_head.weight; with tied embeddings (config
//                 tie_word_embeddings) the merged head is written as its own
//                 lm_head.weight beside the embedding and config.json says
//                 tie_word_embeddings false, since the embedding keeps its values
//   MoE experts   qwen3_moe's hub layout, one tensor per expert:
//                 experts.<e>.gate_proj / up_proj from gate_up's expert e
//                 (rows gate then up), experts.<e>.down_proj from down's; or
//                 gpt_oss's fused [E, in, out] parameters (gate/up columns
//                 interleaved), each expert's delta transposed into them
// gpt_oss's MXFP4 experts (`*_blocks`, `*_scales`) are refused: folding into
// them would need requantizing. Every other file of the base directory
// (config, tokenizer, generation config) is copied; config.json and the
// shard index are rewritten only where an untied lm_head needs it.
//
// Threading: any thread; it reads the base files and the adapter only.
#pragma once
#include <string>

#include "common/status.h"
#include "engine/io/peft.h"

namespace loom::engine {

// Writes model_dir + adapter into out_dir, which appears whole or not at all
// (durable::PublishDirectory: an existing out_dir is AlreadyExists). Every
// adapter factor must name a weight of the base with matching shapes, else
// Invalid naming it; nothing is written then.
Status WriteMergedModel(const std::string& model_dir, const PeftAdapter& adapter, const std::string& out_dir);

}  // namespace loom::engine
