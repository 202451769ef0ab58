// Attention over a packed batch: causal within each sequence, never across
// sequences. One function with two kernels that must agree: a plain math
// reference (the obviously-correct path tests compare against) and SDPA (the
// fused op of the libtorch in use). No padding and no T x T mask: each
// sequence [seq_begin[i], seq_begin[i+1]) is attended on its own.
//
// Pure function of its inputs; any thread.
#pragma once
#include <ATen/ATen.h>

#include <map>
#include <mutex>
#include <vector>

namespace loom::engine {

// A layer's attention beyond plain causal (gpt_oss, as HF's eager path):
// per-head sink logits s_h, one extra softmax column per query row that has
// no value and is dropped after the softmax (rows then sum to < 1), and a
// sliding window: query i sees keys j with i - window < j <= i (window keys,
// itself included). Such layers take the explicit-mask math path, one
// sequence at a time, whatever the padded layout asked for (a [n, L] score
// matrix per sequence: the obviously-correct route), except where
// VariantFlashAvailable's kernel applies (training and full prefills on
// CUDA with kSdpa, sinks and no keep).
// A call may also name the keys each query keeps (`keep` [n, L] bool, on
// top of the causal rule: DSA's choice, dsa.h); that is per sequence, so
// it is set on a copy made for one PrefixCausalAttention call, never on a
// layer's own variant.
struct AttentionVariant {
  at::Tensor sinks;    // [H] in the model dtype, or undefined
  int64_t window = 0;  // 0 = every earlier key
  at::Tensor keep;     // [n, L] bool (one sequence's queries over its keys), or undefined
  bool plain() const { return !sinks.defined() && window == 0 && !keep.defined(); }
};

// Softmax over the last dimension of scores [.., n, L] with the sink logits
// (broadcastable to [.., n, 1]) as one extra column, dropped after: in the
// scores' dtype, as HF's eager_attention_forward.
at::Tensor SinkSoftmax(const at::Tensor& scores, const at::Tensor& sinks);

enum class AttentionKernel {
  kMath,  // explicit q k^T, causal -inf mask, fp32 softmax (as HF's eager path)
  kSdpa,  // scaled_dot_product_attention (fused on libtorch 2.x)
};

// The faster kernel for this libtorch build: SDPA on 2.x; math on 1.13,
// where the private SDPA is a slower composite of the same math.
AttentionKernel DefaultAttentionKernel();

// A packed batch's right-padded layout [S, Lmax] (S = non-empty sequences),
// built once per batch and shared by every layer. Pad slots repeat their
// sequence's first row (finite values; with right padding and a causal mask
// no real query ever sees them, and pad query rows are dropped on the way
// back). Immutable after Make; any thread.
struct PaddedLayout {
  int64_t seqs = 0, max_len = 0;
  // Every sequence has max_len rows and they lie back to back (the uniform
  // layout of engine/train/uniform_pass.h): the packed rows already are the
  // padded layout, so there is nothing to gather and no tensor is built.
  bool uniform = false;
  at::Tensor gather;   // [S * Lmax] int64: packed row read into each padded slot (undefined when uniform)
  at::Tensor scatter;  // [T] int64: padded slot of each packed row (undefined when uniform)
  static PaddedLayout Make(const std::vector<int64_t>& seq_begin, at::Device device);
  // Worth using on this device: more than one sequence, and at most 4x
  // padding waste on CUDA (where one launch beats S of them) or 1.25x on the
  // CPU (where padded tokens cost real arithmetic).
  static bool Prefer(const std::vector<int64_t>& seq_begin, at::Device device);
  // Make when Prefer, else an empty layout (seqs == 0: use the per-sequence path).
  static PaddedLayout IfPreferred(const std::vector<int64_t>& seq_begin, at::Device device) {
    return Prefer(seq_begin, device) ? Make(seq_begin, device) : PaddedLayout{};
  }
  // Set by the trainer for a pass that TrainOnVarlenFlash sends to the
  // varlen flash kernel over the packed rows: PackedCausalAttention then
  // takes that kernel for plain attention (seqs may be 0: nothing padded).
  bool varlen = false;
  at::Tensor cu;            // with varlen: the non-empty sequences' offsets, [S + 1] int32 on the device
  int64_t cu_max_len = 0;   // with varlen: the longest sequence
  // varlen on, with the offsets copied to the device once for every layer.
  void SetVarlen(const std::vector<int64_t>& seq_begin, at::Device device);
  // A pass with shared prefixes (engine/train/shared_prefix.h): sequence i
  // may continue sequence seq_prefix[i] (an earlier one that continues none:
  // a prompt several datums share, its rows trained once), and its queries
  // then see that sequence's keys before their own. key_rows lists, sequence
  // after sequence, the rows of each one's keys (its prefix's, then its
  // own); key_begin the offsets into it. Nothing is padded (seqs == 0); with
  // varlen, cu_k and cu_k_max_len are the keys' offsets and longest run.
  at::Tensor key_rows;             // [K] int64 on the device; undefined: no shared prefix
  std::vector<int64_t> key_begin;  // S + 1
  at::Tensor cu_k;
  int64_t cu_k_max_len = 0;
  bool shared() const { return key_rows.defined(); }
  // The layout of such a pass (varlen: for the varlen flash kernel).
  static PaddedLayout Shared(const std::vector<int64_t>& seq_begin, const std::vector<int>& seq_prefix,
                             at::Device device, bool varlen);
  const PaddedLayout* get() const { return seqs > 0 || varlen || shared() ? this : nullptr; }
};

// How often each shape has been seen, up to max_shapes distinct shapes:
// Count(key) says whether key was seen at least `after` times before this
// call, and counts this one (a shape beyond max_shapes is never counted, so
// stays new). Thread-safe.
class ShapeRecurrence {
 public:
  ShapeRecurrence(int64_t after, size_t max_shapes) : after_(after), max_shapes_(max_shapes) {}
  bool Count(const std::vector<int64_t>& key);

 private:
  const int64_t after_;
  const size_t max_shapes_;
  std::mutex mu_;
  std::map<std::vector<int64_t>, int64_t> seen_;
};

// A training pass's plain causal attention on a GPU: SDPA picks cuDNN's
// fused kernel there, the fastest for a shape it has a plan for, but
// building a plan costs about 0.25 s of host time per new shape, for the
// forward and again for the backward (H100, libtorch 2.11: bench rl's passes
// spent about 1 s of a 2.7 s pass on them), and an RL pass's shape (its
// sequences, the longest, its rows) changes with almost every batch. So a
// pass takes the varlen flash kernel over the packed rows (no plan, no
// padding) unless its shape is recurring: seen in kCudnnAfterPasses earlier
// passes, as a fixed-shape loop's is. True for varlen; counts the pass.
// False where that kernel is not available (the CPU, libtorch before 2.5,
// fp32, head dims not a multiple of 8 up to 256). Any thread.
inline constexpr int64_t kCudnnAfterPasses = 3;
bool TrainOnVarlenFlash(const std::vector<int64_t>& seq_begin, int64_t heads, int64_t kv_heads, int64_t head_dim,
                        at::Device device, at::ScalarType dtype);

// One batched attention over the whole batch in the padded layout (SDPA, or
// batched math for kMath); same result as the per-sequence path to float
// tolerance. Shapes as below.
at::Tensor PaddedCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const PaddedLayout& layout, AttentionKernel kernel);

// q [T, H, hd]; k, v [T, KVH, hd], H a multiple of KVH (grouped-query).
// seq_begin: S+1 cumulative offsets with seq_begin.back() == T.
// Returns [T, H * hd] in q's dtype; differentiable into q, k, v. A
// non-plain variant takes the per-sequence math path (kernel and padded unused).
// v may be narrower than q and k (MLA's v_head_dim: [T, KVH, dv], dv < hd):
// the output is then [T, H * dv] (the values padded with zeros, the output
// narrowed back); the softmax scale is 1/sqrt(hd) either way. With a
// shared layout (PaddedLayout::Shared) a sequence's queries also see its
// prefix's keys, as the last rows of one longer sequence.
at::Tensor PackedCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const std::vector<int64_t>& seq_begin, AttentionKernel kernel,
                                 const PaddedLayout* padded = nullptr,  // batched when given
                                 const AttentionVariant* variant = nullptr);

// Whether a sinks-and-window variant (gpt_oss) on CUDA in bf16/fp16 takes
// the varlen flash kernel over the whole packed batch in
// PackedCausalAttention with kSdpa (libtorch 2.5+): its sinks ride on the
// kernel's log-sum-exp (the output times sigma(lse - s_h)), its window is
// the kernel's left window; the per-sequence math path stays the reference.
bool VariantFlashAvailable();

// One sequence's new tokens over its cached prefix plus themselves: q
// [n, H, hd] holds the last n positions of k, v [L, KVH, hd], and query i
// sees keys 0..L-n+i. SDPA with an explicit mask for kSdpa on libtorch 2.x,
// else math (always math for a non-plain variant). Returns [n, H * hd] in q's dtype.
at::Tensor PrefixCausalAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 AttentionKernel kernel, const AttentionVariant* variant = nullptr);

}  // namespace loom::engine
