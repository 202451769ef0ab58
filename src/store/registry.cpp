// Registry over SQLite; see registry.h for the layout and invariants.
#include "store/registry.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <limits>
#include <set>
#include <system_error>

#include "common/durable.h"
#include "common/log.h"
#include "store/dir_names.h"
#include "store/sqlite.h"

namespace loom::store {

namespace fs = std::filesystem;

struct Registry::Db {
  std::unique_ptr<SqliteDb> sql;
  int lock_fd = -1;  // flock'ed <data_dir>/registry.lock: one process per data dir
  std::atomic<uint64_t> next_unique{0};
  ~Db() {
    sql.reset();
    if (lock_fd >= 0) close(lock_fd);  // releases the flock
  }
};

namespace {

constexpr const char* kSchema = R"sql(
CREATE TABLE IF NOT EXISTS training_runs (
  model_id TEXT PRIMARY KEY,
  owner TEXT NOT NULL,
  base_model TEXT NOT NULL,
  lora_rank INTEGER NOT NULL,
  train_attn INTEGER NOT NULL,
  train_mlp INTEGER NOT NULL,
  train_unembed INTEGER NOT NULL,
  created_ms INTEGER NOT NULL,
  last_request_ms INTEGER NOT NULL,
  user_metadata TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS training_runs_by_owner ON training_runs (owner, created_ms);
CREATE TABLE IF NOT EXISTS checkpoints (
  model_id TEXT NOT NULL,
  kind TEXT NOT NULL,
  name TEXT NOT NULL,
  owner TEXT NOT NULL,
  created_ms INTEGER NOT NULL,
  size_bytes INTEGER NOT NULL,
  expires_ms INTEGER,
  is_public INTEGER NOT NULL,
  version INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (model_id, kind, name)
);
CREATE INDEX IF NOT EXISTS checkpoints_by_owner ON checkpoints (owner, created_ms);
CREATE INDEX IF NOT EXISTS checkpoints_by_expiry ON checkpoints (expires_ms);
CREATE TABLE IF NOT EXISTS sessions (
  session_id TEXT PRIMARY KEY,
  owner TEXT NOT NULL,
  created_ms INTEGER NOT NULL,
  user_metadata TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS sessions_by_owner ON sessions (owner, created_ms);
)sql";

constexpr const char* kRunColumns =
    "owner, model_id, base_model, lora_rank, train_attn, train_mlp, train_unembed, created_ms, "
    "last_request_ms, user_metadata";
constexpr const char* kCheckpointColumns =
    "owner, model_id, kind, name, created_ms, size_bytes, expires_ms, is_public, version";

TrainingRun ReadRun(const SqliteStatement& s) {
  TrainingRun r;
  r.owner = s.Text(0);
  r.model_id = s.Text(1);
  r.base_model = s.Text(2);
  r.lora_rank = static_cast<int>(s.Int(3));
  r.train_attn = s.Int(4) != 0;
  r.train_mlp = s.Int(5) != 0;
  r.train_unembed = s.Int(6) != 0;
  r.created_ms = s.Int(7);
  r.last_request_ms = s.Int(8);
  r.user_metadata = s.Text(9);
  return r;
}

// Reads a checkpoint row (kCheckpointColumns order); the caller derives dir.
Checkpoint ReadCheckpointRow(const SqliteStatement& s) {
  Checkpoint c;
  c.owner = s.Text(0);
  c.model_id = s.Text(1);
  c.kind = s.Text(2);
  c.name = s.Text(3);
  c.created_ms = s.Int(4);
  c.size_bytes = s.Int(5);
  if (!s.IsNull(6)) c.expires_ms = s.Int(6);
  c.is_public = s.Int(7) != 0;
  c.version = s.Int(8);
  c.tinker_path = c.path().ToString();
  return c;
}

Status CheckPage(const PageRequest& page) {
  if (page.offset < 0) return Status::Invalid("offset: must be >= 0");
  return Status::Ok();
}

// A counted, paginated listing of `table` filtered by `column = value`, newest
// first; read(statement) turns the current row (`columns` order) into a T.
template <typename T, typename Read>
Result<Page<T>> ListWhere(SqliteDb& db, const std::string& table, const std::string& columns,
                          const std::string& column, const std::string& value, PageRequest page, Read read) {
  Page<T> out;
  auto count = db.Prepare("SELECT COUNT(*) FROM " + table + " WHERE " + column + " = ?1");
  if (!count.ok()) return count.status();
  count.value()->Bind(1, value);
  if (Result<bool> r = count.value()->Step(); !r.ok()) return r.status();
  out.total = count.value()->Int(0);
  count.value()->Reset();
  auto st = db.Prepare("SELECT " + columns + " FROM " + table + " WHERE " + column +
                       " = ?1 ORDER BY created_ms DESC, rowid DESC LIMIT ?2 OFFSET ?3");
  if (!st.ok()) return st.status();
  st.value()->Bind(1, value);
  st.value()->Bind(2, page.limit < 0 ? int64_t{-1} : page.limit);
  st.value()->Bind(3, page.offset);
  Result<bool> row = st.value()->Step();
  for (; row.ok() && row.value(); row = st.value()->Step()) out.items.push_back(read(*st.value()));
  if (!row.ok()) return row.status();
  return out;
}

Status CheckOwner(const std::string& owner) {
  if (owner.empty()) return Status::Invalid("owner: must not be empty");
  return Status::Ok();
}

// Registries written before checkpoints had versions: every row is version 0,
// whose directory is the old layout's.
Status AddVersionColumn(SqliteDb& db) {
  auto info = db.Prepare("PRAGMA table_info(checkpoints)");
  if (!info.ok()) return info.status();
  bool has_version = false;
  Result<bool> row = info.value()->Step();
  for (; row.ok() && row.value(); row = info.value()->Step()) has_version |= info.value()->Text(1) == "version";
  info.value()->Reset();
  if (!row.ok()) return row.status();
  if (has_version) return Status::Ok();
  log::Info("registry_migrate add_column=checkpoints.version");
  return db.Exec("ALTER TABLE checkpoints ADD COLUMN version INTEGER NOT NULL DEFAULT 0");
}

}  // namespace

int64_t ExpiryMs(int64_t from_ms, int64_t ttl_seconds) {
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min();
  int64_t ttl_ms = 0;
  if (__builtin_mul_overflow(ttl_seconds, int64_t{1000}, &ttl_ms)) ttl_ms = ttl_seconds > 0 ? kMax : kMin;
  int64_t at = 0;
  if (__builtin_add_overflow(from_ms, ttl_ms, &at)) at = ttl_ms > 0 ? kMax : kMin;
  return std::min(at, kMaxExpiryMs);
}

Registry::Registry(std::string data_dir, std::unique_ptr<Db> db)
    : data_dir_(std::move(data_dir)), db_(std::move(db)) {}

Registry::~Registry() = default;

Result<std::unique_ptr<Registry>> Registry::Open(const std::string& data_dir) {
  if (data_dir.empty()) return Status::Invalid("data_dir: must not be empty");
  std::error_code ec;
  const fs::path root = fs::absolute(data_dir, ec).lexically_normal();
  if (ec) return Status::Invalid("data_dir: " + ec.message());
  for (const char* sub : {"runs", "staging", "trash"}) {
    fs::create_directories(root / sub, ec);
    if (ec) return Status::Internal("registry: cannot create " + (root / sub).string() + ": " + ec.message());
  }
  auto db = std::make_unique<Db>();
  db->lock_fd = ::open((root / "registry.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (db->lock_fd < 0 || ::flock(db->lock_fd, LOCK_EX | LOCK_NB) != 0) {
    return Status::Unavailable("data_dir " + root.string() + " is in use by another loom process");
  }
  Result<std::unique_ptr<SqliteDb>> sql = SqliteDb::Open((root / "registry.sqlite3").string());
  if (!sql.ok()) return sql.status();
  db->sql = std::move(sql.value());
  // FULL: a commit is on disk when it returns, so an overwrite never removes
  // the old version while the row that replaces it could still be lost.
  if (Status s = db->sql->Exec("PRAGMA journal_mode=WAL; PRAGMA synchronous=FULL;"); !s.ok()) return s;
  if (Status s = db->sql->Exec(kSchema); !s.ok()) return s;
  if (Status s = AddVersionColumn(*db->sql); !s.ok()) return s;
  auto registry = std::unique_ptr<Registry>(new Registry(root.string(), std::move(db)));
  {
    std::lock_guard lock(registry->mu_);
    if (Status s = registry->ReconcileLocked(); !s.ok()) return s;
  }
  return registry;
}

Status Registry::ReconcileLocked() {
  std::error_code ec;
  const fs::path root(data_dir_);
  // Leftovers of a crash: half-written saves and half-finished deletes.
  for (const char* sub : {"staging", "trash"}) {
    int removed = 0;
    for (const auto& entry : fs::directory_iterator(root / sub, ec)) {
      fs::remove_all(entry.path(), ec);
      ++removed;
    }
    if (removed > 0) log::Info("registry_recover cleared={} entries={}", sub, removed);
  }

  // A row whose files are gone (a crash inside DeleteCheckpoint, or files
  // lost behind the registry's back) is dropped; the others name the live
  // directories.
  std::vector<Checkpoint> dangling;
  std::set<std::string> live;
  {
    auto all = db_->sql->Prepare(std::string("SELECT ") + kCheckpointColumns + " FROM checkpoints");
    if (!all.ok()) return all.status();
    SqliteStatement* st = all.value();
    Result<bool> row = st->Step();
    for (; row.ok() && row.value(); row = st->Step()) {
      Checkpoint c = ReadCheckpointRow(*st);
      Result<std::string> dir = VersionDir(c.model_id, c.kind, c.name, c.version);
      if (!dir.ok() || !fs::is_directory(dir.value(), ec)) {
        dangling.push_back(c);
      } else {
        live.insert(dir.value());
      }
    }
    st->Reset();
    if (!row.ok()) return row.status();
  }
  for (const Checkpoint& c : dangling) {
    log::Warn("registry_drop_dangling tinker_path={} version={} (its files are gone)", c.tinker_path, c.version);
    auto del = db_->sql->Prepare("DELETE FROM checkpoints WHERE model_id = ?1 AND kind = ?2 AND name = ?3");
    if (!del.ok()) return del.status();
    del.value()->Bind(1, c.model_id);
    del.value()->Bind(2, c.kind);
    del.value()->Bind(3, c.name);
    if (Status s = del.value()->Run(); !s.ok()) return s;
  }
  // A checkpoint directory that no row names was never acknowledged (a save
  // that crashed between its rename and its row) or is the replaced version
  // of an overwrite that crashed before removing it: delete it.
  std::vector<fs::path> orphans;
  for (const auto& run : fs::directory_iterator(root / "runs", ec)) {
    if (!fs::is_directory(run.symlink_status(ec))) continue;
    for (const char* kind : {tinker::kWeightsKind, tinker::kSamplerWeightsKind}) {
      std::error_code kind_ec;
      for (const auto& entry : fs::directory_iterator(run.path() / kind, kind_ec)) {
        if (fs::is_directory(entry.symlink_status(kind_ec)) && !live.count(entry.path().string())) {
          orphans.push_back(entry.path());
        }
      }
    }
  }
  for (const fs::path& dir : orphans) {
    log::Warn("registry_remove_orphan dir={} (no registry row names it)", dir.string());
    if (Status s = TrashLocked(dir.string()); !s.ok()) log::Warn("registry_remove_orphan_failed error={}", s.message());
  }
  return Status::Ok();
}

// ---------------------------------------------------------------- layout

Result<std::string> Registry::CheckpointDir(const std::string& model_id, const std::string& kind,
                                            const std::string& name) const {
  if (Status s = tinker::ValidateModelId(model_id); !s.ok()) return s;
  if (Status s = tinker::ParseKind(kind).status(); !s.ok()) return s;
  if (Status s = tinker::ValidateCheckpointName(name); !s.ok()) return s;
  return (fs::path(data_dir_) / "runs" / SanitizeForPath(model_id) / kind / name).string();
}

Result<std::string> Registry::VersionDir(const std::string& model_id, const std::string& kind,
                                         const std::string& name, int64_t version) const {
  Result<std::string> dir = CheckpointDir(model_id, kind, name);
  if (!dir.ok() || version == 0) return dir;
  return dir.value() + "@" + std::to_string(version);
}

Status Registry::TrashLocked(const std::string& dir) {
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dir, ec))) return Status::Ok();
  const fs::path trash = fs::path(data_dir_) / "trash" /
                         (std::to_string(db_->next_unique.fetch_add(1)) + "-" + fs::path(dir).filename().string());
  fs::rename(dir, trash, ec);
  if (ec) return Status::Internal("registry: cannot move " + dir + " to trash: " + ec.message());
  AtStep("trashed");
  fs::remove_all(trash, ec);
  return Status::Ok();
}

void Registry::AtStep(std::string_view step) const {
  if (step_hook_) step_hook_(step);
}

void Registry::SetStepHookForTest(std::function<void(std::string_view step)> hook) {
  std::lock_guard lock(mu_);
  step_hook_ = std::move(hook);
}

Result<std::string> Registry::NewStagingDir() {
  const auto now = std::chrono::steady_clock::now().time_since_epoch().count();
  const fs::path dir = fs::path(data_dir_) / "staging" /
                       (std::to_string(db_->next_unique.fetch_add(1)) + "-" + std::to_string(now));
  std::error_code ec;
  if (!fs::create_directories(dir, ec) || ec) {
    return Status::Internal("registry: cannot create staging dir " + dir.string());
  }
  return dir.string();
}

// ---------------------------------------------------------------- runs

Status Registry::UpsertRun(const TrainingRun& run) {
  if (Status s = CheckOwner(run.owner); !s.ok()) return s;
  if (Status s = tinker::ValidateModelId(run.model_id); !s.ok()) return s;
  if (run.base_model.empty()) return Status::Invalid("base_model: must not be empty");
  if (run.lora_rank < 1) return Status::Invalid("lora_rank: must be >= 1");
  std::lock_guard lock(mu_);
  auto st = db_->sql->Prepare(
      "INSERT INTO training_runs (owner, model_id, base_model, lora_rank, train_attn, train_mlp, "
      "train_unembed, created_ms, last_request_ms, user_metadata) "
      "VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10) "
      "ON CONFLICT (model_id) DO UPDATE SET owner = ?1, base_model = ?3, lora_rank = ?4, "
      "train_attn = ?5, train_mlp = ?6, train_unembed = ?7, created_ms = ?8, "
      "last_request_ms = ?9, user_metadata = ?10");
  if (!st.ok()) return st.status();
  SqliteStatement* s = st.value();
  s->Bind(1, run.owner);
  s->Bind(2, run.model_id);
  s->Bind(3, run.base_model);
  s->Bind(4, int64_t{run.lora_rank});
  s->Bind(5, int64_t{run.train_attn});
  s->Bind(6, int64_t{run.train_mlp});
  s->Bind(7, int64_t{run.train_unembed});
  s->Bind(8, run.created_ms);
  s->Bind(9, run.last_request_ms);
  s->Bind(10, run.user_metadata.empty() ? std::string("{}") : run.user_metadata);
  return s->Run();
}

Status Registry::TouchRun(const std::string& model_id, int64_t now_ms) {
  std::lock_guard lock(mu_);
  auto st = db_->sql->Prepare("UPDATE training_runs SET last_request_ms = ?2 WHERE model_id = ?1");
  if (!st.ok()) return st.status();
  st.value()->Bind(1, model_id);
  st.value()->Bind(2, now_ms);
  if (Status s = st.value()->Run(); !s.ok()) return s;
  if (db_->sql->changes() == 0) return Status::NotFound("training run " + model_id + " not found");
  return Status::Ok();
}

Result<TrainingRun> Registry::GetRun(const std::string& model_id) const {
  std::lock_guard lock(mu_);
  auto st = db_->sql->Prepare(std::string("SELECT ") + kRunColumns +
                              " FROM training_runs WHERE model_id = ?1");
  if (!st.ok()) return st.status();
  st.value()->Bind(1, model_id);
  Result<bool> row = st.value()->Step();
  if (!row.ok()) return row.status();
  if (!row.value()) return Status::NotFound("training run " + model_id + " not found");
  TrainingRun run = ReadRun(*st.value());
  st.value()->Reset();
  return run;
}

Result<Page<TrainingRun>> Registry::ListRuns(const std::string& owner, PageRequest page) const {
  if (Status s = CheckPage(page); !s.ok()) return s;
  std::lock_guard lock(mu_);
  return ListWhere<TrainingRun>(*db_->sql, "training_runs", kRunColumns, "owner", owner, page,
                                [](SqliteStatement& st) { return ReadRun(st); });
}

// ---------------------------------------------------------------- checkpoints

Result<Checkpoint> Registry::CommitCheckpoint(const std::string& staging_dir,
                                              const CheckpointSpec& spec) {
  std::error_code ec;
  auto discard_staging = [&] { fs::remove_all(staging_dir, ec); };
  const fs::path staging = fs::path(staging_dir).lexically_normal();
  if (staging.parent_path() != fs::path(data_dir_) / "staging" || !fs::is_directory(staging, ec)) {
    return Status::Invalid("staging_dir: " + staging_dir + " is not a folder made by NewStagingDir()");
  }
  Status valid = CheckOwner(spec.owner);
  if (valid.ok()) valid = CheckpointDir(spec.model_id, spec.kind, spec.name).status();
  if (!valid.ok()) {
    discard_staging();
    return valid;
  }
  Result<int64_t> size = durable::SyncTree(staging);  // outside the lock: may be slow
  if (!size.ok()) {
    discard_staging();
    return size.status();
  }

  std::lock_guard lock(mu_);
  AtStep("synced");
  const tinker::TinkerPath path{spec.model_id, *tinker::ParseKind(spec.kind), spec.name};  // kind validated above
  Result<Checkpoint> existing = GetLocked(path);
  if (!existing.ok() && existing.status().code() != Code::kNotFound) {
    discard_staging();
    return existing.status();
  }
  const bool replacing = existing.ok();
  if (replacing && !spec.overwrite) {
    discard_staging();
    return Status::Exists("checkpoint " + path.ToString() + " already exists (overwrite is false)");
  }
  Checkpoint c;
  c.owner = spec.owner;
  c.model_id = spec.model_id;
  c.kind = spec.kind;
  c.name = spec.name;
  c.tinker_path = path.ToString();
  c.created_ms = spec.created_ms;
  c.size_bytes = size.value();
  if (spec.expires_ms) c.expires_ms = std::min(*spec.expires_ms, kMaxExpiryMs);
  c.is_public = spec.is_public;
  // The new files go next to the live version, never over it.
  c.version = replacing ? existing->version + 1 : 0;
  c.dir = VersionDir(c.model_id, c.kind, c.name, c.version).value();

  // A directory already there has no row (a save that failed before its
  // row): it is not live.
  if (Status s = TrashLocked(c.dir); !s.ok()) {
    discard_staging();
    return s;
  }
  const fs::path dest(c.dir);
  fs::create_directories(dest.parent_path(), ec);
  fs::rename(staging, dest, ec);
  if (ec) {
    const std::string why = ec.message();
    discard_staging();
    return Status::Internal("registry: cannot publish " + dest.string() + ": " + why);
  }
  AtStep("renamed");
  if (Status s = durable::Sync(dest.parent_path(), true); !s.ok()) {
    TrashLocked(c.dir);
    return s;
  }
  AtStep("published");

  // One transaction moves the checkpoint to the new version (synchronous=FULL).
  auto insert = db_->sql->Prepare(
      "INSERT OR REPLACE INTO checkpoints (owner, model_id, kind, name, created_ms, size_bytes, "
      "expires_ms, is_public, version) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)");
  if (!insert.ok()) {
    TrashLocked(c.dir);
    return insert.status();
  }
  SqliteStatement* s = insert.value();
  s->Bind(1, c.owner);
  s->Bind(2, c.model_id);
  s->Bind(3, c.kind);
  s->Bind(4, c.name);
  s->Bind(5, c.created_ms);
  s->Bind(6, c.size_bytes);
  s->Bind(7, c.expires_ms);
  s->Bind(8, int64_t{c.is_public});
  s->Bind(9, c.version);
  if (Status st = s->Run(); !st.ok()) {
    TrashLocked(c.dir);
    return st;
  }
  AtStep("recorded");
  if (replacing) {
    // Only now is the old version unreferenced; a failure here leaves a
    // directory without a row, which the next Open() removes.
    if (Status st = TrashLocked(existing->dir); !st.ok()) log::Warn("registry_replace_cleanup error={}", st.message());
  }
  return c;
}

tinker::TinkerPath Checkpoint::path() const {
  return {model_id, kind == tinker::kSamplerWeightsKind ? tinker::TinkerPath::Kind::kSampler
                                                        : tinker::TinkerPath::Kind::kTraining, name};
}

Result<Checkpoint> Registry::GetLocked(const tinker::TinkerPath& path) const {
  if (Result<std::string> d = CheckpointDir(path.training_run_id, path.kind_segment(), path.name); !d.ok()) return d.status();
  auto st = db_->sql->Prepare(std::string("SELECT ") + kCheckpointColumns +
                              " FROM checkpoints WHERE model_id = ?1 AND kind = ?2 AND name = ?3");
  if (!st.ok()) return st.status();
  st.value()->Bind(1, path.training_run_id);
  st.value()->Bind(2, std::string(path.kind_segment()));
  st.value()->Bind(3, path.name);
  Result<bool> row = st.value()->Step();
  if (!row.ok()) return row.status();
  if (!row.value()) return Status::NotFound("checkpoint " + path.ToString() + " not found");
  Checkpoint c = ReadCheckpointRow(*st.value());
  st.value()->Reset();
  c.dir = VersionDir(c.model_id, c.kind, c.name, c.version).value();
  return c;
}

Result<Checkpoint> Registry::GetCheckpoint(const tinker::TinkerPath& path) const {
  std::lock_guard lock(mu_);
  return GetLocked(path);
}

namespace {

// A paginated checkpoint listing filtered by one column, with each dir derived.
Result<Page<Checkpoint>> ListCheckpointsWhere(SqliteDb& db, const std::string& column,
                                              const std::string& value, PageRequest page,
                                              const std::function<std::string(const Checkpoint&)>& dir_of) {
  return ListWhere<Checkpoint>(db, "checkpoints", kCheckpointColumns, column, value, page,
                               [&](SqliteStatement& st) {
                                 Checkpoint c = ReadCheckpointRow(st);
                                 c.dir = dir_of(c);
                                 return c;
                               });
}

}  // namespace

Result<Page<Checkpoint>> Registry::ListCheckpoints(const std::string& model_id, PageRequest page) const {
  if (Status s = CheckPage(page); !s.ok()) return s;
  std::lock_guard lock(mu_);
  return ListCheckpointsWhere(*db_->sql, "model_id", model_id, page, [this](const Checkpoint& c) {
    Result<std::string> d = VersionDir(c.model_id, c.kind, c.name, c.version);
    return d.ok() ? d.value() : std::string();
  });
}

Result<Page<Checkpoint>> Registry::ListOwnerCheckpoints(const std::string& owner, PageRequest page) const {
  if (Status s = CheckPage(page); !s.ok()) return s;
  std::lock_guard lock(mu_);
  return ListCheckpointsWhere(*db_->sql, "owner", owner, page, [this](const Checkpoint& c) {
    Result<std::string> d = VersionDir(c.model_id, c.kind, c.name, c.version);
    return d.ok() ? d.value() : std::string();
  });
}

Result<std::map<std::string, Registry::Stored>> Registry::StoredByOwner() const {
  std::lock_guard lock(mu_);
  auto st = db_->sql->Prepare("SELECT owner, COUNT(*), SUM(size_bytes) FROM checkpoints GROUP BY owner");
  if (!st.ok()) return st.status();
  std::map<std::string, Stored> out;
  while (true) {
    Result<bool> row = st.value()->Step();
    if (!row.ok()) return row.status();
    if (!*row) break;
    out[st.value()->Text(0)] = Stored{st.value()->Int(1), st.value()->Int(2)};
  }
  return out;
}

Status Registry::DeleteLocked(const Checkpoint& c) {
  // Files first: renamed into trash (atomic), so the checkpoint stops being
  // loadable at once; then the row. A crash between the two leaves a row
  // without files, which Open() drops.
  if (Status s = TrashLocked(c.dir); !s.ok()) return Status::Internal("registry: cannot delete: " + s.message());
  auto del = db_->sql->Prepare("DELETE FROM checkpoints WHERE model_id = ?1 AND kind = ?2 AND name = ?3");
  if (!del.ok()) return del.status();
  del.value()->Bind(1, c.model_id);
  del.value()->Bind(2, c.kind);
  del.value()->Bind(3, c.name);
  return del.value()->Run();
}

Status Registry::DeleteCheckpoint(const tinker::TinkerPath& path) {
  std::lock_guard lock(mu_);
  Result<Checkpoint> existing = GetLocked(path);
  if (!existing.ok()) return existing.status();
  return DeleteLocked(*existing);
}

Status Registry::SetPublic(const tinker::TinkerPath& path, bool is_public) {
  if (Result<std::string> d = CheckpointDir(path.training_run_id, path.kind_segment(), path.name); !d.ok()) return d.status();
  std::lock_guard lock(mu_);
  auto st = db_->sql->Prepare(
      "UPDATE checkpoints SET is_public = ?4 WHERE model_id = ?1 AND kind = ?2 AND name = ?3");
  if (!st.ok()) return st.status();
  st.value()->Bind(1, path.training_run_id);
  st.value()->Bind(2, std::string(path.kind_segment()));
  st.value()->Bind(3, path.name);
  st.value()->Bind(4, int64_t{is_public});
  if (Status s = st.value()->Run(); !s.ok()) return s;
  if (db_->sql->changes() == 0) return Status::NotFound("checkpoint " + path.ToString() + " not found");
  return Status::Ok();
}

Status Registry::SetExpiry(const tinker::TinkerPath& path, std::optional<int64_t> expires_ms) {
  if (Result<std::string> d = CheckpointDir(path.training_run_id, path.kind_segment(), path.name); !d.ok()) return d.status();
  std::lock_guard lock(mu_);
  auto st = db_->sql->Prepare(
      "UPDATE checkpoints SET expires_ms = ?4 WHERE model_id = ?1 AND kind = ?2 AND name = ?3");
  if (!st.ok()) return st.status();
  st.value()->Bind(1, path.training_run_id);
  st.value()->Bind(2, std::string(path.kind_segment()));
  st.value()->Bind(3, path.name);
  if (expires_ms) expires_ms = std::min(*expires_ms, kMaxExpiryMs);
  st.value()->Bind(4, expires_ms);
  if (Status s = st.value()->Run(); !s.ok()) return s;
  if (db_->sql->changes() == 0) return Status::NotFound("checkpoint " + path.ToString() + " not found");
  return Status::Ok();
}

Result<std::vector<Checkpoint>> Registry::SweepExpired(int64_t now_ms) {
  std::lock_guard lock(mu_);
  std::vector<Checkpoint> expired;
  {
    auto st = db_->sql->Prepare(std::string("SELECT ") + kCheckpointColumns +
                                " FROM checkpoints WHERE expires_ms IS NOT NULL AND expires_ms <= ?1"
                                " ORDER BY expires_ms, rowid");
    if (!st.ok()) return st.status();
    st.value()->Bind(1, now_ms);
    Result<bool> row = st.value()->Step();
    for (; row.ok() && row.value(); row = st.value()->Step()) expired.push_back(ReadCheckpointRow(*st.value()));
    if (!row.ok()) return row.status();
    st.value()->Reset();
  }
  for (Checkpoint& c : expired) {
    Result<std::string> dir = VersionDir(c.model_id, c.kind, c.name, c.version);
    if (!dir.ok()) continue;  // a row Open() would not have let through
    c.dir = dir.value();
    if (Status s = DeleteLocked(c); !s.ok()) return s;
  }
  return expired;
}

// ---------------------------------------------------------------- sessions

Status Registry::AddSession(const SessionRecord& session) {
  if (Status s = CheckOwner(session.owner); !s.ok()) return s;
  if (session.session_id.empty()) return Status::Invalid("session_id: must not be empty");
  std::lock_guard lock(mu_);
  auto st = db_->sql->Prepare(
      "INSERT INTO sessions (session_id, owner, created_ms, user_metadata) VALUES (?1, ?2, ?3, ?4) "
      "ON CONFLICT (session_id) DO UPDATE SET owner = ?2, created_ms = ?3, user_metadata = ?4");
  if (!st.ok()) return st.status();
  st.value()->Bind(1, session.session_id);
  st.value()->Bind(2, session.owner);
  st.value()->Bind(3, session.created_ms);
  st.value()->Bind(4, session.user_metadata.empty() ? std::string("{}") : session.user_metadata);
  return st.value()->Run();
}

Result<SessionRecord> Registry::GetSession(const std::string& session_id) const {
  std::lock_guard lock(mu_);
  auto st = db_->sql->Prepare(
      "SELECT owner, session_id, created_ms, user_metadata FROM sessions WHERE session_id = ?1");
  if (!st.ok()) return st.status();
  st.value()->Bind(1, session_id);
  Result<bool> row = st.value()->Step();
  if (!row.ok()) return row.status();
  if (!row.value()) return Status::NotFound("session " + session_id + " not found");
  SessionRecord r{st.value()->Text(0), st.value()->Text(1), st.value()->Int(2), st.value()->Text(3)};
  st.value()->Reset();
  return r;
}

Result<Page<SessionRecord>> Registry::ListSessions(const std::string& owner, PageRequest page) const {
  if (Status s = CheckPage(page); !s.ok()) return s;
  std::lock_guard lock(mu_);
  return ListWhere<SessionRecord>(*db_->sql, "sessions", "owner, session_id, created_ms, user_metadata", "owner",
                                  owner, page, [](SqliteStatement& st) {
                                    return SessionRecord{st.Text(0), st.Text(1), st.Int(2), st.Text(3)};
                                  });
}

}  // namespace loom::store
