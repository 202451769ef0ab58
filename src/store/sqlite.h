// A thin RAII layer over SQLite's C API, private to store/: a connection that
// caches its prepared statements, and a statement that resets itself when its
// use ends. Not thread-safe; Registry serialises all use under its mutex.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

#include "common/status.h"

struct sqlite3;
struct sqlite3_stmt;

namespace loom::store {

// One prepared statement. Bind*() take 1-based indices; Step() returns true
// while a row is available. Reset() clears bindings for the next use.
class SqliteStatement {
 public:
  SqliteStatement(sqlite3* db, sqlite3_stmt* stmt) : db_(db), stmt_(stmt) {}
  ~SqliteStatement();
  SqliteStatement(const SqliteStatement&) = delete;
  SqliteStatement& operator=(const SqliteStatement&) = delete;

  void Bind(int index, int64_t value);
  void Bind(int index, const std::string& value);
  void Bind(int index, std::optional<int64_t> value);  // nullopt binds NULL
  Result<bool> Step();
  Status Run();  // Step() to completion, for statements without rows
  void Reset();

  int64_t Int(int column) const;
  std::string Text(int column) const;
  bool IsNull(int column) const;

 private:
  sqlite3* db_;
  sqlite3_stmt* stmt_;
};

class SqliteDb {
 public:
  static Result<std::unique_ptr<SqliteDb>> Open(const std::string& path);
  ~SqliteDb();
  SqliteDb(const SqliteDb&) = delete;
  SqliteDb& operator=(const SqliteDb&) = delete;

  Status Exec(const std::string& sql);  // one or more statements, no results
  // The cached statement for `sql`, reset and ready for binding.
  Result<SqliteStatement*> Prepare(const std::string& sql);
  int64_t changes() const;

 private:
  explicit SqliteDb(sqlite3* db) : db_(db) {}
  sqlite3* db_;
  std::map<std::string, std::unique_ptr<SqliteStatement>> statements_;
};

}  // namespace loom::store
