// Adapters in and out of a real store and the real binary (embedded tiny
// qwen3, CPU, fp32):
//  - `loom import-adapter` of a snapshot loom wrote (a short training)
//    makes checkpoints another tenant owns: the sampler path samples the
//    original's prompt logprobs, the state path loads
//    (create_training_client_from_state: weights_info, create_model,
//    load_weights with the optimizer) into a trainer that gives them too and
//    trains on; a third tenant gets 404;
//  - an adapter of alpha 64 imported into a server of alpha 32 samples as
//    `loom forward --adapter` of the file (its B rescaled, the delta kept);
//  - bad adapters (rank over --max-rank, an unknown module, a wrong shape,
//    another base model) fail naming the field and the limit, and leave
//    every file of the store as it was;
//  - `loom export --format merged`: `loom forward` on the merged directory
//    prints base+adapter's logprobs (`loom forward --adapter`), 1e-4;
//    `--format vllm` refuses the trained lm_head unless --drop-lm-head.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "serve_process.h"
#include "tenant_client.h"

namespace loom {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

const std::vector<int32_t> kProbe = {7, 11, 13, 19, 23, 31, 37, 43};

struct Ran {
  int code = -1;
  std::string out;  // stdout and stderr
};
Ran RunLoom(const std::string& args) {
  Ran r;
  FILE* p = ::popen((std::string(LOOM_BINARY) + " " + args + " 2>&1").c_str(), "r");
  if (p == nullptr) return r;
  char buf[4096];
  for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) r.out.append(buf, n);
  const int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

// Every file under dir with its size and modification time.
std::map<std::string, std::pair<uintmax_t, fs::file_time_type>> Files(const std::string& dir) {
  std::map<std::string, std::pair<uintmax_t, fs::file_time_type>> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    out[e.path().string()] = {e.is_regular_file() ? e.file_size() : 0, e.last_write_time()};
  return out;
}

Json ReadJson(const fs::path& path) {
  std::ifstream in(path);
  return Json::parse(in, nullptr, false);
}
void WriteJson(const fs::path& path, const Json& j) { std::ofstream(path) << j.dump(2); }

// The logprob column of `loom forward`'s table.
std::vector<float> ForwardLogprobs(const std::string& args) {
  const Ran r = RunLoom("forward --device cpu --threads 1 " + args);
  EXPECT_EQ(r.code, 0) << r.out;
  std::vector<float> lp;
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {  // rows: seq \t pos \t token \t logprob
    std::vector<std::string> cols;
    std::istringstream fields(line);
    for (std::string f; std::getline(fields, f, '\t');) cols.push_back(f);
    if (cols.size() == 4 && cols[3] != "-" && cols[3] != "logprob") lp.push_back(std::stof(cols[3]));
  }
  return lp;
}

void ExpectNear(const std::vector<float>& got, const std::vector<float>& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], tol) << what << " position " << i;
}

TEST(AdaptersIo, ImportedSnapshotSamplesAndTrainsAsTheOriginalAndExportsMerge) {
  const std::string data_dir = (fs::temp_directory_path() / ("loom_adapters_io_" + std::to_string(::getpid()))).string();
  fs::remove_all(data_dir);
  const std::vector<std::string> flags = {"--max-adapters", "2", "--max-rank", "8"};
  const std::vector<int32_t> probe_in(kProbe.begin(), kProbe.end() - 1);
  const std::vector<int64_t> probe_targets(kProbe.begin() + 1, kProbe.end());
  std::vector<float> original;  // the sampler's prompt logprobs of the trained snapshot
  std::string snapshot;         // its directory
  {
    test::ServeProcess server(data_dir, flags);
    ASSERT_NE(server.port(), 0) << "no listening banner: " << server.banner();
    test::TenantClient c(server.port(), "tml-trainer");
    c.Start();
    c.TrainStep(1);
    c.TrainStep(2);
    const std::string path = c.Result(c.SubmitSave("v1")).value("path", "");
    ASSERT_NE(path.find("/sampler_weights/v1"), std::string::npos) << path;
    original = c.PromptLogprobs(c.SamplingOn(path), kProbe);
    EXPECT_EQ(server.Terminate(), 0);
  }
  for (const auto& e : fs::recursive_directory_iterator(data_dir + "/runs"))
    if (e.is_directory() && e.path().filename() == "v1") snapshot = e.path().string();
  ASSERT_FALSE(snapshot.empty());
  const std::string import = "import-adapter --store " + data_dir + " --max-rank 8 --tenant tml-importer --adapter ";

  // Refused adapters: each names the field and the limit; the store is untouched.
  const auto before = Files(data_dir);
  const auto refused = [&](const std::string& why, const std::function<void(const fs::path&)>& spoil,
                           const std::string& message) {
    const fs::path bad = fs::path(data_dir).parent_path() / ("loom_bad_adapter_" + std::to_string(::getpid()));
    fs::remove_all(bad);
    fs::copy(snapshot, bad);
    spoil(bad);
    const Ran r = RunLoom(import + bad.string());
    EXPECT_EQ(r.code, 2) << why << ": " << r.out;
    EXPECT_NE(r.out.find(message), std::string::npos) << why << ": " << r.out;
    fs::remove_all(bad);
  };
  const auto edit = [](const std::function<void(Json&)>& change) {
    return [change](const fs::path& dir) {
      Json config = ReadJson(dir / "adapter_config.json");
      change(config);
      WriteJson(dir / "adapter_config.json", config);
    };
  };
  refused("rank too high", edit([](Json& j) { j["r"] = 16; }), "r 16 must be in [1, 8]");
  refused("unknown module", edit([](Json& j) { j["target_modules"].push_back("embed_tokens"); }),
          "target_modules names 'embed_tokens', which loom does not adapt");
  refused("wrong shape", edit([](Json& j) { j["r"] = 2; }), "has shape [4, 64], expected [2, 64]");
  refused("another base", edit([](Json& j) { j["base_model_name_or_path"] = "Qwen/Qwen3-4B"; }),
          "base_model_name_or_path 'Qwen/Qwen3-4B' is not the served model 'loom/tiny-qwen3'");
  EXPECT_EQ(Files(data_dir), before) << "a refused import must leave the store as it was";

  // An adapter of another alpha is stored at the server's (32), its delta kept.
  const std::string alpha64 = data_dir + "-alpha64";
  fs::remove_all(alpha64);
  fs::copy(snapshot, alpha64);
  edit([](Json& j) { j["lora_alpha"] = 64; })(alpha64);
  const Ran doubled = RunLoom(import + alpha64 + " --name doubled");
  ASSERT_EQ(doubled.code, 0) << doubled.out;
  const std::string doubled_path = Json::parse(doubled.out, nullptr, false).value("sampler_path", "");

  const Ran imported = RunLoom(import + snapshot + " --name imported");
  ASSERT_EQ(imported.code, 0) << imported.out;
  const Json paths = Json::parse(imported.out, nullptr, false);
  ASSERT_TRUE(paths.is_object()) << imported.out;
  const std::string sampler_path = paths.value("sampler_path", ""), state_path = paths.value("state_path", "");
  std::vector<float> doubled_lp;  // the sampler's, of the alpha-64 import
  EXPECT_NE(sampler_path.find("/sampler_weights/imported"), std::string::npos) << imported.out;
  EXPECT_NE(state_path.find("/weights/imported"), std::string::npos) << imported.out;
  {
    test::ServeProcess server(data_dir, flags);
    ASSERT_NE(server.port(), 0) << "no listening banner: " << server.banner();
    test::TenantClient c(server.port(), "tml-importer");
    c.Start();
    ExpectNear(c.PromptLogprobs(c.SamplingOn(sampler_path), kProbe), original, 1e-5, "the imported sampler path");
    doubled_lp = c.PromptLogprobs(c.SamplingOn(doubled_path), kProbe);

    // create_training_client_from_state_with_optimizer: weights_info, a model of that config, load_weights.
    const Json info = c.PostOk("weights_info", {{"tinker_path", state_path}});
    EXPECT_EQ(info.value("base_model", ""), "loom/tiny-qwen3") << info.dump();
    EXPECT_EQ(info.value("lora_rank", 0), 4) << info.dump();
    EXPECT_EQ(c.LoadState(state_path, /*optimizer=*/true).value("path", ""), state_path);
    ExpectNear(c.Forward(probe_in, probe_targets, /*forward_only=*/true), original, 1e-4, "the loaded state");
    c.TrainStep(3);  // fresh moments: a first AdamW step
    const std::vector<float> trained = c.Forward(probe_in, probe_targets, /*forward_only=*/true);
    ASSERT_EQ(trained.size(), original.size());
    float moved = 0;
    for (size_t i = 0; i < trained.size(); ++i) moved = std::max(moved, std::abs(trained[i] - original[i]));
    EXPECT_GT(moved, 1e-3f) << "training on from the imported state must move it";

    test::TenantClient other(server.port(), "tml-other");
    other.Start();
    const auto foreign = other.Post("create_sampling_session", {{"session_id", other.session()},
                                                                {"sampling_session_seq_id", 0},
                                                                {"model_path", sampler_path},
                                                                {"type", "create_sampling_session"}});
    EXPECT_EQ(foreign.status, 404) << foreign.body;
    EXPECT_EQ(server.Terminate(), 0);
  }

  // Export: the merged model alone prints base+adapter's logprobs.
  const std::string base = data_dir + "/default-model", merged = data_dir + "/merged";
  std::string tokens;
  for (int32_t t : kProbe) tokens += (tokens.empty() ? "" : ",") + std::to_string(t);
  const Ran exported = RunLoom("export --model " + base + " --adapter " + snapshot + " --out " + merged +
                               " --format merged");
  ASSERT_EQ(exported.code, 0) << exported.out;
  const std::vector<float> with_adapter = ForwardLogprobs("--model " + base + " --adapter " + snapshot +
                                                          " --tokens " + tokens);
  ASSERT_EQ(with_adapter.size(), kProbe.size() - 1);
  ExpectNear(ForwardLogprobs("--model " + merged + " --tokens " + tokens), with_adapter, 1e-4, "the merged model");
  ExpectNear(with_adapter, original, 1e-4, "loom forward --adapter against the sampler");
  ExpectNear(doubled_lp, ForwardLogprobs("--model " + base + " --adapter " + alpha64 + " --tokens " + tokens), 1e-4,
             "the alpha-64 adapter, imported at alpha 32");
  ASSERT_EQ(doubled_lp.size(), original.size());
  float apart = 0;
  for (size_t i = 0; i < original.size(); ++i) apart = std::max(apart, std::abs(doubled_lp[i] - original[i]));
  EXPECT_GT(apart, 1e-3f) << "doubling alpha must change the adapter";
  fs::remove_all(alpha64);

  const Ran vllm_refused = RunLoom("export --model " + base + " --adapter " + snapshot + " --out " + data_dir +
                                   "/vllm --format vllm");
  EXPECT_EQ(vllm_refused.code, 2) << vllm_refused.out;
  EXPECT_NE(vllm_refused.out.find("--drop-lm-head"), std::string::npos) << vllm_refused.out;
  EXPECT_FALSE(fs::exists(data_dir + "/vllm"));
  const Ran vllm = RunLoom("export --model " + base + " --adapter " + snapshot + " --out " + data_dir +
                           "/vllm --format vllm --drop-lm-head --base-model-name Qwen/Qwen3-0.6B");
  ASSERT_EQ(vllm.code, 0) << vllm.out;
  const Json config = ReadJson(fs::path(data_dir) / "vllm" / "adapter_config.json");
  EXPECT_EQ(config.value("base_model_name_or_path", ""), "Qwen/Qwen3-0.6B");
  EXPECT_EQ(config["target_modules"].size(), 7u) << config.dump();
  fs::remove_all(data_dir);
}

}  // namespace
}  // namespace loom
