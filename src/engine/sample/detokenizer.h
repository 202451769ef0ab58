// Detokenizer: token id -> the bytes it stands for, read from a Hugging
// Face tokenizer.json with a byte-level BPE vocabulary (Qwen, GPT-2). Each
// vocab string is mapped back through GPT-2's byte->unicode table; added
// tokens (e.g. "<|endoftext|>") stand for their content as written. Used to
// match stop strings on the generated text.
//
// Immutable after Load; any thread may read it. Torch-free.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace loom::engine::sample {

class Detokenizer {
 public:
  // NotFound when the file is absent; Invalid when it has no model.vocab.
  static Result<std::unique_ptr<Detokenizer>> Load(const std::string& tokenizer_json_path);
  static Result<std::unique_ptr<Detokenizer>> Parse(const std::string& json_text);

  // Bytes of one token; empty for an id outside the vocabulary.
  const std::string& Bytes(int64_t id) const;
  std::string Decode(const std::vector<int32_t>& ids) const;
  int64_t size() const { return static_cast<int64_t>(bytes_.size()); }

 private:
  std::vector<std::string> bytes_;
  std::string empty_;
};

// True when one of stops ends inside the last `added` bytes of text, i.e.
// the newest token completed a stop string.
bool EndsWithStop(const std::string& text, size_t added, const std::vector<std::string>& stops);

}  // namespace loom::engine::sample
