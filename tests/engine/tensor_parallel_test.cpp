// Tensor and expert parallel training (engine/model/parallel.h) over Gloo process
// groups on the CPU, against one process: the same script of engine calls
// (two slots of different ranks and groups, a packed cross_entropy pass, an
// AdamW step with clipping, a second pass, a checkpoint, a sampler snapshot)
// runs at TP 1 in this process and at TP 2 and TP 4 in ranks that are this
// test binary run again (one process each, TensorParallelRank.Script): rank
// 0 makes the calls, the others replay them (Engine::RunGroupWorker), as
// under `loom serve --tp`. The logprobs, grad norms and the whole adapter
// rank 0 saves (weights and both Adam moments, so the gradients too) equal
// the single process's to float tolerance; the PEFT snapshot is the same whole adapter; a state
// saved at TP 2 loads at TP 1 and at TP 4, and one saved at TP 1 at TP 2.
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../common/temp_dir.h"
#include "engine/api.h"
#include "engine/io/safetensors.h"
#include "engine/io/tensor_io.h"
#include "engine/model/parallel.h"
#include "engine/model/transformer.h"
#include "mxfp4_twin.h"
#include "testmodel/make_model.h"

namespace loom::engine {
namespace {

using Json = nlohmann::json;

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

Datum Ce(int n, int salt) {
  Datum d;
  std::vector<int64_t> targets;
  for (int i = 0; i < n; ++i) {
    d.tokens.push_back((i * 37 + salt * 11 + 3) % 512);
    targets.push_back((i * 53 + salt * 7 + 1) % 512);
  }
  d.loss_fn_inputs["target_tokens"] = Array::Ints(targets);
  return d;
}

std::vector<ForwardBackwardCall> Calls(bool forward_only) {
  std::vector<ForwardBackwardCall> calls(2);
  calls[0].slot = 0;
  calls[0].data = {Ce(9, 1), Ce(5, 2)};
  calls[1].slot = 1;
  calls[1].data = {Ce(7, 3)};
  for (auto& c : calls) {
    c.loss_fn = "cross_entropy";
    c.forward_only = forward_only;
  }
  return calls;
}

Json Logprobs(std::vector<Result<ForwardBackwardOutput>> results) {
  Json out = Json::array();
  for (auto& r : results) {
    EXPECT_TRUE(r.ok()) << r.status().message();
    if (!r.ok()) continue;
    for (const auto& datum : r->outputs) out.push_back(datum.at("logprobs").f32);
  }
  return out;
}

// The script every topology runs. `load_from`: a state directory each rank
// then loads into slot 0 (with its optimizer) before a forward-only pass.
EngineOptions Options(const std::string& model, int rank, int tp, int ep, const std::string& store) {
  EngineOptions o;
  o.model_dir = model;
  o.device = "cpu";
  o.max_slots = 2;
  o.max_rank = 8;
  o.threads = 1;
  o.group_rank = rank;
  o.tp_size = tp;
  o.ep_size = ep;
  o.group_store = store;
  return o;
}

Json RunScript(const std::string& model, int tp, int ep, const std::string& store, const std::string& out_dir,
               const std::string& tag, const std::string& load_from) {
  auto engine = Engine::Open(Options(model, 0, tp, ep, store));
  EXPECT_TRUE(engine.ok()) << engine.status().message();
  if (!engine.ok()) return {};
  Engine& e = **engine;
  LoraConfig a;
  a.rank = 8, a.alpha = 16, a.seed = 7;
  LoraConfig b;
  b.rank = 4, b.alpha = 4, b.seed = 9, b.train_unembed = false;
  EXPECT_TRUE(e.BindSlot(0, a).ok());
  EXPECT_TRUE(e.BindSlot(1, b).ok());
  Json out;
  out["first"] = Logprobs(e.ForwardBackward(Calls(false)));
  AdamParams adam;
  adam.learning_rate = 1e-2;
  adam.grad_clip_norm = 0.5;
  auto steps = e.OptimStep({{0, adam}, {1, adam}});
  for (auto& s : steps) {
    EXPECT_TRUE(s.ok()) << s.status().message();
    if (s.ok()) out["grad_norm"].push_back(s->metrics.at("grad_norm"));
  }
  out["second"] = Logprobs(e.ForwardBackward(Calls(false)));
  EXPECT_TRUE(e.SaveState(0, out_dir + "/state_" + tag).ok());
  EXPECT_TRUE(e.SaveForSampler(0, out_dir + "/peft_" + tag, "tiny").ok());
  if (!load_from.empty()) {
    EXPECT_TRUE(e.LoadState(0, load_from, /*with_optimizer=*/true).ok());
    out["loaded"] = Logprobs(e.ForwardBackward(Calls(true)));
  }
  return out;
}

// A port nothing listens on now (for the TCP rendezvous).
int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a);
  socklen_t len = sizeof a;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

// The script at max(tp, ep) ranks, each this binary again, as `loom serve
// --tp/--ep` runs them: rank 0 makes the calls (its results are returned),
// the others run Engine::RunGroupWorker.
Json RunRanks(int tp, int ep, const std::string& model, const std::string& dir, const std::string& tag,
                           const std::string& load_from) {
  const int size = std::max(tp, ep);
  // The TP 2 runs meet over TCP (c10d's TCPStore, as ranks on several
  // machines do), the others over a file.
  const std::string store = tag.rfind("tp2", 0) == 0 ? "tcp://127.0.0.1:" + std::to_string(FreePort()) : dir + "/store_" + tag;
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      setenv("LOOM_TP_RANK", std::to_string(r).c_str(), 1);
      setenv("LOOM_TP_TP", std::to_string(tp).c_str(), 1);
      setenv("LOOM_TP_EP", std::to_string(ep).c_str(), 1);
      setenv("LOOM_TP_STORE", store.c_str(), 1);
      setenv("LOOM_TP_MODEL", model.c_str(), 1);
      setenv("LOOM_TP_DIR", dir.c_str(), 1);
      setenv("LOOM_TP_TAG", tag.c_str(), 1);
      setenv("LOOM_TP_LOAD", load_from.c_str(), 1);
      execl("/proc/self/exe", "engine_tests", "--gtest_filter=TensorParallelRank.Script", nullptr);
      _exit(127);
    }
    pids.push_back(pid);
  }
  for (int r = 0; r < size; ++r) {
    int status = 0;
    waitpid(pids[static_cast<size_t>(r)], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << tag << " rank " << r << " failed";
  }
  std::ifstream in(dir + "/result_" + tag + ".json");
  return in ? Json::parse(in) : Json();
}

void ExpectNear(const Json& got, const Json& want, double tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i].is_array()) {
      ExpectNear(got[i], want[i], tol, what + "[" + std::to_string(i) + "]");
    } else {
      const double w = want[i].get<double>(), g = got[i].get<double>();
      EXPECT_NEAR(g, w, tol * std::max(1.0, std::abs(w))) << what << "[" << i << "]";
    }
  }
}

// Every tensor of two safetensors files, by name.
void ExpectSameTensors(const std::string& got_path, const std::string& want_path, double tol) {
  auto got = SafetensorsFile::Open(got_path), want = SafetensorsFile::Open(want_path);
  ASSERT_TRUE(got.ok()) << got.status().message();
  ASSERT_TRUE(want.ok()) << want.status().message();
  ASSERT_EQ((*got)->tensors().size(), (*want)->tensors().size()) << got_path;
  for (const auto& [name, view] : (*want)->tensors()) {
    const TensorView* other = (*got)->find(name);
    ASSERT_NE(other, nullptr) << name << " missing from " << got_path;
    ASSERT_EQ(other->shape, view.shape) << name;
    const at::Tensor w = *LoadTensor(view, at::kDouble, at::kCPU), g = *LoadTensor(*other, at::kDouble, at::kCPU);
    const double scale = std::max(1e-30, w.abs().max().item<double>());
    EXPECT_LE((g - w).abs().max().item<double>(), tol * scale) << name << " in " << got_path;
  }
}

// A split run (rank 0's results and files, tagged `tag`) against the one
// process's (tagged `one`): the passes, the grad norms, slot 0 loaded from
// the other topology's state (the same adapter, so with slot 1 as it was the
// same logprobs as after the step), and the whole adapter rank 0 wrote.
void ExpectSameAsOneProcess(const Json& got, const Json& single, const std::string& dir, const std::string& tag,
                            const std::string& one) {
  constexpr double kTol = 2e-5;
  ExpectNear(got["first"], single["first"], kTol, tag + " first pass");
  ExpectNear(got["grad_norm"], single["grad_norm"], kTol, tag + " grad_norm");
  ExpectNear(got["second"], single["second"], kTol, tag + " second pass");
  ExpectNear(got["loaded"], single["second"], kTol, tag + " loaded");
  ExpectSameTensors(dir + "/state_" + tag + "/adapter_state.safetensors", dir + "/state_" + one + "/adapter_state.safetensors",
                    1e-4);
  ExpectSameTensors(dir + "/peft_" + tag + "/adapter_model.safetensors", dir + "/peft_" + one + "/adapter_model.safetensors",
                    1e-4);
}

// One rank of RunRanks (skipped when run on its own).
TEST(TensorParallelRank, Script) {
  if (Env("LOOM_TP_RANK").empty()) GTEST_SKIP() << "a rank of TensorParallel.*; not a test on its own";
  const int rank = std::stoi(Env("LOOM_TP_RANK")), tp = std::stoi(Env("LOOM_TP_TP")), ep = std::stoi(Env("LOOM_TP_EP"));
  const std::string dir = Env("LOOM_TP_DIR"), tag = Env("LOOM_TP_TAG");
  if (rank > 0) {
    const Status st = Engine::RunGroupWorker(Options(Env("LOOM_TP_MODEL"), rank, tp, ep, Env("LOOM_TP_STORE")));
    EXPECT_TRUE(st.ok()) << st.message();
    return;
  }
  const Json out = RunScript(Env("LOOM_TP_MODEL"), tp, ep, Env("LOOM_TP_STORE"), dir, tag, Env("LOOM_TP_LOAD"));
  std::ofstream(dir + "/result_" + tag + ".json") << out.dump();
}

TEST(TensorParallel, Tp2AndTp4EqualOneProcessAndCheckpointsMoveBetweenThem) {
  if (std::string why = CollectiveUnavailable(at::kCPU); !why.empty()) GTEST_SKIP() << why;
  test::TempDir tmp;
  const std::string model = tmp.path() + "/model";
  testmodel::MakeModelOptions mo;
  mo.arch = "qwen3";
  mo.preset = "tiny-mha";
  mo.seed = 3;
  ASSERT_TRUE(testmodel::MakeModel(mo, model).ok());

  const Json single = RunScript(model, 1, 1, "", tmp.path(), "tp1", "");
  ASSERT_EQ(single["grad_norm"].size(), 2u);
  const Json tp2 = RunRanks(2, 1, model, tmp.path(), "tp2", tmp.path() + "/state_tp1");
  const Json tp4 = RunRanks(4, 1, model, tmp.path(), "tp4", tmp.path() + "/state_tp2");
  ExpectSameAsOneProcess(tp2, single, tmp.path(), "tp2", "tp1");
  ExpectSameAsOneProcess(tp4, single, tmp.path(), "tp4", "tp1");
  // And one process loads what TP 2 saved.
  EngineOptions o;
  o.model_dir = model;
  o.device = "cpu";
  o.max_slots = 2;
  o.max_rank = 8;
  auto one = Engine::Open(o);
  ASSERT_TRUE(one.ok());
  LoraConfig a;
  a.rank = 8, a.alpha = 16, a.seed = 7;
  LoraConfig b;
  b.rank = 4, b.alpha = 4, b.seed = 9, b.train_unembed = false;
  ASSERT_TRUE((*one)->BindSlot(0, a).ok());
  ASSERT_TRUE((*one)->BindSlot(1, b).ok());
  ASSERT_TRUE((*one)->LoadState(0, tmp.path() + "/state_tp2", true).ok());
  const Json loaded = Logprobs((*one)->ForwardBackward(Calls(true)));
  ExpectNear(Json::array({loaded[0], loaded[1]}), Json::array({single["second"][0], single["second"][1]}), 2e-5,
             "tp1 loading tp2's state");
  // Not a test that cannot fail: the adapter moved between the passes.
  double moved = 0;
  for (size_t i = 0; i < single["first"][0].size(); ++i)
    moved = std::max(moved, std::abs(single["first"][0][i].get<double>() - single["second"][0][i].get<double>()));
  EXPECT_GT(moved, 1e-3);
}

// The same for a mixture-of-experts model: its experts split over 2 ranks
// (EP 2; each slot's per-expert factors with their experts, the shared
// ones summed), and with the attention split too (TP 2 + EP 2).
TEST(TensorParallel, Ep2AndTp2Ep2EqualOneProcess) {
  if (std::string why = CollectiveUnavailable(at::kCPU); !why.empty()) GTEST_SKIP() << why;
  test::TempDir tmp;
  const std::string model = tmp.path() + "/model";
  testmodel::MakeModelOptions mo;
  mo.arch = "qwen3_moe";
  mo.preset = "tiny";
  mo.seed = 5;
  ASSERT_TRUE(testmodel::MakeModel(mo, model).ok());
  const Json single = RunScript(model, 1, 1, "", tmp.path(), "one", "");
  const Json ep2 = RunRanks(1, 2, model, tmp.path(), "ep2", tmp.path() + "/state_one");
  const Json both = RunRanks(2, 2, model, tmp.path(), "tp2ep2", tmp.path() + "/state_ep2");
  ExpectSameAsOneProcess(ep2, single, tmp.path(), "ep2", "one");
  ExpectSameAsOneProcess(both, single, tmp.path(), "tp2ep2", "one");
}

// The other families the multi-GPU models belong to, at the split each
// allows: gpt_oss (sinks, biases, sliding layers; GPT-OSS-120B) and
// glm4_moe (a dense first layer, shared experts; GLM-4.5-Air) at TP 2 + EP 2;
// MLA's deepseek_v2 (DeepSeek-V2 236B) and mimo_v2_flash (one key/value
// head) at EP 2.
TEST(TensorParallel, OtherFamiliesEqualOneProcess) {
  if (std::string why = CollectiveUnavailable(at::kCPU); !why.empty()) GTEST_SKIP() << why;
  struct Case {
    const char* arch;
    int tp, ep;
  };
  for (const Case& c : {Case{"gpt_oss", 2, 2}, Case{"glm4_moe", 2, 2}, Case{"deepseek_v2", 1, 2},
                        Case{"mimo_v2_flash", 1, 2}}) {
    SCOPED_TRACE(c.arch);
    test::TempDir tmp;
    const std::string model = tmp.path() + "/model";
    testmodel::MakeModelOptions mo;
    mo.arch = c.arch;
    mo.preset = "tiny";
    mo.seed = 2;
    ASSERT_TRUE(testmodel::MakeModel(mo, model).ok());
    const Json single = RunScript(model, 1, 1, "", tmp.path(), "one", "");
    const Json split = RunRanks(c.tp, c.ep, model, tmp.path(), "split", tmp.path() + "/state_one");
    ExpectSameAsOneProcess(split, single, tmp.path(), "split", "one");
  }
}

// GPT-OSS ships its experts in MXFP4: a split model dequantizes each expert
// tensor when it takes it (not every expert up front), to the same model.
TEST(TensorParallel, AnMxfp4CheckpointSplitEqualsOneProcess) {
  if (std::string why = CollectiveUnavailable(at::kCPU); !why.empty()) GTEST_SKIP() << why;
  test::TempDir tmp;
  const std::string plain = tmp.path() + "/plain", model = tmp.path() + "/model";
  testmodel::MakeModelOptions mo;
  mo.arch = "gpt_oss";
  mo.preset = "tiny";
  mo.seed = 3;
  ASSERT_TRUE(testmodel::MakeModel(mo, plain).ok());
  WriteMxfp4Twin(plain, model, nullptr);
  auto files = ModelWeights::Open(model);  // the experts only as blocks and scales
  ASSERT_TRUE(files.ok());
  ASSERT_EQ(files->find("model.layers.0.mlp.experts.down_proj"), nullptr);
  ASSERT_NE(files->find("model.layers.0.mlp.experts.down_proj_blocks"), nullptr);
  const Json single = RunScript(model, 1, 1, "", tmp.path(), "one", "");
  const Json split = RunRanks(2, 2, model, tmp.path(), "split", tmp.path() + "/state_one");
  ExpectSameAsOneProcess(split, single, tmp.path(), "split", "one");
}

TEST(TensorParallel, RefusesWhatDoesNotSplit) {
  ModelConfig c;
  c.model_type = "qwen3";
  c.num_hidden_layers = 1, c.num_attention_heads = 4, c.num_key_value_heads = 2, c.intermediate_size = 128;
  EXPECT_TRUE(Transformer::SplitSupport(c, 2).ok());
  const Status kv = Transformer::SplitSupport(c, 4);
  EXPECT_NE(kv.message().find("2 key/value heads"), std::string::npos) << kv.message();
  c.num_key_value_heads = 4, c.intermediate_size = 130;
  EXPECT_NE(Transformer::SplitSupport(c, 4).message().find("130 wide"), std::string::npos);
  c.intermediate_size = 128, c.kv_lora_rank = 16;
  EXPECT_NE(Transformer::SplitSupport(c, 2).message().find("latent attention"), std::string::npos);
  EXPECT_NE(Transformer::SplitSupport(c, 1, 2).message().find("no experts"), std::string::npos);
  c.num_experts = 6;
  EXPECT_NE(Transformer::SplitSupport(c, 1, 4).message().find("6 experts"), std::string::npos);
  EngineOptions o;
  o.tp_size = 2;
  o.model_dir = "/nonexistent";
  EXPECT_FALSE(Engine::Open(o).ok());
  o.ep_size = 4;  // each is 1 or the group's size
  EXPECT_NE(Engine::Open(o).status().message().find("tp 2 and ep 4"), std::string::npos);
}

}  // namespace
}  // namespace loom::engine
