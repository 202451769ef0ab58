#include "engine/train/loss_spec.h"

#include "engine/train/text.h"

#include <algorithm>
#include <cmath>

namespace loom::engine::train {
namespace {

std::string Join(const std::vector<std::string>& names) {
  std::string out;
  for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + (shape.size() == 1 ? ",)" : ")");
}

Status Bad(size_t index, const std::string& field, const std::string& what) {
  return Status::Invalid(Cat("data[", index, "].", field, ": ", what));
}

}  // namespace

Result<LossSpec> LossSpec::Parse(const std::string& loss_fn, const std::map<std::string, double>& config) {
  LossSpec spec;
  spec.name = loss_fn;
  std::vector<std::string> keys;
  if (loss_fn == "cross_entropy") {
    spec.kind = LossKind::kCrossEntropy;
  } else if (loss_fn == "importance_sampling") {
    spec.kind = LossKind::kImportanceSampling;
  } else if (loss_fn == "ppo") {
    spec.kind = LossKind::kPpo;
    spec.clip_low = 0.8;
    spec.clip_high = 1.2;
    keys = {"clip_low_threshold", "clip_high_threshold"};
  } else if (loss_fn == "cispo") {
    spec.kind = LossKind::kCispo;
    spec.clip_low = 0.0;
    spec.clip_high = 4.0;
    keys = {"clip_low_threshold", "clip_high_threshold"};
  } else if (loss_fn == "dro") {
    spec.kind = LossKind::kDro;
    spec.beta = 0.05;
    keys = {"beta"};
  } else {
    return Status::Invalid(Cat("loss_fn: unknown loss '", loss_fn, "' (expected cross_entropy, importance_sampling, ppo, cispo or dro)"));
  }
  for (const auto& [key, value] : config) {
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      return Status::Invalid(Cat("loss_fn_config: unknown key '", key, "' for loss ", loss_fn, " (accepted: ", keys.empty() ? std::string("none") : Join(keys), ")"));
    }
    if (!std::isfinite(value)) {
      return Status::Invalid(Cat("loss_fn_config.", key, ": must be finite"));
    }
    if (key == "clip_low_threshold") spec.clip_low = value;
    if (key == "clip_high_threshold") spec.clip_high = value;
    if (key == "beta") spec.beta = value;
  }
  if (spec.clip_low < 0) return Status::Invalid("loss_fn_config.clip_low_threshold: must be >= 0");
  if (spec.clip_low > spec.clip_high) {
    return Status::Invalid(Cat("loss_fn_config: clip_low_threshold ", spec.clip_low, " > clip_high_threshold ", spec.clip_high));
  }
  if (spec.beta < 0) return Status::Invalid("loss_fn_config.beta: must be >= 0");
  return spec;
}

std::vector<std::string> LossSpec::RequiredInputs() const {
  if (kind == LossKind::kCrossEntropy) return {"target_tokens"};
  return {"target_tokens", "logprobs", "advantages"};
}

std::vector<std::string> LossSpec::OptionalInputs() const {
  if (kind == LossKind::kCrossEntropy) return {"weights"};
  return {};
}

int64_t TopK(const Datum& datum) {
  auto it = datum.loss_fn_inputs.find("target_tokens");
  if (it == datum.loss_fn_inputs.end() || it->second.shape.size() < 2) return 0;
  return it->second.shape[1];
}

Status ValidateDatum(const LossSpec& spec, const Datum& datum, size_t index, int64_t vocab_size,
                     int64_t context_window) {
  const int64_t n = static_cast<int64_t>(datum.tokens.size());
  if (n == 0) return Bad(index, "model_input", "empty datum (no input tokens)");
  if (context_window > 0 && n > context_window) {
    return Bad(index, "model_input",
               Cat(n, " tokens exceed the context window of ", context_window, " tokens"));
  }
  for (int64_t t = 0; t < n; ++t) {
    const int32_t tok = datum.tokens[t];
    if (tok < 0 || tok >= vocab_size) {
      return Bad(index, "model_input",
                 Cat("token id ", tok, " at position ", t, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  const auto required = spec.RequiredInputs();
  const auto optional = spec.OptionalInputs();
  for (const auto& key : required) {
    if (!datum.loss_fn_inputs.count(key)) {
      return Bad(index, "loss_fn_inputs." + key, Cat("missing; loss ", spec.name, " needs ", Join(required)));
    }
  }
  std::vector<int64_t> target_shape;
  for (const auto& [key, array] : datum.loss_fn_inputs) {
    const std::string field = "loss_fn_inputs." + key;
    const bool known = std::find(required.begin(), required.end(), key) != required.end() ||
                       std::find(optional.begin(), optional.end(), key) != optional.end();
    if (!known) {
      auto accepted = required;
      accepted.insert(accepted.end(), optional.begin(), optional.end());
      return Bad(index, field, Cat("unknown input for loss ", spec.name, " (accepted: ", Join(accepted), ")"));
    }
    for (int64_t d : array.shape) {
      if (d < 0) return Bad(index, field, "negative dimension in shape " + ShapeText(array.shape));
    }
    const bool is_int = array.dtype == Array::DType::kInt64;
    const size_t stored = is_int ? array.i64.size() : array.f32.size();
    if (static_cast<int64_t>(stored) != array.numel()) {
      return Bad(index, field,
                 Cat(stored, " values do not fill shape ", ShapeText(array.shape)));
    }
    const size_t max_rank = (key == "target_tokens" || key == "weights") && spec.AllowsTopK() ? 2 : 1;
    if (array.shape.empty() || array.shape.size() > max_rank) {
      return Bad(index, field,
                 Cat("shape ", ShapeText(array.shape), " must be (N,)", max_rank == 2 ? " or (N, K)" : "", " with N = ", n, " input tokens"));
    }
    if (array.shape[0] != n) {
      return Bad(index, field,
                 Cat("length ", array.shape[0], " does not match the ", n, " input tokens"));
    }
    if (array.shape.size() == 2 && array.shape[1] < 1) {
      return Bad(index, field, "K must be at least 1 in shape " + ShapeText(array.shape));
    }
    if (key == "target_tokens") {
      if (!is_int) return Bad(index, field, "dtype must be int64");
      for (size_t j = 0; j < array.i64.size(); ++j) {
        if (array.i64[j] < 0 || array.i64[j] >= vocab_size) {
          return Bad(index, field,
                     Cat("token id ", array.i64[j], " at flat index ", j, " is outside the vocabulary [0, ", vocab_size, ")"));
        }
      }
      target_shape = array.shape;
    } else if (!is_int) {
      for (size_t j = 0; j < array.f32.size(); ++j) {
        if (!std::isfinite(array.f32[j])) {
          return Bad(index, field, Cat("value at flat index ", j, " is not finite"));
        }
      }
    }
  }
  auto w = datum.loss_fn_inputs.find("weights");
  if (w != datum.loss_fn_inputs.end() && w->second.shape != target_shape) {
    return Bad(index, "loss_fn_inputs.weights",
               Cat("shape ", ShapeText(w->second.shape), " differs from target_tokens shape ", ShapeText(target_shape)));
  }
  return Status::Ok();
}

Status ValidateCallData(const ForwardBackwardCall& call, int64_t vocab_size, int64_t context_window) {
  auto spec = LossSpec::Parse(call.loss_fn, call.loss_fn_config);
  if (!spec.ok()) return spec.status();
  for (size_t i = 0; i < call.data.size(); ++i) {
    Status s = ValidateDatum(*spec, call.data[i], i, vocab_size, context_window);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

}  // namespace loom::engine::train
