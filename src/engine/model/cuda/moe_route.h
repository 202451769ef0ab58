// MoeRoute and MoeCombine: a decode step's router after its logits, and
// its combine of the (token, choice) pairs' outputs, each one kernel where
// the ATen ops they replace (moe.cpp's Route, PairGemvBlock's weighting and
// CombineNode) launch three to seven.
//
// Conventions of every decode kernel (the model dtype T, where results
// round, streams and buffer ownership): engine/sample/cuda/device.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// The routers with one softmax (moe.h's MoeRouter):
//   kSoftmaxTopK:  p = softmax(fp32(logits)) over E, the top K of p in
//                  descending order, divided by their sum when norm_topk,
//                  rounded to T (qwen3_moe);
//   kTopKSoftmax:  the top K logits in descending order, softmax over them
//                  rounded to T (gpt_oss).
// logits [tokens, E] in T; weights [tokens, K] in T; experts [tokens, K]
// int64. Ties go to the lower expert. False, launching nothing, where
// E > kMoeRouteMaxExperts, K > E or K > kMoeRouteMaxK.
enum class MoeRouteKind { kSoftmaxTopK, kTopKSoftmax };
constexpr int64_t kMoeRouteMaxExperts = 1024;
constexpr int64_t kMoeRouteMaxK = 32;
bool MoeRoute(bool bf16, MoeRouteKind kind, bool norm_topk, const void* logits, void* weights, int64_t* experts,
              int64_t tokens, int64_t E, int64_t K, cudaStream_t stream);

// out [tokens, n] = sum over k of T(y[t K + k] * weights[t, k]), each
// product in fp32 and rounded to T, summed in fp32 and rounded to T once:
// the (token, choice) pairs' outputs y [tokens * K, n] in (token, choice)
// order, weighted and combined. weights [tokens, K] in T, or fp32 where
// weights_f32 (the grouped routers').
void MoeCombine(bool bf16, const void* y, const void* weights, bool weights_f32, void* out, int64_t tokens, int64_t K,
                int64_t n, cudaStream_t stream);

}  // namespace loom::engine::cuda
