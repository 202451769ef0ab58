// Registry: the durable record of training runs, checkpoints and sessions,
// kept in SQLite at <data_dir>/registry.sqlite3 (WAL mode, synchronous=FULL),
// plus the layout of checkpoint files under <data_dir>:
//
//   <data_dir>/runs/<SanitizeForPath(model_id)>/<kind>/<name>/      version 0
//   <data_dir>/runs/<SanitizeForPath(model_id)>/<kind>/<name>@<v>/  version v
//   <data_dir>/staging/<unique>/                                    files being written
//   <data_dir>/trash/<unique>/                                      files being deleted
//
// A checkpoint's row records its version, and only the directory of that
// version is live ('@' cannot occur in a name, so the map is injective). An
// overwrite publishes version v+1 next to v, switches the row to v+1 in one
// SQLite transaction, and only then removes v: a crash at any point leaves the
// old or the new version listed and loadable, never neither.
//
// Invariants: a checkpoint row exists only when its directory is complete
// (files are written to a staging dir, fsynced, renamed into place, then the
// row is written; deletion removes the row's files first, by renaming them
// into trash, then the row). Reopening the same data_dir lists everything that
// was committed before and reconciles the disk with the rows: staging/ and
// trash/ are cleared, a row whose directory is gone is dropped, and every
// directory under runs/ that no row names (a save that crashed before its row
// was written, so it was never acknowledged, or the old version of a finished
// overwrite) is deleted. Each repair is logged.
//
// Threading: every method may be called from any thread (I/O threads and the
// engine thread); an internal mutex serialises them. Methods do disk I/O, so
// keep big file work (writing checkpoint tensors) out of them: write into a
// StagingDir() first, then CommitCheckpoint().
//
// Ownership: Get* return a record whatever its owner; the caller compares
// `owner` with the tenant and answers 404 for a foreign one (Checkpoint's
// AccessibleBy() also honours is_public). List* filter by owner.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "tinker/path.h"

namespace loom::store {

// The latest expiry the registry records: 9999-12-31T23:59:59.999Z, the last
// instant an ISO 8601 timestamp (and the SDK's Python datetime) can carry.
inline constexpr int64_t kMaxExpiryMs = 253402300799999;

// from_ms + ttl_seconds * 1000 for any int64 inputs, without overflow:
// saturated into [INT64_MIN, kMaxExpiryMs], so a huge TTL means "far future"
// and never wraps into the past (where the TTL sweep would delete it).
int64_t ExpiryMs(int64_t from_ms, int64_t ttl_seconds);

// One LoRA training client's model (Tinker's TrainingRun; id = model_id).
struct TrainingRun {
  std::string owner;  // tenant
  std::string model_id;
  std::string base_model;
  int lora_rank = 0;
  bool train_attn = true;
  bool train_mlp = true;
  bool train_unembed = true;
  int64_t created_ms = 0;       // unix epoch milliseconds
  int64_t last_request_ms = 0;
  std::string user_metadata = "{}";  // JSON object text, stored verbatim
};

// One saved checkpoint (Tinker's Checkpoint).
struct Checkpoint {
  std::string owner;
  std::string model_id;
  std::string kind;         // tinker::kWeightsKind | tinker::kSamplerWeightsKind
  std::string name;
  std::string tinker_path;  // "tinker://<model_id>/<kind>/<name>"
  std::string dir;          // absolute directory holding its files
  int64_t created_ms = 0;
  int64_t size_bytes = 0;   // sum of file sizes under dir
  std::optional<int64_t> expires_ms;  // unset: never expires
  bool is_public = false;
  int64_t version = 0;      // times it was overwritten; names `dir` (see the layout above)

  std::string checkpoint_id() const { return kind + "/" + name; }
  tinker::TinkerPath path() const;
  bool AccessibleBy(const std::string& tenant) const { return owner == tenant || is_public; }
};

// One SDK session (create_session).
struct SessionRecord {
  std::string owner;
  std::string session_id;
  int64_t created_ms = 0;
  std::string user_metadata = "{}";  // JSON object text
};

// A page of a listing plus the total number of matching rows (Tinker's
// cursor.total_count).
template <typename T>
struct Page {
  std::vector<T> items;
  int64_t total = 0;
};

// limit < 0 means "all"; offset must be >= 0 (else Invalid).
struct PageRequest {
  int64_t limit = 20;
  int64_t offset = 0;
};

// What the service knows when it saves a checkpoint.
struct CheckpointSpec {
  std::string owner;
  std::string model_id;
  std::string kind;
  std::string name;
  int64_t created_ms = 0;
  std::optional<int64_t> expires_ms;  // ExpiryMs(created_ms, ttl_seconds), or unset
  bool overwrite = false;             // replace an existing checkpoint of that name
  bool is_public = false;
};

class Registry {
 public:
  // Opens (creating if needed) <data_dir>/registry.sqlite3 and the folders.
  static Result<std::unique_ptr<Registry>> Open(const std::string& data_dir);
  ~Registry();
  Registry(const Registry&) = delete;
  Registry& operator=(const Registry&) = delete;

  const std::string& data_dir() const { return data_dir_; }

  // ---- file layout ----
  // <data_dir>/runs/<sanitised model_id>/<kind>/<name>, the directory of a
  // checkpoint's version 0; validates all three (tinker/path.h's rules). A checkpoint's files are in
  // its Checkpoint::dir.
  Result<std::string> CheckpointDir(const std::string& model_id, const std::string& kind,
                                    const std::string& name) const;
  // Creates and returns a fresh empty directory under <data_dir>/staging/
  // (same file system as runs/, so CommitCheckpoint's rename is atomic).
  Result<std::string> NewStagingDir();

  // ---- training runs ----
  // Inserts or replaces the run with this model_id (validated).
  Status UpsertRun(const TrainingRun& run);
  // Sets last_request_ms; NotFound for an unknown run.
  Status TouchRun(const std::string& model_id, int64_t now_ms);
  Result<TrainingRun> GetRun(const std::string& model_id) const;
  // The owner's runs, newest created first.
  Result<Page<TrainingRun>> ListRuns(const std::string& owner, PageRequest page) const;

  // ---- checkpoints ----
  // Publishes the files in `staging_dir` (from NewStagingDir) as a checkpoint:
  // fsyncs them, renames the folder to the directory of version 0, measures
  // its size and inserts the row. An existing checkpoint of that name: Exists
  // unless spec.overwrite; then the files become version v+1, the row moves to
  // it, and version v is removed last (crash-safe, see the top). On failure
  // the staging dir is removed and the previous version stays.
  Result<Checkpoint> CommitCheckpoint(const std::string& staging_dir, const CheckpointSpec& spec);
  Result<Checkpoint> GetCheckpoint(const tinker::TinkerPath& path) const;
  // One run's checkpoints, newest first.
  Result<Page<Checkpoint>> ListCheckpoints(const std::string& model_id, PageRequest page) const;
  // All of an owner's checkpoints across runs, newest first.
  Result<Page<Checkpoint>> ListOwnerCheckpoints(const std::string& owner, PageRequest page) const;
  // What each owner stores: checkpoints and their bytes (size_bytes), for
  // usage; owners without checkpoints are absent.
  struct Stored {
    int64_t checkpoints = 0;
    int64_t bytes = 0;
  };
  Result<std::map<std::string, Stored>> StoredByOwner() const;
  // Removes the files, then the row. NotFound if there is no such checkpoint.
  Status DeleteCheckpoint(const tinker::TinkerPath& path);
  Status SetPublic(const tinker::TinkerPath& path, bool is_public);
  // expires_ms unset clears the expiry.
  Status SetExpiry(const tinker::TinkerPath& path, std::optional<int64_t> expires_ms);
  // Deletes (files, then rows) every checkpoint with expires_ms <= now_ms and
  // returns what was removed.
  Result<std::vector<Checkpoint>> SweepExpired(int64_t now_ms);

  // Test seam for crash tests: `hook` is called (under the mutex) with the
  // name of each step CommitCheckpoint has just made durable or visible; a
  // test _exit()s a forked child there to stand for kill -9. Empty: none.
  void SetStepHookForTest(std::function<void(std::string_view step)> hook);

  // ---- sessions ----
  // Inserts (or replaces) a session.
  Status AddSession(const SessionRecord& session);
  Result<SessionRecord> GetSession(const std::string& session_id) const;
  // The owner's sessions, newest first.
  Result<Page<SessionRecord>> ListSessions(const std::string& owner, PageRequest page) const;

 private:
  struct Db;  // SQLite connection and prepared statements (registry.cpp)
  Registry(std::string data_dir, std::unique_ptr<Db> db);
  // The directory of one version of a checkpoint (validates the names).
  Result<std::string> VersionDir(const std::string& model_id, const std::string& kind, const std::string& name,
                                 int64_t version) const;
  Result<Checkpoint> GetLocked(const tinker::TinkerPath& path) const;  // mu_ held
  Status DeleteLocked(const Checkpoint& c);                      // mu_ held; c as read from its row
  // Open(): drops rows without files and deletes directories without rows.
  Status ReconcileLocked();
  void AtStep(std::string_view step) const;  // mu_ held; calls the test hook

  // Moves `dir` (if it exists) into trash/, atomically, then removes it.
  Status TrashLocked(const std::string& dir);

  std::string data_dir_;
  mutable std::mutex mu_;
  std::unique_ptr<Db> db_;  // guarded by mu_
  std::function<void(std::string_view)> step_hook_;  // guarded by mu_
};

}  // namespace loom::store
