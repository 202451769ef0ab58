// SQLite RAII wrapper; see sqlite.h.
#include "store/sqlite.h"

#include <sqlite3.h>

namespace loom::store {

SqliteStatement::~SqliteStatement() { sqlite3_finalize(stmt_); }

void SqliteStatement::Bind(int index, int64_t value) { sqlite3_bind_int64(stmt_, index, value); }

void SqliteStatement::Bind(int index, const std::string& value) {
  sqlite3_bind_text(stmt_, index, value.data(), static_cast<int>(value.size()), SQLITE_TRANSIENT);
}

void SqliteStatement::Bind(int index, std::optional<int64_t> value) {
  if (value) {
    sqlite3_bind_int64(stmt_, index, *value);
  } else {
    sqlite3_bind_null(stmt_, index);
  }
}

Result<bool> SqliteStatement::Step() {
  const int rc = sqlite3_step(stmt_);
  if (rc == SQLITE_ROW) return true;
  if (rc == SQLITE_DONE) return false;
  return Status::Internal(std::string("registry: sqlite step failed: ") + sqlite3_errmsg(db_));
}

Status SqliteStatement::Run() {
  Result<bool> r = Step();
  while (r.ok() && r.value()) r = Step();
  return r.status();
}

void SqliteStatement::Reset() {
  sqlite3_reset(stmt_);
  sqlite3_clear_bindings(stmt_);
}

int64_t SqliteStatement::Int(int column) const { return sqlite3_column_int64(stmt_, column); }

std::string SqliteStatement::Text(int column) const {
  const auto* p = reinterpret_cast<const char*>(sqlite3_column_text(stmt_, column));
  return p ? std::string(p, static_cast<size_t>(sqlite3_column_bytes(stmt_, column))) : std::string();
}

bool SqliteStatement::IsNull(int column) const {
  return sqlite3_column_type(stmt_, column) == SQLITE_NULL;
}

Result<std::unique_ptr<SqliteDb>> SqliteDb::Open(const std::string& path) {
  sqlite3* db = nullptr;
  const int rc = sqlite3_open_v2(path.c_str(), &db,
                                 SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE | SQLITE_OPEN_NOMUTEX,
                                 nullptr);
  if (rc != SQLITE_OK) {
    std::string msg = db ? sqlite3_errmsg(db) : "out of memory";
    sqlite3_close(db);
    return Status::Internal("registry: cannot open " + path + ": " + msg);
  }
  sqlite3_busy_timeout(db, 5000);
  return std::unique_ptr<SqliteDb>(new SqliteDb(db));
}

SqliteDb::~SqliteDb() {
  statements_.clear();  // finalize before close
  sqlite3_close(db_);
}

Status SqliteDb::Exec(const std::string& sql) {
  char* err = nullptr;
  if (sqlite3_exec(db_, sql.c_str(), nullptr, nullptr, &err) != SQLITE_OK) {
    std::string msg = err ? err : "unknown error";
    sqlite3_free(err);
    return Status::Internal("registry: sqlite: " + msg);
  }
  return Status::Ok();
}

Result<SqliteStatement*> SqliteDb::Prepare(const std::string& sql) {
  auto it = statements_.find(sql);
  if (it == statements_.end()) {
    sqlite3_stmt* stmt = nullptr;
    if (sqlite3_prepare_v2(db_, sql.c_str(), -1, &stmt, nullptr) != SQLITE_OK) {
      return Status::Internal(std::string("registry: cannot prepare statement: ") + sqlite3_errmsg(db_));
    }
    it = statements_.emplace(sql, std::make_unique<SqliteStatement>(db_, stmt)).first;
  }
  it->second->Reset();
  return it->second.get();
}

int64_t SqliteDb::changes() const { return sqlite3_changes(db_); }

}  // namespace loom::store
