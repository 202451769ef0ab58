#include "cli/decode_flags.h"

namespace loom::cli {

DecodeFlags::DecodeFlags(CLI::App& app) {
  const CLI::IsMember on_off({"on", "off"});
  app.add_option("--cuda-graphs", cuda_graphs_,
                 "on | off: the sampler's decode step as a CUDA graph of fused kernels (off: eager libtorch; CUDA only)")
      ->default_val(cuda_graphs_)
      ->check(on_off);
  app.add_option("--decode-gemv", gemv_,
                 "on | off: the matrix-vector kernel for decode projections of <= 4 rows (off: cuBLAS)")
      ->default_val(gemv_)
      ->check(on_off);
  app.add_option("--decode-split", split_,
                 "on | off: split a long LoRA shrink input over several blocks per output tile")
      ->default_val(split_)
      ->check(on_off);
  app.add_option("--fast-prefill", fast_prefill_,
                 "prefill steps of at most this many new tokens (no prompt logprobs) run on the decode step's CUDA "
                 "graphs, one row per token (0: eager prefill always; CUDA only)")
      ->default_val(fast_prefill_)
      ->check(CLI::Range(int64_t{0}, int64_t{1} << 20));
  app.add_option("--decode-stream", stream_,
                 "shared | priority: the sampler's decode thread launches on the device's default stream, which "
                 "the trainer uses too (kernels run in launch order), or on a high-priority CUDA stream of its own "
                 "(CUDA only; on the H200, bench rl's 16 tenants ran no faster with priority, so shared is the default)")
      ->default_val(stream_)
      ->check(CLI::IsMember({"shared", "priority"}));
  app.add_option("--moe-decode-graphs", moe_graphs_,
                 "on | off: a qwen3_moe model's decode steps on the CUDA graphs too (bf16, CUDA; off runs them "
                 "eager, 2.4-5x slower on the H200)")
      ->default_val(moe_graphs_)
      ->check(on_off);
  app.add_option("--moe-decode-gemv", moe_gemv_,
                 "on | off: on the MoE decode graphs, steps of at most 32 (token, expert) pairs run each pair's "
                 "expert projections as matrix-vector products (off: grouped GEMMs over the sorted pairs)")
      ->default_val(moe_gemv_)
      ->check(on_off);
  app.add_option("--decode-attention", attention_,
                 "tokens | dims: the decode graphs' attention kernel for bf16 models with head_dim 128 at many rows: "
                 "each half warp takes a token (tokens, K and V of several tokens loaded together; 1.2-1.7x faster "
                 "on the H100 at 16-256 rows), or each warp's lanes split a head's dims (dims, the earlier kernel)")
      ->default_val(attention_)
      ->check(CLI::IsMember({"dims", "tokens"}));
  app.add_option("--chunk-attention", chunk_attention_,
                 "on | off: on the decode graphs, a prefill chunk's rows attend in tiles that load each K/V row once "
                 "for up to 16 queries, on tensor cores (bf16; off: each row reads its whole context alone)")
      ->default_val(chunk_attention_)
      ->check(on_off);
  app.add_option("--decode-gemm", gemm_,
                 "cublas | tuned: the decode graphs' base projections of more than a few rows through cuBLAS as "
                 "at::linear calls it, or through cuBLASLt with each shape's fastest algorithm, timed once before "
                 "the first graph of that row count is captured (bf16, CUDA only)")
      ->default_val(gemm_)
      ->check(CLI::IsMember({"cublas", "tuned"}));
  app.add_option("--sampler-lora-math", lora_math_,
                 "model | fp32: the sampler's LoRA arithmetic where ATen runs it (eager prefill and decode steps, "
                 "an MoE model's expert LoRA on the decode graphs): the model's dtype (bf16 on a GPU, tensor cores; "
                 "as the trainer, so a prompt's logprobs match its forward's) or fp32 as PEFT does; the CPU's fp32 "
                 "models are the same either way")
      ->default_val(lora_math_)
      ->check(CLI::IsMember({"fp32", "model"}));
  app.add_flag("--decode-profile", profile_,
               "log the GPU time of each decode stage (stages serialized: slower; for measurements)");
}

engine::DecodeOptions DecodeFlags::options() const {
  engine::DecodeOptions o;
  o.cuda_graphs = cuda_graphs_ == "on";
  o.gemv = gemv_ == "on";
  o.split_shrink = split_ == "on";
  o.profile = profile_;
  o.fast_prefill_tokens = fast_prefill_;
  o.priority_stream = stream_ == "priority";
  o.moe_graphs = moe_graphs_ == "on";
  o.moe_gemv = moe_gemv_ == "on";
  o.attention_tokens = attention_ == "tokens";
  o.chunk_attention = chunk_attention_ == "on";
  o.lora_fp32 = lora_math_ == "fp32";
  o.gemm_tuned = gemm_ == "tuned";
  return o;
}

}  // namespace loom::cli
