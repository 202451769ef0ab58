// safetensors: reading and writing the Hugging Face tensor file format,
// without libtorch.
//
// Format: 8-byte little-endian header length N, then N bytes of JSON
//   {"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]},
//    "__metadata__": {"<key>": "<value>", ...}}
// padded with spaces to a multiple of 8, then the raw little-endian bytes of
// every tensor (offsets are relative to the end of the header).
//
// Reading maps the file and hands out views into the mapping; nothing is
// copied until tensor_io.h turns a view into an at::Tensor. Every offset,
// size and shape is validated at Open(): a truncated or corrupt file is a
// Status naming the file and the tensor, never a crash.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace loom::engine {

// Bytes per element of a safetensors dtype name ("F32" → 4, "BF16" → 2,
// "BOOL" → 1, ...); 0 for a name the format does not define.
// Known: F64 F32 F16 BF16 I64 I32 I16 I8 U64 U32 U16 U8 BOOL.
size_t SafetensorsDTypeSize(const std::string& dtype);

// One tensor inside a mapped file. Valid while the file that made it is open.
struct TensorView {
  std::string name;
  std::string dtype;              // safetensors name: "F32", "BF16", "I64", ...
  std::vector<int64_t> shape;     // [] = scalar (one element)
  const uint8_t* data = nullptr;  // little-endian, row-major, possibly unaligned
  size_t nbytes = 0;              // == numel() * SafetensorsDTypeSize(dtype)

  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
};

// SafetensorsFile: one .safetensors file, read-only mapped into memory.
// Invariant: every view's [data, data+nbytes) lies inside the mapping and
// matches its dtype and shape. Immutable after Open; any thread may read it.
class SafetensorsFile {
 public:
  static Result<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  std::map<std::string, std::string> metadata_;
  std::map<std::string, TensorView> tensors_;
};

// The validation half of SafetensorsFile::Open, on a file image already in
// memory: checks [base, base + size) and adds its tensors (views into it) and
// metadata to the maps; `path` names the file in errors. Torch- and
// file-free, so that tests/fuzz/ can feed it bytes. On error the maps may
// hold part of the file.
Status ParseSafetensors(const uint8_t* base, uint64_t size, const std::string& path,
                        std::map<std::string, TensorView>* tensors, std::map<std::string, std::string>* metadata);

// ModelWeights: the weights of a Hugging Face model directory as one
// name → view map. Opens `model.safetensors`, or else every shard named in
// `model.safetensors.index.json`'s weight_map (checking that each listed name
// is in the shard the index names, and that no name appears twice).
// Immutable after Open; any thread may read it. Movable.
class ModelWeights {
 public:
  static Result<ModelWeights> Open(const std::string& model_dir);

  const std::map<std::string, TensorView>& tensors() const { return tensors_; }
  const TensorView* find(const std::string& name) const;
  size_t num_files() const { return files_.size(); }

 private:
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, TensorView> tensors_;
};

// SafetensorsWriter: collects tensors (in insertion order) and metadata, then
// writes one file. A tensor's bytes are either copied in at Add() or produced
// at write time by a Producer, whole, on a worker thread: Write() runs the
// producers of several tensors at once (up to one per core, at most 8 GiB
// ahead) and writes them in order.
// Single-threaded: one owner builds and writes it; producers of different
// tensors must be independent of each other.
class SafetensorsWriter {
 public:
  // Fills dst[0, nbytes) with the tensor's bytes (one call per tensor).
  using Producer = std::function<void(uint8_t* dst, size_t nbytes)>;

  void SetMetadata(const std::string& key, const std::string& value) { metadata_[key] = value; }

  // Copies nbytes from data. Invalid if the name is empty, starts with "__"
  // or repeats, the dtype is unknown, a dimension is negative, or nbytes
  // disagrees with shape and dtype.
  Status Add(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
             const void* data, size_t nbytes);
  // Same checks; the bytes come from producer when the file is written.
  Status AddProduced(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
                     Producer producer);
  // Same checks; every byte zero, written as a hole (skipped over), so on a
  // file system with sparse files the tensor takes no disk blocks.
  Status AddZeros(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape);

  size_t num_tensors() const { return entries_.size(); }
  uint64_t payload_bytes() const { return payload_bytes_; }  // sum of tensor sizes

  // Writes the file at path (truncating) and fsyncs it. Not atomic
  // (durable::WriteSynced).
  Status Write(const std::string& path) const;
  // Replaces path as a whole (durable::ReplaceFile: a temp sibling,
  // fsynced, renamed, the directory fsynced).
  Status WriteAtomic(const std::string& path) const;

 private:
  struct Entry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    size_t nbytes = 0;
    std::vector<uint8_t> bytes;  // when copied
    Producer producer;           // when produced
    bool hole = false;           // AddZeros
  };
  Status Check(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape) const;
  // AddProduced's and AddZeros' entry: producer, or a hole.
  Status AddUnbuffered(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
                       Producer producer, bool hole);
  std::string HeaderJson() const;
  Status WriteTo(int fd, const std::string& path) const;  // the whole file into fd

  std::vector<Entry> entries_;
  std::map<std::string, std::string> metadata_;
  uint64_t payload_bytes_ = 0;
};

}  // namespace loom::engine
