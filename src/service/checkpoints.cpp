// Checkpoints (service/checkpoints.h): saves of both kinds through one name
// rule and one commit, and loads.
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

// The field a save's errors name.
std::string Field(const TrainingOp& op) {
  return op.kind == OpKind::kSaveForSampler ? "save_weights_for_sampler.path" : "save_weights.path";
}
}  // namespace

Result<Checkpoints::Publication> Checkpoints::Prepare(const TrainingOp& op, const ModelRef& ref) {
  const bool for_sampler = op.kind == OpKind::kSaveForSampler;
  // save_weights overwrites when asked; a named sampler save never does; an
  // unnamed one (a sampling session's snapshot) replaces its own when retried.
  const bool named = !op.name.empty();
  const std::string name = for_sampler && !named ? fmt::format("unnamed-seq-{}", op.seq_id) : op.name;
  const bool overwrite = for_sampler ? !named : op.overwrite;
  Publication pub;
  pub.path = tinker::TinkerPath{
      op.model_id, for_sampler ? tinker::TinkerPath::Kind::kSampler : tinker::TinkerPath::Kind::kTraining, name};
  if (!overwrite && registry_.GetCheckpoint(pub.path).ok()) {
    return Status::Invalid(fmt::format("{}: checkpoint '{}' already exists for model '{}'; choose another name{}",
                                       Field(op), name, op.model_id, for_sampler ? "" : " or pass overwrite=true"));
  }
  auto staging = StagingTarget(registry_);
  if (!staging.ok()) return staging.status();
  pub.staging = std::move(*staging);
  pub.spec.owner = ref.owner;
  pub.spec.model_id = op.model_id;
  pub.spec.kind = pub.path.kind_segment();
  pub.spec.name = name;
  pub.spec.created_ms = NowMs();
  pub.spec.expires_ms = ExpiresMs(pub.spec.created_ms, op.ttl_seconds);
  pub.spec.overwrite = overwrite;
  pub.base_model = ref.base_model;
  return pub;
}

Result<store::Checkpoint> Checkpoints::Commit(const Publication& pub, const std::string& field) {
  auto committed = registry_.CommitCheckpoint(pub.staging, pub.spec);
  if (!committed.ok()) {
    Status st = committed.status();
    if (st.code() == Code::kAlreadyExists) st = Status::Invalid(field + ": " + st.message());
    return st;
  }
  registry_.TouchRun(pub.spec.model_id, pub.spec.created_ms);
  return committed;
}

Result<tinker::TinkerPath> Checkpoints::Save(const TrainingOp& op, const ModelRef& ref) {
  auto pub = Prepare(op, ref);
  if (!pub.ok()) return pub.status();
  if (Status saved = engine_.SaveState(ref.slot, pub->staging); !saved.ok()) return saved;
  auto committed = Commit(*pub, Field(op));
  if (!committed.ok()) return committed.status();
  return pub->path;
}

Result<Checkpoints::Publication> Checkpoints::SnapshotForSampler(const TrainingOp& op, const ModelRef& ref) {
  auto pub = Prepare(op, ref);
  if (!pub.ok()) return pub.status();
  auto snapshot = engine_.SnapshotForSampler(ref.slot);
  if (!snapshot.ok()) return snapshot.status();
  pub->snapshot = std::move(*snapshot);
  return pub;
}

Result<store::Checkpoint> Checkpoints::Publish(const Publication& pub) {
  if (Status written = pub.snapshot->WritePeft(pub.staging, pub.base_model); !written.ok()) {
    return Status(written.code(), fmt::format("save_weights_for_sampler: writing checkpoint '{}' to disk failed, so "
                                              "it was not saved (the model is unchanged; retry): {}",
                                              pub.path.ToString(), written.message()));
  }
  return Commit(pub, "save_weights_for_sampler.path");
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
