#include "engine/train/forward_backward.h"

#include <c10/core/GradMode.h>
#include "engine/train/text.h"

#include <cmath>
#include <deque>
#include <memory>
#include <optional>

#include "engine/train/loss_spec.h"
#include "engine/train/losses.h"
#include "engine/train/pass_graphs.h"
#include "engine/train/shared_prefix.h"

namespace loom::engine::train {
namespace {

// Where a datum's rows lie in the packed batch: its shared prefix's
// (prefix_rows of them from prefix_begin; none without), then its own.
struct DatumRows {
  int64_t prefix_begin = 0, prefix_rows = 0, begin = 0;
};

// One call's share of the packed batch: rows [begin, begin + tokens).
struct Part {
  size_t call = 0;
  LossSpec spec;
  std::vector<const Datum*> data;
  int64_t begin = 0;
  int64_t tokens = 0;
  // With shared prefixes (shared_prefix.h): the call's sequences in the
  // pass (each group's shared rows once, then every datum's rest), and how
  // many datums each of those rows stands for.
  std::vector<const Datum*> pieces;
  std::vector<float> weight;
  std::vector<DatumRows> rows;  // per datum
};


Status CheckSlot(const SlotBank& bank, int slot) {
  if (slot < 0 || slot >= bank.num_slots())
    return Status::Invalid(Cat("slot: ", slot, " is outside [0, ", bank.num_slots(), ")"));
  if (!bank.slot(slot).bound) return Status::Precondition(Cat("slot ", slot, " is not bound to a model"));
  return Status::Ok();
}

// A datum's n rows of a host tensor ([T] or [T, K]) as an Array with the
// datum's own shape: (n,) when k == 0, else (n, k).
Array ToArray(const at::Tensor& host, const DatumRows& at, int64_t n, int64_t k) {
  Array a;
  a.dtype = Array::DType::kFloat32;
  at::Tensor rows = at.prefix_rows == 0 ? host.narrow(0, at.begin, n)
                                        : at::cat({host.narrow(0, at.prefix_begin, at.prefix_rows),
                                                   host.narrow(0, at.begin, n - at.prefix_rows)});
  if (k == 0) {
    a.shape = {n};
    if (rows.dim() == 2) rows = rows.select(1, 0);
  } else {
    a.shape = {n, k};
    rows = rows.narrow(1, 0, k);
  }
  rows = rows.to(at::kFloat).contiguous();
  a.f32.assign(rows.data_ptr<float>(), rows.data_ptr<float>() + rows.numel());
  return a;
}

// A part's per-row losses, each shared prefix's rows counted once for every
// datum they stand for (as many times as those datums trained one by one).
at::Tensor SharedRowsWeighted(const at::Tensor& elem, const Part& p) {
  bool shared = false;
  for (float w : p.weight) shared = shared || w != 1.0f;
  if (!shared) return elem;
  std::vector<float> per_row;
  per_row.reserve(static_cast<size_t>(p.tokens));
  for (size_t i = 0; i < p.pieces.size(); ++i) per_row.insert(per_row.end(), p.pieces[i]->tokens.size(), p.weight[i]);
  at::Tensor w = at::tensor(per_row, at::TensorOptions().dtype(at::kFloat)).to(elem.device(), elem.scalar_type());
  return elem * (elem.dim() == 2 ? w.unsqueeze(1) : w);
}

}  // namespace

std::vector<Result<ForwardBackwardOutput>> ForwardBackward(const Transformer& model, SlotBank& bank,
                                                           const std::vector<ForwardBackwardCall>& calls,
                                                           int64_t vocab_size, int64_t context_window,
                                                           int64_t recompute_layers, PassGraphs* graphs,
                                                           int64_t share_min_rows) {
  std::vector<Result<ForwardBackwardOutput>> results(calls.size(), Status::Internal("not run"));
  // 1. Validate; valid calls with data join the batch, in call order.
  std::vector<Part> parts;
  std::deque<Datum> pieces;  // the shared prefixes' pieces of datums
  std::vector<std::vector<int32_t>> seqs;
  std::vector<int> seq_slots, seq_prefix;
  bool shared = false;
  int64_t rows = 0, k_cols = 0;
  bool any_backward = false;
  for (size_t c = 0; c < calls.size(); ++c) {
    const ForwardBackwardCall& call = calls[c];
    Status s = CheckSlot(bank, call.slot);
    if (s.ok()) s = ValidateCallData(call, vocab_size, context_window);
    if (!s.ok()) {
      results[c] = s;
      continue;
    }
    if (call.data.empty()) {
      ForwardBackwardOutput empty;
      empty.metrics["loss:sum"] = 0.0;
      results[c] = empty;
      continue;
    }
    Part part;
    part.call = c;
    part.spec = LossSpec::Parse(call.loss_fn, call.loss_fn_config).value();
    part.begin = rows;
    for (const Datum& d : call.data) {
      part.data.push_back(&d);
      k_cols = std::max(k_cols, TopK(d));
    }
    // The call's sequences: its datums whole, or each group's shared rows
    // once and every datum's rest after them.
    int64_t row = rows;
    auto add = [&](const Datum* d, float weight, int prefix) {
      part.pieces.push_back(d);
      part.weight.push_back(weight);
      seqs.push_back(d->tokens);
      seq_slots.push_back(call.slot);
      seq_prefix.push_back(prefix);
      row += static_cast<int64_t>(d->tokens.size());
    };
    // Every datum whole (a group of one) where nothing is shared.
    std::vector<PrefixGroup> groups;
    if (share_min_rows > 0 && model.config().SharesPrefixes()) groups = PlanSharedPrefixes(call.data, share_min_rows);
    if (groups.empty())
      for (size_t d = 0; d < call.data.size(); ++d) groups.push_back(PrefixGroup{d, 1, 0});
    for (const PrefixGroup& g : groups) {
      DatumRows at;
      int prefix = -1;
      if (g.rows > 0) {
        shared = true;
        at = {row, g.rows, 0};
        prefix = static_cast<int>(seqs.size());
        pieces.push_back(SliceDatum(call.data[g.first], 0, g.rows));
        add(&pieces.back(), static_cast<float>(g.count), -1);
      }
      for (size_t d = g.first; d < g.first + g.count; ++d) {
        const Datum& datum = call.data[d];
        at.begin = row;
        part.rows.push_back(at);
        if (g.rows == 0) {
          add(&datum, 1.0f, -1);
          continue;
        }
        pieces.push_back(SliceDatum(datum, g.rows, static_cast<int64_t>(datum.tokens.size())));
        add(&pieces.back(), 1.0f, prefix);
      }
    }
    part.tokens = row - rows;
    rows += part.tokens;
    any_backward = any_backward || !call.forward_only;
    parts.push_back(std::move(part));
  }
  if (parts.empty()) return results;

  std::vector<const Datum*> all_data;
  for (const Part& p : parts) all_data.insert(all_data.end(), p.data.begin(), p.data.end());
  std::vector<DatumRows> datum_rows;  // in all_data order
  std::vector<double> loss_values;  // per part

  // 2a. A small pass of one loss, all with a backward, in the uniform layout
  // (as CUDA graphs on the GPU: pass_graphs.h).
  std::optional<UniformResult> uniform;
  if (graphs && recompute_layers == 0 && k_cols == 0 && any_backward && !shared) {
    bool same = true;
    for (const Part& p : parts)
      same = same && !calls[p.call].forward_only && p.spec == parts[0].spec;
    if (same) uniform = graphs->Run(model, bank, parts[0].spec, all_data, seq_slots);
  }
  at::Tensor lp_host, elem_host;
  if (uniform) {
    lp_host = uniform->logprobs;
    elem_host = uniform->elementwise;
    size_t j = 0;
    for (const Part& p : parts) {
      double sum = 0;
      for (size_t k = 0; k < p.data.size(); ++k, ++j) {
        datum_rows.push_back(DatumRows{0, 0, static_cast<int64_t>(j) * uniform->len});
        sum += uniform->loss[j];
      }
      loss_values.push_back(sum);
    }
  } else {
    // 2b. One packed forward (no autograd graph when nothing needs a backward).
    const at::Device device = model.device();
    std::unique_ptr<c10::NoGradGuard> no_grad;
    if (!any_backward) no_grad = std::make_unique<c10::NoGradGuard>();
    std::vector<const Datum*> all_pieces;
    for (const Part& p : parts) all_pieces.insert(all_pieces.end(), p.pieces.begin(), p.pieces.end());
    at::Tensor targets = PackTargets(all_pieces, k_cols).to(device);
    PackedBatch batch = PackedBatch::Make(seqs, seq_slots, device, shared ? seq_prefix : std::vector<int>{});
    at::Tensor hidden = model.Hidden(batch, bank, recompute_layers);
    // With every layer kept the plan has room for the logits too (the
    // calibration probes kept theirs: memory_plan.h).
    at::Tensor logprobs = model.TargetLogprobs(hidden, targets, batch, bank, 1024,
                                               recompute_layers == 0 ? UnembedMode::kKeep : UnembedMode::kRecompute);

    // 3. Per-call losses; one host sync for all of them.
    std::vector<at::Tensor> elementwise, losses;
    for (const Part& p : parts) {
      at::Tensor lp = logprobs.narrow(0, p.begin, p.tokens);
      const bool top_k = p.spec.AllowsTopK() && k_cols > 0;
      if (!top_k && lp.dim() == 2) lp = lp.select(1, 0);
      LossInputs in = PackLossInputs(p.spec, p.pieces, top_k ? k_cols : 0, device);
      at::Tensor elem = ElementwiseLoss(p.spec, lp, in);
      // One width for all parts' rows (a 1-D part next to top-K ones fills column 0).
      elementwise.push_back(k_cols > 0 && elem.dim() == 1 ? at::constant_pad_nd(elem.unsqueeze(1), {0, k_cols - 1})
                                                          : elem);
      losses.push_back(SharedRowsWeighted(elem, p).sum());
    }
    at::Tensor loss_host = at::stack(losses).detach().to(at::kDouble).cpu();
    loss_values.assign(loss_host.data_ptr<double>(), loss_host.data_ptr<double>() + parts.size());

    // 4. One backward of the finite losses of calls that want gradients (their
    // slots' gradients may then be non-zero: grad_dirty).
    at::Tensor total;
    std::vector<int> touched;
    for (size_t i = 0; i < parts.size(); ++i) {
      if (calls[parts[i].call].forward_only || !std::isfinite(loss_values[i])) continue;
      total = total.defined() ? total + losses[i] : losses[i];
      touched.push_back(calls[parts[i].call].slot);
    }
    if (total.defined() && total.requires_grad()) {
      for (int s : touched) bank.slot(s).grad_dirty = true;
      total.backward();
    }
    lp_host = logprobs.detach().cpu();
    elem_host = (elementwise.size() == 1 ? elementwise[0] : at::cat(elementwise, 0)).detach().cpu();
    for (const Part& p : parts) datum_rows.insert(datum_rows.end(), p.rows.begin(), p.rows.end());
  }

  // 5. Outputs in datum order.
  size_t j = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& p = parts[i];
    if (!std::isfinite(loss_values[i])) {
      results[p.call] = Status::Invalid(Cat("loss_fn_inputs: the ", p.spec.name, " loss is not finite for this request's data (e.g. logprobs far below the model's, overflowing the ratio); no gradient was accumulated"));
      j += p.data.size();
      continue;
    }
    ForwardBackwardOutput out;
    for (const Datum* d : p.data) {
      const int64_t n = static_cast<int64_t>(d->tokens.size());
      const int64_t k = TopK(*d);
      std::map<std::string, Array> o;
      o["logprobs"] = ToArray(lp_host, datum_rows[j], n, k);
      o["elementwise_loss"] = ToArray(elem_host, datum_rows[j], n, k);
      out.outputs.push_back(std::move(o));
      ++j;
    }
    out.metrics["loss:sum"] = loss_values[i];
    results[p.call] = std::move(out);
  }
  return results;
}

}  // namespace loom::engine::train
