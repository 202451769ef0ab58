#include "engine/io/peft_merge.h"

#include <c10/core/GradMode.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>

#include "common/durable.h"
#include "engine/io/file_text.h"
#include "engine/io/safetensors.h"
#include "engine/io/tensor_io.h"
#include "engine/model/config.h"
#include "engine/model/family.h"

namespace loom::engine {
namespace {

namespace fs = std::filesystem;

const char kSingleFile[] = "model.safetensors";
const char kIndexFile[] = "model.safetensors.index.json";
const char kEmbedding[] = "model.embed_tokens.weight";
const char kHead[] = "lm_head.weight";

Result<nlohmann::json> ReadJson(const std::string& path) {
  Result<std::string> text = ReadTextFile(path);
  if (!text.ok()) return text.status();
  nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Invalid(path + " is not a JSON object");
  return j;
}

// The base's shard files, each open, and every tensor by name.
struct Shards {
  std::vector<std::string> names;  // file names inside the model dir
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, std::pair<size_t, const TensorView*>> tensors;  // name -> (shard, view)
  nlohmann::json index;  // the shard index, when the base has one

  const TensorView* find(const std::string& name) const {
    auto it = tensors.find(name);
    return it == tensors.end() ? nullptr : it->second.second;
  }
};

Result<Shards> OpenShards(const std::string& model_dir) {
  Shards s;
  const fs::path root(model_dir);
  if (fs::exists(root / kIndexFile)) {
    Result<nlohmann::json> index = ReadJson((root / kIndexFile).string());
    if (!index.ok()) return index.status();
    s.index = std::move(*index);
    if (!s.index.contains("weight_map") || !s.index["weight_map"].is_object())
      return Status::Invalid((root / kIndexFile).string() + ": weight_map must be an object");
    std::set<std::string> seen;
    for (const auto& [name, file] : s.index["weight_map"].items()) {
      if (!file.is_string()) return Status::Invalid((root / kIndexFile).string() + ": weight_map values are file names");
      if (seen.insert(file.get<std::string>()).second) s.names.push_back(file.get<std::string>());
    }
  } else {
    s.names.push_back(kSingleFile);
  }
  for (size_t i = 0; i < s.names.size(); ++i) {
    Result<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open((root / s.names[i]).string());
    if (!file.ok()) return file.status();
    for (const auto& [name, view] : (*file)->tensors())
      if (!s.tensors.emplace(name, std::pair{i, &view}).second)
        return Status::Invalid(model_dir + ": tensor '" + name + "' is in two shard files");
    s.files.push_back(std::move(*file));
  }
  return s;
}

// One base tensor's change: out = source + delta() (fp32), in source's dtype.
struct Fold {
  std::string source;  // the base tensor it starts from (the embedding, for an untied head)
  std::function<at::Tensor()> delta;
};

// What the merge writes: output name -> its fold; whether a tied lm_head is
// folded (so config.json must untie it) and whether lm_head.weight is new.
struct Plan {
  std::map<std::string, Fold> folds;
  bool untie = false;
  bool new_head = false;
};

bool IsFloatDtype(const std::string& dtype) {
  return dtype == "F32" || dtype == "BF16" || dtype == "F16" || dtype == "F64";
}

Result<Plan> PlanMerge(const ModelConfig& config, const Shards& base, const PeftAdapter& adapter) {
  Plan plan;
  const double scale = adapter.config.alpha / adapter.config.rank;
  const auto fold = [&](const std::string& module, const std::string& name, const std::string& source,
                        const std::vector<int64_t>& shape, std::function<at::Tensor()> delta) -> Status {
    const TensorView* view = base.find(source);
    if (view == nullptr)
      return Status::Invalid("adapter module '" + module + "': the base has no weight '" + source + "'");
    if (view->shape != shape)
      return Status::Invalid("adapter module '" + module + "': base weight '" + source + "' has shape " +
                             ShapeText(view->shape) + ", the adapter's delta " + ShapeText(shape));
    if (!IsFloatDtype(view->dtype))
      return Status::Invalid("base weight '" + source + "' is " + view->dtype + ", not a float tensor");
    plan.folds[name] = Fold{source, std::move(delta)};
    return Status::Ok();
  };
  for (const PeftAdapter::Factor& f : adapter.factors) {
    const at::Tensor A = f.A, B = f.B;
    const bool experts = A.dim() == 3 || B.dim() == 3;
    if (!experts) {  // A [r, d_in], B [d_out, r]
      const std::vector<int64_t> shape = {B.size(0), A.size(1)};
      const auto delta = [A, B, scale] { return B.matmul(A).mul_(scale); };
      std::string source = f.module + ".weight";
      if (f.module == "lm_head" && config.tie_word_embeddings) {
        plan.untie = true;
        plan.new_head = base.find(kHead) == nullptr;  // a tied checkpoint may still carry a copy
        if (plan.new_head) source = kEmbedding;
      }
      if (Status s = fold(f.module, f.module + ".weight", source, shape, delta); !s.ok()) return s;
      continue;
    }
    if (base.find(f.module + "_blocks") != nullptr)
      return Status::Invalid("adapter module '" + f.module +
                             "': the base stores these experts in MXFP4, which a merge would have to requantize; "
                             "merge into a bf16 copy of the base");
    const std::string experts_prefix = f.module.substr(0, f.module.rfind('.'));  // "...mlp.experts"
    const bool gate_up = B.dim() == 3;  // gate_up: A [r, H] shared, B [E, 2I, r]; down: A [E, r, I], B [H, r] shared
    const int64_t E = gate_up ? B.size(0) : A.size(0);
    const Family* family = FindFamily(config.model_type);
    if (base.find(f.module) != nullptr && family && !family->experts_in_out) {  // fused [E, out, in] (qwen3_5_moe)
      const auto delta = [A, B, scale] { return at::matmul(B, A).mul_(scale); };  // [E, 2I, H] or [E, H, I]
      const std::vector<int64_t> shape =
          gate_up ? std::vector<int64_t>{E, B.size(1), A.size(1)} : std::vector<int64_t>{E, B.size(0), A.size(2)};
      if (Status s = fold(f.module, f.module, f.module, shape, delta); !s.ok()) return s;
      continue;
    }
    if (base.find(f.module) != nullptr) {  // fused [E, in, out] (gpt_oss)
      if (gate_up) {
        const int64_t two_i = B.size(1), H = A.size(1);
        const bool interleaved = f.hf_interleaved;
        const auto delta = [A, B, scale, E, two_i, H, interleaved] {
          const at::Tensor d = at::matmul(B, A).mul_(scale);  // [E, 2I, H], rows gate then up
          // HF's column 2j + k is loom's row k * I + j when interleaved.
          return interleaved ? d.view({E, 2, two_i / 2, H}).permute({0, 3, 2, 1}).reshape({E, H, two_i})
                             : d.transpose(1, 2).contiguous();
        };
        if (Status s = fold(f.module, f.module, f.module, {E, H, two_i}, delta); !s.ok()) return s;
      } else {
        const auto delta = [A, B, scale] { return at::matmul(B, A).mul_(scale).transpose(1, 2).contiguous(); };
        if (Status s = fold(f.module, f.module, f.module, {E, A.size(2), B.size(0)}, delta); !s.ok()) return s;
      }
      continue;
    }
    for (int64_t e = 0; e < E; ++e) {  // one tensor per expert and projection (qwen3_moe's hub layout)
      const std::string expert = experts_prefix + "." + std::to_string(e) + ".";
      if (gate_up) {
        const int64_t I = B.size(1) / 2;
        for (int half = 0; half < 2; ++half) {
          const auto delta = [A, B, scale, e, I, half] { return B[e].narrow(0, half * I, I).matmul(A).mul_(scale); };
          const std::string name = expert + (half == 0 ? "gate_proj.weight" : "up_proj.weight");
          if (Status s = fold(f.module, name, name, {I, A.size(1)}, delta); !s.ok()) return s;
        }
      } else {
        const auto delta = [A, B, scale, e] { return B.matmul(A[e]).mul_(scale); };
        const std::string name = expert + "down_proj.weight";
        if (Status s = fold(f.module, name, name, {B.size(0), A.size(2)}, delta); !s.ok()) return s;
      }
    }
  }
  return plan;
}

// Adds one tensor to writer: the base's bytes, or source + delta in source's dtype.
Status AddOutput(SafetensorsWriter& writer, const std::string& name, const TensorView& view, const Fold* fold) {
  if (fold == nullptr)
    return writer.AddProduced(name, view.dtype, view.shape,
                              [&view](uint8_t* dst, size_t n) { std::memcpy(dst, view.data, n); });
  Result<at::ScalarType> dtype = ScalarTypeFromSafetensors(view.dtype);
  if (!dtype.ok()) return dtype.status();
  const at::ScalarType type = *dtype;
  return writer.AddProduced(name, view.dtype, view.shape, [&view, fold, type](uint8_t* dst, size_t n) {
    c10::NoGradGuard no_grad;
    // The view's dtype and shape were checked when the merge was planned.
    const at::Tensor merged = (*LoadTensor(view, at::kFloat, at::kCPU)).add_(fold->delta()).to(type).contiguous();
    std::memcpy(dst, merged.data_ptr(), std::min(n, static_cast<size_t>(merged.nbytes())));
  });
}

Status CopyOtherFiles(const std::string& model_dir, const std::string& out) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(model_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || entry.path().extension() == ".safetensors") continue;
    fs::copy_file(entry.path(), fs::path(out) / name, fs::copy_options::overwrite_existing, ec);
    if (ec) return Status::Internal("cannot copy " + entry.path().string() + ": " + ec.message());
  }
  if (ec) return Status::Internal("cannot list " + model_dir + ": " + ec.message());
  return Status::Ok();
}

Status WriteJson(const std::string& path, const nlohmann::json& j) {
  std::ofstream out(path, std::ios::trunc);
  out << j.dump(2) << "\n";
  out.close();
  return out ? Status::Ok() : Status::Internal("cannot write " + path);
}

}  // namespace

Status WriteMergedModel(const std::string& model_dir, const PeftAdapter& on_any_device, const std::string& out_dir) {
  Result<ModelConfig> config = ModelConfig::Load(model_dir);
  if (!config.ok()) return config.status();
  Result<Shards> base = OpenShards(model_dir);
  if (!base.ok()) return base.status();
  const PeftAdapter adapter = on_any_device.To(at::kCPU);
  Result<Plan> plan = PlanMerge(*config, *base, adapter);
  if (!plan.ok()) return plan.status();

  // The untied head goes into the embedding's shard.
  const size_t head_shard = plan->new_head ? base->tensors.at(kEmbedding).first : 0;
  return durable::PublishDirectory(out_dir, [&](const std::string& tmp) -> Status {
    if (Status s = CopyOtherFiles(model_dir, tmp); !s.ok()) return s;
    for (size_t i = 0; i < base->names.size(); ++i) {
      const SafetensorsFile& file = *base->files[i];
      SafetensorsWriter writer;
      for (const auto& [key, value] : file.metadata()) writer.SetMetadata(key, value);
      for (const auto& [name, view] : file.tensors()) {
        auto it = plan->folds.find(name);
        const Fold* fold = it == plan->folds.end() || it->second.source != name ? nullptr : &it->second;
        if (Status s = AddOutput(writer, name, view, fold); !s.ok()) return s;
      }
      if (plan->new_head && i == head_shard) {
        if (Status s = AddOutput(writer, kHead, *base->find(kEmbedding), &plan->folds.at(kHead)); !s.ok()) return s;
      }
      if (Status s = writer.Write((fs::path(tmp) / base->names[i]).string()); !s.ok()) return s;
    }
    if (!plan->untie) return Status::Ok();
    // The head now has values of its own: the config unties it, the index lists it.
    Result<nlohmann::json> cfg = ReadJson((fs::path(model_dir) / "config.json").string());
    if (!cfg.ok()) return cfg.status();
    (*cfg)["tie_word_embeddings"] = false;
    if (Status s = WriteJson((fs::path(tmp) / "config.json").string(), *cfg); !s.ok()) return s;
    if (!plan->new_head || base->index.is_null()) return Status::Ok();
    nlohmann::json index = base->index;
    index["weight_map"][kHead] = base->names[head_shard];
    if (index.contains("metadata") && index["metadata"].is_object() && index["metadata"].contains("total_size") &&
        index["metadata"]["total_size"].is_number_integer()) {
      const TensorView& embedding = *base->find(kEmbedding);
      index["metadata"]["total_size"] = index["metadata"]["total_size"].get<int64_t>() +
                                        static_cast<int64_t>(embedding.nbytes);
    }
    return WriteJson((fs::path(tmp) / kIndexFile).string(), index);
  });
}

}  // namespace loom::engine
