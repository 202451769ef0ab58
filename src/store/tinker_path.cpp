// Validation and parsing of Tinker checkpoint paths; see tinker_path.h.
#include "store/tinker_path.h"

#include <cstdio>

namespace loom::store {
namespace {

bool IsAlnum(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
}

Status CheckSegment(const std::string& value, const char* field, size_t max_length,
                    const std::string& extra_chars) {
  const std::string f = field;
  if (value.empty()) return Status::Invalid(f + ": must not be empty");
  if (value.size() > max_length) {
    return Status::Invalid(f + ": longer than " + std::to_string(max_length) + " characters");
  }
  if (value.find("..") != std::string::npos) return Status::Invalid(f + ": must not contain \"..\"");
  if (value == ".") return Status::Invalid(f + ": must not be \".\"");
  for (char c : value) {
    if (c == '/') return Status::Invalid(f + ": must not contain '/'");
    if (!IsAlnum(c) && extra_chars.find(c) == std::string::npos) {
      return Status::Invalid(f + ": only letters, digits and \"" + extra_chars +
                             "\" are allowed");
    }
  }
  return Status::Ok();
}

}  // namespace

Status ValidateCheckpointName(const std::string& name, const char* field) {
  return CheckSegment(name, field, kMaxNameLength, "._-");
}

Status ValidateModelId(const std::string& model_id, const char* field) {
  return CheckSegment(model_id, field, kMaxModelIdLength, "._:@-");
}

Status ValidateKind(const std::string& kind, const char* field) {
  if (kind == kWeightsKind || kind == kSamplerWeightsKind) return Status::Ok();
  return Status::Invalid(std::string(field) + ": must be \"weights\" or \"sampler_weights\"");
}

Result<TinkerPath> ParseTinkerPath(const std::string& path, const char* field) {
  static const std::string kScheme = "tinker://";
  const std::string f = field;
  if (path.compare(0, kScheme.size(), kScheme) != 0) {
    return Status::Invalid(f + ": must start with tinker://");
  }
  const std::string rest = path.substr(kScheme.size());
  const size_t a = rest.find('/');
  const size_t b = a == std::string::npos ? a : rest.find('/', a + 1);
  if (a == std::string::npos || b == std::string::npos || rest.find('/', b + 1) != std::string::npos) {
    return Status::Invalid(f + ": must be tinker://<model_id>/<weights|sampler_weights>/<name>");
  }
  TinkerPath parsed{rest.substr(0, a), rest.substr(a + 1, b - a - 1), rest.substr(b + 1)};
  if (Status s = ValidateModelId(parsed.model_id, (f + " model_id").c_str()); !s.ok()) return s;
  if (Status s = ValidateKind(parsed.kind, (f + " kind").c_str()); !s.ok()) return s;
  if (Status s = ValidateCheckpointName(parsed.name, (f + " name").c_str()); !s.ok()) return s;
  return parsed;
}

Result<TinkerPath> ParseCheckpointId(const std::string& model_id, const std::string& checkpoint_id) {
  const size_t slash = checkpoint_id.find('/');
  if (slash == std::string::npos) {
    return Status::Invalid("checkpoint_id: must be <weights|sampler_weights>/<name>");
  }
  TinkerPath parsed{model_id, checkpoint_id.substr(0, slash), checkpoint_id.substr(slash + 1)};
  if (Status s = ValidateModelId(parsed.model_id, "training_run_id"); !s.ok()) return s;
  if (Status s = ValidateKind(parsed.kind, "checkpoint_id kind"); !s.ok()) return s;
  if (Status s = ValidateCheckpointName(parsed.name, "checkpoint_id name"); !s.ok()) return s;
  return parsed;
}

std::string SanitizeForPath(const std::string& model_id) {
  std::string out;
  for (unsigned char c : model_id) {
    if (IsAlnum(static_cast<char>(c)) || c == '.' || c == '-') {
      out += static_cast<char>(c);
    } else {
      char buf[4];
      std::snprintf(buf, sizeof buf, "_%02X", c);
      out += buf;
    }
  }
  return out;
}

}  // namespace loom::store
