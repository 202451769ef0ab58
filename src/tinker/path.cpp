// Tinker paths and the name rule; see path.h.
#include "tinker/path.h"

#include <vector>

namespace loom::tinker {
namespace {

constexpr std::string_view kScheme = "tinker://";

bool IsAlnum(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }

// One path segment: what = "checkpoint name" / "training run id".
Status CheckSegment(std::string_view value, std::string_view field, std::string_view what, size_t max_length,
                    std::string_view extra_chars) {
  const std::string f = std::string(field) + ": " + std::string(what);
  if (value.empty()) return Status::Invalid(f + " must not be empty");
  if (value.size() > max_length) {
    return Status::Invalid(f + " is longer than " + std::to_string(max_length) + " characters");
  }
  if (value == ".") return Status::Invalid(f + " must not be '.'");
  if (value.find("..") != std::string_view::npos) return Status::Invalid(f + " must not contain \"..\"");
  for (char c : value) {
    if (c == '/') return Status::Invalid(f + " must not contain '/'");
    if (!IsAlnum(c) && extra_chars.find(c) == std::string_view::npos) {
      return Status::Invalid(f + " may hold only letters, digits and \"" + std::string(extra_chars) + "\"");
    }
  }
  return Status::Ok();
}

}  // namespace

const char* TinkerPath::kind_segment() const { return kind == Kind::kTraining ? kWeightsKind : kSamplerWeightsKind; }
const char* TinkerPath::checkpoint_type() const { return kind == Kind::kTraining ? "training" : "sampler"; }
std::string TinkerPath::checkpoint_id() const { return std::string(kind_segment()) + "/" + name; }
std::string TinkerPath::ToString() const { return std::string(kScheme) + training_run_id + "/" + checkpoint_id(); }

Status ValidateCheckpointName(std::string_view name, std::string_view field) {
  return CheckSegment(name, field, "checkpoint name", kMaxNameLength, "._-");
}

Status ValidateModelId(std::string_view model_id, std::string_view field) {
  return CheckSegment(model_id, field, "training run id", kMaxModelIdLength, "._:@-");
}

Result<TinkerPath::Kind> ParseKind(std::string_view segment, std::string_view field) {
  if (segment == kWeightsKind) return TinkerPath::Kind::kTraining;
  if (segment == kSamplerWeightsKind) return TinkerPath::Kind::kSampler;
  return Status::Invalid(std::string(field) + ": kind must be 'weights' or 'sampler_weights'");
}

Result<TinkerPath> ParseTinkerPath(std::string_view uri, std::string_view field_view) {
  const std::string field(field_view);
  const std::string shown = "'" + std::string(uri.substr(0, 200)) + "'";
  if (uri.substr(0, kScheme.size()) != kScheme) {
    return Status::Invalid(field + ": " + shown + " must start with tinker://");
  }
  std::string_view rest = uri.substr(kScheme.size());
  std::vector<std::string_view> parts;
  size_t start = 0;
  for (;;) {
    size_t slash = rest.find('/', start);
    parts.push_back(rest.substr(start, slash == std::string_view::npos ? std::string_view::npos : slash - start));
    if (slash == std::string_view::npos) break;
    start = slash + 1;
  }
  if (parts.size() != 3) {
    return Status::Invalid(field + ": " + shown +
                           " must have exactly 3 parts: tinker://<run_id>/<weights|sampler_weights>/<name>");
  }
  for (auto p : parts) {
    if (p.empty()) return Status::Invalid(field + ": " + shown + " has an empty part");
  }
  auto kind = ParseKind(parts[1], field + ": " + shown);
  if (!kind.ok()) return kind.status();
  if (Status s = ValidateModelId(parts[0], field); !s.ok()) return s;
  if (Status s = ValidateCheckpointName(parts[2], field); !s.ok()) return s;
  return TinkerPath{std::string(parts[0]), *kind, std::string(parts[2])};
}

Result<TinkerPath> ParseCheckpointId(std::string_view training_run_id, std::string_view checkpoint_id) {
  return ParseTinkerPath(std::string(kScheme) + std::string(training_run_id) + "/" + std::string(checkpoint_id),
                         "checkpoint_id");
}

}  // namespace loom::tinker
