// `loom make-model`: writes a random-initialised model directory of any supported family.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "cli/commands.h"
#include "engine/model/family.h"
#include "testmodel/make_model.h"

namespace loom::cli {

int MakeModel(int argc, char** argv) {
  CLI::App app{"Write a random-initialised model in Hugging Face layout (same seed => identical files)",
               "loom make-model"};
  testmodel::MakeModelOptions opt;
  std::string out;
  app.add_option("--arch", opt.arch, "the Hugging Face model_type: " + engine::FamilyNames())->required();
  app.add_option("--preset", opt.preset, "by arch: " + engine::FamilyPresets())->required();
  app.add_option("--seed", opt.seed, "PRNG seed")->default_val(0);
  app.add_option("--out", out, "output directory")->required();
  app.add_option("--dtype", opt.dtype, "bf16 | fp32 (default: fp32 for tiny/small, bf16 for real shapes)");
  app.add_option("--layers", opt.layers, "decoder layers (0 = the preset's): real shapes, fewer layers")
      ->default_val(0);
  app.add_option("--shard-bytes", opt.shard_bytes, "start a new shard when one would exceed this")
      ->default_val(opt.shard_bytes);
  app.add_flag("--zero-experts", opt.zero_experts,
               "the routed experts' weights all zero, written as holes (sparse files): a whole MoE model's shapes "
               "on a small disk; routers, attention and embeddings stay random");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const Status s = testmodel::MakeModel(opt, out);
  if (!s.ok()) {
    std::fprintf(stderr, "loom make-model: %s\n", s.message().c_str());
    return 2;
  }
  std::printf("wrote %s %s model (seed %llu) to %s\n", opt.arch.c_str(), opt.preset.c_str(),
              static_cast<unsigned long long>(opt.seed), out.c_str());
  return 0;
}

}  // namespace loom::cli
