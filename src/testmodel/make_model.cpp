// make_model: deterministic random Qwen-family models in Hugging Face layout.
#include "testmodel/make_model.h"

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>

#include "common/durable.h"
#include "common/hash.h"
#include "engine/io/safetensors.h"
#include "engine/model/family.h"

// The generator's floating-point must be the same on every machine: forbid
// fusing a*b+c into FMA (it would change last bits where FMA is available).
#pragma GCC optimize("fp-contract=off")

namespace loom::testmodel {

using engine::ModelConfig;
using engine::SafetensorsWriter;

namespace {

// ------------------------------------------------------------ random numbers

uint64_t Rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

// Natural log of s in (0, 1] from IEEE basic operations only (+ - * / and
// exact frexp), so it rounds identically everywhere, unlike libm's log.
double PortableLog(double s) {
  int e = 0;
  double m = std::frexp(s, &e);  // s = m * 2^e, m in [0.5, 1)
  if (m < 0.70710678118654752440) {
    m *= 2.0;
    e -= 1;
  }
  // ln m = 2 atanh(t), t = (m-1)/(m+1), |t| <= 0.1716: 12 odd terms reach 1e-18.
  const double t = (m - 1.0) / (m + 1.0);
  const double t2 = t * t;
  double p = 1.0 / 23.0;
  for (int k = 10; k >= 0; --k) p = p * t2 + 1.0 / (2.0 * k + 1.0);
  return 2.0 * t * p + static_cast<double>(e) * 0.69314718055994530942;
}

// NormalStream: xoshiro256** seeded by splitmix64, normals by Marsaglia's
// polar method (no trigonometry). Invariant: the sequence depends only on the
// seed. Single-threaded.
class NormalStream {
 public:
  explicit NormalStream(uint64_t seed) {
    for (auto& w : s_) w = SplitMix64Next(seed);
  }
  uint64_t NextU64() {
    const uint64_t result = Rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = Rotl(s_[3], 45);
    return result;
  }
  double Uniform() { return static_cast<double>(NextU64() >> 11) * 0x1.0p-53; }  // [0, 1)
  double Normal() {
    if (has_spare_) {
      has_spare_ = false;
      return spare_;
    }
    double u, v, s;
    do {
      u = 2.0 * Uniform() - 1.0;
      v = 2.0 * Uniform() - 1.0;
      s = u * u + v * v;
    } while (s >= 1.0 || s == 0.0);
    const double f = std::sqrt(-2.0 * PortableLog(s) / s);
    spare_ = v * f;
    has_spare_ = true;
    return u * f;
  }

 private:
  uint64_t s_[4];
  bool has_spare_ = false;
  double spare_ = 0.0;
};

// fp32 → bf16 with round-to-nearest-even (what torch does).
uint16_t FloatToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7F800000u) == 0x7F800000u && (bits & 0x007FFFFFu)) return 0x7FC0;  // NaN
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// TensorFiller: produces one weight's bytes on demand (ones, or normal(0, std)),
// element by element in row-major order. Single-threaded.
class TensorFiller {
 public:
  TensorFiller(bool ones, double std_dev, bool bf16, uint64_t seed)
      : ones_(ones), std_(std_dev), bf16_(bf16), rng_(seed) {}
  void Fill(uint8_t* dst, size_t nbytes) {
    const size_t elem = bf16_ ? 2 : 4;
    for (size_t i = 0; i + elem <= nbytes; i += elem) {
      const float v = ones_ ? 1.0f : static_cast<float>(rng_.Normal() * std_);
      if (bf16_) {
        const uint16_t b = FloatToBF16(v);
        dst[i] = static_cast<uint8_t>(b);
        dst[i + 1] = static_cast<uint8_t>(b >> 8);
      } else {
        uint32_t b;
        std::memcpy(&b, &v, 4);
        for (int k = 0; k < 4; ++k) dst[i + k] = static_cast<uint8_t>(b >> (8 * k));
      }
    }
  }

 private:
  bool ones_;
  double std_;
  bool bf16_;
  NormalStream rng_;
};

bool EndsWith(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// ------------------------------------------------------------ tokenizer

// GPT-2's byte → printable unicode code point mapping.
std::vector<uint32_t> ByteToCodePoint() {
  std::vector<uint32_t> map(256, 0);
  std::vector<bool> direct(256, false);
  for (int b = '!'; b <= '~'; ++b) direct[b] = true;
  for (int b = 0xA1; b <= 0xAC; ++b) direct[b] = true;
  for (int b = 0xAE; b <= 0xFF; ++b) direct[b] = true;
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) map[b] = direct[b] ? static_cast<uint32_t>(b) : next++;
  return map;
}

std::string Utf8(uint32_t cp) {
  std::string out;
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
  return out;
}

std::string Quote(const std::string& s) { return nlohmann::json(s).dump(); }

Status SetDtype(const std::string& dtype, const std::string& default_dtype, ModelConfig* c) {
  const std::string d = dtype.empty() ? default_dtype : dtype;
  if (d == "bf16") {
    c->torch_dtype = "bfloat16";
  } else if (d == "fp32") {
    c->torch_dtype = "float32";
  } else {
    return Status::Invalid("dtype '" + dtype + "' is not one of bf16, fp32");
  }
  return Status::Ok();
}

// The normal init's std of one tensor: initializer_range, except in the
// gpt_oss tiny preset, whose sinks (1.0), biases (0.5), router (0.5) and
// gate_up experts (0.5: pre-activations of std about 4 on normed rows of
// width 64, so the +-7 clamp bites) are large enough for tests to see them.
// And the embeddings (1.0), with v_proj's and o_proj's biases kept small:
// those biases are the same for every token, so where they rival the
// embeddings in the residual every token's normed row, and its route, is
// nearly the same (at 0.02 embeddings, HF's batch reached 3, then 7, of the
// 8 experts of layer 0).
// The tiny presets with DeepSeek-style experts (deepseek_v2/v3, glm4_moe,
// mimo_v2_flash: shared experts or sigmoid routing) have routers of 0.1 (logits of std about 0.8 on normed
// rows of width 64) that spread their tokens over every expert, where at
// 0.02 the correction bias (0.02) rivals the scores' spread and HF's batch
// reached 5 of deepseek_v3's 8 experts.
double InitStd(const ModelConfig& c, const std::string& preset, const std::string& name) {
  if ((c.n_shared_experts > 0 || c.scoring_func == "sigmoid") && preset == "tiny" && EndsWith(name, "mlp.gate.weight"))
    return 0.1;
  if (!c.IsGptOss() || preset != "tiny") return c.initializer_range;
  if (EndsWith(name, "self_attn.sinks") || EndsWith(name, "embed_tokens.weight")) return 1.0;
  if (EndsWith(name, "v_proj.bias") || EndsWith(name, "o_proj.bias")) return c.initializer_range;
  if (EndsWith(name, "bias") || EndsWith(name, "mlp.router.weight") || EndsWith(name, "experts.gate_up_proj"))
    return 0.5;
  return c.initializer_range;
}

}  // namespace

// ------------------------------------------------------------ presets

Result<ModelConfig> PresetConfig(const std::string& arch, const std::string& preset, const std::string& dtype) {
  const engine::Family* family = engine::FindFamily(arch);
  if (!family) return Status::Invalid("arch '" + arch + "' is not one of " + engine::FamilyNames());
  std::string default_dtype;
  Result<ModelConfig> c = family->preset(preset, &default_dtype);
  if (!c.ok()) return Status::Invalid(c.status().message() + " for arch " + arch);
  if (Status s = SetDtype(dtype, default_dtype, &*c); !s.ok()) return s;
  c->bos_token_id = c->vocab_size - 1;
  c->eos_token_id = c->vocab_size - 1;
  return c;
}

std::vector<WeightSpec> BaseWeightSpecs(const ModelConfig& c) {
  std::vector<WeightSpec> specs;
  for (auto& [name, shape] : engine::BaseWeightShapes(c)) specs.push_back({std::move(name), std::move(shape)});
  return specs;
}

std::string MakeTokenizerJson(int64_t vocab_size) {
  const std::vector<uint32_t> byte_cp = ByteToCodePoint();
  std::vector<std::string> symbol(256);
  for (int b = 0; b < 256; ++b) symbol[b] = Utf8(byte_cp[b]);
  // Multi-symbol tokens: strings over {space, a..z} (as byte-level symbols),
  // by length then lexicographically; each is the merge of its prefix and last symbol.
  std::vector<std::string> alphabet = {symbol[' ']};
  for (char ch = 'a'; ch <= 'z'; ++ch) alphabet.push_back(symbol[static_cast<unsigned char>(ch)]);
  const int64_t eos = vocab_size - 1;
  std::vector<std::string> tokens;
  std::vector<std::string> merges;
  for (int64_t id = 0; id < std::min<int64_t>(256, eos); ++id) tokens.push_back(symbol[id]);
  std::vector<int> digits = {0, 0};  // current string as alphabet indices
  while (static_cast<int64_t>(tokens.size()) < eos) {
    std::string prefix, tok;
    for (size_t i = 0; i + 1 < digits.size(); ++i) prefix += alphabet[digits[i]];
    tok = prefix + alphabet[digits.back()];
    tokens.push_back(tok);
    merges.push_back(prefix + " " + alphabet[digits.back()]);
    // Next string: increment like an odometer; overflow → one symbol longer.
    size_t k = digits.size();
    while (k > 0 && ++digits[k - 1] == static_cast<int>(alphabet.size())) digits[--k] = 0;
    if (k == 0) digits.assign(digits.size() + 1, 0);
  }
  const std::string eos_text = "<|endoftext|>";
  std::string out;
  out.reserve(static_cast<size_t>(vocab_size) * 24);
  out += "{\n  \"version\": \"1.0\",\n  \"truncation\": null,\n  \"padding\": null,\n";
  out += "  \"added_tokens\": [{\"id\": " + std::to_string(eos) + ", \"content\": " + Quote(eos_text) +
         ", \"single_word\": false, \"lstrip\": false, \"rstrip\": false, \"normalized\": false, \"special\": true}],\n";
  out += "  \"normalizer\": null,\n";
  out += "  \"pre_tokenizer\": {\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": true},\n";
  out += "  \"post_processor\": null,\n";
  out += "  \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, \"use_regex\": true},\n";
  out += "  \"model\": {\"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, \"continuing_subword_prefix\": null, "
         "\"end_of_word_suffix\": null, \"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": false,\n";
  out += "    \"vocab\": {";
  for (size_t id = 0; id < tokens.size(); ++id) {
    out += (id ? ", " : "") + Quote(tokens[id]) + ": " + std::to_string(id);
  }
  out += std::string(tokens.empty() ? "" : ", ") + Quote(eos_text) + ": " + std::to_string(eos) + "},\n";
  out += "    \"merges\": [";
  for (size_t i = 0; i < merges.size(); ++i) out += (i ? ", " : "") + Quote(merges[i]);
  out += "]\n  }\n}\n";
  return out;
}

// ------------------------------------------------------------ writing

Result<ModelConfig> MakeModelConfig(const MakeModelOptions& options) {
  auto cfg = PresetConfig(options.arch, options.preset, options.dtype);
  if (!cfg.ok()) return cfg.status();
  if (options.layers < 0) return Status::Invalid("layers must be >= 0 (0: the preset's)");
  if (options.layers > 0) {
    cfg->num_hidden_layers = options.layers;
    // The preset's per-layer pattern over the new layer count (gpt_oss's
    // alternation, mimo's 5:1, qwen3_5's 3:1, GLM-5.2's indexers).
    for (std::vector<std::string>* types : {&cfg->layer_types, &cfg->indexer_types}) {
      if (types->empty()) continue;
      std::vector<std::string> kept;
      for (int64_t i = 0; i < options.layers; ++i) kept.push_back((*types)[static_cast<size_t>(i) % types->size()]);
      *types = std::move(kept);
    }
  }
  return cfg;
}

Status MakeModel(const MakeModelOptions& options, const std::string& out_dir) {
  auto cfg = MakeModelConfig(options);
  if (!cfg.ok()) return cfg.status();
  const ModelConfig& c = cfg.value();
  if (c.vocab_size < 258) return Status::Invalid("vocab_size must be at least 258 for a byte-level tokenizer");
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec) return Status::Internal("create directory " + out_dir + ": " + ec.message());

  const bool bf16 = c.torch_dtype == "bfloat16";
  const std::string st_dtype = bf16 ? "BF16" : "F32";
  const uint64_t elem = bf16 ? 2 : 4;
  const std::vector<WeightSpec> specs = BaseWeightSpecs(c);

  // Shards: consecutive tensors, a new one when the next would pass shard_bytes.
  std::vector<std::vector<const WeightSpec*>> shards(1);
  uint64_t in_shard = 0, total = 0;
  for (const WeightSpec& w : specs) {
    uint64_t bytes = elem;
    for (int64_t d : w.shape) bytes *= static_cast<uint64_t>(d);
    if (!shards.back().empty() && in_shard + bytes > options.shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(&w);
    in_shard += bytes;
    total += bytes;
  }

  const uint64_t seed_base = [&] {
    uint64_t x = options.seed;
    return SplitMix64Next(x);
  }();
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t si = 0; si < shards.size(); ++si) {
    char name[64];
    if (shards.size() == 1) {
      std::snprintf(name, sizeof(name), "model.safetensors");
    } else {
      std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", si + 1, shards.size());
    }
    SafetensorsWriter writer;
    writer.SetMetadata("format", "pt");
    writer.SetMetadata("loom.arch", options.arch);
    writer.SetMetadata("loom.preset", options.preset);
    writer.SetMetadata("loom.seed", std::to_string(options.seed));
    writer.SetMetadata("loom.dtype", bf16 ? "bf16" : "fp32");
    // Only when overridden: the presets' files stay byte-identical (their fingerprints are pinned).
    if (options.layers > 0) writer.SetMetadata("loom.layers", std::to_string(c.num_hidden_layers));
    if (options.zero_experts) writer.SetMetadata("loom.zero_experts", "1");
    for (const WeightSpec* w : shards[si]) {
      if (options.zero_experts && w->name.find(".experts.") != std::string::npos) {
        if (Status s = writer.AddZeros(w->name, st_dtype, w->shape); !s.ok()) return s;
        weight_map[w->name] = name;
        continue;
      }
      const bool ones = EndsWith(w->name, "norm.weight");
      // Each tensor has its own stream, so values do not depend on order or sharding.
      const uint64_t tensor_seed = seed_base ^ Fnv1a64(w->name);
      auto filler = std::make_shared<TensorFiller>(ones, InitStd(c, options.preset, w->name), bf16, tensor_seed);
      Status s = writer.AddProduced(w->name, st_dtype, w->shape,
                                    [filler](uint8_t* dst, size_t n) { filler->Fill(dst, n); });
      if (!s.ok()) return s;
      weight_map[w->name] = name;
    }
    if (Status s = writer.WriteAtomic((fs::path(out_dir) / name).string()); !s.ok()) return s;
  }
  const fs::path single = fs::path(out_dir) / "model.safetensors";
  const fs::path index = fs::path(out_dir) / "model.safetensors.index.json";
  if (shards.size() > 1) {
    fs::remove(single, ec);
    nlohmann::json idx = {{"metadata", {{"total_size", total}}}, {"weight_map", weight_map}};
    if (Status s = durable::ReplaceFile(index.string(), idx.dump(2) + "\n"); !s.ok()) return s;
  } else {
    fs::remove(index, ec);
  }

  if (Status s = durable::ReplaceFile((fs::path(out_dir) / "config.json").string(), c.ToJson()); !s.ok()) return s;
  nlohmann::ordered_json gen;
  gen["bos_token_id"] = c.bos_token_id;
  gen["eos_token_id"] = c.eos_token_id;
  gen["do_sample"] = false;
  if (Status s = durable::ReplaceFile((fs::path(out_dir) / "generation_config.json").string(), gen.dump(2) + "\n"); !s.ok()) {
    return s;
  }
  if (Status s = durable::ReplaceFile((fs::path(out_dir) / "tokenizer.json").string(), MakeTokenizerJson(c.vocab_size));
      !s.ok()) {
    return s;
  }
  nlohmann::ordered_json tok_cfg;
  tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast";
  tok_cfg["bos_token"] = "<|endoftext|>";
  tok_cfg["eos_token"] = "<|endoftext|>";
  tok_cfg["pad_token"] = "<|endoftext|>";
  tok_cfg["model_max_length"] = c.max_position_embeddings;
  return durable::ReplaceFile((fs::path(out_dir) / "tokenizer_config.json").string(), tok_cfg.dump(2) + "\n");
}

}  // namespace loom::testmodel
