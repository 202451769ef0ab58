#include "engine/io/peft_config.h"

#include <nlohmann/json.hpp>

namespace loom::engine {

bool EndsWithAtDot(const std::string& name, const std::string& suffix) {
  return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0 &&
         (name.size() == suffix.size() || name[name.size() - suffix.size() - 1] == '.');
}

bool IsDenseMlpParameter(const std::string& name) {
  for (const char* suffix : {"gate_proj.weight", "up_proj.weight", "down_proj.weight"})
    if (EndsWithAtDot(name, suffix)) return true;
  return false;
}

Result<PeftConfig> ParsePeftConfig(const std::string& text, int64_t max_rank, const std::string& path) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Invalid(path + " is not a JSON object");
  auto bad = [&](const std::string& field, const std::string& why) {
    return Status::Invalid(path + ": " + field + " " + why);
  };
  // Typed reads throughout: json::value() throws on a wrong type.
  if (j.contains("peft_type") && !(j["peft_type"].is_string() && j["peft_type"].get<std::string>() == "LORA"))
    return bad("peft_type", "must be \"LORA\"");
  if (!j.contains("r") || !j["r"].is_number_integer()) return bad("r", "must be an integer");
  const int64_t rank = j["r"].get<int64_t>();
  if (rank < 1 || rank > max_rank)
    return bad("r", std::to_string(rank) + " must be in [1, " + std::to_string(max_rank) + "]");
  if (!j.contains("lora_alpha") || !j["lora_alpha"].is_number()) return bad("lora_alpha", "must be a number");
  const double alpha = j["lora_alpha"].get<double>();
  if (!(alpha > 0 && alpha <= 1e6)) return bad("lora_alpha", "must be in (0, 1e6]");
  for (const char* flag : {"use_rslora", "use_dora"}) {
    if (!j.contains(flag) || j[flag].is_null()) continue;
    if (!j[flag].is_boolean()) return bad(flag, "must be a boolean");
    if (j[flag].get<bool>()) return bad(flag, "is not supported");
  }
  if (j.contains("bias") && j["bias"].is_string() && j["bias"].get<std::string>() != "none")
    return bad("bias", "must be \"none\"");
  for (const char* pattern : {"rank_pattern", "alpha_pattern"})
    if (j.contains(pattern) && j[pattern].is_object() && !j[pattern].empty())
      return bad(pattern, "is not supported (one rank and alpha per adapter)");
  if (!j.contains("target_modules") || !j["target_modules"].is_array())
    return bad("target_modules", "must be a list of module names");

  PeftConfig out;
  LoraConfig& config = out.lora;
  config.rank = static_cast<int>(rank);
  config.alpha = alpha;
  config.train_attn = config.train_mlp = config.train_unembed = false;
  for (const auto& m : j["target_modules"]) {
    if (!m.is_string()) return bad("target_modules", "must hold strings");
    const std::string name = m.get<std::string>();
    if (name == "q_proj" || name == "k_proj" || name == "v_proj" || name == "o_proj" || name == "q_a_proj" ||
        name == "q_b_proj" || name == "kv_a_proj_with_mqa" || name == "kv_b_proj" ||
        name == "in_proj_qkv" || name == "in_proj_z" || name == "in_proj_b" || name == "in_proj_a" ||
        name == "out_proj")  // the last five: a Gated DeltaNet layer's (qwen3_5_moe)
      config.train_attn = true;
    else if (name == "gate_proj" || name == "up_proj" || name == "down_proj")
      config.train_mlp = true;
    else if (name == "lm_head")
      config.train_unembed = true;
    else
      return bad("target_modules", "names '" + name + "', which loom does not adapt");
    out.modules.insert(name);
  }
  if (j.contains("target_parameters") && !j["target_parameters"].is_null()) {
    if (!j["target_parameters"].is_array()) return bad("target_parameters", "must be a list of parameter names");
    int experts = 0;
    for (const auto& p : j["target_parameters"]) {
      if (!p.is_string()) return bad("target_parameters", "must hold strings");
      const std::string name = p.get<std::string>();
      const bool expert = name == "mlp.experts.gate_up_proj" || name == "mlp.experts.down_proj";
      if (!expert && !IsDenseMlpParameter(name))
        return bad("target_parameters", "names '" + name +
                                            "'; loom adapts mlp.experts.gate_up_proj and mlp.experts.down_proj, and "
                                            "a dense MLP's <module>.{gate,up,down}_proj.weight");
      experts += expert && !out.parameters.count(name);
      out.parameters.insert(name);
    }
    if (experts == 1)
      return bad("target_parameters", "must name both mlp.experts.gate_up_proj and mlp.experts.down_proj");
    if (!out.parameters.empty()) config.train_mlp = true;
  }
  return out;
}

}  // namespace loom::engine
