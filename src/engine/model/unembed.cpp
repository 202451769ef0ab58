#include "engine/model/unembed.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "engine/lora/lora_nodes.h"

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
                                 const UnembedSpec& spec, int64_t chunk_tokens) {
  const int64_t chunk = std::max<int64_t>(1, chunk_tokens);
  const bool lora_grad = spec.A.defined() && !spec.runs.empty() && spec.A.requires_grad();
  if (c10::GradMode::is_enabled() && (hidden.requires_grad() || lora_grad)) {
    std::vector<double> scales;
    for (const Run& r : spec.runs) scales.push_back(r.scale);
    return CheckpointedLogprobs::apply(hidden, spec.A, spec.B, lm_head, targets, PackRuns(spec.runs), scales,
                                       chunk);
  }
  const Factors f = spec.A.defined() ? SliceFactors(spec.A, spec.B, spec.runs) : Factors{};
  return AllChunks(hidden, targets, lm_head, spec.runs, f, chunk);
}

}  // namespace loom::engine

namespace loom::engine {

at::Tensor UniformTargetLogprobs(const at::Tensor& hidden, const at::Tensor& targets, const at::Tensor& lm_head,
                                 const at::Tensor& A, const at::Tensor& B, const LoraGroups& groups,
                                 int64_t chunk_tokens) {
  const int64_t len = groups.max_rows;
  TORCH_CHECK(len > 0 && chunk_tokens % len == 0 && hidden.size(0) == groups.rows,
              "UniformTargetLogprobs: chunk ", chunk_tokens, " is not a multiple of ", len, " or rows differ");
  const at::Tensor scale = groups.scale.view({-1, 1, 1});
  if (c10::GradMode::is_enabled() && (hidden.requires_grad() || A.requires_grad()))
    return UniformLogprobs::apply(hidden, A, B, lm_head, targets, groups.slots, scale, len, chunk_tokens);
  return UniformAllChunks(hidden, targets, lm_head, A, B, groups.slots, scale, len, chunk_tokens);
}

}  // namespace loom::engine
