#include "engine/train/state.h"

#include <c10/core/GradMode.h>
#include "engine/train/text.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/durable.h"
#include "engine/io/safetensors.h"
#include "engine/io/tensor_io.h"

namespace loom::engine::train {
namespace {

using nlohmann::json;

constexpr const char* kFormat = "loom-training-state";
constexpr int kVersion = 1;

json ConfigJson(const LoraConfig& c) {
  return json{{"rank", c.rank},           {"alpha", c.alpha},         {"seed", c.seed},
              {"train_attn", c.train_attn}, {"train_mlp", c.train_mlp}, {"train_unembed", c.train_unembed}};
}

// Slot s's part of a bank-shaped tensor [N, R, d_in] (A-like) or [N, d_out, R]
// (B-like), trimmed to rank r.
at::Tensor Trim(const at::Tensor& t, int s, int64_t r, bool is_a) {
  at::Tensor row = t.detach().select(0, s);
  return is_a ? row.narrow(-2, 0, r) : row.narrow(-1, 0, r);  // the rank dims (slot_bank.h)
}

}  // namespace

Status SaveSlotState(const SlotBank& bank, const SlotOptimizer& optimizer, int s, const std::string& dir) {
  if (s < 0 || s >= bank.num_slots()) return Status::Invalid(Cat("slot ", s, " is outside [0, ", bank.num_slots(), ")"));
  const SlotState& st = bank.slot(s);
  if (!st.bound) return Status::Precondition(Cat("slot ", s, " is not bound to a model"));
  const int64_t r = st.config.rank;
  SafetensorsWriter writer;
  json targets = json::array();
  const auto& all = bank.targets();
  for (size_t i = 0; i < all.size(); ++i) {
    const LoraTarget& t = all[i];
    if (!bank.trains(s, t.group)) continue;
    targets.push_back(t.module);
    const std::pair<const char*, const at::Tensor*> parts[] = {
        {".lora_A", &t.A}, {".lora_B", &t.B},
        {".lora_A.exp_avg", &optimizer.a(i).exp_avg}, {".lora_A.exp_avg_sq", &optimizer.a(i).exp_avg_sq},
        {".lora_B.exp_avg", &optimizer.b(i).exp_avg}, {".lora_B.exp_avg_sq", &optimizer.b(i).exp_avg_sq}};
    for (const auto& [suffix, tensor] : parts) {
      const bool is_a = std::string(suffix).rfind(".lora_A", 0) == 0;
      Status add = AddTensor(writer, t.module + suffix, Trim(*tensor, s, r, is_a).to(at::kFloat));
      if (!add.ok()) return add;
    }
  }
  json meta{{"format", kFormat}, {"version", kVersion}, {"lora", ConfigJson(st.config)},
            {"step", st.step},   {"has_optimizer", true}, {"targets", targets}};
  writer.SetMetadata("format", kFormat);
  return durable::PublishDirectory(dir, [&](const std::string& tmp) -> Status {
    if (Status w = writer.Write(tmp + "/" + kStateTensors); !w.ok()) return w;
    std::ofstream out(tmp + "/" + kStateJson);
    out << meta.dump(2) << "\n";
    out.close();
    if (!out) return Status::Internal("write " + tmp + "/" + kStateJson + " failed");
    return Status::Ok();
  });
}

Result<StateInfo> ReadStateInfo(const std::string& dir) {
  const std::string path = dir + "/" + kStateJson;
  std::ifstream in(path);
  if (!in) return Status::NotFound(Cat(dir, ": no training state here (missing ", kStateJson, ")"));
  std::stringstream text;
  text << in.rdbuf();
  json j = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Invalid(path + ": not a JSON object");
  if (j.value("format", std::string()) != kFormat) return Status::Invalid(path + ": format is not " + kFormat);
  if (j.value("version", 0) != kVersion) return Status::Invalid(Cat(path, ": version must be ", kVersion));
  try {
    StateInfo info;
    const json& l = j.at("lora");
    info.lora.rank = l.at("rank").get<int>();
    info.lora.alpha = l.at("alpha").get<double>();
    info.lora.seed = l.at("seed").get<uint64_t>();
    info.lora.train_attn = l.at("train_attn").get<bool>();
    info.lora.train_mlp = l.at("train_mlp").get<bool>();
    info.lora.train_unembed = l.at("train_unembed").get<bool>();
    info.step = j.at("step").get<int64_t>();
    info.has_optimizer = j.at("has_optimizer").get<bool>();
    if (info.lora.rank < 1) return Status::Invalid(path + ": lora.rank must be >= 1");
    if (info.step < 0) return Status::Invalid(path + ": step must be >= 0");
    return info;
  } catch (const json::exception& e) {
    return Status::Invalid(Cat(path, ": ", e.what()));
  }
}

Status LoadSlotState(SlotBank& bank, SlotOptimizer& optimizer, int s, const std::string& dir, bool with_optimizer) {
  if (s < 0 || s >= bank.num_slots()) return Status::Invalid(Cat("slot ", s, " is outside [0, ", bank.num_slots(), ")"));
  SlotState& st = bank.slot(s);
  if (!st.bound) return Status::Precondition(Cat("slot ", s, " is not bound to a model"));
  Result<StateInfo> info = ReadStateInfo(dir);
  if (!info.ok()) return info.status();
  const LoraConfig& want = info->lora;
  const LoraConfig& have = st.config;
  if (want.rank != have.rank)
    return Status::Invalid(Cat("rank: checkpoint has rank ", want.rank, ", the model has rank ", have.rank));
  if (want.alpha != have.alpha)
    return Status::Invalid(Cat("alpha: checkpoint has alpha ", want.alpha, ", the model has alpha ", have.alpha));
  if (want.train_attn != have.train_attn || want.train_mlp != have.train_mlp || want.train_unembed != have.train_unembed)
    return Status::Invalid(Cat("train_attn/train_mlp/train_unembed: checkpoint trains ", want.train_attn, "/", want.train_mlp, "/", want.train_unembed, ", the model trains ", have.train_attn, "/", have.train_mlp, "/", have.train_unembed));
  if (with_optimizer && !info->has_optimizer)
    return Status::Invalid(dir + ": the checkpoint holds no optimizer state");
  auto file = SafetensorsFile::Open(dir + "/" + kStateTensors);
  if (!file.ok()) return file.status();
  const int64_t r = have.rank;
  // Read and check everything before touching the slot, so a bad file
  // leaves it as it was.
  struct Pending {
    at::Tensor dst;  // slot view in the bank or optimizer
    at::Tensor src;
  };
  std::vector<Pending> pending;
  const auto& all = bank.targets();
  for (size_t i = 0; i < all.size(); ++i) {
    const LoraTarget& t = all[i];
    if (!bank.trains(s, t.group)) continue;
    std::vector<std::pair<std::string, const at::Tensor*>> parts = {{".lora_A", &t.A}, {".lora_B", &t.B}};
    if (with_optimizer) {
      parts.insert(parts.end(), {{".lora_A.exp_avg", &optimizer.a(i).exp_avg},
                                 {".lora_A.exp_avg_sq", &optimizer.a(i).exp_avg_sq},
                                 {".lora_B.exp_avg", &optimizer.b(i).exp_avg},
                                 {".lora_B.exp_avg_sq", &optimizer.b(i).exp_avg_sq}});
    }
    for (const auto& [suffix, tensor] : parts) {
      const std::string name = t.module + suffix;
      const bool is_a = suffix.rfind(".lora_A", 0) == 0;
      const TensorView* view = (*file)->find(name);
      if (!view) return Status::Invalid(Cat(dir, ": tensor ", name, " is missing"));
      const std::vector<int64_t> shape = t.FactorShape(is_a, r);
      if (view->shape != shape)
        return Status::Invalid(Cat(dir, ": tensor ", name, " has shape [", JoinInts(view->shape), "], expected [", JoinInts(shape), "]"));
      auto src = LoadTensor(*view, at::kFloat, t.A.device());
      if (!src.ok()) return src.status();
      // A slot's weights and moments are always finite (see SlotOptimizer).
      if (!at::isfinite(*src).all().item<bool>())
        return Status::Invalid(Cat(dir, ": tensor ", name, " holds non-finite values"));
      pending.push_back({Trim(*tensor, s, r, is_a), *src});
    }
  }
  c10::NoGradGuard no_grad;
  for (const LoraTarget& t : all) {  // rows ≥ r and untrained groups stay zero
    t.A.detach().select(0, s).zero_();
    t.B.detach().select(0, s).zero_();
  }
  optimizer.Reset(s);
  for (Pending& p : pending) p.dst.copy_(p.src);
  bank.ZeroGrad(s);
  st.step = with_optimizer ? info->step : 0;
  return Status::Ok();
}

}  // namespace loom::engine::train
