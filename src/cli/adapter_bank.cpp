#include "cli/adapter_bank.h"

#include <filesystem>

#include "engine/io/file_text.h"
#include "engine/io/peft_config.h"
#include "engine/model/transformer.h"

namespace loom::cli {

Result<std::unique_ptr<engine::SlotBank>> AdapterBank(const std::string& model_dir, const std::string& adapter_dir,
                                                      int max_rank) {
  const std::string path = (std::filesystem::path(adapter_dir) / "adapter_config.json").string();
  auto text = engine::ReadTextFile(path);
  if (!text.ok()) return Status::NotFound("--adapter: " + text.status().message());
  auto config = engine::ParsePeftConfig(*text, max_rank, path);
  if (!config.ok()) return config.status();
  auto model = engine::Transformer::Load(model_dir, at::kCPU, at::kBFloat16);
  if (!model.ok()) return Status(model.status().code(), "--model " + model_dir + ": " + model.status().message());
  return std::make_unique<engine::SlotBank>(1, config->lora.rank, at::kCPU, (*model)->LoraTargets());
}

}  // namespace loom::cli
