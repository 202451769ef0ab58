#include "engine/sample/detokenizer.h"

#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

namespace loom::engine::sample {
namespace {

// GPT-2's bytes_to_unicode, inverted: code point -> byte. Printable Latin-1
// bytes map to themselves; the other 68 bytes to 256, 257, ... in order.
std::map<uint32_t, unsigned char> UnicodeToByte() {
  std::map<uint32_t, unsigned char> m;
  auto printable = [](int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) m[printable(b) ? static_cast<uint32_t>(b) : next++] = static_cast<unsigned char>(b);
  return m;
}

// UTF-8 -> code points (invalid bytes pass through as themselves).
std::vector<uint32_t> CodePoints(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    int n = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 1;
    if (i + n > s.size()) n = 1;
    uint32_t cp = n == 1 ? c : n == 2 ? (c & 0x1F) : n == 3 ? (c & 0x0F) : (c & 0x07);
    for (int k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(cp);
    i += n;
  }
  return out;
}

void AppendUtf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

}  // namespace

Result<std::unique_ptr<Detokenizer>> Detokenizer::Load(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound("tokenizer.json not found at " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return Parse(ss.str());
}

Result<std::unique_ptr<Detokenizer>> Detokenizer::Parse(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Invalid("tokenizer.json is not a JSON object");
  if (!j.contains("model") || !j["model"].is_object() || !j["model"].contains("vocab") ||
      !j["model"]["vocab"].is_object())
    return Status::Invalid("tokenizer.json has no model.vocab object (byte-level BPE expected)");
  const auto inverse = UnicodeToByte();
  auto d = std::unique_ptr<Detokenizer>(new Detokenizer());
  auto put = [&](int64_t id, std::string bytes) {
    if (id < 0 || id > (int64_t{1} << 24)) return;
    if (static_cast<int64_t>(d->bytes_.size()) <= id) d->bytes_.resize(static_cast<size_t>(id) + 1);
    d->bytes_[static_cast<size_t>(id)] = std::move(bytes);
  };
  for (const auto& [token, id] : j["model"]["vocab"].items()) {
    if (!id.is_number_integer()) continue;
    std::string bytes;
    for (uint32_t cp : CodePoints(token)) {
      auto it = inverse.find(cp);
      if (it != inverse.end()) bytes += static_cast<char>(it->second);
      else AppendUtf8(bytes, cp);  // not a byte-level symbol: keep the character
    }
    put(id.get<int64_t>(), std::move(bytes));
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array())
    for (const auto& t : j["added_tokens"])
      if (t.is_object() && t.contains("id") && t["id"].is_number_integer() && t.contains("content") &&
          t["content"].is_string())
        put(t["id"].get<int64_t>(), t["content"].get<std::string>());
  return d;
}

const std::string& Detokenizer::Bytes(int64_t id) const {
  if (id < 0 || id >= size()) return empty_;
  return bytes_[static_cast<size_t>(id)];
}

std::string Detokenizer::Decode(const std::vector<int32_t>& ids) const {
  std::string out;
  for (int32_t id : ids) out += Bytes(id);
  return out;
}

bool EndsWithStop(const std::string& text, size_t added, const std::vector<std::string>& stops) {
  for (const std::string& s : stops) {
    if (s.empty() || s.size() > text.size()) continue;
    // A match ending at position e (exclusive) with e in the newest bytes.
    const size_t first_end = std::max(s.size(), text.size() - std::min(added, text.size()) + 1);
    for (size_t e = first_end; e <= text.size(); ++e)
      if (text.compare(e - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

}  // namespace loom::engine::sample
