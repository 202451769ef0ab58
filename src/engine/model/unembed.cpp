#include "engine/model/unembed.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <functional>
#include <memory>

#include "engine/lora/lora_nodes.h"

#if LOOM_CUDA_KERNELS
#include <ATen/cuda/CUDAContext.h>

#include "engine/model/cuda/unembed_kernels.h"
#endif

namespace loom::engine {
namespace {

using Run = UnembedSpec::Run;

// The distinct slots of the runs and, per run, which factor pair it uses.
struct Factors {
  std::vector<int64_t> slot, rank;
  std::vector<at::Tensor> a, b;  // [r, hidden], [vocab, r]
  std::vector<size_t> of_run;
};

Factors SliceFactors(const at::Tensor& A, const at::Tensor& B, const std::vector<Run>& runs) {
  Factors f;
  for (const Run& r : runs) {
    auto it = std::find(f.slot.begin(), f.slot.end(), r.slot);
    if (it == f.slot.end()) {
      f.slot.push_back(r.slot);
      f.rank.push_back(r.rank);
      f.a.push_back(A.select(0, r.slot).narrow(0, 0, r.rank));
      f.b.push_back(B.select(0, r.slot).narrow(1, 0, r.rank));
      it = f.slot.end() - 1;
    }
    f.of_run.push_back(static_cast<size_t>(it - f.slot.begin()));
  }
  return f;
}

// Log-probabilities of rows [c0, c0 + n): h [n, hidden] fp32, targets [n] or
// [n, K]. Logits in the model dtype then fp32, plus the LoRA of each run that
// overlaps the chunk; logit[target] - logsumexp.
at::Tensor ChunkLogprobs(const at::Tensor& h, int64_t c0, const at::Tensor& targets, const at::Tensor& lm_head,
                         const std::vector<Run>& runs, const Factors& f) {
  const int64_t n = h.size(0);
  at::Tensor logits = at::linear(h.to(lm_head.scalar_type()), lm_head).to(at::kFloat);
  std::vector<at::Tensor> pieces;
  int64_t row = 0;
  for (size_t i = 0; i < runs.size(); ++i) {
    const int64_t rb = std::max(runs[i].begin, c0) - c0, re = std::min(runs[i].end, c0 + n) - c0;
    if (re <= rb) continue;
    if (rb > row) pieces.push_back(logits.narrow(0, row, rb - row));
    const size_t k = f.of_run[i];
    pieces.push_back(logits.narrow(0, rb, re - rb) +
                     at::linear(at::linear(h.narrow(0, rb, re - rb), f.a[k]), f.b[k]) * runs[i].scale);
    row = re;
  }
  if (!pieces.empty()) {
    if (row < n) pieces.push_back(logits.narrow(0, row, n - row));
    logits = pieces.size() == 1 ? pieces[0] : at::cat(pieces, 0);
  }
  const at::Tensor lse = at::logsumexp(logits, -1, /*keepdim=*/true);  // [n, 1]
  if (targets.dim() == 1) return (logits.gather(1, targets.unsqueeze(1)) - lse).squeeze(1);
  return logits.gather(1, targets) - lse;
}

at::Tensor AllChunks(const at::Tensor& hidden, const at::Tensor& targets, const at::Tensor& lm_head,
                     const std::vector<Run>& runs, const Factors& f, int64_t chunk) {
  const int64_t T = hidden.size(0);
  std::vector<at::Tensor> out;
  for (int64_t c0 = 0; c0 < T; c0 += chunk) {
    const int64_t n = std::min(chunk, T - c0);
    out.push_back(ChunkLogprobs(hidden.narrow(0, c0, n), c0, targets.narrow(0, c0, n), lm_head, runs, f));
  }
  if (out.empty()) return at::zeros(targets.sizes(), hidden.options().dtype(at::kFloat));
  return out.size() == 1 ? out[0] : at::cat(out, 0);
}

std::vector<int64_t> PackRuns(const std::vector<Run>& runs) {
  std::vector<int64_t> v;
  for (const Run& r : runs) v.insert(v.end(), {r.begin, r.end, r.slot, r.rank});
  return v;
}

std::vector<Run> UnpackRuns(const std::vector<int64_t>& v, const std::vector<double>& scales) {
  std::vector<Run> runs(scales.size());
  for (size_t i = 0; i < runs.size(); ++i)
    runs[i] = Run{v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3], scales[i]};
  return runs;
}

// Autograd node that keeps only hidden (plus the frozen lm_head and targets)
// for the backward pass and recomputes each chunk's logits there, one chunk
// at a time, differentiating into hidden and per-slot slices of A and B
// (added into their .grad in place; none returned for A and B).
class CheckpointedLogprobs : public torch::autograd::Function<CheckpointedLogprobs> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& A,
                            const at::Tensor& B, const at::Tensor& lm_head, const at::Tensor& targets,
                            const std::vector<int64_t>& packed_runs, const std::vector<double>& scales,
                            int64_t chunk) {
    const std::vector<Run> runs = UnpackRuns(packed_runs, scales);
    ctx->save_for_backward({hidden, A, B, lm_head, targets});
    ctx->saved_data["runs"] = packed_runs;
    ctx->saved_data["scales"] = scales;
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["need_h"] = hidden.requires_grad();
    ctx->saved_data["need_ab"] = A.defined() && A.requires_grad() && B.requires_grad();
    return AllChunks(hidden, targets, lm_head, runs, SliceFactors(A, B, runs), chunk);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &A = saved[1], &B = saved[2], &lm_head = saved[3], &targets = saved[4];
    const std::vector<Run> runs =
        UnpackRuns(ctx->saved_data["runs"].toIntVector(), ctx->saved_data["scales"].toDoubleVector());
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const bool need_h = ctx->saved_data["need_h"].toBool();
    const bool need_ab = ctx->saved_data["need_ab"].toBool() && !runs.empty();
    const at::Tensor& g = grad_outputs[0];
    torch::autograd::variable_list none(8);
    if (!g.defined()) return none;

    // Fresh leaves for the used slots' factors, so nested autograd yields
    // [r, ...] gradients instead of dense [N, ...] ones per chunk.
    Factors f = SliceFactors(A, B, runs);
    std::vector<at::Tensor> grad_a, grad_b;
    for (size_t k = 0; k < f.slot.size(); ++k) {
      f.a[k] = f.a[k].detach().requires_grad_(need_ab);
      f.b[k] = f.b[k].detach().requires_grad_(need_ab);
      grad_a.push_back(at::zeros_like(f.a[k]));
      grad_b.push_back(at::zeros_like(f.b[k]));
    }
    at::Tensor grad_h = need_h ? at::zeros_like(hidden) : at::Tensor();

    const int64_t T = hidden.size(0);
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
      const int64_t n = std::min(chunk, T - c0);
      at::Tensor hc;
      std::vector<at::Tensor> inputs;
      std::vector<size_t> which;  // factor index of each a/b input pair
      {
        c10::NoGradGuard no_grad;
        hc = hidden.narrow(0, c0, n).detach();
      }
      if (need_h) {
        hc.requires_grad_();
        inputs.push_back(hc);
      }
      if (need_ab)
        for (size_t i = 0; i < runs.size(); ++i) {
          if (runs[i].end <= c0 || runs[i].begin >= c0 + n) continue;
          const size_t k = f.of_run[i];
          if (std::find(which.begin(), which.end(), k) != which.end()) continue;
          which.push_back(k);
          inputs.push_back(f.a[k]);
          inputs.push_back(f.b[k]);
        }
      if (inputs.empty()) continue;
      at::Tensor lp;
      {
        c10::AutoGradMode enable(true);
        lp = ChunkLogprobs(hc, c0, targets.narrow(0, c0, n), lm_head, runs, f);
      }
      const auto grads = torch::autograd::grad({lp}, inputs, {g.narrow(0, c0, n)}, /*retain_graph=*/false,
                                               /*create_graph=*/false, /*allow_unused=*/true);
      c10::NoGradGuard no_grad;
      size_t at_input = 0;
      if (need_h) grad_h.narrow(0, c0, n).copy_(grads[at_input++]);
      for (size_t k : which) {
        if (grads[at_input].defined()) grad_a[k].add_(grads[at_input]);
        if (grads[at_input + 1].defined()) grad_b[k].add_(grads[at_input + 1]);
        at_input += 2;
      }
    }

    torch::autograd::variable_list out(8);
    out[0] = grad_h;
    if (need_ab) {
      // Into the used slots' rows of .grad in place (as lora_nodes.h), not
      // through a dense [N, ...] gradient of the whole bank.
      c10::NoGradGuard no_grad;
      for (size_t k = 0; k < f.slot.size(); ++k) {
        FactorGrad(A).select(0, f.slot[k]).narrow(0, 0, f.rank[k]).add_(grad_a[k]);
        FactorGrad(B).select(0, f.slot[k]).narrow(1, 0, f.rank[k]).add_(grad_b[k]);
      }
    }
    return out;
  }
};

// One chunk of the uniform layout: h [c * L, hidden] fp32, a [c, R, hidden]
// and b [c, vocab, R] the chunk's sequences' factors, scale [c, 1, 1].
at::Tensor UniformChunkLogprobs(const at::Tensor& h, const at::Tensor& targets, const at::Tensor& lm_head,
                                const at::Tensor& a, const at::Tensor& b, const at::Tensor& scale) {
  const int64_t c = a.size(0), n = h.size(0), L = n / c;
  at::Tensor logits = at::linear(h.to(lm_head.scalar_type()), lm_head).to(at::kFloat);
  // (h a^T) b^T * scale, the order of ChunkLogprobs' run term.
  const at::Tensor delta = at::bmm(at::bmm(h.view({c, L, h.size(1)}), a.transpose(1, 2)), b.transpose(1, 2)) * scale;
  logits = logits + delta.view({n, -1});
  const at::Tensor lse = at::logsumexp(logits, -1, /*keepdim=*/true);
  if (targets.dim() == 1) return (logits.gather(1, targets.unsqueeze(1)) - lse).squeeze(1);
  return logits.gather(1, targets) - lse;
}

at::Tensor UniformAllChunks(const at::Tensor& hidden, const at::Tensor& targets, const at::Tensor& lm_head,
                            const at::Tensor& A, const at::Tensor& B, const at::Tensor& slots,
                            const at::Tensor& scale, int64_t len, int64_t chunk) {
  std::vector<at::Tensor> out;
  for (int64_t c0 = 0; c0 < hidden.size(0); c0 += chunk) {
    const int64_t n = std::min(chunk, hidden.size(0) - c0), s0 = c0 / len, c = n / len;
    const at::Tensor sl = slots.narrow(0, s0, c);
    out.push_back(UniformChunkLogprobs(hidden.narrow(0, c0, n), targets.narrow(0, c0, n), lm_head,
                                       A.index_select(0, sl), B.index_select(0, sl), scale.narrow(0, s0, c)));
  }
  return out.size() == 1 ? out[0] : at::cat(out, 0);
}

// The uniform layout's node: keeps hidden (plus the frozen lm_head, the
// targets and the groups' device tensors) and recomputes each chunk in the
// backward, as CheckpointedLogprobs does, with the chunk's factors gathered
// by index on the device.
class UniformLogprobs : public torch::autograd::Function<UniformLogprobs> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& A,
                            const at::Tensor& B, const at::Tensor& lm_head, const at::Tensor& targets,
                            const at::Tensor& slots, const at::Tensor& scale, int64_t len, int64_t chunk) {
    c10::NoGradGuard no_grad;
    ctx->save_for_backward({hidden, A, B, lm_head, targets, slots, scale});
    ctx->saved_data["len"] = len;
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["need_h"] = hidden.requires_grad();
    return UniformAllChunks(hidden, targets, lm_head, A, B, slots, scale, len, chunk);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &A = saved[1], &B = saved[2], &lm_head = saved[3], &targets = saved[4],
                     &slots = saved[5], &scale = saved[6];
    const int64_t len = ctx->saved_data["len"].toInt(), chunk = ctx->saved_data["chunk"].toInt();
    const bool need_h = ctx->saved_data["need_h"].toBool();
    const at::Tensor& g = grad_outputs[0];
    torch::autograd::variable_list out(9);
    if (!g.defined()) return out;
    at::Tensor grad_h = need_h ? at::zeros_like(hidden) : at::Tensor();
    for (int64_t c0 = 0; c0 < hidden.size(0); c0 += chunk) {
      const int64_t n = std::min(chunk, hidden.size(0) - c0), s0 = c0 / len, c = n / len;
      at::Tensor sl, hc, a, b;
      {
        c10::NoGradGuard no_grad;
        sl = slots.narrow(0, s0, c);
        hc = hidden.narrow(0, c0, n).detach().requires_grad_(need_h);
        a = A.index_select(0, sl).requires_grad_();
        b = B.index_select(0, sl).requires_grad_();
      }
      std::vector<at::Tensor> inputs{a, b};
      if (need_h) inputs.push_back(hc);
      at::Tensor lp;
      {
        c10::AutoGradMode enable(true);
        lp = UniformChunkLogprobs(hc, targets.narrow(0, c0, n), lm_head, a, b, scale.narrow(0, s0, c));
      }
      const auto grads = torch::autograd::grad({lp}, inputs, {g.narrow(0, c0, n)}, /*retain_graph=*/false,
                                               /*create_graph=*/false, /*allow_unused=*/true);
      c10::NoGradGuard no_grad;
      if (grads[0].defined()) FactorGrad(A).index_add_(0, sl, grads[0]);
      if (grads[1].defined()) FactorGrad(B).index_add_(0, sl, grads[1]);
      if (need_h) grad_h.narrow(0, c0, n).copy_(grads[2]);
    }
    out[0] = grad_h;
    return out;
  }
};


#if LOOM_CUDA_KERNELS
// The fused loss head (unembed.h, UnembedMode): logits in the model dtype
// (base GEMM, then each LoRA added into them by one more GEMM), the
// logsumexp and the targets read off them by one kernel, the gradient
// written over them by another; nothing of [rows, vocab] in fp32.

bool FusedApplies(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& targets) {
  return hidden.is_cuda() && hidden.dim() == 2 && hidden.size(0) > 0 && lm_head.is_cuda() &&
         lm_head.scalar_type() == at::kBFloat16 && lm_head.dim() == 2 && lm_head.is_contiguous() &&
         (targets.dim() == 1 || targets.size(1) <= cuda::kMaxLogprobTargets);
}

cudaStream_t StreamOf(const at::Tensor& t) { return at::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// [T, K] int64 contiguous, from [T] or [T, K].
at::Tensor Targets2d(const at::Tensor& targets) {
  return (targets.dim() == 1 ? targets.unsqueeze(1) : targets).to(at::kLong).contiguous();
}

// How one chunk's LoRA enters its logits. Add: logits [n, V] += the chunk's
// deltas, from hb [n, H] in the model dtype. Grad: from gl, the logits'
// gradient, add the factors' gradients into the bank's .grad and, where gh
// [n, H] is defined, the delta's input gradient into gh.
struct ChunkLora {
  std::function<void(const at::Tensor& hb, int64_t c0, at::Tensor& logits)> add;
  std::function<void(const at::Tensor& hb, int64_t c0, const at::Tensor& gl, at::Tensor& gh, bool need_ab)> grad;
};

// The runs layout: one GEMM pair per run, each used slot's factors cast once.
ChunkLora RunsChunkLora(const std::vector<Run>& runs, const Factors& f, at::ScalarType dtype, const at::Tensor& A,
                        const at::Tensor& B) {
  auto a = std::make_shared<std::vector<at::Tensor>>(), b = std::make_shared<std::vector<at::Tensor>>();
  for (size_t k = 0; k < f.slot.size(); ++k) {
    a->push_back(f.a[k].to(dtype));
    b->push_back(f.b[k].to(dtype));
  }
  // The run's rows inside chunk [c0, c0 + n), relative to c0.
  auto overlap = [runs](size_t i, int64_t c0, int64_t n) {
    return std::pair<int64_t, int64_t>{std::max(runs[i].begin, c0) - c0, std::min(runs[i].end, c0 + n) - c0};
  };
  ChunkLora l;
  l.add = [runs, f, a, b, overlap](const at::Tensor& hb, int64_t c0, at::Tensor& logits) {
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto [rb, re] = overlap(i, c0, hb.size(0));
      if (re <= rb) continue;
      const size_t k = f.of_run[i];
      const at::Tensor u = at::mm(hb.narrow(0, rb, re - rb), (*a)[k].t());
      logits.narrow(0, rb, re - rb).addmm_(u, (*b)[k].t(), 1.0, runs[i].scale);
    }
  };
  l.grad = [runs, f, a, b, overlap, A, B](const at::Tensor& hb, int64_t c0, const at::Tensor& gl, at::Tensor& gh,
                                          bool need_ab) {
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto [rb, re] = overlap(i, c0, hb.size(0));
      if (re <= rb) continue;
      const size_t k = f.of_run[i];
      const double scale = runs[i].scale;
      const at::Tensor h = hb.narrow(0, rb, re - rb), g = gl.narrow(0, rb, re - rb);
      const at::Tensor gu = at::mm(g, (*b)[k]).mul_(scale);  // [len, r]: d/du of scale * u b^T
      if (need_ab) {
        const at::Tensor u = at::mm(h, (*a)[k].t());
        FactorGrad(B).select(0, f.slot[k]).narrow(1, 0, f.rank[k]).add_(at::mm(g.t(), u), scale);
        FactorGrad(A).select(0, f.slot[k]).narrow(0, 0, f.rank[k]).add_(at::mm(gu.t(), h));
      }
      if (gh.defined()) gh.narrow(0, rb, re - rb).addmm_(gu, (*a)[k]);
    }
  };
  return l;
}

// The uniform layout: whole sequences of L rows per chunk, their factors
// gathered by the device slots, one batched GEMM pair per chunk.
ChunkLora UniformChunkLora(const at::Tensor& A, const at::Tensor& B, const at::Tensor& slots, const at::Tensor& scale,
                           int64_t len, at::ScalarType dtype) {
  struct Chunk {
    at::Tensor sl, a, b, scale;  // [c], [c, R, H], [c, V, R] in dtype, [c, 1, 1] fp32
  };
  auto take = [A, B, slots, scale, len, dtype](int64_t c0, int64_t n) {
    Chunk c;
    c.sl = slots.narrow(0, c0 / len, n / len);
    c.a = A.index_select(0, c.sl).to(dtype);
    c.b = B.index_select(0, c.sl).to(dtype);
    c.scale = scale.narrow(0, c0 / len, n / len);
    return c;
  };
  // scale * (h a^T), rounded once to the model dtype: [c, L, R].
  auto scaled_u = [len](const at::Tensor& hb, const Chunk& c) {
    const at::Tensor u = at::bmm(hb.reshape({c.sl.size(0), len, hb.size(1)}), c.a.transpose(1, 2));
    return (u.to(at::kFloat) * c.scale).to(u.scalar_type());
  };
  ChunkLora l;
  l.add = [take, scaled_u, len](const at::Tensor& hb, int64_t c0, at::Tensor& logits) {
    const Chunk c = take(c0, hb.size(0));
    logits.view({c.sl.size(0), len, logits.size(1)}).baddbmm_(scaled_u(hb, c), c.b.transpose(1, 2));
  };
  l.grad = [take, scaled_u, len, A, B](const at::Tensor& hb, int64_t c0, const at::Tensor& gl, at::Tensor& gh,
                                       bool need_ab) {
    const Chunk c = take(c0, hb.size(0));
    const int64_t S = c.sl.size(0);
    const at::Tensor g = gl.view({S, len, gl.size(1)});
    const at::Tensor gus = at::bmm(g, c.b);  // [c, L, R]
    const at::Tensor gu = (gus.to(at::kFloat) * c.scale).to(gus.scalar_type());
    if (need_ab) {
      FactorGrad(B).index_add_(0, c.sl, at::bmm(g.transpose(1, 2), scaled_u(hb, c)).to(at::kFloat));
      FactorGrad(A).index_add_(0, c.sl, at::bmm(gu.transpose(1, 2), hb.reshape({S, len, hb.size(1)})).to(at::kFloat));
    }
    if (gh.defined()) gh.view({S, len, gh.size(1)}).baddbmm_(gu, c.a);
  };
  return l;
}

// One chunk's logits [n, V] in the model dtype into out: the base GEMM, then
// the LoRA added in place.
void FusedChunkLogits(const at::Tensor& hb, int64_t c0, const at::Tensor& lm_head, const ChunkLora* lora,
                      at::Tensor& out) {
  at::mm_out(out, hb, lm_head.t());
  if (lora) lora->add(hb, c0, out);
}

// The logits buffer of chunk [c0, c0 + n): a row block of the pass's kept
// logits, or the start of one scratch buffer reused by every chunk.
at::Tensor ChunkBuffer(at::Tensor& kept, at::Tensor& scratch, int64_t c0, int64_t n, int64_t chunk,
                       const at::Tensor& lm_head) {
  if (kept.defined()) return kept.narrow(0, c0, n);
  if (!scratch.defined()) scratch = at::empty({chunk, lm_head.size(0)}, lm_head.options());
  return scratch.narrow(0, 0, n);
}

// Forward: logprobs [T, K] fp32 and lse [T] fp32; the logits stay in kept
// when it is defined ([T, V], filled here).
std::pair<at::Tensor, at::Tensor> FusedForward(const at::Tensor& hidden, const at::Tensor& targets2,
                                               const at::Tensor& lm_head, const ChunkLora* lora, int64_t chunk,
                                               at::Tensor& kept) {
  c10::NoGradGuard no_grad;
  const int64_t T = hidden.size(0), V = lm_head.size(0), K = targets2.size(1);
  const at::Tensor hb = hidden.to(lm_head.scalar_type());
  at::Tensor lp = at::empty({T, K}, hidden.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({T}, hidden.options().dtype(at::kFloat));
  at::Tensor scratch;
  for (int64_t c0 = 0; c0 < T; c0 += chunk) {
    const int64_t n = std::min(chunk, T - c0);
    at::Tensor logits = ChunkBuffer(kept, scratch, c0, n, chunk, lm_head);
    FusedChunkLogits(hb.narrow(0, c0, n), c0, lm_head, lora, logits);
    cuda::TargetLogprobs(true, logits.data_ptr(), targets2.narrow(0, c0, n).data_ptr<int64_t>(),
                         lp.narrow(0, c0, n).data_ptr<float>(), lse.narrow(0, c0, n).data_ptr<float>(), n, V, K,
                         StreamOf(hidden));
  }
  return {lp, lse};
}

// Backward: the gradient into hidden (fp32 [T, H], undefined without
// need_h); the factors' into the bank's .grad (through lora). g [T, K].
at::Tensor FusedBackward(const at::Tensor& hidden, const at::Tensor& targets2, const at::Tensor& lm_head,
                         const ChunkLora* lora, int64_t chunk, at::Tensor kept, const at::Tensor& lse,
                         const at::Tensor& g, bool need_h, bool need_ab) {
  c10::NoGradGuard no_grad;
  const int64_t T = hidden.size(0), V = lm_head.size(0), K = targets2.size(1);
  const at::Tensor hb = hidden.to(lm_head.scalar_type());
  const at::Tensor gk = g.to(at::kFloat).reshape({T, K}).contiguous();
  at::Tensor grad_h = need_h ? at::empty(hidden.sizes(), hidden.options()) : at::Tensor();
  at::Tensor scratch;
  for (int64_t c0 = 0; c0 < T; c0 += chunk) {
    const int64_t n = std::min(chunk, T - c0);
    const at::Tensor h = hb.narrow(0, c0, n);
    at::Tensor logits = ChunkBuffer(kept, scratch, c0, n, chunk, lm_head);
    if (!kept.defined()) FusedChunkLogits(h, c0, lm_head, lora, logits);
    cuda::TargetLogprobsGrad(true, logits.data_ptr(), lse.narrow(0, c0, n).data_ptr<float>(),
                             targets2.narrow(0, c0, n).data_ptr<int64_t>(), gk.narrow(0, c0, n).data_ptr<float>(), n,
                             V, K, StreamOf(hidden));
    at::Tensor gh = need_h ? at::mm(logits, lm_head) : at::Tensor();
    if (lora) lora->grad(h, c0, logits, gh, need_ab);
    if (need_h) grad_h.narrow(0, c0, n).copy_(gh);
  }
  return grad_h;
}

at::Tensor Shaped(const at::Tensor& lp, const at::Tensor& targets) { return targets.dim() == 1 ? lp.squeeze(1) : lp; }

// The pass's ChunkLora, from what the fused node saves: the uniform layout
// where slots is defined (its device slots and scales, L rows a sequence),
// else the runs (packed as PackRuns); null when nothing adds a LoRA.
std::unique_ptr<ChunkLora> MakeChunkLora(const at::Tensor& A, const at::Tensor& B, const at::Tensor& slots,
                                         const at::Tensor& scale, const std::vector<int64_t>& packed_runs,
                                         const std::vector<double>& scales, int64_t len, at::ScalarType dtype) {
  if (!A.defined() || A.numel() == 0) return nullptr;
  if (slots.defined() && slots.numel() > 0)
    return std::make_unique<ChunkLora>(UniformChunkLora(A, B, slots, scale, len, dtype));
  if (scales.empty()) return nullptr;
  const std::vector<Run> runs = UnpackRuns(packed_runs, scales);
  return std::make_unique<ChunkLora>(RunsChunkLora(runs, SliceFactors(A, B, runs), dtype, A, B));
}

// The fused node of both layouts: saves hidden, the targets, lse and (kept)
// the logits; the backward recomputes the logits unless kept. Absent tensors
// (A, B, slots, scale) enter as empty ones.
class FusedLogprobs : public torch::autograd::Function<FusedLogprobs> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& A,
                            const at::Tensor& B, const at::Tensor& lm_head, const at::Tensor& targets,
                            const at::Tensor& slots, const at::Tensor& scale, const std::vector<int64_t>& packed_runs,
                            const std::vector<double>& scales, int64_t len, int64_t chunk, bool keep, bool need_ab) {
    const at::Tensor t2 = Targets2d(targets);
    at::Tensor kept = keep ? at::empty({hidden.size(0), lm_head.size(0)}, lm_head.options()) : at::Tensor();
    const auto lora = MakeChunkLora(A, B, slots, scale, packed_runs, scales, len, lm_head.scalar_type());
    auto [lp, lse] = FusedForward(hidden, t2, lm_head, lora.get(), chunk, kept);
    ctx->save_for_backward({hidden, A, B, lm_head, t2, lse, slots, scale});
    ctx->saved_data["kept"] = kept;
    ctx->saved_data["runs"] = packed_runs;
    ctx->saved_data["scales"] = scales;
    ctx->saved_data["len"] = len;
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["need_h"] = hidden.requires_grad();
    ctx->saved_data["need_ab"] = need_ab;
    return Shaped(lp, targets);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    torch::autograd::variable_list out(13);
    const at::Tensor& g = grad_outputs[0];
    if (!g.defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &hidden = saved[0], &A = saved[1], &B = saved[2], &lm_head = saved[3];
    const auto lora = MakeChunkLora(A, B, saved[6], saved[7], ctx->saved_data["runs"].toIntVector(),
                                    ctx->saved_data["scales"].toDoubleVector(), ctx->saved_data["len"].toInt(),
                                    lm_head.scalar_type());
    const at::Tensor kept = ctx->saved_data["kept"].toTensor();
    ctx->saved_data.erase("kept");  // the logits go as soon as their gradient is used
    out[0] = FusedBackward(hidden, saved[4], lm_head, lora.get(), ctx->saved_data["chunk"].toInt(), kept, saved[5],
                           g, ctx->saved_data["need_h"].toBool(), ctx->saved_data["need_ab"].toBool());
    return out;
  }
};
#endif
}  // namespace

UnembedSpec MakeUnembedSpec(const SlotBank& bank, const std::vector<int64_t>& seq_begin,
                            const std::vector<int>& seq_slot) {
  UnembedSpec spec;
  const LoraTarget* t = bank.find("lm_head");
  if (!t) return spec;
  spec.A = t->A;
  spec.B = t->B;
  for (size_t i = 0; i < seq_slot.size(); ++i) {
    const int s = seq_slot[i];
    if (!bank.trains(s, TargetGroup::kUnembed) || seq_begin[i + 1] == seq_begin[i]) continue;
    const LoraConfig& c = bank.slot(s).config;
    if (!spec.runs.empty() && spec.runs.back().slot == s && spec.runs.back().end == seq_begin[i]) {
      spec.runs.back().end = seq_begin[i + 1];  // extend the run of a neighbouring same-slot sequence
      continue;
    }
    spec.runs.push_back(Run{seq_begin[i], seq_begin[i + 1], s, c.rank, c.alpha / c.rank});
  }
  return spec;
}

at::Tensor ChunkedTargetLogprobs(const at::Tensor& hidden, const at::Tensor& targets, const at::Tensor& lm_head,
                                 const UnembedSpec& spec, int64_t chunk_tokens, UnembedMode mode) {
  const int64_t chunk = std::max<int64_t>(1, chunk_tokens);
  const bool lora_grad = spec.A.defined() && !spec.runs.empty() && spec.A.requires_grad();
  std::vector<double> scales;
  for (const Run& r : spec.runs) scales.push_back(r.scale);
#if LOOM_CUDA_KERNELS
  if (mode != UnembedMode::kPlain && FusedApplies(hidden, lm_head, targets)) {
    const at::Tensor none = at::empty({0}, hidden.options());
    const at::Tensor A = spec.A.defined() ? spec.A : none, B = spec.B.defined() ? spec.B : none;
    const bool grad = c10::GradMode::is_enabled() && (hidden.requires_grad() || lora_grad);
    return FusedLogprobs::apply(hidden, A, B, lm_head, targets, none, none, PackRuns(spec.runs), scales, int64_t{1},
                                chunk, grad && mode == UnembedMode::kKeep, lora_grad);
  }
#else
  (void)mode;
#endif
  if (c10::GradMode::is_enabled() && (hidden.requires_grad() || lora_grad))
    return CheckpointedLogprobs::apply(hidden, spec.A, spec.B, lm_head, targets, PackRuns(spec.runs), scales,
                                       chunk);
  const Factors f = spec.A.defined() ? SliceFactors(spec.A, spec.B, spec.runs) : Factors{};
  return AllChunks(hidden, targets, lm_head, spec.runs, f, chunk);
}

}  // namespace loom::engine

namespace loom::engine {

at::Tensor UniformTargetLogprobs(const at::Tensor& hidden, const at::Tensor& targets, const at::Tensor& lm_head,
                                 const at::Tensor& A, const at::Tensor& B, const LoraGroups& groups,
                                 int64_t chunk_tokens, UnembedMode mode) {
  const int64_t len = groups.max_rows;
  TORCH_CHECK(len > 0 && chunk_tokens % len == 0 && hidden.size(0) == groups.rows,
              "UniformTargetLogprobs: chunk ", chunk_tokens, " is not a multiple of ", len, " or rows differ");
  const at::Tensor scale = groups.scale.view({-1, 1, 1});
#if LOOM_CUDA_KERNELS
  if (mode != UnembedMode::kPlain && FusedApplies(hidden, lm_head, targets)) {
    const bool grad = c10::GradMode::is_enabled() && (hidden.requires_grad() || A.requires_grad());
    const at::Tensor slots = groups.slots.defined() ? groups.slots : at::empty({0}, hidden.options().dtype(at::kLong));
    return FusedLogprobs::apply(hidden, A, B, lm_head, targets, slots, scale, std::vector<int64_t>{},
                                std::vector<double>{}, len, chunk_tokens, grad && mode == UnembedMode::kKeep,
                                A.requires_grad());
  }
#else
  (void)mode;
#endif
  if (c10::GradMode::is_enabled() && (hidden.requires_grad() || A.requires_grad()))
    return UniformLogprobs::apply(hidden, A, B, lm_head, targets, groups.slots, scale, len, chunk_tokens);
  return UniformAllChunks(hidden, targets, lm_head, A, B, groups.slots, scale, len, chunk_tokens);
}

}  // namespace loom::engine
