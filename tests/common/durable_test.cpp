// common/durable.h: a file is replaced as a whole or not at all, a
// directory appears complete or not at all, and a failed write leaves
// neither a temp nor a change behind.
#include "common/durable.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "temp_dir.h"

namespace loom::durable {
namespace {

namespace fs = std::filesystem;

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

TEST(Durable, ReplaceFileSwapsTheWholeFileAndLeavesNoTemp) {
  test::TempDir dir("loom-durable");
  const std::string path = dir / "a.json";
  ASSERT_TRUE(ReplaceFile(path, std::string("first")).ok());
  ASSERT_TRUE(ReplaceFile(path, std::string("second, longer")).ok());
  EXPECT_EQ(Read(path), "second, longer");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(Durable, AFailedFillKeepsTheOldFileAndRemovesTheTemp) {
  test::TempDir dir("loom-durable");
  const std::string path = dir / "a.bin";
  ASSERT_TRUE(ReplaceFile(path, std::string("old")).ok());
  const Status s = ReplaceFile(path, [](int fd, const std::string& tmp) {
    if (Status w = WriteAll(fd, "par", 3, tmp); !w.ok()) return w;
    return Status::Internal("producer failed");
  });
  EXPECT_EQ(s.code(), Code::kInternal);
  EXPECT_EQ(Read(path), "old");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(Durable, PublishDirectoryNeverReplacesAndAFailedFillLeavesNothing) {
  test::TempDir dir("loom-durable");
  const std::string target = dir / "ckpt";
  auto fill = [](const std::string& tmp) {
    fs::create_directories(fs::path(tmp) / "sub");
    if (Status s = ReplaceFile(tmp + "/sub/w.bin", std::string(10, 'x')); !s.ok()) return s;
    return ReplaceFile(tmp + "/config.json", std::string("{}"));
  };
  ASSERT_TRUE(PublishDirectory(target, fill).ok());
  EXPECT_EQ(Read(target + "/config.json"), "{}");
  Result<int64_t> bytes = SyncTree(target);
  ASSERT_TRUE(bytes.ok());
  EXPECT_EQ(bytes.value(), 12);
  EXPECT_EQ(PublishDirectory(target, fill).code(), Code::kAlreadyExists);

  const Status failed = PublishDirectory(dir / "other", [](const std::string&) { return Status::Invalid("no"); });
  EXPECT_EQ(failed.code(), Code::kInvalidArgument);
  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1);  // ckpt alone: no "other", no temp directory
}

}  // namespace
}  // namespace loom::durable
