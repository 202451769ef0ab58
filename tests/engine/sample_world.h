// The sampler tests' shared world: a generated tiny qwen3 model (fp32, CPU)
// and two PEFT snapshots with non-zero A and B, made once per test binary,
// plus helpers to open a sampler and run calls on it.
#pragma once
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <filesystem>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/io/peft.h"
#include "engine/lora/slot_bank.h"
#include "engine/model/transformer.h"
#include "engine/sample_api.h"
#include "testmodel/make_model.h"
#include "tiny_model.h"

namespace loom::engine::testing_sampler {

namespace fs = std::filesystem;

// A tiny model dir and two PEFT snapshots with non-zero A and B, shared by
// every test of this file (made once).
struct World {
  std::string root, model_dir, adapter1, adapter2;
  std::shared_ptr<const Transformer> model;

  World() {
    std::string templ = (fs::temp_directory_path() / "loom-sample-test-XXXXXX").string();
    root = ::mkdtemp(templ.data());
    model_dir = root + "/model";
    testmodel::MakeModelOptions o;
    o.arch = "qwen3";
    o.preset = "tiny";
    o.seed = 5;
    EXPECT_TRUE(testmodel::MakeModel(o, model_dir).ok());
    auto t = Transformer::Load(model_dir, at::kCPU, at::kFloat);
    EXPECT_TRUE(t.ok()) << t.status().message();
    model = std::shared_ptr<const Transformer>(std::move(t.value()));
    SlotBank bank(2, 8, at::kCPU, model->LoraTargets());
    adapter1 = root + "/adapter1";
    adapter2 = root + "/adapter2";
    MakeAdapter(bank, 0, 4, 8.0, 11, adapter1);
    MakeAdapter(bank, 1, 8, 16.0, 12, adapter2);
  }
  ~World() {
    std::error_code ec;
    fs::remove_all(root, ec);
  }

  static void MakeAdapter(SlotBank& bank, int slot, int rank, double alpha, uint64_t seed, const std::string& dir) {
    BindRandom(bank, slot, rank, alpha, seed, 0.3);
    ASSERT_TRUE(SavePeft(bank, slot, dir, "tiny").ok());
  }
};

inline World& W() {
  static World* w = new World();
  return *w;
}

// A sampler of the world's model, or of `model` (the same directory loaded
// otherwise, e.g. in another dtype).
inline std::unique_ptr<Sampler> Open(SamplerOptions o = {}, std::shared_ptr<const Transformer> model = nullptr) {
  if (o.model_dir.empty()) o.model_dir = W().model_dir;
  o.max_rank = 8;
  auto s = Sampler::Open(model ? model : W().model, o);
  EXPECT_TRUE(s.ok()) << s.status().message();
  return std::move(s.value());
}

inline std::future<Result<SampleOutput>> Start(Sampler& s, SampleCall call) {
  auto p = std::make_shared<std::promise<Result<SampleOutput>>>();
  auto f = p->get_future();
  s.Submit(std::move(call), [p](Result<SampleOutput> r) { p->set_value(std::move(r)); });
  return f;
}

inline SampleOutput SampleNow(Sampler& s, SampleCall call) {
  Result<SampleOutput> r = Start(s, std::move(call)).get();
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(r.value()) : SampleOutput{};
}

inline SampleCall Call(std::vector<int32_t> prompt, int max_tokens, double temperature, std::string adapter = "",
                std::optional<uint64_t> seed = std::nullopt) {
  SampleCall c;
  c.prompt = std::move(prompt);
  c.adapter_dir = std::move(adapter);
  c.params.max_tokens = max_tokens;
  c.params.temperature = temperature;
  c.params.seed = seed;
  return c;
}

inline const std::vector<int32_t> kPrompt = {300, 17, 99, 260, 45, 301, 7, 402, 88, 120, 33};  // 11 tokens

}  // namespace loom::engine::testing_sampler
