// Sampler end to end on a generated tiny qwen3 model (fp32, CPU): sampling
// parameters, seeds, stops, the trainer/sampler logprob consistency, KV
// cache vs full recompute, multi-adapter decode steps, adapter eviction,
// snapshots offered from memory, the context window and KV admission control.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/io/peft.h"
#include "engine/io/peft_snapshot.h"
#include "engine/lora/slot_bank.h"
#include "testmodel/make_model.h"
#include "engine/model/transformer.h"
#include "engine/sample/detokenizer.h"
#include "engine/sample_api.h"
#include "sample_world.h"

namespace loom::engine {
namespace {

using testing_sampler::Call;
using testing_sampler::kPrompt;
using testing_sampler::Open;
using testing_sampler::SampleNow;
using testing_sampler::Start;
using testing_sampler::W;

// The trainer's view: one packed forward of prompt + generated[:-1] with the
// snapshot loaded into a trainer-side bank (slot 0), logprobs of every next token.
std::vector<float> TrainerLogprobs(const std::vector<int32_t>& prompt, const std::vector<int32_t>& gen,
                                   const std::string& adapter, const Transformer* model = nullptr) {
  const Transformer& m = model ? *model : *W().model;
  SlotBank bank(1, 8, at::kCPU, m.LoraTargets());
  if (!adapter.empty()) EXPECT_TRUE(LoadPeft(bank, 0, adapter).ok());
  std::vector<int32_t> seq = prompt;
  seq.insert(seq.end(), gen.begin(), gen.end());
  std::vector<int32_t> input(seq.begin(), seq.end() - 1);
  std::vector<int64_t> targets(seq.begin() + 1, seq.end());
  c10::NoGradGuard no_grad;
  const PackedBatch b = PackedBatch::Make({input}, {adapter.empty() ? -1 : 0}, at::kCPU);
  const at::Tensor lp = m.TargetLogprobs(m.Hidden(b, bank), at::tensor(targets, at::TensorOptions().dtype(at::kLong)),
                                         b, bank).contiguous();
  return std::vector<float>(lp.data_ptr<float>(), lp.data_ptr<float>() + lp.numel());
}

TEST(Sampler, GreedyIsDeterministicAndStopsAtLength) {
  auto s = Open();
  const SampleOutput a = SampleNow(*s, Call(kPrompt, 12, 0.0));
  const SampleOutput b = SampleNow(*s, Call(kPrompt, 12, 0.0));
  ASSERT_EQ(a.sequences.size(), 1u);
  EXPECT_EQ(a.sequences[0].tokens, b.sequences[0].tokens);
  EXPECT_EQ(a.sequences[0].tokens.size(), 12u);
  EXPECT_EQ(a.sequences[0].logprobs.size(), 12u);
  EXPECT_EQ(a.sequences[0].stop_reason, SampleStopReason::kLength);
  EXPECT_FALSE(a.prompt_logprobs.has_value());
}

TEST(Sampler, KvCachedDecodeEqualsFullRecompute) {
  // Greedy token i must be the argmax of a full forward over prompt + tokens[:i].
  auto s = Open();
  for (const std::string& adapter : {std::string(), W().adapter1}) {
    const SampleOutput out = SampleNow(*s, Call(kPrompt, 20, 0.0, adapter));
    const std::vector<int32_t>& gen = out.sequences[0].tokens;
    ASSERT_EQ(gen.size(), 20u);
    const Transformer& m = *W().model;
    SlotBank bank(1, 8, at::kCPU, m.LoraTargets());
    if (!adapter.empty()) ASSERT_TRUE(LoadPeft(bank, 0, adapter).ok());
    c10::NoGradGuard no_grad;
    for (size_t i = 0; i < gen.size(); ++i) {
      std::vector<int32_t> seq = kPrompt;
      seq.insert(seq.end(), gen.begin(), gen.begin() + static_cast<std::ptrdiff_t>(i));
      const PackedBatch b = PackedBatch::Make({seq}, {adapter.empty() ? -1 : 0}, at::kCPU);
      const at::Tensor h = m.Hidden(b, bank);
      const PackedBatch last = PackedBatch::Make({{seq.back()}}, {adapter.empty() ? -1 : 0}, at::kCPU);
      const at::Tensor logits = m.Logits(h.narrow(0, h.size(0) - 1, 1), last, bank);
      EXPECT_EQ(logits.argmax(-1).item<int64_t>(), gen[i]) << "step " << i << " adapter '" << adapter << "'";
    }
  }
}

TEST(Sampler, SampledLogprobsEqualTrainerForwardLogprobs) {
  // The trainer/sampler consistency test: within 1e-4 in fp32 on CPU.
  auto s = Open();
  for (const std::string& adapter : {std::string(), W().adapter1, W().adapter2}) {
    SampleCall c = Call(kPrompt, 24, 1.0, adapter, 1234);
    c.num_samples = 3;
    c.prompt_logprobs = true;
    const SampleOutput out = SampleNow(*s, c);
    ASSERT_EQ(out.sequences.size(), 3u);
    for (const SampledSequence& seq : out.sequences) {
      ASSERT_FALSE(seq.tokens.empty());
      const std::vector<float> ref = TrainerLogprobs(kPrompt, seq.tokens, adapter);
      const size_t off = kPrompt.size() - 1;
      ASSERT_EQ(ref.size(), off + seq.tokens.size());
      for (size_t i = 0; i < seq.tokens.size(); ++i)
        EXPECT_NEAR(seq.logprobs[i], ref[off + i], 1e-4) << "token " << i << " adapter '" << adapter << "'";
      // prompt_logprobs: NaN first, then the trainer's.
      ASSERT_TRUE(out.prompt_logprobs.has_value());
      ASSERT_EQ(out.prompt_logprobs->size(), kPrompt.size());
      EXPECT_TRUE(std::isnan((*out.prompt_logprobs)[0]));
      for (size_t t = 1; t < kPrompt.size(); ++t) EXPECT_NEAR((*out.prompt_logprobs)[t], ref[t - 1], 1e-4);
    }
  }
}

TEST(Sampler, TopkPromptLogprobsAreTheBestTokensOfTheFullDistribution) {
  auto s = Open();
  SampleCall c = Call(kPrompt, 1, 0.0, W().adapter2);
  c.topk_prompt_logprobs = 5;
  c.prompt_logprobs = true;
  const SampleOutput out = SampleNow(*s, c);
  ASSERT_EQ(out.topk, 5);
  ASSERT_EQ(out.topk_token_ids.size(), kPrompt.size() * 5);
  for (int j = 0; j < 5; ++j) {
    EXPECT_EQ(out.topk_token_ids[j], 0);
    EXPECT_EQ(out.topk_logprobs[j], SampleOutput::kTopkPad);
  }
  // Full recompute: log_softmax of the adapter's logits at every position.
  const Transformer& m = *W().model;
  SlotBank bank(1, 8, at::kCPU, m.LoraTargets());
  ASSERT_TRUE(LoadPeft(bank, 0, W().adapter2).ok());
  c10::NoGradGuard no_grad;
  const PackedBatch b = PackedBatch::Make({kPrompt}, {0}, at::kCPU);
  const at::Tensor lsm = at::log_softmax(m.Logits(m.Hidden(b, bank), b, bank), -1);
  for (size_t t = 1; t < kPrompt.size(); ++t) {
    const auto [vals, ids] = lsm[t - 1].topk(5);
    for (int j = 0; j < 5; ++j) {
      EXPECT_EQ(out.topk_token_ids[t * 5 + j], ids[j].item<int64_t>()) << t << "," << j;
      EXPECT_NEAR(out.topk_logprobs[t * 5 + j], vals[j].item<float>(), 1e-5);
    }
    // The prompt token's own logprob is at most the best one.
    EXPECT_LE((*out.prompt_logprobs)[t], out.topk_logprobs[t * 5] + 1e-6);
  }
}

// decode_rows counts the sequences of every decode step (bench rl's "rows a
// step" is decode_rows / decode_steps): each sequence's first token comes from
// its prefill, every later one from one decode row.
TEST(Sampler, DecodeRowsCountEachDecodeStepsSequences) {
  auto s = Open();
  SampleCall c = Call(kPrompt, 8, 1.0, W().adapter1, 42);
  c.num_samples = 3;
  const SampleOutput out = SampleNow(*s, c);
  int64_t tokens = 0;
  for (const auto& q : out.sequences) tokens += static_cast<int64_t>(q.tokens.size());
  const SamplerStats st = s->stats();
  EXPECT_EQ(st.tokens_generated, tokens);
  EXPECT_EQ(st.decode_rows, tokens - 3);
  EXPECT_GE(st.decode_rows, st.decode_steps);
  EXPECT_LE(st.decode_rows, 3 * st.decode_steps);
}

TEST(Sampler, SeededSamplingIgnoresBatchNeighbours) {
  auto s = Open();
  SampleCall c = Call(kPrompt, 16, 1.0, W().adapter1, 42);
  c.num_samples = 2;
  const SampleOutput alone = SampleNow(*s, c);
  ASSERT_NE(alone.sequences[0].tokens, alone.sequences[1].tokens) << "samples of one call must differ";
  // The same call, surrounded by other tenants' calls in the same steps.
  std::vector<std::future<Result<SampleOutput>>> others;
  others.push_back(Start(*s, Call({5, 6, 7, 8, 9}, 20, 0.7, W().adapter2, 1)));
  others.push_back(Start(*s, Call({200, 201}, 30, 1.0, "", 2)));
  auto mine = Start(*s, c);
  others.push_back(Start(*s, Call({1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}, 25, 1.0, W().adapter1, 3)));
  Result<SampleOutput> crowded = mine.get();
  for (auto& f : others) ASSERT_TRUE(f.get().ok());
  ASSERT_TRUE(crowded.ok());
  for (int j = 0; j < 2; ++j) {
    EXPECT_EQ(crowded->sequences[j].tokens, alone.sequences[j].tokens) << "sample " << j;
    for (size_t i = 0; i < alone.sequences[j].logprobs.size(); ++i)
      EXPECT_NEAR(crowded->sequences[j].logprobs[i], alone.sequences[j].logprobs[i], 1e-5);
  }
  EXPECT_GE(s->stats().max_rows_in_step, 3);
  // A different seed gives a different draw.
  SampleCall d = c;
  d.params.seed = 43;
  EXPECT_NE(SampleNow(*s, d).sequences[0].tokens, alone.sequences[0].tokens);
}

TEST(Sampler, TopK1AndTinyTopPEqualGreedy) {
  auto s = Open();
  const SampleOutput greedy = SampleNow(*s, Call(kPrompt, 16, 0.0, W().adapter1));
  SampleCall k1 = Call(kPrompt, 16, 1.3, W().adapter1, 9);
  k1.params.top_k = 1;
  SampleCall p0 = Call(kPrompt, 16, 1.0, W().adapter1, 9);
  p0.params.top_p = 1e-6;
  EXPECT_EQ(SampleNow(*s, k1).sequences[0].tokens, greedy.sequences[0].tokens);
  EXPECT_EQ(SampleNow(*s, p0).sequences[0].tokens, greedy.sequences[0].tokens);
  // Logprobs are of the unscaled distribution, whatever the temperature.
  const SampleOutput k1out = SampleNow(*s, k1);
  for (size_t i = 0; i < greedy.sequences[0].logprobs.size(); ++i)
    EXPECT_NEAR(k1out.sequences[0].logprobs[i], greedy.sequences[0].logprobs[i], 1e-6);
  // A plain temperature-1 draw is not greedy (64 tokens over a 512 vocabulary).
  SampleCall free_draw = Call(kPrompt, 16, 1.0, W().adapter1, 9);
  EXPECT_NE(SampleNow(*s, free_draw).sequences[0].tokens, greedy.sequences[0].tokens);
}

TEST(Sampler, StopTokenAndStopStringAreIncluded) {
  auto s = Open();
  const std::vector<int32_t> g = SampleNow(*s, Call(kPrompt, 16, 0.0)).sequences[0].tokens;
  ASSERT_EQ(g.size(), 16u);
  // Stop token: the first occurrence of g[5] ends the sequence, included.
  SampleCall st = Call(kPrompt, 16, 0.0);
  st.params.stop_tokens = {g[5]};
  const size_t first = static_cast<size_t>(std::find(g.begin(), g.end(), g[5]) - g.begin());
  const SampledSequence a = SampleNow(*s, st).sequences[0];
  EXPECT_EQ(a.tokens, std::vector<int32_t>(g.begin(), g.begin() + first + 1));
  EXPECT_EQ(a.stop_reason, SampleStopReason::kStop);
  // Stop string spanning tokens 6 and 7 of the detokenized text.
  auto detok = sample::Detokenizer::Load(W().model_dir + "/tokenizer.json");
  ASSERT_TRUE(detok.ok());
  const std::string t6 = (*detok)->Bytes(g[6]), t7 = (*detok)->Bytes(g[7]);
  ASSERT_FALSE(t6.empty());
  ASSERT_FALSE(t7.empty());
  const std::string stop = t6.substr(t6.size() - 1) + t7.substr(0, 1);
  size_t expect = 0;  // the first prefix of g whose text contains the stop string
  while (expect < g.size() &&
         (*detok)->Decode(std::vector<int32_t>(g.begin(), g.begin() + expect + 1)).find(stop) == std::string::npos)
    ++expect;
  ASSERT_LE(expect, 7u);
  SampleCall ss = Call(kPrompt, 16, 0.0);
  ss.params.stop_strings = {stop};
  const SampledSequence b = SampleNow(*s, ss).sequences[0];
  EXPECT_EQ(b.tokens, std::vector<int32_t>(g.begin(), g.begin() + expect + 1));
  EXPECT_EQ(b.stop_reason, SampleStopReason::kStop);
  // max_tokens 0: nothing generated, length.
  const SampledSequence z = SampleNow(*s, Call(kPrompt, 0, 0.0)).sequences[0];
  EXPECT_TRUE(z.tokens.empty());
  EXPECT_EQ(z.stop_reason, SampleStopReason::kLength);
}

TEST(Sampler, EosStops) {
  // Make EOS the greedy choice's token: stop tokens and EOS behave alike, so
  // check via info() that generation_config's EOS is known, and that a
  // stop token equal to the first greedy token yields exactly one token.
  auto s = Open();
  ASSERT_EQ(s->info().eos_token_ids, std::vector<int32_t>{511});
  const std::vector<int32_t> g = SampleNow(*s, Call(kPrompt, 4, 0.0)).sequences[0].tokens;
  SampleCall c = Call(kPrompt, 4, 0.0);
  c.params.stop_tokens = {g[0]};
  const SampledSequence one = SampleNow(*s, c).sequences[0];
  EXPECT_EQ(one.tokens.size(), 1u);
  EXPECT_EQ(one.stop_reason, SampleStopReason::kStop);
}

TEST(Sampler, NumSamplesShareOnePrefill) {
  // 21 prompt tokens with 16-token blocks: the forks share one full block
  // and copy the partial one. Greedy samples must all equal the solo run.
  SamplerOptions o;
  o.block_size = 16;
  auto s = Open(o);
  std::vector<int32_t> prompt;
  for (int i = 0; i < 21; ++i) prompt.push_back((i * 37 + 11) % 500);
  const SampleOutput solo = SampleNow(*s, Call(prompt, 18, 0.0, W().adapter2));
  const int64_t prefills = s->stats().prefill_steps;
  SampleCall c = Call(prompt, 18, 0.0, W().adapter2);
  c.num_samples = 4;
  const SampleOutput many = SampleNow(*s, c);
  EXPECT_EQ(s->stats().prefill_steps, prefills + 1);
  ASSERT_EQ(many.sequences.size(), 4u);
  for (const auto& seq : many.sequences) EXPECT_EQ(seq.tokens, solo.sequences[0].tokens);
  EXPECT_EQ(s->stats().kv_blocks_free, s->info().kv_blocks);
}

TEST(Sampler, TwoAdaptersInOneDecodeStepEachEqualTheirSoloRun) {
  auto s = Open();
  const SampleOutput solo1 = SampleNow(*s, Call(kPrompt, 24, 1.0, W().adapter1, 5));
  const SampleOutput solo2 = SampleNow(*s, Call(kPrompt, 24, 1.0, W().adapter2, 5));
  const SampleOutput solo0 = SampleNow(*s, Call(kPrompt, 24, 1.0, "", 5));
  auto f1 = Start(*s, Call(kPrompt, 24, 1.0, W().adapter1, 5));
  auto f2 = Start(*s, Call(kPrompt, 24, 1.0, W().adapter2, 5));
  auto f0 = Start(*s, Call(kPrompt, 24, 1.0, "", 5));
  auto r1 = f1.get(), r2 = f2.get(), r0 = f0.get();
  ASSERT_TRUE(r1.ok() && r2.ok() && r0.ok());
  EXPECT_EQ(r1->sequences[0].tokens, solo1.sequences[0].tokens);
  EXPECT_EQ(r2->sequences[0].tokens, solo2.sequences[0].tokens);
  EXPECT_EQ(r0->sequences[0].tokens, solo0.sequences[0].tokens);
  EXPECT_NE(solo1.sequences[0].tokens, solo2.sequences[0].tokens) << "the adapters must matter";
  EXPECT_GE(s->stats().max_adapters_in_step, 2);
}

TEST(Sampler, TheStartUpProbeOfItsLargestStepsLeavesNoTrace) {
  // The probe (on the CPU only when asked) prefills into free KV blocks and
  // decodes max_batch_rows rows through a scratch adapter in slot 0; after
  // it every block and slot is free and sampling is unchanged.
  SamplerOptions probed;
  probed.probe_steps = true;
  probed.max_prefill_tokens = 48;
  probed.max_batch_rows = 8;
  SamplerOptions plain = probed;
  plain.probe_steps = false;
  auto p = Open(probed), q = Open(plain);
  EXPECT_EQ(p->info().probe_prefill_tokens, 48);
  EXPECT_EQ(p->info().probe_decode_rows, 8);
  EXPECT_EQ(q->info().probe_prefill_tokens, 0);
  ASSERT_NE(p->device_reserve(), nullptr);
  EXPECT_EQ(p->device_reserve()->bytes.load(), 0) << "nothing is measured on the CPU";
  const SamplerStats fresh = p->stats();
  EXPECT_EQ(fresh.kv_blocks_free, p->info().kv_blocks);
  EXPECT_EQ(fresh.kv_blocks_cached, 0);
  EXPECT_EQ(fresh.requests_done + fresh.prefill_steps + fresh.decode_steps, 0);
  for (const std::string& adapter : {W().adapter1, std::string()}) {
    const SampleOutput a = SampleNow(*p, Call(kPrompt, 24, 1.0, adapter, 5));
    const SampleOutput b = SampleNow(*q, Call(kPrompt, 24, 1.0, adapter, 5));
    EXPECT_EQ(a.sequences[0].tokens, b.sequences[0].tokens) << adapter;
    EXPECT_EQ(a.sequences[0].logprobs, b.sequences[0].logprobs) << adapter;
  }
}

TEST(DeviceTurns, TurnsAreTakenInArrivalOrder) {
  DeviceTurns turns;
  DeviceTurns::Turn first = turns.Take();
  EXPECT_FALSE(turns.contended());
  std::vector<int> order;
  std::mutex mu;
  std::vector<std::thread> waiters;
  for (int i = 0; i < 3; ++i) {
    waiters.emplace_back([&, i] {
      DeviceTurns::Turn t = turns.Take();
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
    });
    // Each waiter queued before the next starts.
    while (turns.waiting() < i + 1) std::this_thread::yield();
  }
  EXPECT_TRUE(turns.contended());
  first.Release();
  for (auto& w : waiters) w.join();
  EXPECT_EQ(order, (std::vector<int>{0, 1, 2}));
  EXPECT_FALSE(turns.contended());
}

TEST(Sampler, InTurnsItRunsNoStepWhileAnotherHoldsTheDevice) {
  // --device-turn-ms: the trainer's pass holds a turn; the sampler's steps
  // wait for it, and a running request gives its turn up within the
  // turn's time once a pass waits.
  SamplerOptions o;
  o.device_turn = std::chrono::milliseconds(1);
  auto s = Open(o);
  ASSERT_NE(s->device_reserve(), nullptr);
  const std::shared_ptr<DeviceTurns> turns = s->device_reserve()->turns;
  ASSERT_NE(turns, nullptr);
  const auto steps = [&] { return s->stats().decode_steps + s->stats().prefill_steps; };
  {
    DeviceTurns::Turn pass = turns->Take();
    auto f = Start(*s, Call(kPrompt, 8, 0.0));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(steps(), 0) << "a step ran during another's turn";
    pass.Release();
    ASSERT_TRUE(f.get().ok());
  }
  auto f = Start(*s, Call(kPrompt, 400, 0.0));
  while (steps() < 3) std::this_thread::yield();
  {
    DeviceTurns::Turn pass = turns->Take();  // granted once the sampler's turn ends
    const int64_t during = steps();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_EQ(steps(), during);
  }
  Result<SampleOutput> r = f.get();
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->sequences[0].tokens.size(), 400u);
}

TEST(Sampler, EvictedAdapterReloadsWithUnchangedResults) {
  SamplerOptions two;
  two.sampler_adapters = 2;
  auto ref = Open(two);
  const SampleOutput a = SampleNow(*ref, Call(kPrompt, 12, 1.0, W().adapter1, 8));
  const SampleOutput b = SampleNow(*ref, Call(kPrompt, 12, 1.0, W().adapter2, 8));
  SamplerOptions one;
  one.sampler_adapters = 1;
  auto s = Open(one);
  for (int round = 0; round < 2; ++round) {
    EXPECT_EQ(SampleNow(*s, Call(kPrompt, 12, 1.0, W().adapter1, 8)).sequences[0].tokens, a.sequences[0].tokens);
    EXPECT_EQ(SampleNow(*s, Call(kPrompt, 12, 1.0, W().adapter2, 8)).sequences[0].tokens, b.sequences[0].tokens);
  }
  EXPECT_EQ(s->stats().adapter_loads, 4);
  EXPECT_EQ(s->stats().adapter_evictions, 3);
  // Both at once with one slot: the second waits for the first, then runs.
  auto f1 = Start(*s, Call(kPrompt, 12, 1.0, W().adapter1, 8));
  auto f2 = Start(*s, Call(kPrompt, 12, 1.0, W().adapter2, 8));
  auto r1 = f1.get(), r2 = f2.get();
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_EQ(r1->sequences[0].tokens, a.sequences[0].tokens);
  EXPECT_EQ(r2->sequences[0].tokens, b.sequences[0].tokens);
  // A snapshot that does not exist is an error, not a hang.
  const auto missing = Start(*s, Call(kPrompt, 4, 0.0, W().root + "/nope")).get();
  EXPECT_FALSE(missing.ok());
}

// A trainer's snapshot of a directory's adapter, offered to the sampler.
std::shared_ptr<const PeftSnapshot> SnapshotOf(const std::string& dir) {
  SlotBank trainer(1, 8, at::kCPU, W().model->LoraTargets());
  EXPECT_TRUE(LoadPeft(trainer, 0, dir).ok());
  auto snapshot = PeftSnapshot::Take(trainer, 0);
  EXPECT_TRUE(snapshot.ok()) << snapshot.status().message();
  return snapshot.ok() ? *snapshot : nullptr;
}

// A copy of adapter1's directory under dir.
void CopyAdapter(const std::string& dir) {
  std::filesystem::create_directories(dir);
  for (const char* f : {"adapter_config.json", "adapter_model.safetensors"})
    std::filesystem::copy_file(W().adapter1 + "/" + f, dir + "/" + f,
                               std::filesystem::copy_options::overwrite_existing);
}

TEST(Sampler, AnOfferedSnapshotIsInstalledWithoutReadingTheFiles) {
  const SampleCall from_disk = Call(kPrompt, 12, 1.0, W().adapter1, 21);
  const SampleOutput want = SampleNow(*Open(), from_disk);
  const std::string dir = W().root + "/offered";
  CopyAdapter(dir);
  auto s = Open();
  s->Offer(dir + "/", SnapshotOf(dir));  // another spelling of the same directory
  // The weights file is gone: only the offer can serve the sample.
  std::filesystem::remove(dir + "/adapter_model.safetensors");
  SampleCall call = from_disk;
  call.adapter_dir = dir;
  const SampleOutput got = SampleNow(*s, call);
  ASSERT_EQ(got.sequences.size(), 1u);
  // The same values in the same kernels: the same bits as the disk's copy.
  EXPECT_EQ(got.sequences[0].tokens, want.sequences[0].tokens);
  EXPECT_EQ(got.sequences[0].logprobs, want.sequences[0].logprobs);
  SampleNow(*s, call);  // resident now: neither installed nor loaded again
  EXPECT_EQ(s->stats().adapter_installs, 1);
  EXPECT_EQ(s->stats().adapter_loads, 0);
}

TEST(Sampler, OffersBeyondTheAdapterSlotsDropTheOldest) {
  SamplerOptions two;
  two.sampler_adapters = 2;
  auto s = Open(two);
  std::vector<std::string> dirs;
  for (int i = 0; i < 3; ++i) {
    dirs.push_back(W().root + "/offer" + std::to_string(i));
    CopyAdapter(dirs.back());
    s->Offer(dirs.back(), SnapshotOf(dirs.back()));
  }
  SampleNow(*s, Call(kPrompt, 2, 0.0, dirs[2]));
  EXPECT_EQ(s->stats().adapter_installs, 1);
  SampleNow(*s, Call(kPrompt, 2, 0.0, dirs[0]));  // dropped: from disk
  EXPECT_EQ(s->stats().adapter_loads, 1);
  EXPECT_EQ(s->stats().adapter_installs, 1);
}

// An ephemeral sampler's call carries its weights (SampleCall::snapshot)
// under a key that names no directory: installed from the call, never read
// from disk, the same tokens as the directory's copy; evicted, the call's
// snapshot installs it again.
TEST(Sampler, ACallsOwnSnapshotIsInstalledUnderAKeyThatNamesNoDirectory) {
  const SampleCall from_disk = Call(kPrompt, 12, 1.0, W().adapter1, 21);
  const SampleOutput want = SampleNow(*Open(), from_disk);
  SamplerOptions two;
  two.sampler_adapters = 2;
  auto s = Open(two);
  EXPECT_TRUE(s->SamplesFromMemory());
  SampleCall call = from_disk;
  call.adapter_dir = "snapshot:future-1";
  call.snapshot = SnapshotOf(W().adapter1);
  EXPECT_TRUE(s->Validate(call).ok());
  SampleCall without = call;
  without.snapshot.reset();
  EXPECT_EQ(s->Validate(without).code(), Code::kNotFound);  // no such directory, no weights
  const SampleOutput got = SampleNow(*s, call);
  ASSERT_EQ(got.sequences.size(), 1u);
  EXPECT_EQ(got.sequences[0].tokens, want.sequences[0].tokens);
  EXPECT_EQ(got.sequences[0].logprobs, want.sequences[0].logprobs);
  EXPECT_EQ(s->stats().adapter_installs, 1);
  // Two other adapters evict it; the call's snapshot brings it back.
  SampleNow(*s, Call(kPrompt, 2, 0.0, W().adapter1));
  SampleNow(*s, Call(kPrompt, 2, 0.0, W().adapter2));
  EXPECT_EQ(SampleNow(*s, call).sequences[0].tokens, want.sequences[0].tokens);
  EXPECT_EQ(s->stats().adapter_installs, 2);
  EXPECT_EQ(s->stats().adapter_loads, 2);  // adapter1 and adapter2 from their directories
}

TEST(Sampler, ContextWindowAndInputErrors) {
  SamplerOptions o;
  o.context_window = 64;
  auto s = Open(o);
  std::vector<int32_t> prompt(60, 7);
  const Status over = s->Validate(Call(prompt, 10, 0.0));
  EXPECT_EQ(over.code(), Code::kInvalidArgument);
  EXPECT_NE(over.message().find("60"), std::string::npos) << over.message();
  EXPECT_NE(over.message().find("10"), std::string::npos) << over.message();
  EXPECT_NE(over.message().find("64"), std::string::npos) << over.message();
  EXPECT_TRUE(s->Validate(Call(prompt, 4, 0.0)).ok());
  // Submit reports the same error through the callback.
  EXPECT_EQ(Start(*s, Call(prompt, 10, 0.0)).get().status().code(), Code::kInvalidArgument);
  EXPECT_NE(s->Validate(Call({1, 512}, 4, 0.0)).message().find("vocabulary"), std::string::npos);
  EXPECT_FALSE(s->Validate(Call({}, 4, 0.0)).ok());
  SampleCall bad_k = Call({1, 2}, 4, 1.0);
  bad_k.params.top_k = 0;
  EXPECT_NE(s->Validate(bad_k).message().find("top_k"), std::string::npos);
  SampleCall bad_p = Call({1, 2}, 4, 1.0);
  bad_p.params.top_p = 0;
  EXPECT_NE(s->Validate(bad_p).message().find("top_p"), std::string::npos);
  // Unset max_tokens fills the window.
  SampleCall fill = Call(std::vector<int32_t>(60, 7), 0, 0.0);
  fill.params.max_tokens.reset();
  const SampleOutput out = SampleNow(*s, fill);
  EXPECT_LE(out.sequences[0].tokens.size(), 4u);
  // Stop strings need a tokenizer.json.
  SamplerOptions bare;
  bare.model_dir = W().root;  // no tokenizer.json there
  auto no_tok = Open(bare);
  SampleCall ss = Call({1, 2}, 4, 0.0);
  ss.params.stop_strings = {"ab"};
  EXPECT_NE(no_tok->Validate(ss).message().find("stop strings need tokenizer.json"), std::string::npos);
}

// A KV cache the machine cannot hold is refused at Open, naming the flag
// and both sizes, before anything is allocated (on the CPU against the host's
// available memory, on CUDA against the device's free memory).
TEST(Sampler, AKvCacheBeyondTheMemoryIsRefusedAtOpen) {
  SamplerOptions o;
  o.model_dir = W().model_dir;
  o.max_rank = 8;
  o.kv_budget_tokens = int64_t{1} << 40;  // terabytes of KV even for the tiny model
  auto s = Sampler::Open(W().model, o);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.status().code(), Code::kInvalidArgument);
  EXPECT_NE(s.status().message().find("--kv-budget-tokens"), std::string::npos) << s.status().message();
  EXPECT_NE(s.status().message().find("MiB are left for it"), std::string::npos) << s.status().message();
  EXPECT_EQ(s.status().message().find("recurrent states"), std::string::npos) << s.status().message();  // none here
  o.kv_budget_tokens = 4096;
  EXPECT_TRUE(Sampler::Open(W().model, o).ok());
}

TEST(Sampler, AdmissionControlQueuesUntilKvBlocksFree) {
  // 4 blocks of 16 tokens; each call needs 2 (8 prompt + 16 new - 1 = 23 positions).
  SamplerOptions o;
  o.kv_budget_tokens = 64;
  o.block_size = 16;
  auto s = Open(o);
  EXPECT_EQ(s->info().kv_blocks, 4);
  std::vector<int32_t> prompt = {10, 20, 30, 40, 50, 60, 70, 80};
  const SampleOutput solo = SampleNow(*s, Call(prompt, 16, 0.0, W().adapter1));
  std::vector<std::future<Result<SampleOutput>>> fs;
  for (int i = 0; i < 5; ++i) fs.push_back(Start(*s, Call(prompt, 16, 0.0, W().adapter1)));
  for (auto& f : fs) {
    auto r = f.get();
    ASSERT_TRUE(r.ok()) << r.status().message();
    EXPECT_EQ(r->sequences[0].tokens, solo.sequences[0].tokens);
  }
  EXPECT_GE(s->stats().admission_waits, 1);
  EXPECT_LE(s->stats().max_rows_in_step, 2);
  EXPECT_EQ(s->stats().kv_blocks_free, 4);
  // A call that can never fit is refused up front.
  SampleCall huge = Call(prompt, 100, 0.0);
  EXPECT_NE(s->Validate(huge).message().find("KV budget"), std::string::npos);
}

TEST(Sampler, CancelDropsASessionsQueuedAndRunningCallsAndFreesTheirBlocks) {
  SamplerOptions o;
  o.max_batch_rows = 2;
  auto s = Open(o);
  const int64_t long_tokens = s->info().context_window - static_cast<int64_t>(kPrompt.size());
  auto in = [](SampleCall c, const std::string& session) {
    c.tenant = "t";
    c.session = session;
    return c;
  };
  std::vector<std::future<Result<SampleOutput>>> doomed;
  for (int i = 0; i < 4; ++i) doomed.push_back(Start(*s, in(Call(kPrompt, long_tokens, 1.0, "", i), "t:sample:0")));
  // Two run (the batch holds 2 rows), two wait.
  while (s->stats().decode_steps == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  auto other = Start(*s, in(Call(kPrompt, 8, 0.0), "t:sample:1"));
  s->Cancel("t:sample:0", Status::Precondition("session expired (test)"));
  for (auto& f : doomed) {
    auto r = f.get();
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kFailedPrecondition);
    EXPECT_EQ(r.status().message(), "session expired (test)");
  }
  EXPECT_TRUE(other.get().ok());
  const SamplerStats st = s->stats();
  EXPECT_EQ(st.requests_cancelled, 4);
  EXPECT_EQ(st.kv_blocks_free, s->info().kv_blocks);
  EXPECT_EQ(st.requests_waiting, 0);
  EXPECT_LT(st.tokens_generated, 4 * long_tokens);  // they did not run to the end
  // Sticky: the session's later calls fail at once.
  auto late = Start(*s, in(Call(kPrompt, 4, 0.0), "t:sample:0")).get();
  EXPECT_EQ(late.status().message(), "session expired (test)");
}

// Requests submitted a few ms apart to an idle sampler: with an admission
// window they share one prefill; without, the first arrival starts alone
// (which is what makes the first test able to fail).
int64_t PrefillsForSpacedArrivals(std::chrono::microseconds window) {
  SamplerOptions o;
  o.admission_window = window;
  auto s = Open(o);
  std::vector<std::future<Result<SampleOutput>>> fs;
  for (int i = 0; i < 5; ++i) {
    if (i > 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
    fs.push_back(Start(*s, Call(kPrompt, 24, 0.0)));
  }
  for (auto& f : fs) EXPECT_TRUE(f.get().ok());
  return s->stats().prefill_steps;
}

TEST(Sampler, AdmissionWindowGivesRequestsSentTogetherOnePrefill) {
  EXPECT_EQ(PrefillsForSpacedArrivals(std::chrono::milliseconds(100)), 1);
}

TEST(Sampler, WithoutAdmissionWindowTheFirstArrivalPrefillsAlone) {
  EXPECT_GT(PrefillsForSpacedArrivals(std::chrono::microseconds(0)), 1);
}

TEST(Sampler, LoraMathModelRunsTheAdapterInTheModelDtype) {
  // --sampler-lora-math: a bf16 model's adapter in bf16 (the trainer's way,
  // the default) or in fp32 (PEFT's). Both are within bf16 rounding of the
  // fp32 model; they differ from each other only where an adapter applies;
  // in the model's dtype the prompt's logprobs are the trainer forward's
  // (bf16 LoRA, EngineOptions' default), which fp32 arithmetic is not.
  auto bf16 = Transformer::Load(W().model_dir, at::kCPU, at::kBFloat16);
  ASSERT_TRUE(bf16.ok()) << bf16.status().message();
  const std::shared_ptr<const Transformer> model(std::move(bf16.value()));
  auto open = [&](bool lora_fp32) {
    SamplerOptions o;
    o.decode.lora_fp32 = lora_fp32;
    return Open(o, model);
  };
  auto fp32_math = open(true), model_math = open(false);
  auto reference = Open();  // the fp32 model
  auto prompt_logprobs = [](Sampler& s, const std::string& adapter) {
    SampleCall c = Call(kPrompt, 1, 0.0, adapter);
    c.prompt_logprobs = true;
    const SampleOutput out = SampleNow(s, c);
    EXPECT_TRUE(out.prompt_logprobs.has_value());
    return out.prompt_logprobs.value_or(std::vector<float>{});
  };
  for (const std::string& adapter : {std::string(), W().adapter2}) {
    const std::vector<float> ref = prompt_logprobs(*reference, adapter);
    const std::vector<float> a = prompt_logprobs(*fp32_math, adapter);
    const std::vector<float> b = prompt_logprobs(*model_math, adapter);
    ASSERT_EQ(a.size(), kPrompt.size());
    ASSERT_EQ(b.size(), kPrompt.size());
    const std::vector<float> tr = TrainerLogprobs(kPrompt, {}, adapter, model.get());  // [t - 1]: token t's
    ASSERT_EQ(tr.size(), kPrompt.size() - 1);
    double ta = 0, tb = 0;
    for (size_t t = 1; t < kPrompt.size(); ++t) {
      ta = std::max(ta, static_cast<double>(std::abs(a[t] - tr[t - 1])));
      tb = std::max(tb, static_cast<double>(std::abs(b[t] - tr[t - 1])));
    }
    std::printf("adapter '%s': |sampler - trainer| prompt logprobs: fp32 math %.3g, model math %.3g\n",
                adapter.c_str(), ta, tb);
    EXPECT_LE(tb, 1e-3) << "model math is the trainer's, adapter '" << adapter << "'";  // 0 measured
    if (!adapter.empty()) EXPECT_GT(ta, 10 * tb) << "fp32 math is not";                  // 0.032 measured
    double apart = 0;
    for (size_t t = 1; t < kPrompt.size(); ++t) {
      EXPECT_NEAR(a[t], ref[t], 0.15) << "fp32 math, token " << t << " adapter '" << adapter << "'";
      EXPECT_NEAR(b[t], ref[t], 0.15) << "model math, token " << t << " adapter '" << adapter << "'";
      apart = std::max(apart, static_cast<double>(std::abs(a[t] - b[t])));
    }
    if (adapter.empty())
      EXPECT_EQ(apart, 0.0) << "without an adapter the setting changes nothing";
    else
      EXPECT_GT(apart, 0.0) << "the setting reaches the adapter's arithmetic";
  }
}

}  // namespace
}  // namespace loom::engine
