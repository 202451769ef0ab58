// Tensor parallelism: one process per device, each holding a part of every
// split block, over libtorch's c10d process groups (Gloo on the CPU, NCCL
// on CUDA). Nothing home-made: the collectives are c10d's.
//
// What is split (Megatron's layout), with `tp` ranks:
//   - attention: q/k/v column-split by heads (each rank H/tp query heads and
//     KVH/tp key/value heads), o row-split (the matching input columns; its
//     bias on rank 0 only); the block's output is summed over the ranks;
//   - dense MLPs (and an MoE layer's shared experts): gate/up column-split,
//     down row-split, summed likewise.
// Everything else (embeddings, norms, the router and experts, lm_head) is
// whole on every rank and computed redundantly, so every rank holds the
// same residual stream, logits and loss.
//
// The LoRA of a split target is split to match (slot_bank.h FactorShard):
// a column-split target's B is split by rows, its A whole; a row-split
// target's A is split by columns, its B whole. Since the block's output is
// a sum over ranks of each rank's part, each rank's LoRA delta is its part
// too, and the whole factor's gradient is a part per rank (kPartial): the
// engine sums those over the ranks after each pass. The optimizer's global
// norm counts split factors on every rank and whole ones once.
//
// Autograd: TpEnter before a split block's projections (identity forward;
// the input's gradient, a part per rank, summed in the backward) and
// TpLeave after its output projection (sum forward; identity backward).
// Every rank runs the same ops in the same order, so the collectives meet.
//
// Threading: the engine thread (a Collective is used by one thread).
#pragma once
#include <ATen/ATen.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace loom::engine {

// The group's collectives (c10d underneath). Each call is a collective:
// every rank makes it, in the same order, with tensors of the same shape.
class Collective {
 public:
  virtual ~Collective() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // In place on every rank.
  virtual void AllReduceSum(at::Tensor& t) = 0;
  virtual void AllReduceMin(at::Tensor& t) = 0;
  // timeout 0: the group's own.
  virtual void Broadcast(at::Tensor& t, int root, std::chrono::milliseconds timeout = {}) = 0;
  // Every rank's t, in rank order (each rank's t has the same shape).
  virtual std::vector<at::Tensor> AllGather(const at::Tensor& t) = 0;
};

// Whether this build has a c10d process group for the device (Gloo for the
// CPU, NCCL for CUDA): "" when it has, else why not.
std::string CollectiveUnavailable(at::Device device);

// Rank `rank` of `size` over a rendezvous at store_path: a file (c10d's
// FileStore: every rank names the same path on a shared filesystem; a fresh
// path per group), or tcp://HOST:PORT (c10d's TCPStore, which rank 0 serves
// on HOST: ranks on several machines). Blocks until every rank has joined
// or timeout. Gloo
// connects over the loopback address, or over the network interface named
// by LOOM_GLOO_IFNAME (ranks on several machines).
Result<std::shared_ptr<Collective>> OpenCollective(const std::string& store_path, int rank, int size,
                                                   at::Device device,
                                                   std::chrono::milliseconds timeout = std::chrono::minutes(5));

// How a model is split over a group of ranks (size 1: not at all): tensor
// parallel (tp: attention and dense MLPs), expert parallel (ep: each MoE
// layer's experts, E / size on each rank, rank r the r-th run), or both over
// the same ranks.
struct Parallel {
  int rank = 0;
  int size = 1;
  std::shared_ptr<Collective> group;  // null when size == 1
  bool tp = false;
  bool ep = false;
  bool split() const { return size > 1; }
  int tp_size() const { return tp ? size : 1; }
  int ep_size() const { return ep ? size : 1; }
};

// Identity forward; the gradient summed over the group (g null: identity).
at::Tensor TpEnter(const at::Tensor& x, Collective* g);
// Sum over the group forward; identity backward (g null: identity).
at::Tensor TpLeave(const at::Tensor& x, Collective* g);

}  // namespace loom::engine
