#include "engine/sample/model_runner.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <limits>
#include <type_traits>

namespace loom::engine::sample {
namespace {

at::Tensor LongTensor(const std::vector<int64_t>& v, at::Device d) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(d);
}

// The most context reads (the sum over rows of their context lengths) a fast
// prefill takes. The decode attention reads each row's context once per
// head, with no tiling over queries as a prefill kernel has: 2^19 is ~two
// 256-row decode steps over 1,024-token contexts, beyond which the eager
// prefill's fused attention does better (e.g. 1,024 new tokens over a
// 4,096-token prefix).
constexpr int64_t kFastPrefillContext = int64_t{1} << 19;
// Rows per fast-prefill replay: the largest batch bucket of decode steps at
// the default 256 rows (SamplerOptions::max_batch_rows), so prefill needs no
// graph of a size decode does not (each graph keeps [rows, vocab] fp32
// logits: 155 MB at 256 rows of qwen3-4b's vocabulary).
constexpr int64_t kFastPrefillSlice = std::min<int64_t>(256, kFastDecodeMaxRows);

// A PackedBatch that only routes rows to slots (Logits / TargetLogprobs use
// seq_begin and seq_slot, not the tokens).
PackedBatch Routing(std::vector<int64_t> seq_begin, std::vector<int> seq_slot) {
  PackedBatch b;
  b.seq_begin = std::move(seq_begin);
  b.seq_slot = std::move(seq_slot);
  return b;
}

}  // namespace

ModelRunner::ModelRunner(std::shared_ptr<const Transformer> model, SlotBank* bank, int64_t num_blocks,
                         int64_t block_size, const DecodeOptions& decode)
    : model_(std::move(model)), bank_(bank), block_size_(block_size), fast_prefill_tokens_(decode.fast_prefill_tokens) {
  const ModelConfig& c = model_->config();
  cache_ = KvCache::Allocate(Transformer::KvShapes(c), (num_blocks + 1) * block_size, model_->device(), model_->dtype());
  fast_ = MakeFastDecode(model_, bank_, &cache_, block_size_, num_blocks * block_size_, decode);
}

int64_t ModelRunner::KvBytesPerToken(const Transformer& model) {
  const ModelConfig& c = model.config();
  int64_t elements = 0;
  for (const KvRowShape& shape : Transformer::KvShapes(c)) elements += shape.elements();
  return elements * static_cast<int64_t>(c10::elementSize(model.dtype()));
}

int64_t ModelRunner::StateBytesPerRow(const Transformer& model) {
  const ModelConfig& c = model.config();
  int64_t elements = 0;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i)
    if (c.IsLinearLayer(i)) elements += c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
  return elements * static_cast<int64_t>(sizeof(float));
}

bool ModelRunner::ReserveStates(int64_t slots) {
  const ModelConfig& c = model_->config();
  cache_.state.assign(cache_.k.size(), at::Tensor());
  bool any = false;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    if (!c.IsLinearLayer(i)) continue;
    cache_.state[i] = at::zeros({slots, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim},
                                at::TensorOptions().dtype(at::kFloat).device(model_->device()));
    any = true;
  }
  if (!any) cache_.state.clear();
  return any;
}

void ModelRunner::CopyState(int src, int dst) {
  c10::NoGradGuard no_grad;
  for (at::Tensor& s : cache_.state)
    if (s.defined()) s[dst].copy_(s[src]);
}

int64_t ModelRunner::Row(const Sequence& s, int64_t pos) const {
  return static_cast<int64_t>(s.block_table[pos / block_size_]) * block_size_ + pos % block_size_;
}

void ModelRunner::AddDecodeRows(const std::vector<Sequence*>& seqs, DecodeStep* step) const {
  for (const Sequence* s : seqs) {
    step->tokens.push_back(s->tokens.back());
    step->positions.push_back(s->cached);
    step->write_rows.push_back(Row(*s, s->cached));
    step->ctx_len.push_back(static_cast<int32_t>(s->cached + 1));
    step->tables.push_back(&s->block_table);
    step->slots.push_back(s->request->slot);
  }
}

bool ModelRunner::AddChunkRows(const std::vector<PrefillChunk>& chunks, DecodeStep* step,
                               std::vector<int64_t>* last) const {
  int64_t rows = 0, reads = 0;
  for (const PrefillChunk& c : chunks) {
    if (c.request->call.prompt_logprobs || c.request->call.topk_prompt_logprobs > 0) return false;
    rows += c.end - c.begin;
    reads += (c.end * (c.end + 1) - c.begin * (c.begin + 1)) / 2;  // positions begin..end-1 read p + 1 each
  }
  if (rows == 0 || rows > fast_prefill_tokens_ || reads > kFastPrefillContext) return false;
  for (const PrefillChunk& c : chunks) {
    const SampleRequest& r = *c.request;
    const Sequence& s0 = *r.sequences[0];
    for (int64_t p = c.begin; p < c.end; ++p) {
      step->tokens.push_back(r.call.prompt[p]);
      step->positions.push_back(p);
      step->write_rows.push_back(Row(s0, p));
      step->ctx_len.push_back(static_cast<int32_t>(p + 1));
      step->tables.push_back(&s0.block_table);
      step->slots.push_back(r.slot);
    }
    last->push_back(static_cast<int64_t>(step->tokens.size()) - 1);
  }
  return true;
}

at::Tensor ModelRunner::Replay(const DecodeStep& all, const std::vector<int64_t>& picks) {
  const int64_t rows = static_cast<int64_t>(all.tokens.size());
  const auto part = [](const auto& v, int64_t b, int64_t n) { return std::decay_t<decltype(v)>(v.begin() + b, v.begin() + b + n); };
  std::vector<at::Tensor> picked;
  size_t next = 0;
  for (int64_t b = 0; b < rows; b += kFastPrefillSlice) {
    const int64_t n = std::min(kFastPrefillSlice, rows - b);
    DecodeStep step;
    step.tokens = part(all.tokens, b, n);
    step.positions = part(all.positions, b, n);
    step.write_rows = part(all.write_rows, b, n);
    step.ctx_len = part(all.ctx_len, b, n);
    step.tables = part(all.tables, b, n);
    step.slots = part(all.slots, b, n);
    const at::Tensor logits = fast_->Decode(step);  // valid until the next Decode: picked rows are copies
    if (!logits.defined()) return {};  // the caller's eager fallback rewrites every new row's K/V
    std::vector<int64_t> mine;
    for (; next < picks.size() && picks[next] < b + n; ++next) mine.push_back(picks[next] - b);
    if (!mine.empty()) picked.push_back(logits.index_select(0, LongTensor(mine, logits.device())));
  }
  return picked.size() == 1 ? picked[0] : at::cat(picked, 0);
}

at::Tensor ModelRunner::FastPrefill(const std::vector<PrefillChunk>& chunks) {
  if (!fast_) return {};
  DecodeStep all;
  std::vector<int64_t> last;  // each chunk's last row: its logits are the step's
  if (!AddChunkRows(chunks, &all, &last)) return {};
  at::Tensor logits = Replay(all, last);
  if (logits.defined()) ++fast_prefills_;
  return logits;
}

at::Tensor ModelRunner::Mixed(const std::vector<Sequence*>& seqs, const std::vector<PrefillChunk>& chunks) {
  c10::NoGradGuard no_grad;
  if (!fast_ || seqs.empty()) return {};
  DecodeStep all;
  AddDecodeRows(seqs, &all);
  std::vector<int64_t> picks(seqs.size());
  for (size_t i = 0; i < seqs.size(); ++i) picks[i] = static_cast<int64_t>(i);
  if (!AddChunkRows(chunks, &all, &picks)) return {};
  at::Tensor logits = Replay(all, picks);
  if (logits.defined()) ++mixed_steps_;
  return logits;
}

at::Tensor ModelRunner::Prefill(const std::vector<PrefillChunk>& chunks) {
  c10::NoGradGuard no_grad;
  if (at::Tensor logits = FastPrefill(chunks); logits.defined()) return logits;
  const at::Device dev = model_->device();
  std::vector<int64_t> tokens, positions, rows, seq_begin{0}, last, seq_cached, cached_rows;
  std::vector<int> slots;
  for (const PrefillChunk& c : chunks) {
    const SampleRequest& r = *c.request;
    const Sequence& s0 = *r.sequences[0];
    for (int64_t p = 0; p < c.begin; ++p) cached_rows.push_back(Row(s0, p));
    for (int64_t p = c.begin; p < c.end; ++p) {
      tokens.push_back(r.call.prompt[p]);
      positions.push_back(p);
      rows.push_back(Row(s0, p));
    }
    seq_cached.push_back(c.begin);
    seq_begin.push_back(static_cast<int64_t>(tokens.size()));
    last.push_back(seq_begin.back() - 1);
    slots.push_back(r.slot);
  }
  CachedBatch b;
  b.tokens = LongTensor(tokens, dev);
  b.positions = LongTensor(positions, dev);
  b.write_rows = LongTensor(rows, dev);
  b.seq_begin = seq_begin;
  b.seq_slot = slots;
  b.prefill = true;
  if (!cache_.state.empty())
    for (const PrefillChunk& c : chunks) b.seq_state.push_back(c.request->sequences[0]->state);
  if (!cached_rows.empty()) {
    b.seq_cached = std::move(seq_cached);
    b.cached_rows = LongTensor(cached_rows, dev);
  }
  const at::Tensor hidden = model_->ForwardCached(b, cache_, *bank_);
  // A request asking for prompt logprobs reused no prefix and is never split
  // (the scheduler's rules), so its whole prompt is in hidden.
  for (size_t i = 0; i < chunks.size(); ++i) PromptLogprobs(*chunks[i].request, hidden, seq_begin[i]);
  std::vector<int64_t> one_each(chunks.size() + 1);
  for (size_t i = 0; i < one_each.size(); ++i) one_each[i] = static_cast<int64_t>(i);
  return model_->Logits(hidden.index_select(0, LongTensor(last, dev)), Routing(one_each, slots), *bank_);
}

void ModelRunner::PromptLogprobs(SampleRequest& r, const at::Tensor& hidden, int64_t begin) {
  const int64_t P = r.prompt_len();
  const int64_t K = r.call.topk_prompt_logprobs;
  if (!r.call.prompt_logprobs && K <= 0) return;
  const at::Device dev = model_->device();
  const at::Tensor h = hidden.narrow(0, begin, P - 1);  // position t predicts prompt[t + 1]
  if (r.call.prompt_logprobs) {
    std::vector<float> out(static_cast<size_t>(P), std::numeric_limits<float>::quiet_NaN());
    if (P > 1) {
      std::vector<int64_t> targets(r.call.prompt.begin() + 1, r.call.prompt.end());
      const at::Tensor lp =
          model_->TargetLogprobs(h, LongTensor(targets, dev), Routing({0, P - 1}, {r.slot}), *bank_)
              .to(at::kCPU)
              .contiguous();
      std::copy(lp.data_ptr<float>(), lp.data_ptr<float>() + (P - 1), out.begin() + 1);
    }
    r.output.prompt_logprobs = std::move(out);
  }
  if (K > 0) {
    const int64_t k = std::min<int64_t>(K, model_->config().vocab_size);
    SampleOutput& o = r.output;
    o.topk = static_cast<int32_t>(K);
    o.topk_token_ids.assign(static_cast<size_t>(P * K), 0);
    o.topk_logprobs.assign(static_cast<size_t>(P * K), SampleOutput::kTopkPad);
    const int64_t chunk = 256;
    for (int64_t c0 = 0; c0 < P - 1; c0 += chunk) {
      const int64_t n = std::min(chunk, P - 1 - c0);
      const at::Tensor logits = model_->Logits(h.narrow(0, c0, n), Routing({0, n}, {r.slot}), *bank_);
      at::Tensor vals, ids;
      std::tie(vals, ids) = at::log_softmax(logits, -1).topk(k, -1);
      vals = vals.to(at::kCPU).contiguous();
      ids = ids.to(at::kCPU).contiguous();
      for (int64_t i = 0; i < n; ++i)
        for (int64_t j = 0; j < k; ++j) {
          const size_t at_cell = static_cast<size_t>((c0 + i + 1) * K + j);
          o.topk_token_ids[at_cell] = static_cast<int32_t>(ids.data_ptr<int64_t>()[i * k + j]);
          o.topk_logprobs[at_cell] = vals.data_ptr<float>()[i * k + j];
        }
    }
  }
}

at::Tensor ModelRunner::Decode(const std::vector<Sequence*>& seqs) {
  c10::NoGradGuard no_grad;
  const at::Device dev = model_->device();
  const int64_t S = static_cast<int64_t>(seqs.size());
  if (fast_) {
    DecodeStep step;
    AddDecodeRows(seqs, &step);
    if (at::Tensor logits = fast_->Decode(step); logits.defined()) return logits;
  }
  int64_t L = 0;
  for (const Sequence* s : seqs) L = std::max(L, s->cached + 1);
  std::vector<int64_t> tokens(S), positions(S), rows(S), seq_begin(S + 1), ctx(static_cast<size_t>(S * L));
  std::vector<uint8_t> mask(static_cast<size_t>(S * L), 0);
  std::vector<int> slots(S);
  for (int64_t i = 0; i < S; ++i) {
    const Sequence& s = *seqs[i];
    tokens[i] = s.tokens.back();
    positions[i] = s.cached;
    rows[i] = Row(s, s.cached);
    seq_begin[i + 1] = i + 1;
    slots[i] = s.request->slot;
    // Context positions past the sequence's own length are masked, but still
    // read: they point at its own first row, never at a row of another
    // sequence (0 * inf would carry a poisoned neighbour's values in).
    for (int64_t p = 0; p < L; ++p) {
      ctx[i * L + p] = Row(s, p <= s.cached ? p : 0);
      mask[i * L + p] = p <= s.cached ? 1 : 0;
    }
  }
  CachedBatch b;
  b.tokens = LongTensor(tokens, dev);
  b.positions = LongTensor(positions, dev);
  b.write_rows = LongTensor(rows, dev);
  b.seq_begin = seq_begin;
  b.seq_slot = slots;
  b.prefill = false;
  if (!cache_.state.empty())
    for (const Sequence* s : seqs) b.seq_state.push_back(s->state);
  b.context_rows = LongTensor(ctx, dev).view({S, L});
  b.context_mask = at::tensor(at::ArrayRef<uint8_t>(mask), at::TensorOptions().dtype(at::kByte))
                       .to(at::kBool)
                       .to(dev)
                       .view({S, L});
  const at::Tensor hidden = model_->ForwardCached(b, cache_, *bank_);
  return model_->Logits(hidden, Routing(seq_begin, slots), *bank_);
}

void ModelRunner::CopyBlock(int src, int dst, int64_t rows) {
  if (rows <= 0) return;
  c10::NoGradGuard no_grad;
  for (size_t l = 0; l < cache_.k.size(); ++l) {
    cache_.k[l].narrow(0, dst * block_size_, rows).copy_(cache_.k[l].narrow(0, src * block_size_, rows));
    cache_.v[l].narrow(0, dst * block_size_, rows).copy_(cache_.v[l].narrow(0, src * block_size_, rows));
  }
}

}  // namespace loom::engine::sample
