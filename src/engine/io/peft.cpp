#include "engine/io/peft.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "common/durable.h"
#include "engine/io/peft_config.h"
#include "engine/io/safetensors.h"
#include "engine/io/tensor_io.h"

namespace loom::engine {
namespace {

const char kConfigFile[] = "adapter_config.json";
const char kWeightsFile[] = "adapter_model.safetensors";
const char kPrefix[] = "base_model.model.";

std::string TensorName(const std::string& module, bool is_a) {
  return std::string(kPrefix) + module + (is_a ? ".lora_A.weight" : ".lora_B.weight");
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Result<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::string PeftShortName(const std::string& module) {
  const size_t dot = module.rfind('.');
  return dot == std::string::npos ? module : module.substr(dot + 1);
}

Status SavePeft(const SlotBank& bank, int slot, const std::string& dir, const std::string& base_model_name) {
  if (slot < 0 || slot >= bank.num_slots() || !bank.slot(slot).bound)
    return Status::Precondition("slot " + std::to_string(slot) + " is not bound to an adapter");
  const LoraConfig& c = bank.slot(slot).config;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::Internal("cannot create " + dir + ": " + ec.message());

  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  std::vector<std::string> modules;  // short names, first-seen order
  for (const LoraTarget& t : bank.targets()) {
    if (!bank.trains(slot, t.group)) continue;
    const std::string shorty = PeftShortName(t.module);
    if (std::find(modules.begin(), modules.end(), shorty) == modules.end()) modules.push_back(shorty);
    c10::NoGradGuard no_grad;
    const at::Tensor a = t.A.select(0, slot).narrow(0, 0, c.rank).detach().to(at::kCPU).contiguous();
    const at::Tensor b = t.B.select(0, slot).narrow(1, 0, c.rank).detach().to(at::kCPU).contiguous();
    if (Status s = AddTensor(writer, TensorName(t.module, true), a); !s.ok()) return s;
    if (Status s = AddTensor(writer, TensorName(t.module, false), b); !s.ok()) return s;
  }

  nlohmann::json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model_name},
      {"r", c.rank},
      {"target_modules", modules},
      {"bias", "none"},
      {"lora_dropout", 0.0},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"use_rslora", false},
      {"use_dora", false},
      {"modules_to_save", nullptr},
      {"layers_to_transform", nullptr},
      {"layers_pattern", nullptr},
      {"rank_pattern", nlohmann::json::object()},
      {"alpha_pattern", nlohmann::json::object()},
      {"revision", nullptr},
  };
  // PEFT types lora_alpha as int; keep it an integer when it is one.
  if (c.alpha == std::floor(c.alpha) && std::abs(c.alpha) < 1e15)
    config["lora_alpha"] = static_cast<int64_t>(c.alpha);
  else
    config["lora_alpha"] = c.alpha;

  const std::filesystem::path root(dir);
  if (Status s = writer.WriteAtomic((root / kWeightsFile).string()); !s.ok()) return s;
  return durable::ReplaceFile((root / kConfigFile).string(), config.dump(2) + "\n");
}

Status LoadPeft(SlotBank& bank, int slot, const std::string& dir) {
  if (slot < 0 || slot >= bank.num_slots())
    return Status::Invalid("slot " + std::to_string(slot) + " is outside [0, " + std::to_string(bank.num_slots()) +
                           ")");
  const std::filesystem::path root(dir);
  const std::string config_path = (root / kConfigFile).string();
  Result<std::string> text = ReadText(config_path);
  if (!text.ok()) return text.status();
  Result<PeftConfig> cfg = ParsePeftConfig(*text, bank.max_rank(), config_path);
  if (!cfg.ok()) return cfg.status();
  const LoraConfig& config = cfg->lora;
  const std::set<std::string>& modules = cfg->modules;
  const int64_t rank = config.rank;

  const std::string weights_path = (root / kWeightsFile).string();
  Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(weights_path);
  if (!file.ok()) return file.status();

  // Check every tensor before touching the bank.
  std::map<std::string, std::pair<const LoraTarget*, bool>> expected;  // name -> (target, is_a)
  for (const LoraTarget& t : bank.targets()) {
    if (!modules.count(PeftShortName(t.module))) continue;
    expected[TensorName(t.module, true)] = {&t, true};
    expected[TensorName(t.module, false)] = {&t, false};
  }
  for (const auto& [name, view] : (*file)->tensors())
    if (!expected.count(name))
      return Status::Invalid(weights_path + ": tensor '" + name + "' is not expected by target_modules");
  std::vector<std::pair<std::pair<const LoraTarget*, bool>, at::Tensor>> loaded;
  for (const auto& [name, where] : expected) {
    const TensorView* view = (*file)->find(name);
    if (!view) return Status::Invalid(weights_path + ": tensor '" + name + "' is missing");
    const LoraTarget& t = *where.first;
    const std::vector<int64_t> want = where.second ? std::vector<int64_t>{rank, t.d_in}
                                                   : std::vector<int64_t>{t.d_out, rank};
    if (view->shape != want)
      return Status::Invalid(weights_path + ": tensor '" + name + "' has shape " + ShapeText(view->shape) +
                             ", expected " + ShapeText(want));
    Result<at::Tensor> tensor = LoadTensor(*view, at::kFloat, t.A.device());
    if (!tensor.ok()) return tensor.status();
    // A non-finite factor would poison every row it is multiplied with (the
    // slot invariant: a slot's weights are always finite).
    if (!at::isfinite(*tensor).all().item<bool>())
      return Status::Invalid(weights_path + ": tensor '" + name + "' holds non-finite values");
    loaded.push_back({where, std::move(*tensor)});
  }

  if (Status s = bank.Bind(slot, config); !s.ok()) return s;
  c10::NoGradGuard no_grad;
  for (auto& t : bank.targets()) {  // no trace of the random init remains
    t.A.select(0, slot).zero_();
    t.B.select(0, slot).zero_();
  }
  for (const auto& [where, tensor] : loaded) {
    LoraTarget* t = bank.find(where.first->module);
    if (where.second)
      t->A.select(0, slot).narrow(0, 0, rank).copy_(tensor);
    else
      t->B.select(0, slot).narrow(1, 0, rank).copy_(tensor);
  }
  return Status::Ok();
}

}  // namespace loom::engine
