#include "cli/adapter_bank.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/io/peft_config.h"
#include "engine/model/transformer.h"

namespace loom::cli {

Result<std::unique_ptr<engine::SlotBank>> AdapterBank(const std::string& model_dir, const std::string& adapter_dir,
                                                      int max_rank) {
  const std::string path = (std::filesystem::path(adapter_dir) / "adapter_config.json").string();
  std::ifstream in(path);
  if (!in) return Status::NotFound("--adapter: cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  auto config = engine::ParsePeftConfig(text.str(), max_rank, path);
  if (!config.ok()) return config.status();
  auto model = engine::Transformer::Load(model_dir, at::kCPU, at::kBFloat16);
  if (!model.ok()) return Status(model.status().code(), "--model " + model_dir + ": " + model.status().message());
  return std::make_unique<engine::SlotBank>(1, config->lora.rank, at::kCPU, (*model)->LoraTargets());
}

}  // namespace loom::cli
