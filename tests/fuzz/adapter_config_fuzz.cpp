// libFuzzer target: adapter_config.json parsing (engine/io/peft_config.h,
// what LoadPeft reads before it touches a slot). The input is the file's text;
// the bank's max rank is 32 (serve's default).
//
// Beyond "no crash, no throw": an accepted config must be one LoadPeft can
// bind (rank in [1, max], at least one group trained iff any module named).
#include <cstdint>
#include <string>

#include "engine/io/peft_config.h"
#include "require.h"

using loom::fuzz::Require;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  constexpr int64_t kMaxRank = 32;
  const std::string text(reinterpret_cast<const char*>(data), size);
  auto cfg = loom::engine::ParsePeftConfig(text, kMaxRank, "adapter_config.json");
  if (!cfg.ok()) {
    Require(cfg.status().code() == loom::Code::kInvalidArgument, "an error that is not Invalid");
    return 0;
  }
  const loom::engine::LoraConfig& c = cfg->lora;
  Require(c.rank >= 1 && c.rank <= kMaxRank, "a rank outside [1, max_rank]");
  Require((c.train_attn || c.train_mlp || c.train_unembed) == !cfg->modules.empty(),
          "trained groups disagree with target_modules");
  return 0;
}
