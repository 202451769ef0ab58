// The sampler's decode switches (engine::DecodeOptions) as flags, shared by
// `loom serve`, `loom bench sample` and `loom bench rl`. Each on/off flag takes exactly "on"
// or "off"; anything else fails the command line at start-up with the
// flag's name and its allowed values (CLI11's check, exit non-zero).
#pragma once
#include <CLI/CLI.hpp>
#include <string>

#include "engine/sample_api.h"

namespace loom::cli {

class DecodeFlags {
 public:
  // Adds --cuda-graphs, --decode-gemv, --decode-split, --fast-prefill, --decode-stream, --moe-decode-graphs,
  // --moe-decode-gemv, --decode-attention, --chunk-attention, --decode-gemm, --sampler-lora-math and
  // --decode-profile to app.
  explicit DecodeFlags(CLI::App& app);
  // The options the parsed flags stand for (call after app.parse).
  engine::DecodeOptions options() const;

 private:
  std::string cuda_graphs_ = "on", gemv_ = "on", split_ = "on", stream_ = "shared", moe_graphs_ = "on",
              moe_gemv_ = "on", attention_ = "tokens", chunk_attention_ = "on",
              gemm_ = engine::DecodeOptions{}.gemm_tuned ? "tuned" : "cublas",
              lora_math_ = engine::DecodeOptions{}.lora_fp32 ? "fp32" : "model";
  bool profile_ = false;
  int64_t fast_prefill_ = engine::DecodeOptions{}.fast_prefill_tokens;
};

}  // namespace loom::cli
