#include "engine/model/parallel.h"

#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>

#if LOOM_WITH_GLOO || LOOM_WITH_NCCL
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#endif
#if LOOM_WITH_GLOO
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if LOOM_WITH_NCCL
#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

namespace loom::engine {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct EnterNode : torch::autograd::Function<EnterNode> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* g = reinterpret_cast<Collective*>(ctx->saved_data["group"].toInt());
    at::Tensor sum = grads[0].contiguous().clone();
    g->AllReduceSum(sum);
    return {sum, at::Tensor()};
  }
};

struct LeaveNode : torch::autograd::Function<LeaveNode> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, int64_t group) {
    auto* g = reinterpret_cast<Collective*>(group);
    at::Tensor sum = x.contiguous().clone();
    g->AllReduceSum(sum);
    return sum;
  }
  static variable_list backward(AutogradContext*, variable_list grads) { return {grads[0], at::Tensor()}; }
};

#if LOOM_WITH_GLOO || LOOM_WITH_NCCL
// A c10d process group as a Collective. Every call waits for its work. PG
// is the concrete group (ProcessGroupGloo, ProcessGroupNCCL): a
// ProcessGroup in libtorch 1.13, a Backend in 2.x, with the same calls. A
// tensor elsewhere than the group's device (NCCL: the rank's GPU; Gloo: the
// CPU) travels through a copy there, e.g. the engine calls rank 0 sends
// (group_engine.cpp), which are host bytes.
template <typename PG>
class C10dCollective final : public Collective {
 public:
  C10dCollective(c10::intrusive_ptr<PG> pg, int rank, int size, at::Device device)
      : pg_(std::move(pg)), rank_(rank), size_(size), device_(device) {}
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  void AllReduceSum(at::Tensor& t) override { Reduce(t, c10d::ReduceOp::SUM); }
  void AllReduceMin(at::Tensor& t) override { Reduce(t, c10d::ReduceOp::MIN); }
  void Broadcast(at::Tensor& t, int root, std::chrono::milliseconds timeout) override {
    std::vector<at::Tensor> ts{Here(t)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    if (timeout.count() > 0) o.timeout = timeout;
    pg_->broadcast(ts, o)->wait();
    if (!ts[0].is_same(t)) t.copy_(ts[0]);
  }
  std::vector<at::Tensor> AllGather(const at::Tensor& t) override {
    std::vector<at::Tensor> in{t.to(device_).contiguous()};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < size_; ++r) out[0].push_back(at::empty_like(in[0]));
    pg_->allgather(out, in)->wait();
    if (t.device() != device_)
      for (at::Tensor& part : out[0]) part = part.to(t.device());
    return out[0];
  }

 private:
  // t itself where the group can use it in place, else a contiguous copy on its device.
  at::Tensor Here(at::Tensor& t) const { return t.device() == device_ && t.is_contiguous() ? t : t.to(device_).contiguous(); }
  void Reduce(at::Tensor& t, c10d::ReduceOp op) {
    std::vector<at::Tensor> ts{Here(t)};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    pg_->allreduce(ts, o)->wait();
    if (!ts[0].is_same(t)) t.copy_(ts[0]);
  }
  c10::intrusive_ptr<PG> pg_;
  int rank_, size_;
  at::Device device_;
};
#endif

}  // namespace

std::string CollectiveUnavailable(at::Device device) {
  if (device.is_cuda()) {
#if LOOM_WITH_NCCL
    return "";
#else
    return "this build has no NCCL process group (libtorch's c10d ProcessGroupNCCL)";
#endif
  }
#if LOOM_WITH_GLOO
  return "";
#else
  return "this build has no Gloo process group (install libgloo-dev and rebuild)";
#endif
}

Result<std::shared_ptr<Collective>> OpenCollective(const std::string& store_path, int rank, int size,
                                                   at::Device device, std::chrono::milliseconds timeout) {
  if (size < 1 || rank < 0 || rank >= size)
    return Status::Invalid("process group: rank " + std::to_string(rank) + " of " + std::to_string(size));
  if (std::string why = CollectiveUnavailable(device); !why.empty()) return Status::Invalid("process group: " + why);
  try {
#if LOOM_WITH_GLOO || LOOM_WITH_NCCL
    // tcp://HOST:PORT: rank 0 serves the rendezvous there (ranks on several
    // machines); anything else is a FileStore path.
    c10::intrusive_ptr<c10d::Store> store;
    if (store_path.rfind("tcp://", 0) == 0) {
      const std::string where = store_path.substr(6);
      const size_t colon = where.rfind(':');
      if (colon == std::string::npos || colon == 0 || colon + 1 == where.size() ||
          where.find_first_not_of("0123456789", colon + 1) != std::string::npos || where.size() - colon > 6)
        return Status::Invalid("process group: '" + store_path + "' is not tcp://HOST:PORT");
      c10d::TCPStoreOptions o;
      o.port = static_cast<std::uint16_t>(std::stoi(where.substr(colon + 1)));
      o.isServer = rank == 0;
      o.numWorkers = static_cast<std::size_t>(size);
      o.timeout = timeout;
      store = c10::make_intrusive<c10d::TCPStore>(where.substr(0, colon), o);
    } else {
      store = c10::make_intrusive<c10d::FileStore>(store_path, size);
    }
    store->setTimeout(timeout);
#endif
#if LOOM_WITH_NCCL
    if (device.is_cuda()) {
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = timeout;
      auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
      return std::shared_ptr<Collective>(new C10dCollective<c10d::ProcessGroupNCCL>(pg, rank, size, device));
    }
#endif
#if LOOM_WITH_GLOO
    if (!device.is_cuda()) {
      auto opts = c10d::ProcessGroupGloo::Options::create();
      opts->timeout = timeout;
      const char* ifname = std::getenv("LOOM_GLOO_IFNAME");
      opts->devices.push_back(ifname && *ifname ? c10d::ProcessGroupGloo::createDeviceForInterface(ifname)
                                                : c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, opts);
      return std::shared_ptr<Collective>(new C10dCollective<c10d::ProcessGroupGloo>(pg, rank, size, at::kCPU));
    }
#endif
    return Status::Invalid("process group: no backend for this device");
  } catch (const std::exception& e) {
    return Status::Unavailable(std::string("process group: ") + e.what());
  }
}

at::Tensor TpEnter(const at::Tensor& x, Collective* g) {
  if (g == nullptr || g->size() == 1) return x;
  return EnterNode::apply(x, reinterpret_cast<int64_t>(g));
}

at::Tensor TpLeave(const at::Tensor& x, Collective* g) {
  if (g == nullptr || g->size() == 1) return x;
  return LeaveNode::apply(x, reinterpret_cast<int64_t>(g));
}

}  // namespace loom::engine
