#include "engine/lora/peft.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "engine/model/safetensors.h"
#include "engine/model/tensor_io.h"

namespace loom::engine {
namespace {

const char kConfigFile[] = "adapter_config.json";
const char kWeightsFile[] = "adapter_model.safetensors";
const char kPrefix[] = "base_model.model.";

std::string TensorName(const std::string& module, bool is_a) {
  return std::string(kPrefix) + module + (is_a ? ".lora_A.weight" : ".lora_B.weight");
}

TargetGroup GroupOfShortName(const std::string& name, bool* known) {
  *known = true;
  if (name == "q_proj" || name == "k_proj" || name == "v_proj" || name == "o_proj") return TargetGroup::kAttn;
  if (name == "gate_proj" || name == "up_proj" || name == "down_proj") return TargetGroup::kMlp;
  if (name == "lm_head") return TargetGroup::kUnembed;
  *known = false;
  return TargetGroup::kAttn;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

Result<nlohmann::json> ReadJson(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Status::NotFound("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  nlohmann::json j = nlohmann::json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Invalid(path + " is not a JSON object");
  return j;
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
  return WriteFileAtomic((root / kConfigFile).string(), config.dump(2) + "\n");
}

Status LoadPeft(SlotBank& bank, int slot, const std::string& dir) {
  if (slot < 0 || slot >= bank.num_slots())
    return Status::Invalid("slot " + std::to_string(slot) + " is outside [0, " + std::to_string(bank.num_slots()) +
                           ")");
  const std::filesystem::path root(dir);
  const std::string config_path = (root / kConfigFile).string();
  Result<nlohmann::json> cfg = ReadJson(config_path);
  if (!cfg.ok()) return cfg.status();
  const nlohmann::json& j = *cfg;
  auto bad = [&](const std::string& field, const std::string& why) {
    return Status::Invalid(config_path + ": " + field + " " + why);
  };
  if (j.value("peft_type", std::string("LORA")) != "LORA") return bad("peft_type", "must be \"LORA\"");
  if (!j.contains("r") || !j["r"].is_number_integer()) return bad("r", "must be an integer");
  const int64_t rank = j["r"].get<int64_t>();
  if (rank < 1 || rank > bank.max_rank())
    return bad("r", std::to_string(rank) + " must be in [1, " + std::to_string(bank.max_rank()) + "]");
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number()) return bad("lora_alpha", "must be a number");
  const double alpha = j["lora_alpha"].get<double>();
  if (!(alpha > 0 && alpha <= 1e6)) return bad("lora_alpha", "must be in (0, 1e6]");
  if (j.value("use_rslora", false)) return bad("use_rslora", "is not supported");
  if (j.value("use_dora", false)) return bad("use_dora", "is not supported");
  if (j.contains("bias") && j["bias"].is_string() && j["bias"].get<std::string>() != "none")
    return bad("bias", "must be \"none\"");
  for (const char* pattern : {"rank_pattern", "alpha_pattern"})
    if (j.contains(pattern) && j[pattern].is_object() && !j[pattern].empty())
      return bad(pattern, "is not supported (one rank and alpha per adapter)");
  if (!j.contains("target_modules") || !j["target_modules"].is_array())
    return bad("target_modules", "must be a list of module names");

  std::set<std::string> modules;
  LoraConfig config;
  config.rank = static_cast<int>(rank);
  config.alpha = alpha;
  config.train_attn = config.train_mlp = config.train_unembed = false;
  for (const auto& m : j["target_modules"]) {
    if (!m.is_string()) return bad("target_modules", "must hold strings");
    const std::string name = m.get<std::string>();
    bool known = false;
    const TargetGroup g = GroupOfShortName(name, &known);
    if (!known) return bad("target_modules", "names '" + name + "', which loom does not adapt");
    modules.insert(name);
    (g == TargetGroup::kAttn ? config.train_attn : g == TargetGroup::kMlp ? config.train_mlp : config.train_unembed) =
        true;
  }

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
