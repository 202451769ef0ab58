// durable: the one way loom makes bytes survive a crash. A file is written
// to a temp sibling, fsynced, renamed over its name, and the directory is
// fsynced; a directory is filled under a temp name, every file and folder
// in it fsynced, renamed into place, and its parent fsynced. After a crash
// a reader sees the old version or the new one, never a torn one (at
// worst a stray temp is left, which no reader opens).
//
// The store's two-step publish (staging rename, then the registry row;
// docs/reliability.md) is built from Sync and SyncTree here.
//
// Torch-free, no shared state: any thread, as long as two callers do not
// write the same path.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>

#include "common/status.h"

namespace loom::durable {

// Writes the n bytes at data to fd, retrying short writes and EINTR;
// errors name `path`.
Status WriteAll(int fd, const void* data, size_t n, const std::string& path);

// fsyncs a file, or (directory) a directory so that entries renamed into
// it are durable.
Status Sync(const std::string& path, bool directory);

// fsyncs every regular file and folder under dir (symlinks are not
// followed), then dir itself. Returns the total size of the files.
Result<int64_t> SyncTree(const std::string& dir);

// Creates or truncates path (0644), lets fill(fd, path) write it, then
// fsyncs it. Not atomic: a crash may leave part of it. For files inside
// a directory that PublishDirectory publishes as a whole.
using FillFile = std::function<Status(int fd, const std::string& path)>;
Status WriteSynced(const std::string& path, const FillFile& fill);

// Replaces path as a whole: WriteSynced("<path>.tmp", fill), renamed onto
// path, path's directory fsynced. On error the temp is removed and path
// is as it was.
Status ReplaceFile(const std::string& path, const FillFile& fill);
Status ReplaceFile(const std::string& path, const std::string& contents);

// Makes dir appear complete or not at all: fill(tmp_dir) writes into a
// fresh sibling "<dir>.tmp-XXXXXX", everything there is fsynced
// (SyncTree), the temp directory is renamed onto dir and the parent
// fsynced. An existing dir is never replaced: AlreadyExists. fill's error
// aborts and removes the temp directory.
Status PublishDirectory(const std::string& dir, const std::function<Status(const std::string& tmp_dir)>& fill);

}  // namespace loom::durable
