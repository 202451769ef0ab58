#include "engine/io/peft.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>

#include "common/durable.h"
#include "engine/io/file_text.h"
#include "engine/io/peft_config.h"
#include "engine/io/safetensors.h"
#include "engine/io/tensor_io.h"

namespace loom::engine {
namespace {

const char kConfigFile[] = "adapter_config.json";
const char kWeightsFile[] = "adapter_model.safetensors";
const char kPrefix[] = "base_model.model.";

// An expert target's module path ends in the parameter's name
// ("...mlp.experts.gate_up_proj"); PEFT adapts it with target_parameters.
const char kExperts[] = ".mlp.experts.";
bool IsExpertModule(const std::string& module) {
  const size_t at = module.rfind(kExperts);
  return at != std::string::npos && module.find('.', at + std::strlen(kExperts)) == std::string::npos;
}
// "model.layers.0.mlp.experts.gate_up_proj" -> "mlp.experts.gate_up_proj" (target_parameters' entry).
std::string PeftParameterName(const std::string& module) { return "mlp.experts." + PeftShortName(module); }

// PEFT's key of a factor. Expert parameters: PEFT wraps the experts module
// once per targeted parameter, gate_up_proj first, so gate_up_proj's wrapper
// is the inner one (".base_layer") and down_proj's the outer.
std::string TensorName(const std::string& module, bool is_a) {
  const std::string lora = is_a ? ".lora_A.weight" : ".lora_B.weight";
  if (!IsExpertModule(module)) return std::string(kPrefix) + module + lora;
  const std::string experts = module.substr(0, module.rfind('.'));
  return std::string(kPrefix) + experts + (PeftShortName(module) == "gate_up_proj" ? ".base_layer" : "") + lora;
}

// Expert factors between loom's layout (slot_bank.h: one of A, B per expert,
// the other shared) and PEFT's (ParamWrapper: lora_A [E * r, d_in] with
// expert e's rows e * r + k, lora_B [d_out, r * E] with its columns k * E + e;
// every expert has its own of both). loom -> PEFT repeats the shared factor.
// PEFT's lora_B rows [d_out, ..] from loom's halves (hf_interleaved), and back.
at::Tensor InterleaveRows(const at::Tensor& b) {
  const int64_t half = b.size(0) / 2;
  return at::stack({b.narrow(0, 0, half), b.narrow(0, half, half)}, 1).flatten(0, 1);
}
at::Tensor DeinterleaveRows(const at::Tensor& b) {
  return at::cat({b.slice(0, 0, b.size(0), 2), b.slice(0, 1, b.size(0), 2)}, 0);
}

std::pair<at::Tensor, at::Tensor> ExpertsToPeft(const at::Tensor& A, const at::Tensor& B, bool interleaved) {
  if (A.dim() == 2) {  // A [r, d_in] shared, B [E, d_out, r]
    const int64_t E = B.size(0);
    const at::Tensor b = B.permute({1, 2, 0}).reshape({B.size(1), -1});
    return {A.repeat({E, 1}), interleaved ? InterleaveRows(b) : b};
  }
  const int64_t E = A.size(0), r = A.size(1), d_out = B.size(0);  // A [E, r, d_in], B [d_out, r] shared
  const at::Tensor b = B.unsqueeze(2).expand({d_out, r, E}).reshape({d_out, r * E});
  return {A.reshape({E * r, A.size(2)}), interleaved ? InterleaveRows(b) : b};
}

// PEFT -> loom for target t at rank r; the factor loom shares must be the
// same for every expert (as loom's own snapshots write it).
Result<std::pair<at::Tensor, at::Tensor>> ExpertsFromPeft(const LoraTarget& t, int64_t r, const at::Tensor& a,
                                                          const at::Tensor& b, const std::string& where) {
  const int64_t E = t.experts;
  const at::Tensor pa = a.view({E, r, t.d_in});
  const at::Tensor pb = (t.hf_interleaved ? DeinterleaveRows(b) : b).reshape({t.d_out, r, E});
  const auto differs = [&](const std::string& factor) {
    return Status::Invalid(where + ": " + factor + " of " + PeftParameterName(t.module) +
                           " differs between experts; loom shares it across a layer's experts");
  };
  if (t.per_expert == ExpertFactor::kB) {
    const at::Tensor shared = pa.select(0, 0);
    if (!at::equal(pa, shared.unsqueeze(0).expand_as(pa))) return differs("lora_A");
    return std::pair{shared.contiguous(), pb.permute({2, 0, 1}).contiguous()};
  }
  const at::Tensor shared = pb.select(2, 0);
  if (!at::equal(pb, shared.unsqueeze(2).expand_as(pb))) return differs("lora_B");
  return std::pair{pa.contiguous(), shared.contiguous()};
}

}  // namespace

std::string PeftShortName(const std::string& module) {
  const size_t dot = module.rfind('.');
  return dot == std::string::npos ? module : module.substr(dot + 1);
}

PeftAdapter PeftAdapter::To(at::Device device) const {
  if (storage.defined()) return WithStorage(storage.to(device));
  PeftAdapter out;
  out.config = config;
  for (const Factor& f : factors) out.factors.push_back({f.module, f.A.to(device), f.B.to(device), f.hf_interleaved});
  return out;
}

PeftAdapter PeftAdapter::WithStorage(at::Tensor copy) const {
  if (!storage.defined() || copy.sizes() != storage.sizes())
    throw std::invalid_argument("PeftAdapter::WithStorage: a copy of the adapter's storage is needed");
  PeftAdapter out;
  out.config = config;
  out.storage = std::move(copy);
  out.flat_begin = flat_begin;
  out.flat_rank = flat_rank;
  out.flat_width = flat_width;
  // Each factor at the same place in the new buffer as in the old.
  const auto moved = [&](const at::Tensor& t) {
    return out.storage.as_strided(t.sizes(), t.strides(),
                                  t.storage_offset() - storage.storage_offset() + out.storage.storage_offset());
  };
  for (const Factor& f : factors) out.factors.push_back({f.module, moved(f.A), moved(f.B), f.hf_interleaved});
  return out;
}

int64_t PeftAdapter::bytes() const {
  if (storage.defined()) return static_cast<int64_t>(storage.nbytes());
  int64_t n = 0;
  for (const Factor& f : factors) n += static_cast<int64_t>(f.A.nbytes() + f.B.nbytes());
  return n;
}

Result<PeftAdapter> CopyPeft(const SlotBank& bank, int slot, PeftPlaces* deferred) {
  if (slot < 0 || slot >= bank.num_slots() || !bank.slot(slot).bound)
    return Status::Precondition("slot " + std::to_string(slot) + " is not bound to an adapter");
  PeftAdapter out;
  out.config = bank.slot(slot).config;
  const int64_t r = out.config.rank, R = bank.max_rank();
  // Each group's targets are one column range of the slot's flat row: the
  // trained groups lie within one span of it (an untrained group between
  // them is zero there), copied at once.
  int64_t begin = bank.flat().size(1), end = 0;
  for (TargetGroup g : {TargetGroup::kAttn, TargetGroup::kMlp, TargetGroup::kUnembed}) {
    const auto [first, width] = bank.GroupColumns(g);
    if (width == 0 || !bank.trains(slot, g)) continue;
    begin = std::min(begin, first);
    end = std::max(end, first + width);
  }
  if (end <= begin) return out;
  c10::NoGradGuard no_grad;
  out.storage = bank.flat().select(0, slot).narrow(0, begin, end - begin).clone();
  out.flat_begin = begin;
  out.flat_rank = R;
  out.flat_width = bank.flat().size(1);
  PeftPlaces places;
  PeftPlaces& p = deferred ? *deferred : places;
  p.places.clear();
  p.rank = r;
  for (const LoraTarget& t : bank.targets()) {
    if (!bank.trains(slot, t.group)) continue;
    p.places.push_back({t.module, t.hf_interleaved, t.a_col - begin, t.b_col - begin, t.FactorShape(true, R),
                        t.FactorShape(false, R)});
  }
  if (!deferred) ViewFactors(out, places);
  return out;
}

void ViewFactors(PeftAdapter& adapter, const PeftPlaces& places) {
  c10::NoGradGuard no_grad;
  adapter.factors.clear();
  adapter.factors.reserve(places.places.size());
  const auto elems = [](const std::vector<int64_t>& shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  };
  // One as_strided a factor (not narrow, view, narrow: a third of the ops):
  // the contiguous block of `shape` at `offset`, its dimension `dim` cut to the rank.
  const at::Tensor& s = adapter.storage;
  const auto view = [&](const std::vector<int64_t>& shape, int64_t offset, int64_t dim) {
    std::vector<int64_t> sizes = shape, strides(shape.size(), 1);
    for (int64_t i = static_cast<int64_t>(shape.size()) - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
    sizes[shape.size() + dim] = places.rank;
    return s.as_strided(sizes, strides, s.storage_offset() + offset);
  };
  for (const PeftPlaces::Place& p : places.places) {
    if (p.a_offset + elems(p.a_shape) > s.numel() || p.b_offset + elems(p.b_shape) > s.numel())
      throw std::out_of_range("ViewFactors: a factor of '" + p.module + "' lies past the storage");
    adapter.factors.push_back({p.module, view(p.a_shape, p.a_offset, -2), view(p.b_shape, p.b_offset, -1),
                               p.hf_interleaved});
  }
}

Status WritePeft(const PeftAdapter& adapter, const std::string& dir, const std::string& base_model_name) {
  const LoraConfig& c = adapter.config;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Status::Internal("cannot create " + dir + ": " + ec.message());

  SafetensorsWriter writer;
  writer.SetMetadata("format", "pt");
  std::vector<std::string> modules, parameters;  // short names / expert parameters, first-seen order
  // Beside experts, a dense MLP projection is a target_parameters entry by
  // its full name: PEFT's transformers-v5 shim takes a gate_proj module
  // target of an MoE model for the experts' fused tensor.
  const bool moe = std::any_of(adapter.factors.begin(), adapter.factors.end(),
                               [](const PeftAdapter::Factor& f) { return IsExpertModule(f.module); });
  for (const PeftAdapter::Factor& f : adapter.factors) {
    const bool expert = IsExpertModule(f.module);
    const bool dense_param = moe && !expert && IsDenseMlpParameter(f.module + ".weight");
    const std::string name =
        expert ? PeftParameterName(f.module) : dense_param ? f.module + ".weight" : PeftShortName(f.module);
    std::vector<std::string>& list = expert || dense_param ? parameters : modules;
    if (std::find(list.begin(), list.end(), name) == list.end()) list.push_back(name);
    const auto [a, b] = expert ? ExpertsToPeft(f.A, f.B, f.hf_interleaved) : std::pair{f.A, f.B};
    if (Status s = AddTensor(writer, TensorName(f.module, true), a); !s.ok()) return s;
    if (Status s = AddTensor(writer, TensorName(f.module, false), b); !s.ok()) return s;
  }

  nlohmann::json config = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model_name},
      {"r", c.rank},
      {"target_modules", modules},
      {"target_parameters", parameters.empty() ? nlohmann::json(nullptr) : nlohmann::json(parameters)},
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

Result<PeftAdapter> ReadPeft(const SlotBank& bank, const std::string& dir) {
  const std::filesystem::path root(dir);
  const std::string config_path = (root / kConfigFile).string();
  Result<std::string> text = ReadTextFile(config_path);
  if (!text.ok()) return text.status();
  Result<PeftConfig> cfg = ParsePeftConfig(*text, bank.max_rank(), config_path);
  if (!cfg.ok()) return cfg.status();
  const std::set<std::string>& modules = cfg->modules;
  const int64_t rank = cfg->lora.rank;

  const std::string weights_path = (root / kWeightsFile).string();
  Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(weights_path);
  if (!file.ok()) return file.status();

  // Whether the config names target t (a module by its short name, an
  // expert parameter by its target_parameters entry).
  const auto named = [&](const LoraTarget& t) {
    if (t.is_expert()) return cfg->parameters.count(PeftParameterName(t.module)) > 0;
    if (modules.count(PeftShortName(t.module))) return true;
    // A dense MLP weight as a parameter entry: its full name or a suffix of it at a dot.
    for (const std::string& p : cfg->parameters)
      if (IsDenseMlpParameter(p) && EndsWithAtDot(t.module + ".weight", p)) return true;
    return false;
  };
  std::set<std::string> expected;
  for (const LoraTarget& t : bank.targets()) {
    if (!named(t)) continue;
    expected.insert(TensorName(t.module, true));
    expected.insert(TensorName(t.module, false));
  }
  for (const auto& [name, view] : (*file)->tensors())
    if (!expected.count(name))
      return Status::Invalid(weights_path + ": tensor '" + name + "' is not expected by target_modules");
  // One tensor of the file, checked against the shape `want`.
  const auto load = [&](const std::string& name, const std::vector<int64_t>& want,
                        at::Device device) -> Result<at::Tensor> {
    const TensorView* view = (*file)->find(name);
    if (!view) return Status::Invalid(weights_path + ": tensor '" + name + "' is missing");
    if (view->shape != want)
      return Status::Invalid(weights_path + ": tensor '" + name + "' has shape " + ShapeText(view->shape) +
                             ", expected " + ShapeText(want));
    Result<at::Tensor> tensor = LoadTensor(*view, at::kFloat, device);
    if (!tensor.ok()) return tensor.status();
    // A non-finite factor would poison every row it is multiplied with (the
    // slot invariant: a slot's weights are always finite).
    if (!at::isfinite(*tensor).all().item<bool>())
      return Status::Invalid(weights_path + ": tensor '" + name + "' holds non-finite values");
    return tensor;
  };
  PeftAdapter out;
  out.config = cfg->lora;
  for (const LoraTarget& t : bank.targets()) {
    if (!named(t)) continue;
    const int64_t e = t.is_expert() ? t.experts : 1;  // PEFT: every expert its own rank-r slice
    Result<at::Tensor> a = load(TensorName(t.module, true), {e * rank, t.d_in}, t.A.device());
    if (!a.ok()) return a.status();
    Result<at::Tensor> b = load(TensorName(t.module, false), {t.d_out, rank * e}, t.B.device());
    if (!b.ok()) return b.status();
    if (!t.is_expert()) {
      out.factors.push_back({t.module, std::move(*a), std::move(*b)});
      continue;
    }
    auto factors = ExpertsFromPeft(t, rank, *a, *b, weights_path);
    if (!factors.ok()) return factors.status();
    out.factors.push_back({t.module, std::move(factors->first), std::move(factors->second), t.hf_interleaved});
  }
  return out;
}

Status InstallPeft(SlotBank& bank, int slot, const PeftAdapter& adapter) {
  if (slot < 0 || slot >= bank.num_slots())
    return Status::Invalid("slot " + std::to_string(slot) + " is outside [0, " + std::to_string(bank.num_slots()) +
                           ")");
  const LoraConfig& c = adapter.config;
  const int64_t r = c.rank;
  if (r < 1 || r > bank.max_rank())
    return Status::Invalid("adapter rank " + std::to_string(r) + " must be in [1, " + std::to_string(bank.max_rank()) +
                           "] (the bank's max rank)");
  const auto trained = [&](TargetGroup g) {
    return g == TargetGroup::kAttn ? c.train_attn : g == TargetGroup::kMlp ? c.train_mlp : c.train_unembed;
  };
  // Everything is checked before the bank is touched. `same_layout`: each
  // factor sits in adapter.storage where it sits in this bank's row.
  const auto offset = [&](const at::Tensor& t) { return t.storage_offset() - adapter.storage.storage_offset(); };
  bool same_layout = adapter.storage.defined() && adapter.flat_rank == bank.max_rank() &&
                     adapter.flat_width == bank.flat().size(1) && adapter.storage.is_contiguous();
  std::vector<std::pair<LoraTarget*, const PeftAdapter::Factor*>> copies;
  for (const PeftAdapter::Factor& f : adapter.factors) {
    LoraTarget* t = bank.find(f.module);
    if (t == nullptr) return Status::Invalid("adapter module '" + f.module + "' is not a LoRA target of this model");
    if (!trained(t->group))
      return Status::Invalid("adapter module '" + f.module + "' is outside the groups its config trains");
    const std::vector<int64_t> want_a = t->FactorShape(true, r), want_b = t->FactorShape(false, r);
    if (f.A.sizes().vec() != want_a || f.B.sizes().vec() != want_b)
      return Status::Invalid("adapter module '" + f.module + "': A " + ShapeText(f.A.sizes().vec()) + " and B " +
                             ShapeText(f.B.sizes().vec()) + ", expected " + ShapeText(want_a) + " and " +
                             ShapeText(want_b));
    copies.emplace_back(t, &f);
    same_layout = same_layout && f.A.is_alias_of(adapter.storage) && f.B.is_alias_of(adapter.storage) &&
                  offset(f.A) == t->a_col - adapter.flat_begin && offset(f.B) == t->b_col - adapter.flat_begin;
  }
  // Bind draws a random A for the groups it trains, which the copies would
  // overwrite anyway: bind with none (every entry of the slot zero), then
  // give the slot its groups.
  LoraConfig bare = c;
  bare.train_attn = bare.train_mlp = bare.train_unembed = false;
  if (Status s = bank.Bind(slot, bare); !s.ok()) return s;
  bank.slot(slot).config = c;
  c10::NoGradGuard no_grad;
  if (same_layout) {
    bank.flat().select(0, slot).narrow(0, adapter.flat_begin, adapter.storage.numel()).copy_(adapter.storage);
    return Status::Ok();
  }
  for (const auto& [t, f] : copies) {
    t->A.select(0, slot).narrow(-2, 0, r).copy_(f->A);  // the rank dims (slot_bank.h)
    t->B.select(0, slot).narrow(-1, 0, r).copy_(f->B);
  }
  return Status::Ok();
}

Status SavePeft(const SlotBank& bank, int slot, const std::string& dir, const std::string& base_model_name) {
  Result<PeftAdapter> adapter = CopyPeft(bank, slot);
  if (!adapter.ok()) return adapter.status();
  return WritePeft(*adapter, dir, base_model_name);
}

Status LoadPeft(SlotBank& bank, int slot, const std::string& dir) {
  if (slot < 0 || slot >= bank.num_slots())
    return Status::Invalid("slot " + std::to_string(slot) + " is outside [0, " + std::to_string(bank.num_slots()) +
                           ")");
  Result<PeftAdapter> adapter = ReadPeft(bank, dir);
  if (!adapter.ok()) return adapter.status();
  return InstallPeft(bank, slot, *adapter);
}

}  // namespace loom::engine
