// MakeFastDecode for CUDA builds: the graph-captured decode step described
// in engine/sample/fast_decode.h, over the kernels of this folder (one
// family per .cu).
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/GradMode.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <map>
#include <tuple>

#include "common/log.h"
#include "engine/model/transformer_impl.h"
#include "engine/sample/cuda/attention.h"
#include "engine/sample/cuda/decode_profiler.h"
#include "engine/model/cuda/gemv.h"
#include "engine/sample/cuda/lora.h"
#include "engine/sample/cuda/lt_gemm.h"
#include "engine/sample/cuda/rmsnorm.h"
#include "engine/sample/cuda/rope.h"
#include "engine/sample/cuda/silu.h"
#include "engine/sample/chunk_tiles.h"
#include "engine/sample/fast_decode.h"

namespace loom::engine {
namespace {

constexpr int64_t kMaxRows = kFastDecodeMaxRows;  // larger steps run eager
constexpr int64_t kMinTable = 16;   // smallest block-table width bucket

int64_t Pow2AtLeast(int64_t n, int64_t lo) {
  int64_t p = lo;
  while (p < n) p *= 2;
  return p;
}

// The LoRA factors of targets that share an input, stacked for the BGMV
// kernels in the model dtype: A [N, K*R, d_in] (target k's rows at k*R),
// B [N, d_total, R] (targets' outputs one after another, as the fused base
// projection lays them out).
struct LoraGroup {
  TargetGroup group = TargetGroup::kAttn;
  std::vector<const LoraTarget*> targets;
  std::vector<int64_t> seg_end;  // cumulative output width per target
  int64_t d_in = 0, d_total = 0, r_total = 0;
  at::Tensor A, B;

  bool Make(std::vector<const LoraTarget*> ts, int64_t rank, int64_t slots, const at::TensorOptions& opts) {
    if (ts.empty()) return false;
    for (const LoraTarget* t : ts)
      if (!t || t->d_in != ts[0]->d_in || t->group != ts[0]->group) return false;
    targets = std::move(ts);
    group = targets[0]->group;
    d_in = targets[0]->d_in;
    for (const LoraTarget* t : targets) seg_end.push_back(d_total += t->d_out);
    r_total = rank * static_cast<int64_t>(targets.size());
    A = at::zeros({slots, r_total, d_in}, opts);
    B = at::zeros({slots, d_total, rank}, opts);
    return seg_end.size() <= static_cast<size_t>(cuda::kMaxSegments);
  }
  // LoraExpand's arguments for t, this group's shrink.
  cuda::LoraArgs Args(const int32_t* slot, const at::Tensor& t, int64_t rank) const {
    cuda::LoraArgs a;
    a.B = B.data_ptr();
    a.t = t.data_ptr<float>();
    a.slot = slot;
    a.rank = rank;
    a.r_total = r_total;
    a.d_total = d_total;
    for (size_t k = 0; k < seg_end.size(); ++k) a.seg_end[k] = seg_end[k];
    return a;
  }
  void Sync(int s, int64_t rank) {
    int64_t col = 0;
    for (size_t k = 0; k < targets.size(); ++k) {
      const LoraTarget& t = *targets[k];
      A.select(0, s).narrow(0, static_cast<int64_t>(k) * rank, rank).copy_(t.A.select(0, s));
      B.select(0, s).narrow(0, col, t.d_out).copy_(t.B.select(0, s));
      col += t.d_out;
    }
  }
};

class CudaFastDecode final : public FastDecode {
 public:
  // profiler: null in production; given, every stage is timed (serialized).
  CudaFastDecode(std::shared_ptr<const Transformer> model, const SlotBank* bank, KvCache* cache, int64_t block_size,
                 int64_t scratch_row, const DecodeOptions& options, std::unique_ptr<DecodeProfiler> profiler)
      : model_(std::move(model)),
        bank_(bank),
        cache_(cache),
        block_size_(block_size),
        scratch_row_(scratch_row),
        bf16_(model_->dtype() == at::kBFloat16),
        stale_(bank ? static_cast<size_t>(bank->num_slots()) : 0, true),
        pool_(at::cuda::graph_pool_handle()),
        gemv_(options.gemv),
        moe_gemv_(options.moe_gemv),
        attention_(options.attention_tokens ? cuda::AttentionForm::kTokens : cuda::AttentionForm::kDims),
        split_(options.split_shrink),
        profiler_(std::move(profiler)) {
    if (options.gemm_tuned && bf16_) lt_ = std::make_unique<cuda::LtGemm>();
    const auto& w = model_->weights();
    if (options.chunk_attention && cuda::ChunkAttentionApplies(bf16_, w.heads, w.kv_heads, w.head_dim)) {
      chunk_rows_ = cuda::ChunkTileRows(w.heads, w.kv_heads);
      int sms = 0;
      const at::Device d = model_->device();
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount,
                             d.has_index() ? d.index() : c10::cuda::current_device());
      chunk_target_warps_ = 4 * std::max(sms, 1);  // a few warps an SM to hide the K/V loads
    }
    // The LoRA branch at the highest priority, so that its few blocks are
    // scheduled ahead of the concurrent projection's waiting ones. (The
    // lowest measured the same on the H200, docs/benchmarks.md 2026-11-29
    // session 5: no switch.)
    int least = 0, greatest = 0;
    cudaDeviceGetStreamPriorityRange(&least, &greatest);
    cudaStreamCreateWithPriority(&branch_, cudaStreamNonBlocking, greatest);
    cudaEventCreateWithFlags(&fork_, cudaEventDisableTiming);
    cudaEventCreateWithFlags(&join_, cudaEventDisableTiming);
    BuildMirror();
  }

  ~CudaFastDecode() override {
    graphs_.clear();
    profiler_.reset();  // logs the replays since its last lines
    cudaEventDestroy(fork_);
    cudaEventDestroy(join_);
    cudaStreamDestroy(branch_);
  }

  void SlotChanged(int s) override {
    if (s >= 0 && s < static_cast<int>(stale_.size())) stale_[static_cast<size_t>(s)] = true;
  }
  int64_t graphs_captured() const override { return captured_.load(); }
  double capture_seconds() const override { return capture_seconds_.load(); }

  at::Tensor Decode(const DecodeStep& step) override {
    c10::NoGradGuard no_grad;
    const int64_t S = static_cast<int64_t>(step.tokens.size());
    if (S == 0 || S > kMaxRows) return {};
    bool lora = false;
    int64_t blocks = 1;
    for (int64_t i = 0; i < S; ++i) {
      if (step.slots[i] >= 0) lora = true;
      blocks = std::max<int64_t>(blocks, (step.ctx_len[i] + block_size_ - 1) / block_size_);
    }
    if (lora && !has_lora_) return {};
    if (lora) {
      for (int i = 0; i < S; ++i) {
        const int s = step.slots[i];
        if (s >= 0 && stale_[static_cast<size_t>(s)]) {
          for (auto& layer : groups_)
            for (auto& g : layer) g.Sync(s, bank_->max_rank());
          if (head_group_.A.defined()) head_group_.Sync(s, bank_->max_rank());
          stale_[static_cast<size_t>(s)] = false;
        }
      }
    }
    // Rows of prefill chunks attend in tiles (chunk_tiles.h) on graphs of their own.
    ChunkTilePlan plan;
    if (chunk_rows_ > 0 && S >= 2)
      plan = PlanChunkTiles(step.positions, step.ctx_len, step.tables, chunk_rows_, model_->weights().kv_heads,
                            chunk_target_warps_, cuda::kChunkMaxWarps);
    Graph& g = GetGraph(Pow2AtLeast(S, 1), Pow2AtLeast(blocks, kMinTable), lora, plan.tiles() > 0);
    Fill(g, step, plan);
    g.dev_long.copy_(g.host_long, /*non_blocking=*/true);
    g.dev_int.copy_(g.host_int, /*non_blocking=*/true);
    g.graph->replay();
    if (profiler_) profiler_->Replayed(g.profile, at::cuda::getCurrentCUDAStream().stream());
    return g.logits.narrow(0, 0, S);
  }

 private:
  struct Graph {
    int64_t rows = 0, table = 0;
    bool lora = false;
    bool chunk = false;  // attends chunk tiles with cuda::ChunkAttention
    // long: [3, rows] tokens, positions, write_rows. int: ctx_len [rows],
    // slots [3, rows] (attn, mlp, unembed), tables [rows, table]; then the
    // chunk tiles' inputs: the rows DecodeAttention serves, by ctx_len
    // (0: a tile's row) [rows], row_tile [rows], the plan [3 + 2 rows]
    // (cuda::ChunkAttention's).
    at::Tensor host_long, host_int, dev_long, dev_int;
    std::unique_ptr<at::cuda::CUDAGraph> graph;
    at::Tensor logits;
    // The LoRA shrinks' split tickets (cuda::ShrinkScratch), zeroed here
    // once: every launch leaves them 0.
    at::Tensor tickets;
    int profile = -1;  // its id in profiler_ (when there is one)
  };

  void BuildMirror() {
    if (!bank_ || bank_->num_slots() == 0) return;
    const auto opts = at::TensorOptions().dtype(model_->dtype()).device(model_->device());
    const int64_t R = bank_->max_rank(), N = bank_->num_slots();
    const size_t L = model_->weights().layers.size();
    groups_.resize(L);
    bool ok = true;
    experts_.assign(L, {nullptr, nullptr});
    for (size_t l = 0; l < L && ok; ++l) {
      auto t = [&](int k) { return LayerTarget(*bank_, l, k); };
      groups_[l].resize(4);
      ok = groups_[l][0].Make({t(0), t(1), t(2)}, R, N, opts) && groups_[l][1].Make({t(3)}, R, N, opts);
      if (model_->weights().layers[l].moe.defined()) {  // the experts' own targets, read from the bank (MoeForward)
        experts_[l] = ExpertTargets(*bank_, l);
        ok = ok && experts_[l].first && experts_[l].second;
      } else {
        ok = ok && groups_[l][2].Make({t(4), t(5)}, R, N, opts) && groups_[l][3].Make({t(6)}, R, N, opts);
      }
    }
    if (const LoraTarget* head = bank_->find("lm_head")) {
      ok = ok && head_group_.Make({head}, R, N, opts);
    }
    has_lora_ = ok;
    if (!ok) {
      experts_.clear();
      groups_.clear();
      log::Warn("fast decode: the sampler's LoRA targets do not match the model; adapter steps run eager");
    }
  }

  Graph& GetGraph(int64_t rows, int64_t table, bool lora, bool chunk) {
    const auto key = std::make_tuple(rows, table, lora, chunk);
    if (auto it = graphs_.find(key); it != graphs_.end()) return *it->second;
    auto g = std::make_unique<Graph>();
    g->rows = rows;
    g->table = table;
    g->lora = lora;
    g->chunk = chunk;
    const auto pinned_long = at::TensorOptions().dtype(at::kLong).pinned_memory(true);
    const auto pinned_int = at::TensorOptions().dtype(at::kInt).pinned_memory(true);
    g->host_long = at::empty({3 * rows}, pinned_long);
    g->host_int = at::empty({rows * (4 + table) + ChunkInts(rows)}, pinned_int);
    if (lora) {
      const int64_t widest = 3 * bank_->max_rank();  // q, k, v's ranks
      const auto ints = at::TensorOptions().dtype(at::kInt).device(model_->device());
      g->tickets = at::zeros({rows * ((widest + 15) / 16)}, ints);
    }
    Fill(*g, DecodeStep{}, ChunkTilePlan{});
    g->dev_long = g->host_long.to(model_->device());
    g->dev_int = g->host_int.to(model_->device());
    // Warm up on a side stream (cuBLAS handles and workspaces are made
    // outside the capture), then capture there. Thread-local capture mode:
    // the trainer may use the same device from its own thread meanwhile.
    const auto t0 = std::chrono::steady_clock::now();
    c10::cuda::device_synchronize();
    at::cuda::CUDAStream side = at::cuda::getStreamFromPool();
    {
      c10::cuda::CUDAStreamGuard guard(side);
      TuneGemms(rows, side.stream());
      Run(*g);
      side.synchronize();
      if (profiler_) g->profile = profiler_->AddGraph(rows, table, lora);
      g->graph = std::make_unique<at::cuda::CUDAGraph>();
      g->graph->capture_begin(pool_, cudaStreamCaptureModeThreadLocal);
      capturing_ = g.get();
      g->logits = Run(*g);
      capturing_ = nullptr;
      g->graph->capture_end();
      side.synchronize();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    capture_seconds_.store(capture_seconds_.load() + seconds);  // only this thread writes
    ++captured_;
    log::Info("fast decode: captured rows={} table_blocks={} lora={} chunk={} in {:.1f} ms", rows, table, lora, chunk,
              seconds * 1e3);
    Graph& ref = *g;
    graphs_.emplace(key, std::move(g));
    return ref;
  }

  // Profiling only: an event node at this point of the graph being captured;
  // the stage since the previous mark is charged to `label`.
  void Mark(const char* label, cudaStream_t st) const {
    if (profiler_ && capturing_) profiler_->Mark(capturing_->profile, label, st);
  }

  // The ints after the tables: ctx_len of DecodeAttention's rows, row_tile, the plan.
  static int64_t ChunkInts(int64_t rows) { return 2 * rows + 3 + 2 * rows; }

  // Host inputs of the step; rows beyond it are padding that writes to the
  // scratch row and attends to it alone. plan: the step's chunk tiles (on a
  // chunk graph; none elsewhere).
  void Fill(Graph& g, const DecodeStep& step, const ChunkTilePlan& plan) const {
    const int64_t S = static_cast<int64_t>(step.tokens.size()), R = g.rows, W = g.table;
    int64_t* lg = g.host_long.data_ptr<int64_t>();
    int32_t* in = g.host_int.data_ptr<int32_t>();
    const int32_t scratch_block = static_cast<int32_t>(scratch_row_ / block_size_);
    for (int64_t i = 0; i < R; ++i) {
      const bool real = i < S;
      lg[i] = real ? step.tokens[i] : 0;
      lg[R + i] = real ? step.positions[i] : 0;
      lg[2 * R + i] = real ? step.write_rows[i] : scratch_row_;
      in[i] = real ? step.ctx_len[i] : 1;
      const int s = real ? step.slots[i] : -1;
      in[R + i] = bank_ && bank_->trains(s, TargetGroup::kAttn) ? s : -1;
      in[2 * R + i] = bank_ && bank_->trains(s, TargetGroup::kMlp) ? s : -1;
      in[3 * R + i] = bank_ && bank_->trains(s, TargetGroup::kUnembed) ? s : -1;
      int32_t* row = in + 4 * R + i * W;
      const int64_t used = real ? static_cast<int64_t>(step.tables[i]->size()) : 0;
      for (int64_t b = 0; b < W; ++b) row[b] = b < used ? (*step.tables[i])[b] : scratch_block;
    }
    int32_t* single = in + R * (4 + W);
    int32_t* row_tile = single + R;
    int32_t* p = row_tile + R;
    const int64_t tiles = plan.tiles();
    for (int64_t i = 0; i < R; ++i) {
      const bool tiled = i < S && tiles > 0 && plan.row_tile[static_cast<size_t>(i)] >= 0;
      row_tile[i] = tiled ? plan.row_tile[static_cast<size_t>(i)] : -1;
      single[i] = tiled ? 0 : in[i];
    }
    p[0] = static_cast<int32_t>(tiles);
    p[1] = plan.splits;
    p[2] = plan.split_len;
    for (int64_t t = 0; t < R; ++t) {
      p[3 + t] = t < tiles ? plan.first[static_cast<size_t>(t)] : 0;
      p[3 + R + t] = t < tiles ? plan.rows[static_cast<size_t>(t)] : 0;
    }
  }

  // Starts group g's LoRA on the branch stream, beside what the main
  // stream runs next (the base projection of the same x): the shrink of x
  // into t (a long d_in split over blocks when `split` is given), then
  // (delta defined) the expand of t into delta, T(delta) per output cell,
  // which the projection's consumer adds itself. Join makes the main
  // stream wait for it. Profiling times every stage alone: the branch then
  // runs on the main stream.
  void ForkLora(const LoraGroup& g, const at::Tensor& x, const int32_t* slot, const at::Tensor& t,
                const at::Tensor& delta, const cuda::ShrinkScratch* split, cudaStream_t st) const {
    const bool serial = profiler_ != nullptr;
    const cudaStream_t on = serial ? st : branch_;
    if (!serial) {
      cudaEventRecord(fork_, st);
      cudaStreamWaitEvent(branch_, fork_, 0);
    }
    cuda::LoraShrink(bf16_, x.data_ptr(), x.stride(0), g.A.data_ptr(), slot, bank_->scales().data_ptr<float>(),
                     t.data_ptr<float>(), x.size(0), g.d_in, g.r_total, on, split);
    Mark("shrink", on);
    if (delta.defined()) {
      cuda::LoraExpand(bf16_, g.Args(slot, t, bank_->max_rank()), nullptr, delta.data_ptr(), false, delta.stride(0),
                       x.size(0), on);
      Mark("expand", on);
    }
    if (!serial) cudaEventRecord(join_, branch_);
  }
  void Join(cudaStream_t st) const {
    if (!profiler_) cudaStreamWaitEvent(st, join_, 0);
  }

  // --decode-gemm tuned: the cuBLASLt algorithm of each base projection's
  // shape at `rows` (every dense layer's weights of that shape, and
  // lm_head's), chosen before the graph that runs them is captured.
  void TuneGemms(int64_t rows, cudaStream_t st) {
    if (!lt_ || (gemv_ && rows <= cuda::kGemvMaxRows)) return;
    const auto& m = model_->weights();
    std::map<std::pair<int64_t, int64_t>, std::vector<at::Tensor>> shapes;  // (n, k) -> the weights
    auto add = [&](const at::Tensor& w, const at::Tensor& b) {
      if (w.defined() && !b.defined() && w.is_contiguous()) shapes[{w.size(0), w.size(1)}].push_back(w);
    };
    for (const auto& l : m.layers) {
      add(l.qkv_w, l.qkv_b);
      add(l.o_w, l.o_b);
      add(l.gate_up_w, {});
      add(l.down_w, {});
    }
    add(m.lm_head, {});
    std::erase_if(shapes, [&](const auto& e) { return lt_->Tuned(rows, e.first.first, e.first.second); });
    if (shapes.empty()) return;
    // Scratch from the caching allocator, no larger than the step's own
    // projections' inputs and outputs (its measured working memory).
    int64_t n_max = 0, k_max = 0;
    for (const auto& [nk, ws] : shapes) n_max = std::max(n_max, nk.first), k_max = std::max(k_max, nk.second);
    const auto opts = at::TensorOptions().dtype(at::kBFloat16).device(model_->device());
    const at::Tensor x = at::zeros({rows, k_max}, opts), y = at::empty({rows, n_max}, opts);
    for (const auto& [nk, ws] : shapes) {
      const auto [n, k] = nk;
      std::vector<const void*> ptrs;
      for (const at::Tensor& w : ws) ptrs.push_back(w.data_ptr());
      // The baseline: Linear's own path when Run declines (at::linear
      // without a bias: cublasGemmEx), on the same scratch.
      at::Tensor xs = x.view({-1}).narrow(0, 0, rows * k).view({rows, k});
      at::Tensor ys = y.view({-1}).narrow(0, 0, rows * n).view({rows, n});
      auto baseline = [&](size_t i) {
        at::mm_out(ys, xs, ws[i].t());
        return true;
      };
      std::string line;
      lt_->Tune(rows, n, k, ptrs, xs.data_ptr(), ys.data_ptr(), st, &line, baseline);
      if (!line.empty()) log::Info("fast decode: tuned gemm {}", line);
    }
  }

  // x @ w^T + b: the matrix-vector kernel for a few rows, else cuBLAS
  // (cuBLASLt's tuned algorithm with --decode-gemm tuned).
  // f32: the result as fp32 (rounded through the model dtype first).
  at::Tensor Linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, bool f32, cudaStream_t st) const {
    const int64_t R = x.size(0), N = w.size(0);
    if (gemv_ && R <= cuda::kGemvMaxRows && w.is_contiguous() && x.stride(1) == 1) {
      at::Tensor y = at::empty({R, N}, x.options().dtype(f32 ? at::kFloat : x.scalar_type()));
      if (cuda::Gemv(bf16_, x.data_ptr(), x.stride(0), w.data_ptr(), b.defined() ? b.data_ptr() : nullptr,
                     y.data_ptr(), f32, R, N, w.size(1), st))
        return y;
    }
    if (lt_ && !b.defined() && w.is_contiguous() && x.is_contiguous()) {
      at::Tensor y = at::empty({R, N}, x.options());
      if (lt_->Run(x.data_ptr(), w.data_ptr(), y.data_ptr(), R, N, w.size(1), st)) return f32 ? y.to(at::kFloat) : y;
    }
    at::Tensor y = at::linear(x, w, b);
    return f32 ? y.to(at::kFloat) : y;
  }

  // The decode forward over g's static inputs; returns logits [rows, vocab] fp32.
  at::Tensor Run(Graph& g) const {
    const auto& m = model_->weights();
    const ModelConfig& c = model_->config();
    const float eps = static_cast<float>(c.rms_norm_eps);
    const cudaStream_t st = at::cuda::getCurrentCUDAStream().stream();
    const int64_t R = g.rows, hd = m.head_dim, H = m.heads, KVH = m.kv_heads;
    const at::Tensor tokens = g.dev_long.narrow(0, 0, R), positions = g.dev_long.narrow(0, R, R);
    const int64_t* write_rows = g.dev_long.data_ptr<int64_t>() + 2 * R;
    const int32_t* ctx_len = g.dev_int.data_ptr<int32_t>();
    const int32_t* slot_attn = ctx_len + R;
    const int32_t* slot_mlp = ctx_len + 2 * R;
    const int32_t* slot_head = ctx_len + 3 * R;
    const int32_t* tables = ctx_len + 4 * R;
    const int32_t* ctx_single = tables + R * g.table;  // a chunk graph's DecodeAttention rows
    const int32_t* row_tile = ctx_single + R;
    const int32_t* chunk_plan = row_tile + R;
    const at::Tensor chunk_scratch =
        g.chunk ? at::empty({cuda::ChunkScratchFloats(hd)},
                            at::TensorOptions().dtype(at::kFloat).device(model_->device()))
                : at::Tensor();

    at::Tensor x = at::embedding(m.embed, tokens).contiguous();  // the residual stream, updated in place
    at::Tensor h = at::empty_like(x);
    at::Tensor q = at::empty({R, H * hd}, x.options());
    at::Tensor attn = at::empty({R, H * hd}, x.options());
    at::Tensor act = at::empty({R, m.inter}, x.options());
    // The LoRA branch's buffers: t, the shrink's output, for the widest
    // group (q, k, v: 3 ranks); room for 8 partial sums of a one-rank
    // shrink (down's d_in takes 5 on qwen3-4b); and the deltas of qkv,
    // gate_up and the hidden-wide o and down (o's is read before down's is
    // written). Groups take turns: each is forked after the consumer of
    // the previous one.
    const int64_t rank = bank_ ? bank_->max_rank() : 0;
    at::Tensor t, part, d_qkv, d_gate_up, d_hidden;
    cuda::ShrinkScratch scratch;
    if (g.lora) {
      t = at::empty({R * 3 * rank}, x.options().dtype(at::kFloat));
      if (split_) {
        part = at::empty({R * 8 * rank}, x.options().dtype(at::kFloat));
        scratch = {part.data_ptr<float>(), part.numel(), g.tickets.data_ptr<int32_t>(), g.tickets.numel()};
      }
      d_qkv = at::empty({R, (H + 2 * KVH) * hd}, x.options());
      d_gate_up = at::empty({R, 2 * m.inter}, x.options());
      d_hidden = at::empty_like(x);
    }
    auto fork = [&](int i, int k, const at::Tensor& in, const int32_t* slot, const at::Tensor& delta) {
      if (g.lora)
        ForkLora(groups_[static_cast<size_t>(i)][static_cast<size_t>(k)], in, slot, t, delta,
                 split_ ? &scratch : nullptr, st);
    };
    auto join = [&] {
      if (g.lora) Join(st);
    };
    auto ptr = [&](const at::Tensor& d) { return g.lora ? d.data_ptr() : nullptr; };
    // MoE layers: the rows' slots for the experts' LoRA (moe.h's pair form).
    const ExpertLoraRows expert_rows =
        g.lora && !experts_.empty() ? ExpertLoraRows::FromSlots(*bank_, g.dev_int.narrow(0, 2 * R, R))
                                    : ExpertLoraRows{};
    at::Tensor pending;  // the previous layer's MLP output, not yet added to x
    bool pending_delta = false;  // and its LoRA delta, in d_hidden
    const int layers = static_cast<int>(m.layers.size());
    Mark("start", st);
    for (int i = 0; i < layers; ++i) {
      const auto& l = m.layers[static_cast<size_t>(i)];
      cuda::RmsNorm(bf16_, x.data_ptr(), pending.defined() ? pending.data_ptr() : nullptr,
                    pending_delta ? ptr(d_hidden) : nullptr, x.data_ptr(), l.input_norm.data_ptr(), h.data_ptr(), R,
                    x.size(1), eps, st);
      Mark("norm", st);
      fork(i, 0, h, slot_attn, d_qkv);
      at::Tensor qkv = Linear(h, l.qkv_w, l.qkv_b, false, st);
      join();
      Mark("qkv", st);
      cuda::QkNormRopeWrite(bf16_, qkv.data_ptr(), ptr(d_qkv), l.q_norm.defined() ? l.q_norm.data_ptr() : nullptr,
                            l.k_norm.defined() ? l.k_norm.data_ptr() : nullptr, positions.data_ptr<int64_t>(),
                            m.inv_freq.data_ptr<float>(), static_cast<float>(m.rope_scale), write_rows,
                            q.data_ptr(), cache_->k[i].data_ptr(), cache_->v[i].data_ptr(), R, H, KVH, hd, eps, st);
      Mark("rope", st);
      cuda::DecodeAttention(bf16_, q.data_ptr(), cache_->k[i].data_ptr(), cache_->v[i].data_ptr(), tables, g.table,
                            g.chunk ? ctx_single : ctx_len, block_size_, attn.data_ptr(), R, H, KVH, hd, st,
                            attention_);
      if (g.chunk)
        cuda::ChunkAttention(q.data_ptr(), cache_->k[i].data_ptr(), cache_->v[i].data_ptr(), tables, g.table, ctx_len,
                             chunk_plan, R, row_tile, block_size_, attn.data_ptr(), chunk_scratch.data_ptr<float>(),
                             R, H, KVH, hd, st);
      Mark("attn", st);
      fork(i, 1, attn, slot_attn, d_hidden);
      at::Tensor o = Linear(attn, l.o_w, l.o_b, false, st);
      join();
      Mark("o", st);
      cuda::RmsNorm(bf16_, x.data_ptr(), o.data_ptr(), ptr(d_hidden), x.data_ptr(), l.post_norm.data_ptr(),
                    h.data_ptr(), R, x.size(1), eps, st);
      Mark("norm", st);
      if (l.moe.defined()) {  // the experts' block: ATen ops that read nothing on the host (Supported)
        const auto& [gate_up_t, down_t] = experts_.empty() ? std::pair<const LoraTarget*, const LoraTarget*>{}
                                                           : experts_[static_cast<size_t>(i)];
        pending = MoeForward(l.moe, h, *bank_, gate_up_t, down_t, expert_rows, moe_gemv_);
        pending_delta = false;
        Mark("moe", st);
        continue;
      }
      fork(i, 2, h, slot_mlp, d_gate_up);
      at::Tensor gate_up = Linear(h, l.gate_up_w, {}, false, st);
      join();
      Mark("gate_up", st);
      cuda::SiluMul(bf16_, gate_up.data_ptr(), ptr(d_gate_up), act.data_ptr(), R, m.inter, st);
      Mark("silu", st);
      fork(i, 3, act, slot_mlp, d_hidden);
      pending = Linear(act, l.down_w, {}, false, st);
      pending_delta = g.lora;
      join();
      Mark("down", st);
    }
    cuda::RmsNorm(bf16_, x.data_ptr(), pending.defined() ? pending.data_ptr() : nullptr,
                  pending_delta ? ptr(d_hidden) : nullptr, x.data_ptr(), m.norm.data_ptr(), h.data_ptr(), R,
                  x.size(1), eps, st);
    Mark("norm", st);
    // lm_head's expand (the delta unrounded in fp32) waits for the logits:
    // it also converts them to fp32 (y in the model dtype, as the eager
    // path rounds it, plus the delta).
    const bool head_lora = g.lora && head_group_.A.defined();
    if (head_lora) ForkLora(head_group_, h, slot_head, t, at::Tensor(), split_ ? &scratch : nullptr, st);
    const at::Tensor y = Linear(h, m.lm_head, {}, !head_lora, st);
    at::Tensor logits = y;
    if (head_lora) {
      Join(st);
      if (y.scalar_type() != at::kFloat) logits = at::empty(y.sizes(), y.options().dtype(at::kFloat));
      cuda::LoraExpand(bf16_, head_group_.Args(slot_head, t, rank), y.data_ptr(), logits.data_ptr(), true,
                       y.stride(0), R, st);
    }
    Mark("head", st);
    return logits;
  }

  std::shared_ptr<const Transformer> model_;
  const SlotBank* bank_;
  KvCache* cache_;
  int64_t block_size_, scratch_row_;
  bool bf16_;
  std::vector<bool> stale_;
  decltype(at::cuda::graph_pool_handle()) pool_;
  std::vector<std::vector<LoraGroup>> groups_;  // per layer: qkv, o, gate_up, down (an MoE layer's last two unused)
  // Per layer: an MoE layer's expert targets in the bank (null elsewhere).
  std::vector<std::pair<const LoraTarget*, const LoraTarget*>> experts_;
  LoraGroup head_group_;  // lm_head's; its A is defined when lm_head has a LoRA target
  bool has_lora_ = false;
  bool gemv_;   // DecodeOptions::gemv off: cuBLAS for every projection
  bool moe_gemv_;  // DecodeOptions::moe_gemv: MoeForward's pair_gemv
  cuda::AttentionForm attention_;  // DecodeOptions::attention_tokens
  bool split_;  // DecodeOptions::split_shrink off: a LoRA shrink's d_in on one block per output tile
  // DecodeOptions::chunk_attention where cuda::ChunkAttention applies: a
  // tile's rows (0: off), and the warps a launch should have.
  int64_t chunk_rows_ = 0, chunk_target_warps_ = 0;
  std::unique_ptr<DecodeProfiler> profiler_;  // null in production
  std::unique_ptr<cuda::LtGemm> lt_;  // DecodeOptions::gemm_tuned on a bf16 model; else null
  Graph* capturing_ = nullptr;  // the graph being captured (profiling marks)
  // Read by stats() from any thread.
  std::atomic<int64_t> captured_{0};
  std::atomic<double> capture_seconds_{0};
  // The LoRA shrinks run on branch_, forked from and joined back to the
  // step's stream (parallel branches of the captured graph).
  cudaStream_t branch_ = nullptr;
  cudaEvent_t fork_ = nullptr, join_ = nullptr;
  std::map<std::tuple<int64_t, int64_t, bool, bool>, std::unique_ptr<Graph>> graphs_;
};

// An MoE model on the graphs (DecodeOptions::moe_graphs): qwen3_moe's
// attention is the dense kernels' (no sinks, windows, MLA or shared
// experts), and its experts' block must read nothing on the host.
bool MoeSupported(const Transformer& model) {
  if (model.config().model_type != "qwen3_moe") return false;
  for (const auto& l : model.weights().layers)
    if (l.moe.defined() && (l.gate_up_w.defined() || !MoeReadsNoHost(l.moe, model.dtype(), model.device())))
      return false;
  return true;
}

bool Supported(const Transformer& model, const SlotBank* bank, const DecodeOptions& options) {
  if (!model.device().is_cuda()) return false;
  if (model.config().num_experts > 0 && !(options.moe_graphs && bank && MoeSupported(model)))
    return false;  // MoE layers decode on the eager path
  if (model.config().IsMla()) return false;          // so do MLA layers (their pools hold latents)
  if (model.dtype() != at::kBFloat16 && model.dtype() != at::kFloat) return false;
  const auto& m = model.weights();
  if (m.head_dim != 32 && m.head_dim != 64 && m.head_dim != 128 && m.head_dim != 256) return false;
  if (m.kv_heads <= 0 || m.heads % m.kv_heads != 0) return false;
  return m.embed.size(1) <= cuda::kMaxNormWidth;
}

}  // namespace

std::unique_ptr<FastDecode> MakeFastDecode(std::shared_ptr<const Transformer> model, const SlotBank* bank,
                                           KvCache* cache, int64_t block_size, int64_t scratch_row,
                                           const DecodeOptions& options) {
  if (!options.cuda_graphs || !model || !cache || !Supported(*model, bank, options)) return nullptr;
  std::unique_ptr<DecodeProfiler> profiler;
  if (options.profile) profiler = std::make_unique<DecodeProfiler>();
  return std::make_unique<CudaFastDecode>(std::move(model), bank, cache, block_size, scratch_row, options,
                                          std::move(profiler));
}

}  // namespace loom::engine
