// `loom forward`: runs the transformer once over a packed batch and prints
// the log-probability of every token given the tokens before it in its own
// sequence (a debugging aid; compare with HF transformers on the same ids).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "cli/commands.h"
#include "engine/io/peft.h"
#include "engine/model/transformer.h"

namespace loom::cli {
namespace {

// "1,2,3;4,5" -> {{1,2,3},{4,5}}. Every id must be in [0, vocab).
Result<std::vector<std::vector<int32_t>>> ParseTokens(const std::string& text, int64_t vocab) {
  std::vector<std::vector<int32_t>> seqs(1);
  std::string number;
  auto flush = [&]() -> Status {
    if (number.empty()) return Status::Ok();
    size_t used = 0;
    long long id = -1;
    try {
      id = std::stoll(number, &used);
    } catch (...) {
      used = 0;
    }
    if (used != number.size()) return Status::Invalid("--tokens: '" + number + "' is not an integer");
    if (id < 0 || id >= vocab)
      return Status::Invalid("--tokens: id " + number + " is outside the vocabulary [0, " + std::to_string(vocab) +
                             ")");
    seqs.back().push_back(static_cast<int32_t>(id));
    number.clear();
    return Status::Ok();
  };
  for (char c : text) {
    if (c == ',' || c == ';' || c == ' ') {
      if (Status s = flush(); !s.ok()) return s;
      if (c == ';') seqs.emplace_back();
    } else {
      number.push_back(c);
    }
  }
  if (Status s = flush(); !s.ok()) return s;
  for (size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].empty()) return Status::Invalid("--tokens: sequence " + std::to_string(i) + " is empty");
  return seqs;
}

int Fail(const Status& s) {
  std::fprintf(stderr, "loom forward: %s\n", s.message().c_str());
  return 2;
}

}  // namespace

int Forward(int argc, char** argv) {
  CLI::App app{"Print per-token logprobs of the base model (or one PEFT adapter) on packed sequences",
               "loom forward"};
  std::string model_dir, tokens_text, device_name = "auto", dtype_name = "auto", attention = "auto", adapter;
  int threads = 0;
  app.add_option("--model", model_dir, "model directory (config.json + safetensors)")->required();
  app.add_option("--tokens", tokens_text, "token ids: '1,2,3' or several sequences '1,2,3;4,5'")->required();
  app.add_option("--threads", threads, "CPU intra-op threads (0 = all cores)")->default_val(0);
  app.add_option("--device", device_name, "auto | cpu | cuda")->default_val("auto");
  app.add_option("--dtype", dtype_name, "auto (bf16 on cuda, fp32 on cpu) | fp32 | bf16")->default_val("auto");
  app.add_option("--attention", attention, "auto | math | sdpa")->default_val("auto");
  app.add_option("--adapter", adapter, "PEFT adapter directory applied to every sequence");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  at::set_num_threads(threads > 0 ? threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  if (device_name == "auto") device_name = at::hasCUDA() ? "cuda" : "cpu";
  if (device_name != "cpu" && device_name != "cuda") return Fail(Status::Invalid("--device must be auto, cpu or cuda"));
  if (device_name == "cuda" && !at::hasCUDA()) return Fail(Status::Invalid("--device cuda: no CUDA device"));
  const at::Device device = device_name == "cuda" ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  if (dtype_name == "auto") dtype_name = device_name == "cuda" ? "bf16" : "fp32";
  if (dtype_name != "fp32" && dtype_name != "bf16") return Fail(Status::Invalid("--dtype must be auto, fp32 or bf16"));
  const at::ScalarType dtype = dtype_name == "bf16" ? at::kBFloat16 : at::kFloat;

  const auto t0 = std::chrono::steady_clock::now();
  auto model = engine::Transformer::Load(model_dir, device, dtype);
  if (!model.ok()) return Fail(model.status());
  if (attention == "math") (*model)->set_attention_kernel(engine::AttentionKernel::kMath);
  else if (attention == "sdpa") (*model)->set_attention_kernel(engine::AttentionKernel::kSdpa);
  else if (attention != "auto") return Fail(Status::Invalid("--attention must be auto, math or sdpa"));
  auto seqs = ParseTokens(tokens_text, (*model)->config().vocab_size);
  if (!seqs.ok()) return Fail(seqs.status());

  engine::SlotBank bank(1, 128, device, (*model)->LoraTargets());
  int slot = -1;
  if (!adapter.empty()) {
    if (Status s = engine::LoadPeft(bank, 0, adapter); !s.ok()) return Fail(s);
    slot = 0;
  }
  const auto t1 = std::chrono::steady_clock::now();

  // Position t predicts token t+1 of its own sequence; the last position's
  // target is a placeholder (0) and is not printed.
  std::vector<int64_t> targets;
  for (const auto& s : *seqs)
    for (size_t i = 0; i < s.size(); ++i) targets.push_back(i + 1 < s.size() ? s[i + 1] : 0);
  c10::NoGradGuard no_grad;
  const engine::PackedBatch batch =
      engine::PackedBatch::Make(*seqs, std::vector<int>(seqs->size(), slot), device);
  const at::Tensor hidden = (*model)->Hidden(batch, bank);
  const at::Tensor lp =
      (*model)->TargetLogprobs(hidden, at::tensor(targets, at::TensorOptions().dtype(at::kLong)).to(device), batch, bank)
          .to(at::kCPU)
          .contiguous();
  const auto t2 = std::chrono::steady_clock::now();

  const float* v = lp.data_ptr<float>();
  std::printf("seq\tpos\ttoken\tlogprob\n");
  double total = 0;
  int64_t counted = 0;
  for (size_t s = 0; s < seqs->size(); ++s) {
    const auto& seq = (*seqs)[s];
    const int64_t begin = batch.seq_begin[s];
    std::printf("%zu\t0\t%d\t-\n", s, seq[0]);
    for (size_t i = 1; i < seq.size(); ++i) {
      const float x = v[begin + static_cast<int64_t>(i) - 1];
      total += x;
      ++counted;
      std::printf("%zu\t%zu\t%d\t%.6f\n", s, i, seq[i], x);
    }
  }
  auto ms = [](auto a, auto b) { return std::chrono::duration<double, std::milli>(b - a).count(); };
  std::fprintf(stderr, "%s %s %s, %d threads: load %.1f ms, forward %.1f ms, %lld tokens, mean logprob %.6f\n",
               (*model)->config().model_type.c_str(), device_name.c_str(), dtype_name.c_str(), at::get_num_threads(),
               ms(t0, t1), ms(t1, t2), static_cast<long long>(batch.num_tokens()),
               counted ? total / static_cast<double>(counted) : 0.0);
  return 0;
}

}  // namespace loom::cli
