// safetensors reader/writer and tensor_io: round trips, sharded model
// directories, and clean errors for damaged files.
#include "engine/io/safetensors.h"
#include "../common/temp_dir.h"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/durable.h"
#include "engine/io/tensor_io.h"

namespace loom::engine {
namespace {

namespace fs = std::filesystem;

// A fresh directory under /tmp, removed at the end of the test.
using TempDir = loom::test::TempDir;

std::vector<uint8_t> Pattern(size_t n, uint8_t salt) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(i * 31 + salt);
  return v;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteRaw(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A file from a raw header text and payload (for hand-made corrupt files).
std::string RawFile(const std::string& header, size_t payload) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  out += header;
  out += std::string(payload, '\x01');
  return out;
}

TEST(Safetensors, RoundTripsEveryDtypeWithMetadata) {
  TempDir dir;
  const std::vector<std::string> dtypes = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16",
                                           "I8",  "U64", "U32", "U16",  "U8",  "BOOL"};
  SafetensorsWriter w;
  w.SetMetadata("format", "pt");
  w.SetMetadata("note", "hello \"quoted\"");
  std::map<std::string, std::vector<uint8_t>> expect;
  for (size_t i = 0; i < dtypes.size(); ++i) {
    const size_t elem = SafetensorsDTypeSize(dtypes[i]);
    ASSERT_GT(elem, 0u) << dtypes[i];
    auto bytes = Pattern(3 * 5 * elem, static_cast<uint8_t>(i));
    if (dtypes[i] == "BOOL") for (auto& b : bytes) b &= 1;
    const std::string name = "t." + dtypes[i];
    ASSERT_TRUE(w.Add(name, dtypes[i], {3, 5}, bytes.data(), bytes.size()).ok());
    expect[name] = bytes;
  }
  const float scalar = 2.5f;
  ASSERT_TRUE(w.Add("scalar", "F32", {}, &scalar, 4).ok());
  ASSERT_TRUE(w.Add("empty", "F32", {0, 4}, nullptr, 0).ok());
  const std::string path = dir / "all.safetensors";
  ASSERT_TRUE(w.WriteAtomic(path).ok());
  EXPECT_FALSE(fs::exists(path + ".tmp"));

  // The data starts 8-byte aligned.
  const std::string raw = ReadAll(path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(raw[i]);
  EXPECT_EQ((8 + header_len) % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + header_len + w.payload_bytes());

  auto file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status().message();
  const SafetensorsFile& f = *file.value();
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("note"), "hello \"quoted\"");
  EXPECT_EQ(f.tensors().size(), dtypes.size() + 2);
  for (const auto& [name, bytes] : expect) {
    const TensorView* v = f.find(name);
    ASSERT_NE(v, nullptr) << name;
    EXPECT_EQ(v->dtype, name.substr(2));
    EXPECT_EQ(v->shape, (std::vector<int64_t>{3, 5}));
    ASSERT_EQ(v->nbytes, bytes.size());
    EXPECT_EQ(std::memcmp(v->data, bytes.data(), bytes.size()), 0) << name;
  }
  const TensorView* s = f.find("scalar");
  ASSERT_NE(s, nullptr);
  EXPECT_TRUE(s->shape.empty());
  EXPECT_EQ(s->numel(), 1);
  float got;
  std::memcpy(&got, s->data, 4);
  EXPECT_EQ(got, 2.5f);
  EXPECT_EQ(f.find("empty")->nbytes, 0u);
  EXPECT_EQ(f.find("missing"), nullptr);
}

TEST(Safetensors, ProducedTensorsAreWrittenInOrderWhateverThreadMadeThem) {
  TempDir dir;
  SafetensorsWriter w;
  // Produced tensors (made on worker threads, one call each) around a copied
  // one; each holds base + index, so a swapped or partial tensor shows.
  const std::vector<int64_t> sizes = {(3 << 20) + 3, 5, 1 << 16, 0, 777};
  std::vector<int> calls(sizes.size(), 0);
  for (size_t k = 0; k < sizes.size(); ++k) {
    const int64_t n = sizes[k];
    ASSERT_TRUE(w.AddProduced("t" + std::to_string(k), "F32", {n},
                              [&calls, k, n](uint8_t* dst, size_t bytes) {
                                ++calls[k];
                                EXPECT_EQ(bytes, static_cast<size_t>(4 * n));
                                for (int64_t i = 0; i < n; ++i) {
                                  const float v = static_cast<float>(1000000 * k + i);
                                  std::memcpy(dst + 4 * i, &v, 4);
                                }
                              })
                    .ok());
    if (k == 1) {
      const float copied[2] = {-1.0f, -2.0f};
      ASSERT_TRUE(w.Add("copied", "F32", {2}, copied, sizeof(copied)).ok());
    }
  }
  ASSERT_TRUE(w.Write(dir / "many.safetensors").ok());
  for (size_t k = 0; k < sizes.size(); ++k) EXPECT_EQ(calls[k], sizes[k] > 0 ? 1 : 0) << k;
  auto f = SafetensorsFile::Open(dir / "many.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().message();
  for (size_t k = 0; k < sizes.size(); ++k) {
    const TensorView* v = f.value()->find("t" + std::to_string(k));
    ASSERT_NE(v, nullptr);
    for (int64_t i : {int64_t{0}, int64_t{1}, sizes[k] / 2, sizes[k] - 1}) {
      if (i < 0 || i >= sizes[k]) continue;
      float x;
      std::memcpy(&x, v->data + 4 * i, 4);
      EXPECT_EQ(x, static_cast<float>(1000000 * k + i)) << k << " " << i;
    }
  }
  const TensorView* c = f.value()->find("copied");
  ASSERT_NE(c, nullptr);
  float second;
  std::memcpy(&second, c->data + 4, 4);
  EXPECT_EQ(second, -2.0f);
}

// Zero tensors are holes: read back as zeros between and after written
// tensors, the file as long as its header says, and (on a file system with
// sparse files) without their disk blocks.
TEST(Safetensors, ZeroTensorsAreHolesThatReadAsZeros) {
  TempDir dir;
  SafetensorsWriter w;
  const float head[3] = {1.0f, 2.0f, 3.0f};
  const int64_t big = int64_t{4} << 20;  // 16 MB of F32
  ASSERT_TRUE(w.Add("head", "F32", {3}, head, sizeof(head)).ok());
  ASSERT_TRUE(w.AddZeros("hole", "F32", {big}).ok());
  ASSERT_TRUE(w.AddProduced("made", "BF16", {5}, [](uint8_t* dst, size_t n) { std::memset(dst, 0x3f, n); }).ok());
  ASSERT_TRUE(w.AddZeros("tail", "BF16", {1000, 3}).ok());
  EXPECT_FALSE(w.AddZeros("hole", "F32", {1}).ok());  // the writer's checks apply
  EXPECT_EQ(w.payload_bytes(), 12u + 4u * static_cast<uint64_t>(big) + 10u + 6000u);
  const std::string path = dir / "holes.safetensors";
  ASSERT_TRUE(w.WriteAtomic(path).ok());
  auto f = SafetensorsFile::Open(path);
  ASSERT_TRUE(f.ok()) << f.status().message();
  const TensorView* hole = f.value()->find("hole");
  const TensorView* tail = f.value()->find("tail");
  const TensorView* made = f.value()->find("made");
  ASSERT_TRUE(hole && tail && made);
  EXPECT_TRUE(std::all_of(hole->data, hole->data + hole->nbytes, [](uint8_t b) { return b == 0; }));
  EXPECT_TRUE(std::all_of(tail->data, tail->data + tail->nbytes, [](uint8_t b) { return b == 0; }));
  EXPECT_TRUE(std::all_of(made->data, made->data + made->nbytes, [](uint8_t b) { return b == 0x3f; }));
  float third;
  std::memcpy(&third, f.value()->find("head")->data + 8, 4);
  EXPECT_EQ(third, 3.0f);
  // The file ends where the last tensor does: 8 bytes of header length, the
  // header, the payload.
  uint64_t header_len = 0;
  {
    std::ifstream in(path, std::ios::binary);
    unsigned char len[8];
    in.read(reinterpret_cast<char*>(len), 8);
    for (int i = 0; i < 8; ++i) header_len |= static_cast<uint64_t>(len[i]) << (8 * i);
  }
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(static_cast<uint64_t>(st.st_size), 8 + header_len + w.payload_bytes());
  EXPECT_LT(static_cast<uint64_t>(st.st_blocks) * 512, static_cast<uint64_t>(st.st_size) - (uint64_t{8} << 20))
      << "the 16 MB hole took disk blocks";
}

TEST(Safetensors, WriterRejectsBadEntries) {
  SafetensorsWriter w;
  float x[4] = {};
  EXPECT_TRUE(w.Add("a", "F32", {4}, x, 16).ok());
  EXPECT_FALSE(w.Add("a", "F32", {4}, x, 16).ok());         // repeated name
  EXPECT_FALSE(w.Add("b", "F8", {4}, x, 4).ok());           // unknown dtype
  EXPECT_FALSE(w.Add("c", "F32", {4}, x, 12).ok());         // bytes disagree with shape
  EXPECT_FALSE(w.Add("d", "F32", {-1}, x, 0).ok());         // negative dim
  EXPECT_FALSE(w.Add("__metadata__", "F32", {4}, x, 16).ok());
  EXPECT_FALSE(w.Add("", "F32", {4}, x, 16).ok());
  Status s = w.Add("c", "F32", {4}, x, 12);
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("'c'"), std::string::npos) << s.message();
  EXPECT_EQ(w.num_tensors(), 1u);
}

TEST(Safetensors, CorruptHeaderIsInvalidNamingFile) {
  TempDir dir;
  const std::string p = dir / "bad.safetensors";
  WriteRaw(p, RawFile("{\"a\": {\"dtype\": \"F32\", ", 16));
  auto f = SafetensorsFile::Open(p);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), Code::kInvalidArgument);
  EXPECT_NE(f.status().message().find(p), std::string::npos) << f.status().message();

  WriteRaw(p, "abc");  // shorter than the length prefix
  EXPECT_EQ(SafetensorsFile::Open(p).status().code(), Code::kInvalidArgument);

  WriteRaw(p, RawFile("[1, 2]", 0));  // not an object
  EXPECT_FALSE(SafetensorsFile::Open(p).ok());

  std::string huge = RawFile("{}", 0);
  huge[5] = 1;  // header length ~ 2^40
  WriteRaw(p, huge);
  EXPECT_FALSE(SafetensorsFile::Open(p).ok());

  WriteRaw(p, RawFile("{\"a\": {\"dtype\": \"Q4\", \"shape\": [2], \"data_offsets\": [0, 2]}}", 2));
  auto q = SafetensorsFile::Open(p);
  ASSERT_FALSE(q.ok());
  EXPECT_NE(q.status().message().find("'a'"), std::string::npos) << q.status().message();

  EXPECT_EQ(SafetensorsFile::Open(dir / "nope.safetensors").status().code(), Code::kNotFound);
  EXPECT_EQ(SafetensorsFile::Open(dir.path()).status().code(), Code::kInvalidArgument);  // a directory
}

TEST(Safetensors, TruncatedFileNamesTensor) {
  TempDir dir;
  SafetensorsWriter w;
  auto a = Pattern(64, 1), b = Pattern(256, 2);
  ASSERT_TRUE(w.Add("first", "F32", {16}, a.data(), a.size()).ok());
  ASSERT_TRUE(w.Add("second", "F32", {64}, b.data(), b.size()).ok());
  const std::string p = dir / "t.safetensors";
  ASSERT_TRUE(w.Write(p).ok());
  ASSERT_TRUE(SafetensorsFile::Open(p).ok());
  fs::resize_file(p, fs::file_size(p) - 10);
  auto f = SafetensorsFile::Open(p);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), Code::kInvalidArgument);
  EXPECT_NE(f.status().message().find("'second'"), std::string::npos) << f.status().message();
  EXPECT_NE(f.status().message().find(p), std::string::npos);

  fs::resize_file(p, 20);  // cut inside the header
  EXPECT_EQ(SafetensorsFile::Open(p).status().code(), Code::kInvalidArgument);
}

TEST(Safetensors, OffsetsOutOfRangeOrInconsistent) {
  TempDir dir;
  const std::string p = dir / "o.safetensors";
  struct Case {
    std::string header;
    size_t payload;
  };
  const std::vector<Case> cases = {
      {R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 32]}})", 16},   // end past data
      {R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}})", 16},   // size != shape
      {R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}})", 16},   // begin > end
      {R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [-4, 12]}})", 16},  // negative
      {R"({"w": {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]}})", 16},  // negative dim
      {R"({"w": {"dtype": "F32", "shape": [4]}})", 16},                             // no offsets
      {R"({"w": {"dtype": "F32", "shape": [4611686018427387904, 8], "data_offsets": [0, 16]}})", 16},  // overflow
  };
  for (const Case& c : cases) {
    WriteRaw(p, RawFile(c.header, c.payload));
    auto f = SafetensorsFile::Open(p);
    ASSERT_FALSE(f.ok()) << c.header;
    EXPECT_EQ(f.status().code(), Code::kInvalidArgument);
    EXPECT_NE(f.status().message().find("'w'"), std::string::npos) << f.status().message();
  }
  // Two tensors sharing bytes.
  WriteRaw(p, RawFile(R"({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                      16));
  EXPECT_FALSE(SafetensorsFile::Open(p).ok());
  // The same layout without overlap opens.
  WriteRaw(p, RawFile(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}})",
                      16));
  EXPECT_TRUE(SafetensorsFile::Open(p).ok());
}

// Caught by tests/fuzz/safetensors_fuzz (UBSan): with a 0 last, the byte size is 0 and
// fits, but TensorView::numel() multiplies 2^32 * 2^31 first, past int64_t
// (undefined behaviour before the 0 is reached).
TEST(Safetensors, ShapeWhoseElementCountOverflowsIsInvalidEvenWhenEmpty) {
  TempDir dir;
  const std::string p = dir / "e.safetensors";
  WriteRaw(p, RawFile(R"({"w": {"dtype": "U8", "shape": [4294967296, 2147483648, 0], "data_offsets": [0, 0]}})", 0));
  auto f = SafetensorsFile::Open(p);
  ASSERT_FALSE(f.ok()) << "opened, numel() = " << f.value()->find("w")->numel();
  EXPECT_EQ(f.status().code(), Code::kInvalidArgument);
  EXPECT_NE(f.status().message().find("'w': shape overflows"), std::string::npos) << f.status().message();
  // A 0 first keeps every partial product at 0: a valid empty tensor.
  WriteRaw(p, RawFile(R"({"w": {"dtype": "U8", "shape": [0, 4294967296, 2147483648], "data_offsets": [0, 0]}})", 0));
  auto g = SafetensorsFile::Open(p);
  ASSERT_TRUE(g.ok()) << g.status().message();
  EXPECT_EQ(g.value()->find("w")->numel(), 0);
}

// Writes two shards plus an index; returns the model directory.
void WriteShardedModel(const TempDir& dir, const std::string& index_json) {
  SafetensorsWriter s1, s2;
  auto a = Pattern(8, 3), b = Pattern(12, 4), c = Pattern(4, 5);
  ASSERT_TRUE(s1.Add("x.weight", "F32", {2}, a.data(), 8).ok());
  ASSERT_TRUE(s1.Add("y.weight", "F16", {6}, b.data(), 12).ok());
  ASSERT_TRUE(s2.Add("z.weight", "BF16", {2}, c.data(), 4).ok());
  ASSERT_TRUE(s1.Write(dir / "model-00001-of-00002.safetensors").ok());
  ASSERT_TRUE(s2.Write(dir / "model-00002-of-00002.safetensors").ok());
  ASSERT_TRUE(durable::ReplaceFile(dir / "model.safetensors.index.json", index_json).ok());
}

TEST(ModelWeights, OpensShardedIndexAsOneMap) {
  TempDir dir;
  WriteShardedModel(dir, R"({"metadata": {"total_size": 24}, "weight_map": {
      "x.weight": "model-00001-of-00002.safetensors", "y.weight": "model-00001-of-00002.safetensors",
      "z.weight": "model-00002-of-00002.safetensors"}})");
  auto w = ModelWeights::Open(dir.path());
  ASSERT_TRUE(w.ok()) << w.status().message();
  EXPECT_EQ(w->num_files(), 2u);
  EXPECT_EQ(w->tensors().size(), 3u);
  const TensorView* z = w->find("z.weight");
  ASSERT_NE(z, nullptr);
  EXPECT_EQ(z->dtype, "BF16");
  auto c = Pattern(4, 5);
  EXPECT_EQ(std::memcmp(z->data, c.data(), 4), 0);
  // Views stay valid after the ModelWeights is moved.
  ModelWeights moved = std::move(w.value());
  EXPECT_EQ(std::memcmp(moved.find("z.weight")->data, c.data(), 4), 0);
}

TEST(ModelWeights, IndexErrors) {
  {
    TempDir dir;  // index puts z in the wrong shard
    WriteShardedModel(dir, R"({"weight_map": {"x.weight": "model-00001-of-00002.safetensors",
        "z.weight": "model-00001-of-00002.safetensors"}})");
    auto w = ModelWeights::Open(dir.path());
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.status().message().find("z.weight"), std::string::npos) << w.status().message();
  }
  {
    TempDir dir;  // missing shard file
    WriteShardedModel(dir, R"({"weight_map": {"x.weight": "model-00009-of-00009.safetensors"}})");
    EXPECT_FALSE(ModelWeights::Open(dir.path()).ok());
  }
  {
    TempDir dir;  // path escape
    WriteShardedModel(dir, R"({"weight_map": {"x.weight": "../model-00001-of-00002.safetensors"}})");
    EXPECT_EQ(ModelWeights::Open(dir.path()).status().code(), Code::kInvalidArgument);
  }
  {
    TempDir dir;  // not JSON
    WriteShardedModel(dir, "{weight_map");
    EXPECT_EQ(ModelWeights::Open(dir.path()).status().code(), Code::kInvalidArgument);
  }
  {
    TempDir dir;  // the same tensor in two shards
    SafetensorsWriter s;
    float v[2] = {1, 2};
    ASSERT_TRUE(s.Add("x.weight", "F32", {2}, v, 8).ok());
    ASSERT_TRUE(s.Write(dir / "a.safetensors").ok());
    ASSERT_TRUE(s.Write(dir / "b.safetensors").ok());
    ASSERT_TRUE(durable::ReplaceFile(dir / "model.safetensors.index.json",
                                R"({"weight_map": {"x.weight": "a.safetensors", "y": "b.safetensors"}})")
                    .ok());
    auto w = ModelWeights::Open(dir.path());
    ASSERT_FALSE(w.ok());
    EXPECT_NE(w.status().message().find("x.weight"), std::string::npos);
  }
  {
    TempDir dir;  // nothing there
    EXPECT_EQ(ModelWeights::Open(dir.path()).status().code(), Code::kNotFound);
  }
}

TEST(TensorIO, LoadsAndConvertsFloatTypes) {
  TempDir dir;
  at::Tensor ref = at::arange(12, at::kFloat).reshape({3, 4}) * 0.25 - 1.0;  // exact in bf16/f16
  SafetensorsWriter w;
  ASSERT_TRUE(AddTensor(w, "f32", ref).ok());
  ASSERT_TRUE(AddTensor(w, "bf16", ref, at::kBFloat16).ok());
  ASSERT_TRUE(AddTensor(w, "f16", ref.to(at::kHalf)).ok());
  ASSERT_TRUE(AddTensor(w, "i64", at::arange(5, at::kLong) * static_cast<int64_t>(1000000000000)).ok());
  at::Tensor leaf = ref.clone().requires_grad_();
  ASSERT_TRUE(AddTensor(w, "leaf_t", (leaf * 2).t()).ok());  // non-contiguous, has grad_fn
  ASSERT_TRUE(w.Write(dir / "t.safetensors").ok());

  auto f = SafetensorsFile::Open(dir / "t.safetensors");
  ASSERT_TRUE(f.ok());
  const auto& file = *f.value();
  EXPECT_EQ(file.find("bf16")->dtype, "BF16");
  EXPECT_EQ(file.find("f16")->dtype, "F16");
  for (const char* name : {"f32", "bf16", "f16"}) {
    auto t = LoadTensor(*file.find(name), at::kFloat, at::kCPU);
    ASSERT_TRUE(t.ok()) << name;
    EXPECT_EQ(t->scalar_type(), at::kFloat);
    EXPECT_TRUE(at::equal(t.value(), ref)) << name;
  }
  auto as_bf16 = LoadTensor(*file.find("f32"), at::kBFloat16, at::kCPU);
  ASSERT_TRUE(as_bf16.ok());
  EXPECT_EQ(as_bf16->scalar_type(), at::kBFloat16);
  EXPECT_TRUE(at::equal(as_bf16->to(at::kFloat), ref));
  auto kept = LoadTensor(*file.find("bf16"), at::kCPU);
  ASSERT_TRUE(kept.ok());
  EXPECT_EQ(kept->scalar_type(), at::kBFloat16);
  auto i64 = LoadTensor(*file.find("i64"), at::kCPU);
  ASSERT_TRUE(i64.ok());
  EXPECT_EQ(i64->scalar_type(), at::kLong);
  EXPECT_EQ(i64.value()[4].item<int64_t>(), 4000000000000LL);
  auto lt = LoadTensor(*file.find("leaf_t"), at::kFloat, at::kCPU);
  ASSERT_TRUE(lt.ok());
  EXPECT_EQ(lt->sizes(), (std::vector<int64_t>{4, 3}));
  EXPECT_TRUE(at::equal(lt.value(), (ref * 2).t()));
  EXPECT_FALSE(lt->requires_grad());
  // Integer data cannot load as float and vice versa.
  EXPECT_EQ(LoadTensor(*file.find("i64"), at::kFloat, at::kCPU).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(LoadTensor(*file.find("f32"), at::kLong, at::kCPU).status().code(), Code::kInvalidArgument);
  // The loaded tensor owns its memory: it survives closing the file.
  auto owned = LoadTensor(*file.find("f32"), at::kFloat, at::kCPU);
  f.value().reset();
  EXPECT_TRUE(at::equal(owned.value(), ref));
}

}  // namespace
}  // namespace loom::engine
