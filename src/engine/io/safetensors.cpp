// safetensors reader (mmap + validation) and writer (streamed, fsync'd).
#include "engine/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <future>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include "common/durable.h"

namespace loom::engine {
namespace {

using json = nlohmann::json;

// A header larger than this is not a tensor file (the format's own limit is 100 MB).
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Produced tensors are written in chunks of at most this many bytes.
constexpr uint64_t kAheadBytes = 8ull << 30;  // produced bytes held in memory at once

std::string ErrnoText() { return std::strerror(errno); }

// Closes a file descriptor on scope exit.
struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

// numel * elem_size with overflow detection; false on overflow or negative dims.
// TensorView::numel() multiplies the dims in order in int64_t, so every partial
// element count must fit it too (a trailing 0 does not make [2^32, 2^31, 0] safe).
bool ByteSize(const std::vector<int64_t>& shape, size_t elem, uint64_t* out) {
  uint64_t n = elem;
  int64_t count = 1;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d != 0 && count > std::numeric_limits<int64_t>::max() / d) return false;
    count *= d;
    if (d != 0 && n > std::numeric_limits<uint64_t>::max() / static_cast<uint64_t>(d)) return false;
    n *= static_cast<uint64_t>(d);
  }
  *out = n;
  return true;
}

}  // namespace

size_t SafetensorsDTypeSize(const std::string& dtype) {
  static const std::map<std::string, size_t> kSizes = {
      {"F64", 8}, {"F32", 4}, {"F16", 2}, {"BF16", 2}, {"I64", 8}, {"I32", 4}, {"I16", 2},
      {"I8", 1},  {"U64", 8}, {"U32", 4}, {"U16", 2},  {"U8", 1},   {"BOOL", 1}};
  auto it = kSizes.find(dtype);
  return it == kSizes.end() ? 0 : it->second;
}

// ---------------------------------------------------------------- reading

SafetensorsFile::~SafetensorsFile() {
  if (map_ != nullptr) ::munmap(map_, map_size_);
}

const TensorView* SafetensorsFile::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Result<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(const std::string& path) {
  Fd fd;
  fd.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd.fd < 0) {
    if (errno == ENOENT) return Status::NotFound("safetensors file " + path + " does not exist");
    return Status::Internal("open " + path + ": " + ErrnoText());
  }
  struct stat st {};
  if (::fstat(fd.fd, &st) != 0) return Status::Internal("stat " + path + ": " + ErrnoText());
  if (!S_ISREG(st.st_mode)) return Status::Invalid("safetensors file " + path + " is not a regular file");
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  if (size > 0) {  // mmap refuses 0 bytes; ParseSafetensors reports the truncation
    file->map_size_ = size;
    file->map_ = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd.fd, 0);
    if (file->map_ == MAP_FAILED) {
      file->map_ = nullptr;
      return Status::Internal("mmap " + path + ": " + ErrnoText());
    }
  }
  Status s = ParseSafetensors(static_cast<const uint8_t*>(file->map_), size, path, &file->tensors_, &file->metadata_);
  if (!s.ok()) return s;
  return file;
}

Status ParseSafetensors(const uint8_t* base, uint64_t size, const std::string& path,
                        std::map<std::string, TensorView>* tensors, std::map<std::string, std::string>* metadata) {
  if (size < 8) {
    return Status::Invalid("safetensors file " + path + " is truncated: " + std::to_string(size) +
                           " bytes, less than the 8-byte header length");
  }
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | base[i];
  if (header_len > kMaxHeaderBytes) {
    return Status::Invalid("safetensors file " + path + " has a corrupt header length " +
                           std::to_string(header_len) + " (limit " + std::to_string(kMaxHeaderBytes) + ")");
  }
  if (header_len > size - 8) {
    return Status::Invalid("safetensors file " + path + " is truncated: header needs " +
                           std::to_string(header_len) + " bytes, file has " + std::to_string(size - 8));
  }
  json header;
  try {
    header = json::parse(reinterpret_cast<const char*>(base + 8), reinterpret_cast<const char*>(base + 8 + header_len));
  } catch (const std::exception& e) {
    return Status::Invalid("safetensors file " + path + " has a corrupt header: " + e.what());
  }
  if (!header.is_object()) return Status::Invalid("safetensors file " + path + ": header is not a JSON object");

  const uint8_t* data = base + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& name = it.key();
    const json& v = it.value();
    const std::string where = "safetensors file " + path + ", tensor '" + name + "': ";
    if (name == "__metadata__") {
      if (!v.is_object()) return Status::Invalid("safetensors file " + path + ": __metadata__ is not an object");
      for (auto m = v.begin(); m != v.end(); ++m) {
        if (!m.value().is_string()) {
          return Status::Invalid("safetensors file " + path + ": __metadata__ value of '" + m.key() +
                                 "' is not a string");
        }
        (*metadata)[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    if (!v.is_object()) return Status::Invalid(where + "entry is not an object");
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return Status::Invalid(where + "missing or non-string dtype");
    if (sh == v.end() || !sh->is_array()) return Status::Invalid(where + "missing or non-array shape");
    if (off == v.end() || !off->is_array() || off->size() != 2) {
      return Status::Invalid(where + "data_offsets must be [begin, end]");
    }
    TensorView view;
    view.name = name;
    view.dtype = dt->get<std::string>();
    const size_t elem = SafetensorsDTypeSize(view.dtype);
    if (elem == 0) return Status::Invalid(where + "unknown dtype '" + view.dtype + "'");
    for (const json& d : *sh) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) return Status::Invalid(where + "shape has a non-natural dimension");
      view.shape.push_back(d.get<int64_t>());
    }
    for (const json& o : *off) {
      if (!o.is_number_unsigned()) return Status::Invalid(where + "data_offsets are not non-negative integers");
    }
    const uint64_t begin = (*off)[0].get<uint64_t>();
    const uint64_t end = (*off)[1].get<uint64_t>();
    uint64_t expect = 0;
    if (!ByteSize(view.shape, elem, &expect)) return Status::Invalid(where + "shape overflows");
    if (begin > end) return Status::Invalid(where + "data_offsets begin > end");
    if (end > data_size) {
      return Status::Invalid(where + "data_offsets end " + std::to_string(end) + " is past the data (" +
                             std::to_string(data_size) + " bytes; file truncated or corrupt)");
    }
    if (end - begin != expect) {
      return Status::Invalid(where + "data_offsets span " + std::to_string(end - begin) + " bytes but " +
                             view.dtype + " shape needs " + std::to_string(expect));
    }
    view.data = data + begin;
    view.nbytes = static_cast<size_t>(expect);
    if (expect > 0) ranges.emplace_back(begin, end);
    tensors->emplace(name, std::move(view));
  }
  std::sort(ranges.begin(), ranges.end());
  for (size_t i = 1; i < ranges.size(); ++i) {
    if (ranges[i].first < ranges[i - 1].second) {
      return Status::Invalid("safetensors file " + path + ": tensors overlap at data offset " +
                             std::to_string(ranges[i].first));
    }
  }
  return Status::Ok();
}

const TensorView* ModelWeights::find(const std::string& name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

Result<ModelWeights> ModelWeights::Open(const std::string& model_dir) {
  namespace fs = std::filesystem;
  ModelWeights weights;
  const fs::path dir(model_dir);
  const fs::path single = dir / "model.safetensors";
  const fs::path index = dir / "model.safetensors.index.json";
  std::error_code ec;
  if (fs::exists(single, ec)) {
    auto file = SafetensorsFile::Open(single.string());
    if (!file.ok()) return file.status();
    std::shared_ptr<SafetensorsFile> f(std::move(file.value()));
    weights.tensors_ = f->tensors();
    weights.files_.push_back(std::move(f));
    return weights;
  }
  if (!fs::exists(index, ec)) {
    return Status::NotFound("model directory " + model_dir +
                            " has neither model.safetensors nor model.safetensors.index.json");
  }
  json idx;
  try {
    std::ifstream in(index);
    idx = json::parse(in);
  } catch (const std::exception& e) {
    return Status::Invalid("index " + index.string() + " is not valid JSON: " + e.what());
  }
  if (!idx.is_object() || !idx.contains("weight_map") || !idx["weight_map"].is_object()) {
    return Status::Invalid("index " + index.string() + " has no weight_map object");
  }
  std::map<std::string, std::string> weight_map;  // tensor → shard file name
  std::set<std::string> shard_names;
  for (auto it = idx["weight_map"].begin(); it != idx["weight_map"].end(); ++it) {
    if (!it.value().is_string()) {
      return Status::Invalid("index " + index.string() + ": weight_map['" + it.key() + "'] is not a string");
    }
    std::string shard = it.value().get<std::string>();
    if (shard.empty() || shard.find('/') != std::string::npos || shard == "." || shard == "..") {
      return Status::Invalid("index " + index.string() + ": weight_map['" + it.key() + "'] names an invalid shard '" +
                             shard + "'");
    }
    weight_map[it.key()] = shard;
    shard_names.insert(shard);
  }
  std::map<std::string, std::shared_ptr<SafetensorsFile>> shards;
  for (const std::string& s : shard_names) {
    auto file = SafetensorsFile::Open((dir / s).string());
    if (!file.ok()) return file.status();
    std::shared_ptr<SafetensorsFile> f(std::move(file.value()));
    for (const auto& [name, view] : f->tensors()) {
      if (weights.tensors_.count(name)) {
        return Status::Invalid("model directory " + model_dir + ": tensor '" + name + "' appears in more than one shard");
      }
      weights.tensors_.emplace(name, view);
    }
    shards[s] = f;
    weights.files_.push_back(std::move(f));
  }
  for (const auto& [name, shard] : weight_map) {
    if (shards[shard]->find(name) == nullptr) {
      return Status::Invalid("index " + index.string() + " puts tensor '" + name + "' in " + shard +
                             ", which does not contain it");
    }
  }
  return weights;
}

// ---------------------------------------------------------------- writing

Status SafetensorsWriter::Check(const std::string& name, const std::string& dtype,
                                const std::vector<int64_t>& shape) const {
  if (name.empty()) return Status::Invalid("safetensors tensor name is empty");
  if (name.rfind("__", 0) == 0) return Status::Invalid("safetensors tensor name '" + name + "' starts with __");
  if (SafetensorsDTypeSize(dtype) == 0) {
    return Status::Invalid("safetensors tensor '" + name + "': unknown dtype '" + dtype + "'");
  }
  for (int64_t d : shape) {
    if (d < 0) return Status::Invalid("safetensors tensor '" + name + "': negative dimension in shape");
  }
  for (const Entry& e : entries_) {
    if (e.name == name) return Status::Invalid("safetensors tensor '" + name + "' added twice");
  }
  return Status::Ok();
}

Status SafetensorsWriter::Add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
                              const void* data, size_t nbytes) {
  if (Status s = Check(name, dtype, shape); !s.ok()) return s;
  uint64_t expect = 0;
  if (!ByteSize(shape, SafetensorsDTypeSize(dtype), &expect) || expect != nbytes) {
    return Status::Invalid("safetensors tensor '" + name + "': " + std::to_string(nbytes) + " bytes given, " +
                           dtype + " shape needs " + std::to_string(expect));
  }
  Entry e;
  e.name = name;
  e.dtype = dtype;
  e.shape = shape;
  e.nbytes = nbytes;
  const auto* p = static_cast<const uint8_t*>(data);
  e.bytes.assign(p, p + nbytes);
  entries_.push_back(std::move(e));
  payload_bytes_ += nbytes;
  return Status::Ok();
}

Status SafetensorsWriter::AddProduced(const std::string& name, const std::string& dtype,
                                      const std::vector<int64_t>& shape, Producer producer) {
  return AddUnbuffered(name, dtype, shape, std::move(producer), /*hole=*/false);
}

Status SafetensorsWriter::AddZeros(const std::string& name, const std::string& dtype,
                                   const std::vector<int64_t>& shape) {
  return AddUnbuffered(name, dtype, shape, nullptr, /*hole=*/true);
}

Status SafetensorsWriter::AddUnbuffered(const std::string& name, const std::string& dtype,
                                        const std::vector<int64_t>& shape, Producer producer, bool hole) {
  if (Status s = Check(name, dtype, shape); !s.ok()) return s;
  uint64_t expect = 0;
  if (!ByteSize(shape, SafetensorsDTypeSize(dtype), &expect)) {
    return Status::Invalid("safetensors tensor '" + name + "': shape overflows");
  }
  Entry e;
  e.name = name;
  e.dtype = dtype;
  e.shape = shape;
  e.nbytes = static_cast<size_t>(expect);
  e.producer = std::move(producer);
  e.hole = hole;
  entries_.push_back(std::move(e));
  payload_bytes_ += expect;
  return Status::Ok();
}

std::string SafetensorsWriter::HeaderJson() const {
  json header = json::object();
  uint64_t offset = 0;
  for (const Entry& e : entries_) {
    header[e.name] = {{"dtype", e.dtype}, {"shape", e.shape}, {"data_offsets", {offset, offset + e.nbytes}}};
    offset += e.nbytes;
  }
  if (!metadata_.empty()) header["__metadata__"] = metadata_;
  std::string text = header.dump();
  // Pad with spaces so the data starts 8-byte aligned in the file.
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');
  return text;
}

Status SafetensorsWriter::WriteTo(int fd, const std::string& path) const {
  const std::string header = HeaderJson();
  uint8_t len[8];
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  if (Status s = durable::WriteAll(fd, len, 8, path); !s.ok()) return s;
  if (Status s = durable::WriteAll(fd, header.data(), header.size(), path); !s.ok()) return s;
  // Produced tensors are generated ahead on worker threads (a window of up
  // to one per core and kAheadBytes in flight) and written in order.
  const size_t workers = std::max(1u, std::thread::hardware_concurrency());
  std::deque<std::future<std::vector<uint8_t>>> ahead;
  size_t next = 0;  // first entry not yet started
  uint64_t in_flight = 0;
  auto start_more = [&](size_t from) {
    if (next < from) next = from;
    while (next < entries_.size() && ahead.size() < workers) {
      const Entry& e = entries_[next];
      if (!e.producer) break;
      if (!ahead.empty() && in_flight + e.nbytes > kAheadBytes) break;
      in_flight += e.nbytes;
      ahead.push_back(std::async(std::launch::async, [&e] {
        std::vector<uint8_t> bytes(e.nbytes);
        if (e.nbytes > 0) e.producer(bytes.data(), e.nbytes);
        return bytes;
      }));
      ++next;
    }
  };
  bool holes = false;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const Entry& e = entries_[i];
    if (e.hole) {  // skipped over: reads as zeros
      if (e.nbytes > 0 && ::lseek(fd, static_cast<off_t>(e.nbytes), SEEK_CUR) < 0)
        return Status::Internal("seek in " + path + ": " + std::strerror(errno));
      holes = true;
      continue;
    }
    if (!e.producer) {
      if (Status s = durable::WriteAll(fd, e.bytes.data(), e.bytes.size(), path); !s.ok()) return s;
      continue;
    }
    start_more(i);
    std::vector<uint8_t> bytes = ahead.front().get();
    ahead.pop_front();
    in_flight -= e.nbytes;
    start_more(i + 1);
    if (Status s = durable::WriteAll(fd, bytes.data(), bytes.size(), path); !s.ok()) {
      for (auto& f : ahead) f.wait();
      return s;
    }
  }
  if (holes) {  // a hole at the end: the file's length covers it
    const off_t end = ::lseek(fd, 0, SEEK_CUR);
    if (end < 0 || ::ftruncate(fd, end) != 0)
      return Status::Internal("extend " + path + ": " + std::strerror(errno));
  }
  return Status::Ok();
}

Status SafetensorsWriter::Write(const std::string& path) const {
  return durable::WriteSynced(path, [this](int fd, const std::string& p) { return WriteTo(fd, p); });
}

Status SafetensorsWriter::WriteAtomic(const std::string& path) const {
  return durable::ReplaceFile(path, [this](int fd, const std::string& p) { return WriteTo(fd, p); });
}

}  // namespace loom::engine
