// End to end: starts the real `loom serve` binary (LOOM_BINARY) on the
// embedded tiny qwen3 over loopback and drives the Tinker training flow with
// loom's own HTTP client: create -> forward_backward (protobuf) -> optim_step
// -> save_state -> load_state -> save_weights_for_sampler -> REST
// list/delete/archive -> SIGTERM (exit 0) -> restart -> still listed and
// loadable, with the loaded adapter giving the same loss as before.
#include <gtest/gtest.h>

#include <chrono>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "../http/test_client.h"
#include "serve_process.h"
#include "tenant_client.h"
#include "wire/forward_backward.h"

namespace loom {
namespace {

using Json = nlohmann::json;
using namespace std::chrono_literals;
constexpr const char* kKey = "tml-integration-tenant";

// The server of this flow: 2 adapter slots of rank <= 8.
class LoomServer : public test::ServeProcess {
 public:
  explicit LoomServer(const std::string& data_dir, std::vector<std::string> extra = {})
      : ServeProcess(data_dir, WithSlots(std::move(extra))) {}

 private:
  static std::vector<std::string> WithSlots(std::vector<std::string> extra) {
    extra.insert(extra.begin(), {"--max-adapters", "2", "--max-rank", "8"});
    return extra;
  }
};

// The tenant's client (tenant_client.h) with this flow's model and datum.
class Flow : public test::TenantClient {
 public:
  explicit Flow(uint16_t port, const char* key = kKey) : TenantClient(port, key) {}

  std::string NewModel() {
    Json s = PostOk("create_session", {{"tags", Json::array()}, {"user_metadata", Json::object()},
                                       {"sdk_version", "0.26.2"}, {"type", "create_session"}});
    Json m = Result(PostOk("create_model", {{"session_id", s["session_id"]}, {"model_seq_id", 0},
                                            {"base_model", "loom/tiny-qwen3"},
                                            {"lora_config", {{"rank", 4}, {"seed", 7}, {"train_unembed", true},
                                                             {"train_mlp", true}, {"train_attn", true}}},
                                            {"type", "create_model"}}));
    return m.value("model_id", "");
  }

  // forward_backward (or forward) of one fixed datum; returns the loss:sum and checks the logprobs.
  double ForwardBackward(const std::string& model, int seq, bool forward_only) {
    tinker::ForwardBackwardRequest req;
    req.model_id = model;
    req.seq_id = seq;
    tinker::Datum d;
    d.tokens = {5, 17, 42, 9, 3};
    d.loss_fn_inputs["target_tokens"] = tinker::Array::Ints({17, 42, 9, 3, 8});
    d.loss_fn_inputs["weights"] = tinker::Array::Floats({0, 1, 1, 1, 1});
    req.call.data.push_back(d);
    req.call.loss_fn = "cross_entropy";
    req.call.forward_only = forward_only;
    auto sub = PostProto("forward_backward", wire::EncodeForwardBackwardRequest(req));
    EXPECT_EQ(sub.status, 200) << sub.body;
    if (sub.status != 200) return NAN;
    auto res = Retrieve(Json::parse(sub.body)["request_id"], /*proto=*/true);
    EXPECT_EQ(res.content_type, "application/x-protobuf") << res.body;
    auto out = wire::DecodeForwardBackwardOutput(res.body);
    EXPECT_TRUE(out.ok()) << out.status().message();
    if (!out.ok() || out->outputs.size() != 1) return NAN;
    const auto& lp = out->outputs[0].at("logprobs").f32;
    EXPECT_EQ(lp.size(), 5u);
    double expect = 0;
    for (size_t t = 0; t < lp.size(); ++t) {
      EXPECT_TRUE(std::isfinite(lp[t]) && lp[t] <= 0) << lp[t];
      expect += -lp[t] * (t == 0 ? 0.0 : 1.0);
    }
    const double loss = out->metrics.at("loss:sum");
    EXPECT_NEAR(loss, expect, 1e-4 * std::max(1.0, std::abs(expect)));  // loss = sum of -logprob * weight
    return loss;
  }
};

std::string Adam(double lr) {
  return Json{{"learning_rate", lr}, {"beta1", 0.9}, {"beta2", 0.95}, {"eps", 1e-12}, {"weight_decay", 0.0},
              {"grad_clip_norm", 0.0}}
      .dump();
}

TEST(ServeFlow, TrainSaveLoadRestListArchiveRestart) {
  const std::string data_dir =
      (std::filesystem::temp_directory_path() / ("loom_integration_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(data_dir);
  double loss_after_step = 0;
  std::string model;
  {
    LoomServer server(data_dir);
    ASSERT_NE(server.port(), 0) << "no listening banner: " << server.banner();
    Flow f(server.port());
    EXPECT_EQ(f.Get("/api/v1/healthz").status, 200);
    EXPECT_EQ(f.PostOk("client/config", {{"sdk_version", "0.26.2"}}).is_object(), true);
    model = f.NewModel();
    ASSERT_FALSE(model.empty());
    Json info = f.PostOk("get_info", {{"model_id", model}, {"type", "get_info"}});
    EXPECT_EQ(info["model_data"]["arch"], "qwen3");
    EXPECT_EQ(info["lora_rank"], 4);

    const double loss0 = f.ForwardBackward(model, 1, /*forward_only=*/false);
    Json step = f.Result(f.PostOk("optim_step", {{"model_id", model}, {"seq_id", 2},
                                                 {"adam_params", Json::parse(Adam(1e-2))}, {"type", "optim_step"}}));
    EXPECT_TRUE(step.contains("metrics")) << step.dump();
    Json saved = f.Result(f.PostOk("save_weights", {{"model_id", model}, {"path", "ck1"}, {"seq_id", 3},
                                                    {"overwrite", false}, {"type", "save_weights"}}));
    EXPECT_EQ(saved["path"], "tinker://" + model + "/weights/ck1");
    Json loaded = f.Result(f.PostOk("load_weights", {{"model_id", model}, {"seq_id", 4}, {"path", saved["path"]},
                                                     {"optimizer", true}, {"type", "load_weights"}}));
    EXPECT_EQ(loaded["model_id"], model);
    loss_after_step = f.ForwardBackward(model, 5, /*forward_only=*/true);
    EXPECT_LT(loss_after_step, loss0) << "one AdamW step on this datum should lower its loss";

    Json named = f.Result(f.PostOk("save_weights_for_sampler", {{"model_id", model}, {"path", "s1"}, {"seq_id", 6},
                                                                {"type", "save_weights_for_sampler"}}));
    EXPECT_EQ(named["path"], "tinker://" + model + "/sampler_weights/s1");
    Json unnamed = f.Result(f.PostOk("save_weights_for_sampler", {{"model_id", model}, {"seq_id", 7},
                                                                  {"sampling_session_seq_id", 0},
                                                                  {"type", "save_weights_for_sampler"}}));
    EXPECT_TRUE(unnamed.contains("sampling_session_id")) << unnamed.dump();
    // The wire's ephemeral sampler: no path; its weights are written after the answer.
    EXPECT_TRUE(!unnamed.contains("path") || unnamed["path"].is_null()) << unnamed.dump();

    const std::string run = "/api/v1/training_runs/" + model;
    Json list = Json::parse(f.Get(run + "/checkpoints").body);
    for (int tries = 0; list["checkpoints"].size() < 3u && tries < 200; ++tries) {  // the unnamed one, once written
      std::this_thread::sleep_for(std::chrono::milliseconds(25));
      list = Json::parse(f.Get(run + "/checkpoints").body);
    }
    EXPECT_EQ(list["checkpoints"].size(), 3u) << list.dump();
    auto archive = f.Get(run + "/checkpoints/sampler_weights/s1/archive");
    ASSERT_EQ(archive.status, 200) << archive.body;
    std::string url = Json::parse(archive.body)["url"];
    auto tar = testing::HttpClient("127.0.0.1", server.port()).Call("GET", url.substr(url.find("/api/v1/")));
    ASSERT_EQ(tar.status, 200);
    for (const char* file : {"adapter_config.json", "adapter_model.safetensors", "checkpoint_complete"}) {
      EXPECT_NE(tar.body.find(file), std::string::npos) << file;
    }
    EXPECT_EQ(f.Delete(run + "/checkpoints/sampler_weights/s1").status, 200);
    EXPECT_EQ(Json::parse(f.Get(run + "/checkpoints").body)["checkpoints"].size(), 2u);
    EXPECT_EQ(server.Terminate(), 0);
  }
  {
    LoomServer server(data_dir);
    ASSERT_NE(server.port(), 0) << server.banner();
    Flow f(server.port());
    Json mine = Json::parse(f.Get("/api/v1/checkpoints?limit=100&offset=0").body);
    ASSERT_EQ(mine["cursor"]["total_count"], 2) << mine.dump();
    Json runs = Json::parse(f.Get("/api/v1/training_runs?limit=20&offset=0").body);
    EXPECT_EQ(runs["training_runs"][0]["training_run_id"], model);
    // create_training_client_from_state: weights_info, create_model, load_weights.
    const std::string path = "tinker://" + model + "/weights/ck1";
    Json winfo = f.PostOk("weights_info", {{"tinker_path", path}});
    EXPECT_EQ(winfo["lora_rank"], 4);
    std::string resumed = f.NewModel();
    f.Result(f.PostOk("load_weights", {{"model_id", resumed}, {"seq_id", 1}, {"path", path}, {"optimizer", true},
                                       {"type", "load_weights"}}));
    const double loss_resumed = f.ForwardBackward(resumed, 2, /*forward_only=*/true);
    EXPECT_NEAR(loss_resumed, loss_after_step, 1e-5) << "the restored adapter must equal the saved one";
    EXPECT_EQ(server.Terminate(), 0);
  }
  std::filesystem::remove_all(data_dir);
}

TEST(ServeFlow, BadRequestsGet4xxJsonWhileAnotherTenantTrains) {
  const std::string data_dir =
      (std::filesystem::temp_directory_path() / ("loom_integration_bad_" + std::to_string(::getpid()))).string();
  std::filesystem::remove_all(data_dir);
  LoomServer server(data_dir, {"--max-body-bytes", "65536"});
  ASSERT_NE(server.port(), 0) << server.banner();
  Flow good(server.port());
  Flow evil(server.port(), "tml-someone-else");
  const std::string model = good.NewModel();
  ASSERT_FALSE(model.empty());
  const double before = good.ForwardBackward(model, 1, false);

  testing::HttpClient raw("127.0.0.1", server.port());
  auto expect_json_4xx = [](const testing::Reply& r, int status) {
    EXPECT_EQ(r.status, status) << r.body;
    Json j = Json::parse(r.body, nullptr, false);
    EXPECT_TRUE(j.is_object() && j.contains("error") && !j["error"].get<std::string>().empty()) << r.body;
  };
  const std::vector<std::pair<std::string, std::string>> key{{"X-API-Key", "tml-someone-else"}};
  expect_json_4xx(raw.Call("POST", "/api/v1/create_session", "{\"tags\": [", key), 400);              // malformed JSON
  expect_json_4xx(raw.Call("POST", "/api/v1/optim_step", "{\"model_id\": 5, \"seq_id\": \"x\"}", key), 400);  // wrong types
  auto proto_key = key;
  proto_key.emplace_back("Content-Type", "application/x-protobuf");
  expect_json_4xx(raw.Call("POST", "/api/v1/forward_backward", std::string("\x0a\xff\xff\xff\x0f", 5), proto_key), 400);
  expect_json_4xx(raw.Call("POST", "/api/v1/get_info", Json{{"model_id", model}}.dump(), key), 404);  // foreign id
  expect_json_4xx(raw.Call("GET", "/api/v1/training_runs/" + model + "/checkpoints", "", key), 404);
  expect_json_4xx(raw.Call("POST", "/api/v1/create_session", "{}", {{"X-API-Key", "sk-wrong"}}), 401);  // bad key
  expect_json_4xx(raw.Call("POST", "/api/v1/create_session", "{}"), 401);                               // no key
  expect_json_4xx(raw.Call("POST", "/api/v1/create_session", std::string(100000, ' '), key), 413);     // oversized
  // Out-of-vocabulary tokens are refused before the engine, naming the field.
  tinker::ForwardBackwardRequest oov;
  oov.model_id = evil.NewModel();
  oov.seq_id = 1;
  tinker::Datum d;
  d.tokens = {1, 1 << 30};
  d.loss_fn_inputs["target_tokens"] = tinker::Array::Ints({1, 2});
  d.loss_fn_inputs["weights"] = tinker::Array::Floats({1, 1});
  oov.call.data.push_back(d);
  auto r = raw.Call("POST", "/api/v1/forward_backward", wire::EncodeForwardBackwardRequest(oov), proto_key);
  expect_json_4xx(r, 400);
  EXPECT_NE(r.body.find("data[0]"), std::string::npos) << r.body;

  // The good tenant carries on: its next step and its result are unaffected.
  Json step = good.Result(good.PostOk("optim_step", {{"model_id", model}, {"seq_id", 2},
                                                     {"adam_params", Json::parse(Adam(1e-2))}}));
  EXPECT_TRUE(step.contains("metrics"));
  const double after = good.ForwardBackward(model, 3, true);
  EXPECT_LT(after, before);
  EXPECT_EQ(server.Terminate(), 0);
  std::filesystem::remove_all(data_dir);
}

}  // namespace
}  // namespace loom
