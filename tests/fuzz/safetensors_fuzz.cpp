// libFuzzer target: the safetensors reader's validation
// (engine/io/safetensors.h, ParseSafetensors, which SafetensorsFile::Open
// runs on its mapping). The input is the whole file image.
//
// Beyond "no crash": every view Open hands out must keep the header's
// invariant (inside the file, nbytes == numel() x dtype size), and reading
// every byte of every view must stay inside the input (ASan checks that).
#include <cstdint>
#include <map>
#include <string>

#include "engine/io/safetensors.h"
#include "require.h"

using loom::fuzz::Require;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::map<std::string, loom::engine::TensorView> tensors;
  std::map<std::string, std::string> metadata;
  loom::Status s = loom::engine::ParseSafetensors(data, size, "fuzz.safetensors", &tensors, &metadata);
  if (!s.ok()) {
    Require(!s.message().empty(), "an error without a message");
    return 0;
  }
  uint8_t sum = 0;
  for (const auto& [name, v] : tensors) {
    Require(v.name == name, "a view under another name");
    const size_t elem = loom::engine::SafetensorsDTypeSize(v.dtype);
    Require(elem != 0, "a view of an unknown dtype");
    Require(static_cast<uint64_t>(v.numel()) * elem == v.nbytes, "nbytes != numel() x dtype size");
    Require(v.data >= data && v.nbytes <= size && v.data <= data + size - v.nbytes, "a view outside the file");
    for (size_t i = 0; i < v.nbytes; ++i) sum ^= v.data[i];
  }
  volatile uint8_t sink = sum;
  (void)sink;
  return 0;
}
