// `loom export`: a sampler snapshot (or any PEFT adapter directory of the
// model) written for other inference stacks:
//   --format merged  a Hugging Face model directory with the adapter folded
//                    into the base weights (engine/io/peft_merge.h);
//   --format vllm    the LoRA directory vLLM and SGLang load
//                    (engine/io/peft_vllm.h).
// The adapter is read against the model's LoRA targets first (ReadPeft:
// rank, modules, shapes), so a snapshot of another model is refused before
// anything is written; the output directory appears whole or not at all.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <string>

#include "cli/adapter_bank.h"
#include "cli/commands.h"
#include "common/durable.h"
#include "engine/io/peft.h"
#include "engine/io/peft_merge.h"
#include "engine/io/peft_vllm.h"

namespace loom::cli {
namespace {

int Fail(const Status& s) {
  std::fprintf(stderr, "loom export: %s\n", s.message().c_str());
  return 2;
}

}  // namespace

int Export(int argc, char** argv) {
  CLI::App app{"Write a LoRA snapshot as a merged Hugging Face model or as a vLLM/SGLang LoRA directory",
               "loom export"};
  std::string model_dir, adapter_dir, out_dir, format, base_model_name;
  bool drop_lm_head = false;
  app.add_option("--model", model_dir, "the base model directory (Hugging Face layout)")->required();
  app.add_option("--adapter", adapter_dir, "the snapshot: a PEFT adapter directory (a sampler_weights checkpoint's)")
      ->required();
  app.add_option("--out", out_dir, "output directory (must not exist)")->required();
  app.add_option("--format", format, "merged | vllm")->required()->check(CLI::IsMember({"merged", "vllm"}));
  app.add_option("--base-model-name", base_model_name,
                 "vllm: base_model_name_or_path written into adapter_config.json (default: --model)");
  app.add_flag("--drop-lm-head", drop_lm_head,
               "vllm: leave out the lm_head LoRA, which vLLM does not load (outputs then differ from the trained "
               "adapter's)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  auto bank = AdapterBank(model_dir, adapter_dir, /*max_rank=*/1 << 16);
  if (!bank.ok()) return Fail(bank.status());
  auto adapter = engine::ReadPeft(**bank, adapter_dir);
  if (!adapter.ok()) return Fail(adapter.status());
  bank->reset();

  if (format == "merged") {
    if (Status s = engine::WriteMergedModel(model_dir, *adapter, out_dir); !s.ok()) return Fail(s);
  } else {
    auto vllm = engine::VllmLayout(*adapter, drop_lm_head);
    if (!vllm.ok()) return Fail(vllm.status());
    const std::string name = base_model_name.empty() ? model_dir : base_model_name;
    Status s = durable::PublishDirectory(out_dir, [&](const std::string& tmp) { return engine::WritePeft(*vllm, tmp, name); });
    if (!s.ok()) return Fail(s);
  }
  std::printf("loom export: wrote %s (%s, rank %d)\n", out_dir.c_str(), format.c_str(), adapter->config.rank);
  return 0;
}

}  // namespace loom::cli
