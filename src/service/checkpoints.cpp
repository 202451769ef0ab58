// Checkpoints (service/checkpoints.h): saves of both kinds through one name
// rule and one commit, and loads.
#include "service/checkpoints.h"

#include <fmt/format.h>

#include "common/log.h"
#include "service/util.h"

namespace loom::service {

namespace {
std::optional<int64_t> ExpiresMs(int64_t created_ms, const std::optional<int64_t>& ttl_seconds) {
  if (!ttl_seconds) return std::nullopt;
  return store::ExpiryMs(created_ms, *ttl_seconds);  // saturated: a huge TTL never wraps into the past
}

// The field a save's errors name.
std::string Field(bool for_sampler) { return for_sampler ? "save_weights_for_sampler.path" : "save_weights.path"; }
}  // namespace

Checkpoints::Publication Checkpoints::Target(const TrainingOp& op, const ModelRef& ref) {
  const bool for_sampler = op.kind == OpKind::kSaveForSampler;
  // save_weights overwrites when asked; a named sampler save never does; an
  // unnamed one (a sampling session's snapshot) replaces its own when retried.
  const bool named = !op.name.empty();
  Publication pub;
  pub.path = tinker::TinkerPath{
      op.model_id, for_sampler ? tinker::TinkerPath::Kind::kSampler : tinker::TinkerPath::Kind::kTraining,
      for_sampler && !named ? fmt::format("unnamed-seq-{}", op.seq_id) : op.name};
  pub.spec.owner = ref.owner;
  pub.spec.model_id = op.model_id;
  pub.spec.kind = pub.path.kind_segment();
  pub.spec.name = pub.path.name;
  pub.spec.created_ms = NowMs();
  pub.spec.expires_ms = ExpiresMs(pub.spec.created_ms, op.ttl_seconds);
  pub.spec.overwrite = for_sampler ? !named : op.overwrite;
  pub.base_model = ref.base_model;
  return pub;
}

Status Checkpoints::Stage(Publication& pub) {
  const bool for_sampler = pub.path.kind == tinker::TinkerPath::Kind::kSampler;
  if (!pub.spec.overwrite && registry_.GetCheckpoint(pub.path).ok()) {
    return Status::Invalid(fmt::format("{}: checkpoint '{}' already exists for model '{}'; choose another name{}",
                                       Field(for_sampler), pub.path.name, pub.spec.model_id,
                                       for_sampler ? "" : " or pass overwrite=true"));
  }
  auto staging = registry_.NewStagingPath();  // the engine writes its directory whole
  if (!staging.ok()) return staging.status();
  pub.staging = std::move(*staging);
  return Status::Ok();
}

Result<store::Checkpoint> Checkpoints::Commit(const Publication& pub) {
  auto committed = registry_.CommitCheckpoint(pub.staging, pub.spec);
  if (!committed.ok()) {
    Status st = committed.status();
    if (st.code() == Code::kAlreadyExists) {
      st = Status::Invalid(Field(pub.path.kind == tinker::TinkerPath::Kind::kSampler) + ": " + st.message());
    }
    return st;
  }
  registry_.TouchRun(pub.spec.model_id, pub.spec.created_ms);
  return committed;
}

Result<tinker::TinkerPath> Checkpoints::Save(const TrainingOp& op, const ModelRef& ref) {
  Publication pub = Target(op, ref);
  if (Status st = Stage(pub); !st.ok()) return st;
  if (Status saved = engine_.SaveState(ref.slot, pub.staging); !saved.ok()) return saved;
  auto committed = Commit(pub);
  if (!committed.ok()) return committed.status();
  return pub.path;
}

Result<Checkpoints::Publication> Checkpoints::SnapshotForSampler(const TrainingOp& op, const ModelRef& ref) {
  Publication pub = Target(op, ref);
  auto snapshot = engine_.SnapshotForSampler(ref.slot);
  if (!snapshot.ok()) return snapshot.status();
  pub.snapshot = std::move(*snapshot);
  return pub;
}

Result<store::Checkpoint> Checkpoints::Publish(Publication& pub) {
  if (Status st = Stage(pub); !st.ok()) return st;
  if (Status written = pub.snapshot->WritePeft(pub.staging, pub.base_model); !written.ok()) {
    return Status(written.code(), fmt::format("save_weights_for_sampler: writing checkpoint '{}' to disk failed, so "
                                              "it was not saved (the model is unchanged; retry): {}",
                                              pub.path.ToString(), written.message()));
  }
  return Commit(pub);
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
