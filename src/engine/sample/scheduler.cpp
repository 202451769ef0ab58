#include "engine/sample/scheduler.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <chrono>
#include <exception>
#include <iterator>
#include <map>
#include <stdexcept>

#include "engine/sample/op_count.h"
#include "engine/sample/sampling.h"

namespace loom::engine::sample {

Scheduler::Scheduler(std::shared_ptr<const Transformer> model, std::unique_ptr<SlotBank> bank, int64_t num_blocks,
                     int64_t block_size, SchedulerLimits limits, const DecodeOptions& decode, const Detokenizer* detok,
                     std::vector<int32_t> eos)
    : bank_(std::move(bank)),
      adapters_(bank_.get()),
      blocks_(num_blocks, block_size),
      waiting_(num_blocks * block_size),
      runner_(std::move(model), bank_.get(), num_blocks, block_size, decode),
      limits_(limits),
      detok_(detok),
      eos_(std::move(eos)) {
  // One state slot a row: at most max_batch_rows sequences run at once.
  if (runner_.ReserveStates(limits_.max_batch_rows))
    for (int i = limits_.max_batch_rows - 1; i >= 0; --i) free_states_.push_back(i);
}

void Scheduler::Probe(int64_t prefill_tokens, int64_t context_window) {
  const int64_t bs = blocks_.block_size(), nblocks = blocks_.num_blocks();
  const int64_t V = runner_.model().config().vocab_size;
  const bool lora = bank_->num_slots() > 0;
  if (lora) {
    LoraConfig scratch;
    scratch.rank = bank_->max_rank();
    scratch.alpha = scratch.rank;
    scratch.seed = 1;
    if (Status st = bank_->Bind(0, scratch); !st.ok()) throw std::runtime_error(st.message());
    runner_.SlotChanged(0);
  }
  struct Release {
    Scheduler* s;
    bool lora;
    ~Release() {
      if (!lora) return;
      s->bank_->Release(0);
      s->runner_.SlotChanged(0);
    }
  } release{this, lora};
  SampleRequest r;
  r.slot = lora ? 0 : -1;
  const int64_t T = std::max<int64_t>(1, std::min(prefill_tokens, nblocks * bs));
  for (int64_t i = 0; i < T; ++i) r.call.prompt.push_back(static_cast<int32_t>((i * 7919 + 1) % V));
  auto s0 = std::make_unique<Sequence>();
  s0->request = &r;
  for (int64_t b = 0; b * bs < T; ++b) s0->block_table.push_back(static_cast<int>(b));
  if (!free_states_.empty()) s0->state = free_states_.back();
  r.sequences.push_back(std::move(s0));
  runner_.Prefill({PrefillChunk{&r, 0, T}});
  // The decode rows: each at a context of its share of the cache.
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(limits_.max_batch_rows, nblocks));
  const int64_t per_row = std::max<int64_t>(1, nblocks / rows);
  const int64_t context = std::max<int64_t>(1, std::min(per_row * bs, context_window));
  std::vector<std::unique_ptr<Sequence>> seqs;
  std::vector<Sequence*> step;
  for (int64_t i = 0; i < rows; ++i) {
    auto q = std::make_unique<Sequence>();
    q->request = &r;
    q->tokens = {1};
    for (int64_t b = 0; b < per_row; ++b) q->block_table.push_back(static_cast<int>(i * per_row + b));
    q->cached = context - 1;
    if (i < static_cast<int64_t>(free_states_.size())) q->state = free_states_[static_cast<size_t>(i)];
    step.push_back(q.get());
    seqs.push_back(std::move(q));
  }
  const at::Tensor logits = runner_.Decode(step);
  std::vector<RowChoiceParams> params(static_cast<size_t>(rows));
  for (RowChoiceParams& p : params) {
    p.top_k = 50;
    p.top_p = 0.9;
    p.u = 0.5;
  }
  (void)ChooseTokens(logits, params);
}

void Scheduler::EnsureBlock(Sequence& s, int64_t pos) {
  while (pos / blocks_.block_size() >= static_cast<int64_t>(s.block_table.size())) {
    s.block_table.push_back(blocks_.Allocate());
    --s.request->reserved_blocks;
  }
}

std::vector<int> Scheduler::CacheHits(const SampleRequest& r) const {
  if (!limits_.prefix_cache || r.call.prompt_logprobs || r.call.topk_prompt_logprobs > 0) return {};
  return blocks_.Match(r.cache_root, r.call.prompt.data(), (r.prompt_len() - 1) / blocks_.block_size());
}

void Scheduler::PublishFull(Sequence& s) {
  if (!limits_.prefix_cache) return;
  const int64_t bs = blocks_.block_size();
  for (int64_t j = s.published; (j + 1) * bs <= s.cached; ++j) {
    const uint64_t parent = j == 0 ? s.request->cache_root : blocks_.Tag(s.block_table[j - 1]);
    blocks_.Publish(s.block_table[j], parent, s.tokens.data() + j * bs);
    s.published = j + 1;
  }
}

void Scheduler::Admit() {
  // A tenant's new prompt tokens join while the prefill it still owes fits
  // one step (so a request admitted now is prefilled soon); another
  // tenant's owed prefill never holds it back.
  std::map<std::string, int64_t> owed;
  for (const auto& r : admitted_)
    if (r->prefilling()) owed[r->call.tenant] += r->prompt_len() - r->sequences[0]->cached;
  const int64_t bs = blocks_.block_size();
  const auto held = [&](const SampleRequest& r, const std::vector<int>& hits) {
    const int64_t mine = owed[r.call.tenant];
    const int64_t fresh_tokens = r.prompt_len() - static_cast<int64_t>(hits.size()) * bs;
    return mine > 0 && mine + fresh_tokens > limits_.max_prefill_tokens;
  };
  // Only a tenant that owes prefill can be held: the others skip the prompt's hashing here.
  const auto ready = [&](const SampleRequest& r) {
    const auto it = owed.find(r.call.tenant);
    return it == owed.end() || it->second == 0 || !held(r, CacheHits(r));
  };
  // A request costs the free blocks its admission takes: its worst case less
  // the cached blocks it reuses, plus those of them no one holds now.
  const auto cost = [&](const SampleRequest& r) -> std::optional<int64_t> {
    if (rows_in_use_ + r.call.num_samples > limits_.max_batch_rows) return std::nullopt;
    const std::vector<int> hits = CacheHits(r);
    if (held(r, hits)) return std::nullopt;
    const int64_t need = blocks_.WorstCase(r.prompt_len(), r.max_tokens, r.call.num_samples) -
                         static_cast<int64_t>(hits.size());
    return (need + blocks_.Idle(hits)) * bs;
  };
  const auto admit = [&](std::unique_ptr<SampleRequest>& owned) {
    SampleRequest& r = *owned;
    const int64_t n = r.call.num_samples, P = r.prompt_len();
    int slot = -1;
    if (!r.call.adapter_dir.empty()) {
      Result<AdapterCache::Acquired> got =
          adapters_.Acquire(r.call.adapter_dir, std::dynamic_pointer_cast<const PeftSnapshot>(r.call.snapshot));
      if (!got.ok() && got.status().code() == Code::kResourceExhausted) return sched::Take::kRefused;
      if (!got.ok()) {
        Complete(*owned, got.status());
        owned.reset();
        return sched::Take::kDropped;
      }
      if (got->fresh) runner_.SlotChanged(got->slot);
      slot = got->slot;
    }
    // Matched again: an earlier admission of this pass may have evicted (or
    // taken a hold on) some of the blocks cost() saw, which never makes it dearer.
    const std::vector<int> hits = CacheHits(r);
    const int64_t need = blocks_.WorstCase(P, r.max_tokens, n) - static_cast<int64_t>(hits.size());
    if (!blocks_.Acquire(hits, need)) {
      if (slot >= 0) adapters_.Release(slot);
      return sched::Take::kRefused;
    }
    r.reserved_blocks = need;
    r.kv_tokens = blocks_.WorstCase(P, r.max_tokens, n) * bs;
    r.cached_prefix = static_cast<int64_t>(hits.size()) * bs;
    r.output.prompt_cache_hit_tokens = static_cast<int32_t>(r.cached_prefix);
    stats_.prompt_cache_hit_tokens += r.cached_prefix;
    r.slot = slot;
    r.output.sequences.assign(static_cast<size_t>(n), SampledSequence{});
    for (int64_t j = 0; j < n; ++j) {
      auto s = std::make_unique<Sequence>();
      s->request = &r;
      s->index = static_cast<int>(j);
      s->tokens = r.call.prompt;
      if (!free_states_.empty()) {  // rows_in_use_ <= max_batch_rows: a slot for each
        s->state = free_states_.back();
        free_states_.pop_back();
      }
      r.sequences.push_back(std::move(s));
    }
    Sequence& s0 = *r.sequences[0];
    s0.block_table = hits;
    s0.published = static_cast<int64_t>(hits.size());
    s0.cached = r.cached_prefix;
    EnsureBlock(s0, P - 1);
    rows_in_use_ += n;
    owed[r.call.tenant] += P - r.cached_prefix;
    admitted_.push_back(std::move(owned));
    return sched::Take::kTaken;
  };
  const SampleRequest* waits =
      waiting_.Admit((blocks_.free_count() - blocks_.reserved()) * bs, ready, cost, admit);
  if (waits != nullptr && head_waited_ != waits->id + 1) {
    ++stats_.admission_waits;
    head_waited_ = waits->id + 1;
  }
}

void Scheduler::PrefillStep(std::vector<PrefillChunk> chunks) {
  std::stable_sort(chunks.begin(), chunks.end(),
                   [](const auto& a, const auto& b) { return a.request->slot < b.request->slot; });
  const int64_t on_graphs = runner_.fast_prefills();
  const at::Tensor logits = runner_.Prefill(chunks);
  ++stats_.prefill_steps;
  if (runner_.fast_prefills() > on_graphs) ++stats_.fast_prefill_steps;
  AfterPrefill(chunks, logits);
}

void Scheduler::AfterPrefill(const std::vector<PrefillChunk>& chunks, const at::Tensor& logits) {
  const int64_t bs = blocks_.block_size();
  std::vector<int64_t> from;
  std::vector<RowChoiceParams> params;
  std::vector<Sequence*> rows;
  for (size_t i = 0; i < chunks.size(); ++i) {
    SampleRequest& r = *chunks[i].request;
    const int64_t P = r.prompt_len();
    Sequence& s0 = *r.sequences[0];
    s0.cached = chunks[i].end;
    s0.last_step = history_.step;
    PublishFull(s0);
    stats_.prefill_tokens += chunks[i].end - chunks[i].begin;
    if (r.prefilling()) continue;  // more chunks to come; its logits are not a sample's
    for (size_t j = 1; j < r.sequences.size(); ++j) {  // fork from the one prefill
      Sequence& s = *r.sequences[j];
      for (int64_t b = 0; b < P / bs; ++b) {
        blocks_.Share(s0.block_table[b]);
        s.block_table.push_back(s0.block_table[b]);
      }
      if (P % bs != 0) {
        EnsureBlock(s, P - 1);
        runner_.CopyBlock(s0.block_table[P / bs], s.block_table.back(), P % bs);
      }
      if (s.state >= 0) runner_.CopyState(s0.state, s.state);
      s.cached = P;
      s.last_step = history_.step;
      s.published = P / bs;  // s0's, shared
    }
    for (auto& s : r.sequences) {
      if (r.max_tokens <= 0) {
        Finish(*s, SampleStopReason::kLength);
        continue;
      }
      from.push_back(static_cast<int64_t>(i));
      const SamplingParams& p = r.call.params;
      params.push_back({p.temperature, p.top_k, p.top_p, UniformDraw(r.seed, s->index, 0)});
      rows.push_back(s.get());
    }
  }
  if (rows.empty()) return;
  const at::Tensor expanded =
      logits.index_select(0, at::tensor(from, at::TensorOptions().dtype(at::kLong)).to(logits.device()));
  const Choices c = ChooseTokens(expanded, params);
  for (size_t k = 0; k < rows.size(); ++k) Append(*rows[k], c.tokens[k], c.logprobs[k]);
}

void Scheduler::DecodeStep(std::vector<Sequence*> rows) {
  if (rows.empty()) return;
  std::vector<RowChoiceParams> params = BeforeDecode(rows);
  AfterDecode(rows, params, runner_.Decode(rows));
}

void Scheduler::MixedStep(std::vector<Sequence*> rows, std::vector<PrefillChunk> chunks) {
  if (rows.empty()) return PrefillStep(std::move(chunks));
  if (chunks.empty()) return DecodeStep(std::move(rows));
  std::vector<RowChoiceParams> params = BeforeDecode(rows);
  const at::Tensor logits = runner_.Mixed(rows, chunks);
  if (!logits.defined()) {  // not on the graphs: the two steps' work one after the other
    AfterDecode(rows, params, runner_.Decode(rows));
    PrefillStep(std::move(chunks));
    return;
  }
  const int64_t R = static_cast<int64_t>(rows.size());
  AfterDecode(rows, params, logits.narrow(0, 0, R));
  ++stats_.prefill_steps;
  ++stats_.fast_prefill_steps;  // a mixed step runs on the decode graphs
  ++stats_.mixed_steps;
  AfterPrefill(chunks, logits.narrow(0, R, static_cast<int64_t>(chunks.size())));
}

std::vector<RowChoiceParams> Scheduler::BeforeDecode(std::vector<Sequence*>& rows) {
  std::stable_sort(rows.begin(), rows.end(), [](const Sequence* a, const Sequence* b) {
    if (a->request->slot != b->request->slot) return a->request->slot < b->request->slot;
    return a->request->id < b->request->id;
  });
  std::vector<RowChoiceParams> params;
  for (Sequence* s : rows) {
    EnsureBlock(*s, s->cached);
    const SampleRequest& r = *s->request;
    const SamplingParams& p = r.call.params;
    const uint64_t step = r.output.sequences[s->index].tokens.size();
    params.push_back({p.temperature, p.top_k, p.top_p, UniformDraw(r.seed, s->index, step)});
  }
  return params;
}

void Scheduler::AfterDecode(const std::vector<Sequence*>& rows, const std::vector<RowChoiceParams>& params,
                            const at::Tensor& logits) {
  int64_t adapters = 0;
  int last_slot = -2;
  for (const Sequence* s : rows)
    if (s->request->slot != last_slot) ++adapters, last_slot = s->request->slot;
  const Choices c = ChooseTokens(logits, params);
  ++stats_.decode_steps;
  stats_.decode_rows += static_cast<int64_t>(rows.size());
  stats_.max_rows_in_step = std::max<int64_t>(stats_.max_rows_in_step, static_cast<int64_t>(rows.size()));
  stats_.max_adapters_in_step = std::max(stats_.max_adapters_in_step, adapters);
  for (size_t k = 0; k < rows.size(); ++k) {
    ++rows[k]->cached;
    rows[k]->last_step = history_.step;
    PublishFull(*rows[k]);
    Append(*rows[k], c.tokens[k], c.logprobs[k]);
  }
}

bool Scheduler::Append(Sequence& s, int32_t token, float logprob) {
  SampleRequest& r = *s.request;
  SampledSequence& out = r.output.sequences[s.index];
  s.tokens.push_back(token);
  out.tokens.push_back(token);
  out.logprobs.push_back(logprob);
  ++stats_.tokens_generated;
  const SamplingParams& p = r.call.params;
  bool stop = std::find(p.stop_tokens.begin(), p.stop_tokens.end(), token) != p.stop_tokens.end() ||
              std::find(eos_.begin(), eos_.end(), token) != eos_.end();
  if (!stop && !p.stop_strings.empty() && detok_) {
    const std::string& bytes = detok_->Bytes(token);
    s.text += bytes;
    stop = EndsWithStop(s.text, bytes.size(), p.stop_strings);
  }
  if (stop) {
    Finish(s, SampleStopReason::kStop);
    return true;
  }
  if (static_cast<int64_t>(out.tokens.size()) >= r.max_tokens) {
    Finish(s, SampleStopReason::kLength);
    return true;
  }
  return false;
}

void Scheduler::Finish(Sequence& s, SampleStopReason why) {
  if (s.finished) return;
  s.finished = true;
  s.request->output.sequences[s.index].stop_reason = why;
  // Last block first: the prefix cache's LRU then evicts a chain from its tail.
  for (auto b = s.block_table.rbegin(); b != s.block_table.rend(); ++b) blocks_.Release(*b);
  s.block_table.clear();
  if (s.state >= 0) free_states_.push_back(s.state);
  s.state = -1;
  --rows_in_use_;
}

void Scheduler::Complete(SampleRequest& r, Result<SampleOutput> result) {
  for (auto& s : r.sequences)
    if (!s->finished) Finish(*s, SampleStopReason::kLength);
  if (r.slot >= 0) adapters_.Release(r.slot);
  r.slot = -1;
  blocks_.Unreserve(r.reserved_blocks);
  r.reserved_blocks = 0;
  ++stats_.requests_done;
  if (r.done) completed_.emplace_back(std::move(r.done), std::move(result));
}

void Scheduler::CompleteDone() {
  for (size_t i = 0; i < admitted_.size();) {
    SampleRequest& r = *admitted_[i];
    const bool done = std::all_of(r.sequences.begin(), r.sequences.end(), [](auto& s) { return s->finished; });
    if (!done) {
      ++i;
      continue;
    }
    std::unique_ptr<SampleRequest> owned = std::move(admitted_[i]);
    admitted_.erase(admitted_.begin() + static_cast<std::ptrdiff_t>(i));
    history_.last_done[owned->call.tenant] = history_.step;
    SampleOutput out = std::move(owned->output);
    Complete(*owned, std::move(out));
  }
}

void Scheduler::Step() {
  try {
    Admit();
    StepPlan plan = PlanStep(admitted_, limits_, history_);
    ++history_.step;
    const auto t0 = std::chrono::steady_clock::now();
    // Named spans for a profiler trace (bench/trace_summary.py --within) and
    // for OpCount (op_count.h); free when nothing observes them.
    if (plan.prefill) {
      RECORD_USER_SCOPE(kPrefillScope);
      PrefillStep(std::move(plan.chunks));
    } else if (!plan.chunks.empty()) {  // a decode step with prompt chunks riding along (StepLimits::mixed_steps)
      RECORD_USER_SCOPE(kDecodeScope);
      MixedStep(std::move(plan.rows), std::move(plan.chunks));
    } else {
      RECORD_USER_SCOPE(kDecodeScope);
      DecodeStep(std::move(plan.rows));
    }
    history_.last_prefill = plan.prefill;
    history_.last_within_prefill = plan.within_prefill;
    history_.within_run = plan.within_decode ? history_.within_run + 1 : 0;
    if (plan.contended) ++stats_.contended_steps;
    const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    (plan.prefill ? stats_.prefill_seconds : stats_.decode_seconds) += took;
    for (auto it = history_.last_done.begin(); it != history_.last_done.end();)  // forget tenants long done
      it = history_.step - it->second >= kRecentSteps ? history_.last_done.erase(it) : std::next(it);
    CompleteDone();
  } catch (const std::exception& e) {
    const Status failed = Status::Internal(std::string("sampler step failed: ") + e.what());
    std::vector<std::unique_ptr<SampleRequest>> admitted = std::move(admitted_);
    admitted_.clear();
    for (auto& r : admitted) Complete(*r, failed);
  }
}

void Scheduler::FailAll(const Status& status) {
  std::vector<std::unique_ptr<SampleRequest>> admitted = std::move(admitted_);
  admitted_.clear();
  for (auto& r : admitted) Complete(*r, status);
  for (auto& r : waiting_.TakeAll()) Complete(*r, status);
}

void Scheduler::Cancel(const std::string& session, const Status& status) {
  for (auto& r : waiting_.TakeSession(session)) {
    Complete(*r, status);
    ++stats_.requests_cancelled;
  }
  for (size_t i = 0; i < admitted_.size();) {
    if (admitted_[i]->call.session != session) {
      ++i;
      continue;
    }
    std::unique_ptr<SampleRequest> r = std::move(admitted_[i]);
    admitted_.erase(admitted_.begin() + static_cast<std::ptrdiff_t>(i));
    Complete(*r, status);
    ++stats_.requests_cancelled;
  }
}

SamplerStats Scheduler::stats() const {
  SamplerStats s = stats_;
  s.adapter_loads = adapters_.loads();
  s.adapter_installs = adapters_.installs();
  s.adapter_evictions = adapters_.evictions();
  s.kv_blocks_free = blocks_.free_count();
  s.kv_blocks_cached = blocks_.cached_count();
  s.kv_cache_evictions = blocks_.evictions();
  s.decode_graphs_captured = runner_.graphs_captured();
  s.decode_graph_capture_seconds = runner_.capture_seconds();
  s.requests_waiting = static_cast<int64_t>(waiting_.size());
  return s;
}

}  // namespace loom::engine::sample
