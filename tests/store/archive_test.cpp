// Tests of the ustar checkpoint archive: our own header parser, GNU tar's
// listing and extraction, determinism, long names, limits.
#include "store/archive.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include "store_test_util.h"

namespace loom::store {
namespace {

namespace fs = std::filesystem;
using testing::Bytes;
using testing::ReadFile;
using testing::TempDir;
using testing::WriteFile;

struct TarMember {
  std::string name;
  char type = 0;
  int64_t size = 0;
  int64_t mode = 0;
  int64_t mtime = 0;
  std::string content;
};

int64_t Octal(const std::string& tar, size_t off, size_t width) {
  return std::strtoll(tar.substr(off, width).c_str(), nullptr, 8);
}

// Parses a ustar archive; fails the test on a bad checksum or layout.
std::vector<TarMember> Parse(const std::string& tar) {
  std::vector<TarMember> out;
  EXPECT_EQ(tar.size() % 512, 0u);
  size_t off = 0;
  while (off + 512 <= tar.size()) {
    const std::string h = tar.substr(off, 512);
    if (h == std::string(512, '\0')) break;
    EXPECT_EQ(h.substr(257, 6), std::string("ustar\0", 6));
    EXPECT_EQ(h.substr(263, 2), "00");
    unsigned sum = 0;
    for (size_t i = 0; i < 512; ++i) sum += (i >= 148 && i < 156) ? ' ' : static_cast<unsigned char>(h[i]);
    EXPECT_EQ(static_cast<int64_t>(sum), Octal(h, 148, 8)) << "checksum";
    TarMember m;
    const std::string prefix = h.substr(345, 155).c_str();
    const std::string name = h.substr(0, 100).c_str();
    m.name = prefix.empty() ? name : prefix + "/" + name;
    m.type = h[156];
    m.mode = Octal(h, 100, 8);
    m.size = Octal(h, 124, 12);
    m.mtime = Octal(h, 136, 12);
    m.content = tar.substr(off + 512, static_cast<size_t>(m.size));
    off += 512 + (static_cast<size_t>(m.size) + 511) / 512 * 512;
    out.push_back(m);
  }
  EXPECT_EQ(tar.size() - off, 1024u) << "two zero blocks end the archive";
  EXPECT_EQ(tar.substr(off), std::string(tar.size() - off, '\0'));
  return out;
}

void MakeCheckpoint(const fs::path& dir) {
  WriteFile(dir / "adapter_config.json", R"({"r": 8, "lora_alpha": 16})");
  WriteFile(dir / "adapter_model.safetensors", Bytes(1000, 1));
  WriteFile(dir / "optimizer" / "state.bin", Bytes(600, 2));
}

TEST(ArchiveTest, HoldsFilesAndMarkerInSortedOrder) {
  TempDir tmp;
  const fs::path dir = fs::path(tmp.path()) / "ckpt";
  MakeCheckpoint(dir);
  auto tar = TarDirectory(dir.string());
  ASSERT_TRUE(tar.ok()) << tar.status().message();
  auto members = Parse(tar.value());
  ASSERT_EQ(members.size(), 5u);
  EXPECT_EQ(members[0].name, "adapter_config.json");
  EXPECT_EQ(members[0].content, R"({"r": 8, "lora_alpha": 16})");
  EXPECT_EQ(members[1].name, "adapter_model.safetensors");
  EXPECT_EQ(members[1].size, 1000);
  EXPECT_EQ(members[1].content, Bytes(1000, 1));
  EXPECT_EQ(members[1].type, '0');
  EXPECT_EQ(members[1].mode, 0644);
  EXPECT_EQ(members[2].name, "checkpoint_complete");
  EXPECT_EQ(members[2].size, 0);
  EXPECT_EQ(members[3].name, "optimizer/");
  EXPECT_EQ(members[3].type, '5');
  EXPECT_EQ(members[3].mode, 0755);
  EXPECT_EQ(members[4].name, "optimizer/state.bin");
  EXPECT_EQ(members[4].content, Bytes(600, 2));
  // 5 headers + ceil(27/512)+2+0+0+2 content blocks + 2 end blocks.
  EXPECT_EQ(tar->size(), 512u * (5 + 1 + 2 + 2 + 2));
}

TEST(ArchiveTest, IsDeterministic) {
  TempDir tmp;
  const fs::path dir = fs::path(tmp.path()) / "ckpt";
  MakeCheckpoint(dir);
  auto a = TarDirectory(dir.string());
  fs::last_write_time(dir / "adapter_model.safetensors", fs::file_time_type::clock::now() - std::chrono::hours(5));
  auto b = TarDirectory(dir.string());
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(a.value(), b.value());
  TarOptions opts;
  opts.mtime = 1700000000;
  auto c = TarDirectory(dir.string(), opts);
  ASSERT_TRUE(c.ok());
  for (const auto& m : Parse(c.value())) EXPECT_EQ(m.mtime, 1700000000);
}

TEST(ArchiveTest, ExistingMarkerIsNotDuplicated) {
  TempDir tmp;
  const fs::path dir = fs::path(tmp.path()) / "ckpt";
  MakeCheckpoint(dir);
  WriteFile(dir / "checkpoint_complete", "");
  auto tar = TarDirectory(dir.string());
  ASSERT_TRUE(tar.ok());
  int markers = 0;
  for (const auto& m : Parse(tar.value())) markers += m.name == "checkpoint_complete";
  EXPECT_EQ(markers, 1);
}

TEST(ArchiveTest, GnuTarListsAndExtractsIt) {
  TempDir tmp;
  const fs::path dir = fs::path(tmp.path()) / "ckpt";
  MakeCheckpoint(dir);
  // A path over 100 bytes needs ustar's prefix field.
  const std::string long_rel = std::string(60, 'd') + "/" + std::string(70, 'f') + ".bin";
  WriteFile(dir / long_rel, Bytes(777, 3));
  TarOptions opts;
  opts.prefix = "step_10";
  auto tar = TarDirectory(dir.string(), opts);
  ASSERT_TRUE(tar.ok()) << tar.status().message();
  const fs::path file = fs::path(tmp.path()) / "archive.tar";
  {
    std::ofstream out(file, std::ios::binary);
    out.write(tar->data(), static_cast<std::streamsize>(tar->size()));
  }
  const fs::path listing = fs::path(tmp.path()) / "listing.txt";
  ASSERT_EQ(std::system(("tar -tvf " + file.string() + " > " + listing.string()).c_str()), 0);
  const std::string text = ReadFile(listing);
  for (const std::string& name : std::vector<std::string>{"step_10/adapter_config.json", "step_10/adapter_model.safetensors",
                                 "step_10/checkpoint_complete", "step_10/optimizer/state.bin",
                                 "step_10/" + long_rel}) {
    EXPECT_NE(text.find(name), std::string::npos) << name << " missing from:\n" << text;
  }
  const fs::path out = fs::path(tmp.path()) / "out";
  fs::create_directories(out);
  ASSERT_EQ(std::system(("tar -xf " + file.string() + " -C " + out.string()).c_str()), 0);
  EXPECT_EQ(ReadFile(out / "step_10" / "adapter_model.safetensors"), Bytes(1000, 1));
  EXPECT_EQ(ReadFile(out / "step_10" / "optimizer" / "state.bin"), Bytes(600, 2));
  EXPECT_EQ(ReadFile(out / "step_10" / long_rel), Bytes(777, 3));
  EXPECT_TRUE(fs::is_regular_file(out / "step_10" / "checkpoint_complete"));
  EXPECT_EQ(fs::file_size(out / "step_10" / "checkpoint_complete"), 0u);
}

TEST(ArchiveTest, RefusesWhatItCannotRepresent) {
  TempDir tmp;
  const fs::path dir = fs::path(tmp.path()) / "ckpt";
  MakeCheckpoint(dir);
  TarOptions small;
  small.max_bytes = 4096;
  EXPECT_EQ(TarDirectory(dir.string(), small).status().code(), Code::kPayloadTooLarge);
  EXPECT_EQ(TarDirectory((fs::path(tmp.path()) / "missing").string()).status().code(), Code::kNotFound);
  TarOptions bad_prefix;
  bad_prefix.prefix = "../up";
  EXPECT_EQ(TarDirectory(dir.string(), bad_prefix).status().code(), Code::kInvalidArgument);
  const fs::path too_long = fs::path(tmp.path()) / "long";
  WriteFile(too_long / std::string(120, 'x'), "1");  // one component > 100 bytes
  EXPECT_EQ(TarDirectory(too_long.string()).status().code(), Code::kInvalidArgument);
  fs::create_symlink("/etc/passwd", dir / "link");
  auto link = TarDirectory(dir.string());
  EXPECT_EQ(link.status().code(), Code::kInvalidArgument);
  EXPECT_NE(link.status().message().find("link"), std::string::npos) << link.status().message();
}

}  // namespace
}  // namespace loom::store
