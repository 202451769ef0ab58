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
  app.add_flag("--decode-profile", profile_,
               "log the GPU time of each decode stage (stages serialized: slower; for measurements)");
}

engine::DecodeOptions DecodeFlags::options() const {
  engine::DecodeOptions o;
  o.cuda_graphs = cuda_graphs_ == "on";
  o.gemv = gemv_ == "on";
  o.split_shrink = split_ == "on";
  o.profile = profile_;
  return o;
}

}  // namespace loom::cli
