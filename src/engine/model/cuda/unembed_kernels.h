// The trainer's loss head on CUDA (model/unembed.h, UnembedMode): log-probabilities
// of target tokens read straight off the logits in the model dtype, and
// their gradient written over those logits, so that no fp32 copy of the
// [rows, vocab] logits is ever made (HF computes the logits in the model
// dtype too, then upcasts them for the loss; these kernels upcast in
// registers instead).
//
// Conventions as lean_kernels.h: raw pointers and a stream, contiguous
// row-major buffers, T the model dtype (bf16 or fp32, chosen by `bf16`),
// asynchronous on `stream`. targets [rows, k] int64 in [0, vocab).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// The most targets a row may have in TargetLogprobsGrad (its shared memory).
constexpr int64_t kMaxLogprobTargets = 1024;

// Per row: lse = logsumexp(logits) in fp32 (one pass, a running max), and
// logprob[j] = logits[targets[j]] - lse for the row's k targets.
void TargetLogprobs(bool bf16, const void* logits, const int64_t* targets, float* logprob, float* lse, int64_t rows,
                    int64_t vocab, int64_t k, cudaStream_t stream);

// The gradient of sum_j g[j] * logprob[j] with respect to the logits, over
// them in place: T(sum_{j: targets[j] = v} g[j] - G exp(logits[v] - lse)),
// G = sum_j g[j], rounded once from fp32. g [rows, k] fp32, lse [rows] the
// forward's. k <= kMaxLogprobTargets.
void TargetLogprobsGrad(bool bf16, void* logits, const float* lse, const int64_t* targets, const float* g,
                        int64_t rows, int64_t vocab, int64_t k, cudaStream_t stream);

}  // namespace loom::engine::cuda
