// Checkpoints on the engine thread: one save path for both kinds, loads, and
// the registry's TTL sweep and grant expiry the janitor asks for. The REST
// side is in rest.cpp.
#include "service/checkpoints.h"

#include <fmt/format.h>

#include <filesystem>

#include "common/log.h"
#include "service/util.h"

namespace loom::service {

namespace fs = std::filesystem;

namespace {
// A fresh path under the registry's staging folder that does not exist yet
// (the engine writes its directory atomically and creates it itself).
Result<std::string> StagingTarget(store::Registry& registry) {
  auto dir = registry.NewStagingDir();
  if (!dir.ok()) return dir.status();
  std::error_code ec;
  fs::remove_all(*dir, ec);
  return *dir;
}

std::optional<int64_t> ExpiresMs(int64_t created_ms, const std::optional<int64_t>& ttl_seconds) {
  if (!ttl_seconds) return std::nullopt;
  return store::ExpiryMs(created_ms, *ttl_seconds);  // saturated: a huge TTL never wraps into the past
}
}  // namespace

Result<tinker::TinkerPath> Checkpoints::Save(const TrainingOp& op, const ModelRef& ref) {
  const bool for_sampler = op.kind == OpKind::kSaveForSampler;
  const std::string field = for_sampler ? "save_weights_for_sampler.path" : "save_weights.path";
  // save_weights overwrites when asked; a named sampler save never does; an
  // unnamed one (a sampling session's snapshot) replaces its own when retried.
  const bool named = !op.name.empty();
  const std::string name = for_sampler && !named ? fmt::format("unnamed-seq-{}", op.seq_id) : op.name;
  const bool overwrite = for_sampler ? !named : op.overwrite;
  const tinker::TinkerPath path{
      op.model_id, for_sampler ? tinker::TinkerPath::Kind::kSampler : tinker::TinkerPath::Kind::kTraining, name};
  if (!overwrite && registry_.GetCheckpoint(path).ok()) {
    return Status::Invalid(fmt::format("{}: checkpoint '{}' already exists for model '{}'; choose another name{}",
                                       field, name, op.model_id, for_sampler ? "" : " or pass overwrite=true"));
  }
  auto staging = StagingTarget(registry_);
  if (!staging.ok()) return staging.status();
  Status saved = for_sampler ? engine_.SaveForSampler(ref.slot, *staging, ref.base_model)
                             : engine_.SaveState(ref.slot, *staging);
  if (!saved.ok()) return saved;
  store::CheckpointSpec spec;
  spec.owner = ref.owner;
  spec.model_id = op.model_id;
  spec.kind = path.kind_segment();
  spec.name = name;
  spec.created_ms = NowMs();
  spec.expires_ms = ExpiresMs(spec.created_ms, op.ttl_seconds);
  spec.overwrite = overwrite;
  auto committed = registry_.CommitCheckpoint(*staging, spec);
  if (!committed.ok()) {
    Status st = committed.status();
    if (st.code() == Code::kAlreadyExists) st = Status::Invalid(field + ": " + st.message());
    return st;
  }
  registry_.TouchRun(op.model_id, spec.created_ms);
  return path;
}

Result<tinker::TinkerPath> Checkpoints::Load(const TrainingOp& op, const ModelRef& ref) {
  const tinker::TinkerPath& path = *op.load_path;  // set for every kLoadWeights
  auto ckpt = registry_.GetCheckpoint(path);
  if (!ckpt.ok() || !ckpt->AccessibleBy(ref.owner)) {
    return Status::NotFound("load_weights.path: checkpoint '" + path.ToString() + "' not found");
  }
  if (Status st = engine_.LoadState(ref.slot, ckpt->dir, op.with_optimizer); !st.ok()) return st;
  return path;
}

Status Checkpoints::Restore(int slot, const tinker::TinkerPath& load_path, bool with_optimizer) {
  auto ckpt = registry_.GetCheckpoint(load_path);
  return ckpt.ok() ? engine_.LoadState(slot, ckpt->dir, with_optimizer) : ckpt.status();
}

}  // namespace loom::service
