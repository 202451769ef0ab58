#include "engine/group_engine.h"

#include <ATen/ATen.h>

#include <nlohmann/json.hpp>

#include "common/log.h"

namespace loom::engine {

namespace {

using Json = nlohmann::json;

// A worker waits this long for rank 0's next call (an idle service sends
// none); rank 0 stopping sends kStop, and a dead rank 0 takes its workers
// down with it (the group's connections close).
constexpr auto kIdleWait = std::chrono::hours(24 * 365);

Json ArrayJson(const Array& a) {
  Json j = {{"shape", a.shape}};
  if (a.dtype == Array::DType::kInt64) {
    j["i64"] = a.i64;
  } else {
    j["f32"] = a.f32;
  }
  return j;
}

Array ArrayOf(const Json& j) {
  Array a;
  a.shape = j.at("shape").get<std::vector<int64_t>>();
  if (j.contains("i64")) {
    a.dtype = Array::DType::kInt64;
    a.i64 = j.at("i64").get<std::vector<int64_t>>();
  } else {
    a.f32 = j.at("f32").get<std::vector<float>>();
  }
  return a;
}

Json CallJson(const ForwardBackwardCall& c) {
  Json data = Json::array();
  for (const Datum& d : c.data) {
    Json inputs = Json::object();
    for (const auto& [name, array] : d.loss_fn_inputs) inputs[name] = ArrayJson(array);
    data.push_back({{"tokens", d.tokens}, {"inputs", std::move(inputs)}});
  }
  return {{"slot", c.slot},
          {"loss_fn", c.loss_fn},
          {"config", c.loss_fn_config},
          {"forward_only", c.forward_only},
          {"data", std::move(data)}};
}

ForwardBackwardCall CallOf(const Json& j) {
  ForwardBackwardCall c;
  c.slot = j.at("slot").get<int>();
  c.loss_fn = j.at("loss_fn").get<std::string>();
  c.loss_fn_config = j.at("config").get<std::map<std::string, double>>();
  c.forward_only = j.at("forward_only").get<bool>();
  for (const Json& d : j.at("data")) {
    Datum datum;
    datum.tokens = d.at("tokens").get<std::vector<int32_t>>();
    for (const auto& [name, array] : d.at("inputs").items()) datum.loss_fn_inputs[name] = ArrayOf(array);
    c.data.push_back(std::move(datum));
  }
  return c;
}

Json LoraJson(const LoraConfig& l) {
  return {{"rank", l.rank},           {"alpha", l.alpha},         {"seed", l.seed},
          {"attn", l.train_attn},     {"mlp", l.train_mlp},       {"unembed", l.train_unembed}};
}

LoraConfig LoraOf(const Json& j) {
  LoraConfig l;
  l.rank = j.at("rank").get<int>();
  l.alpha = j.at("alpha").get<double>();
  l.seed = j.at("seed").get<uint64_t>();
  l.train_attn = j.at("attn").get<bool>();
  l.train_mlp = j.at("mlp").get<bool>();
  l.train_unembed = j.at("unembed").get<bool>();
  return l;
}

Json AdamJson(const AdamParams& a) {
  return {{"lr", a.learning_rate}, {"b1", a.beta1}, {"b2", a.beta2},
          {"eps", a.eps},          {"wd", a.weight_decay}, {"clip", a.grad_clip_norm}};
}

AdamParams AdamOf(const Json& j) {
  AdamParams a;
  a.learning_rate = j.at("lr").get<double>();
  a.beta1 = j.at("b1").get<double>();
  a.beta2 = j.at("b2").get<double>();
  a.eps = j.at("eps").get<double>();
  a.weight_decay = j.at("wd").get<double>();
  a.grad_clip_norm = j.at("clip").get<double>();
  return a;
}

// One call over the group: its length, then its bytes, from rank 0.
void SendCall(Collective& group, const Json& call) {
  const std::vector<uint8_t> bytes = Json::to_msgpack(call);
  at::Tensor len = at::full({1}, static_cast<int64_t>(bytes.size()), at::kLong);
  group.Broadcast(len, 0);
  at::Tensor body = at::from_blob(const_cast<uint8_t*>(bytes.data()), {static_cast<int64_t>(bytes.size())}, at::kByte)
                        .clone();
  group.Broadcast(body, 0);
}

Json ReceiveCall(Collective& group) {
  at::Tensor len = at::zeros({1}, at::kLong);
  group.Broadcast(len, 0, kIdleWait);
  const int64_t n = len.item<int64_t>();
  at::Tensor body = at::empty({n}, at::kByte);
  group.Broadcast(body, 0);
  const uint8_t* p = body.data_ptr<uint8_t>();
  return Json::from_msgpack(std::vector<uint8_t>(p, p + n));
}

// Rank 0 of a group: every state-changing call goes to the workers first.
class GroupLeader final : public Engine {
 public:
  GroupLeader(std::unique_ptr<Engine> inner, std::shared_ptr<Collective> group)
      : inner_(std::move(inner)), group_(std::move(group)) {}
  ~GroupLeader() override {
    try {
      SendCall(*group_, {{"op", "stop"}});
    } catch (const std::exception& e) {
      log::Warn("group_stop_failed what={}", e.what());
    }
  }

  const ModelInfo& info() const override { return inner_->info(); }
  Status ValidateForwardBackward(const ForwardBackwardCall& call) const override {
    return inner_->ValidateForwardBackward(call);
  }
  Status BindSlot(int slot, const LoraConfig& config) override {
    SendCall(*group_, {{"op", "bind"}, {"slot", slot}, {"lora", LoraJson(config)}});
    return inner_->BindSlot(slot, config);
  }
  void ReleaseSlot(int slot) override {
    SendCall(*group_, {{"op", "release"}, {"slot", slot}});
    inner_->ReleaseSlot(slot);
  }
  std::vector<Result<ForwardBackwardOutput>> ForwardBackward(const std::vector<ForwardBackwardCall>& calls) override {
    Json all = Json::array();
    for (const ForwardBackwardCall& c : calls) all.push_back(CallJson(c));
    SendCall(*group_, {{"op", "fb"}, {"calls", std::move(all)}});
    return inner_->ForwardBackward(calls);
  }
  void MarkGrad(int slot) override { Slot("mark", slot, [&] { inner_->MarkGrad(slot); }); }
  void RollbackGrad(int slot) override { Slot("rollback", slot, [&] { inner_->RollbackGrad(slot); }); }
  void ForgetGradMark(int slot) override { Slot("forget", slot, [&] { inner_->ForgetGradMark(slot); }); }
  std::vector<Result<OptimStepOutput>> OptimStep(const std::vector<OptimStepCall>& calls) override {
    Json all = Json::array();
    for (const OptimStepCall& c : calls) all.push_back({{"slot", c.slot}, {"adam", AdamJson(c.params)}});
    SendCall(*group_, {{"op", "step"}, {"calls", std::move(all)}});
    return inner_->OptimStep(calls);
  }
  Status SaveState(int slot, const std::string& dir) override {
    SendCall(*group_, {{"op", "save"}, {"slot", slot}, {"dir", dir}});
    return inner_->SaveState(slot, dir);
  }
  Status LoadState(int slot, const std::string& dir, bool with_optimizer) override {
    SendCall(*group_, {{"op", "load"}, {"slot", slot}, {"dir", dir}, {"optimizer", with_optimizer}});
    return inner_->LoadState(slot, dir, with_optimizer);
  }
  Result<std::shared_ptr<const SlotSnapshot>> SnapshotForSampler(int slot) override {
    SendCall(*group_, {{"op", "snapshot"}, {"slot", slot}});
    return inner_->SnapshotForSampler(slot);
  }
  void PrepareSnapshotWriter() const override { inner_->PrepareSnapshotWriter(); }
  void ReleaseSnapshotWriter() const override { inner_->ReleaseSnapshotWriter(); }
  DeviceMemory Memory() const override { return inner_->Memory(); }
  int64_t MaxPassTokens() const override { return inner_->MaxPassTokens(); }
  int64_t KeptPassTokens() const override { return inner_->KeptPassTokens(); }
  std::string MemoryPlanReport() const override { return inner_->MemoryPlanReport(); }
  void ShareDevice(std::shared_ptr<const DeviceReserve> neighbour) override { inner_->ShareDevice(std::move(neighbour)); }
  GraphStats TrainGraphStats() const override { return inner_->TrainGraphStats(); }
  RecomputeStats TrainRecomputeStats() const override { return inner_->TrainRecomputeStats(); }
  void ResetPeakMemory() override { inner_->ResetPeakMemory(); }
  // The split model is no sampler's: sampling runs on replicas.
  std::shared_ptr<const Transformer> SharedModel() const override { return nullptr; }

 private:
  template <typename F>
  void Slot(const char* op, int slot, F&& run) {
    SendCall(*group_, {{"op", op}, {"slot", slot}});
    run();
  }
  std::unique_ptr<Engine> inner_;
  std::shared_ptr<Collective> group_;
};

// A worker's loop: rank 0's calls, run on this rank's engine, until "stop".
Status ServeCalls(Engine& e, Collective& group) {
  while (true) {
    const Json call = ReceiveCall(group);
    const std::string op = call.at("op").get<std::string>();
    if (op == "stop") return Status::Ok();
    if (op == "bind") {
      e.BindSlot(call.at("slot").get<int>(), LoraOf(call.at("lora")));
    } else if (op == "release") {
      e.ReleaseSlot(call.at("slot").get<int>());
    } else if (op == "fb") {
      std::vector<ForwardBackwardCall> calls;
      for (const Json& c : call.at("calls")) calls.push_back(CallOf(c));
      e.ForwardBackward(calls);
    } else if (op == "mark") {
      e.MarkGrad(call.at("slot").get<int>());
    } else if (op == "rollback") {
      e.RollbackGrad(call.at("slot").get<int>());
    } else if (op == "forget") {
      e.ForgetGradMark(call.at("slot").get<int>());
    } else if (op == "step") {
      std::vector<OptimStepCall> calls;
      for (const Json& c : call.at("calls")) calls.push_back({c.at("slot").get<int>(), AdamOf(c.at("adam"))});
      e.OptimStep(calls);
    } else if (op == "save") {
      e.SaveState(call.at("slot").get<int>(), call.at("dir").get<std::string>());
    } else if (op == "load") {
      e.LoadState(call.at("slot").get<int>(), call.at("dir").get<std::string>(), call.at("optimizer").get<bool>());
    } else if (op == "snapshot") {
      (void)e.SnapshotForSampler(call.at("slot").get<int>());
    } else {
      return Status::Internal("group worker: unknown call '" + op + "' from rank 0");
    }
  }
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::Open(const EngineOptions& options) {
  if (options.group_rank != 0)
    return Status::Invalid("group_rank: rank " + std::to_string(options.group_rank) +
                           " of a group runs Engine::RunGroupWorker, not Open");
  std::shared_ptr<Collective> group;
  auto engine = OpenTrainingEngine(options, &group);
  if (!engine.ok() || !group) return engine;
  return std::unique_ptr<Engine>(new GroupLeader(std::move(*engine), std::move(group)));
}

Status Engine::RunGroupWorker(const EngineOptions& options) {
  if (options.group_rank < 1) return Status::Invalid("group_rank: a worker is rank 1 or more");
  std::shared_ptr<Collective> group;
  auto opened = OpenTrainingEngine(options, &group);
  if (!opened.ok()) return opened.status();
  Engine& e = **opened;
  try {
    return ServeCalls(e, *group);
  } catch (const std::exception& ex) {  // the group's connections broke (rank 0 gone), or a malformed call
    return Status::Internal(std::string("group worker: ") + ex.what());
  }
}

}  // namespace loom::engine
