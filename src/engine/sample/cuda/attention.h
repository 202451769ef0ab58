// DecodeAttention: one query token per row over its paged KV cache; ChunkAttention: a prefill chunk's rows in tiles.
//
// Conventions of every decode kernel (the model dtype T, where results
// round, streams and buffer ownership): engine/sample/cuda/device.cuh.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// One query token per row over its cached context: row s attends to
// positions [0, ctx_len[s]) whose K/V rows are
// block_table[s][p / block_size] * block_size + p % block_size.
// q [rows, H, hd]; pools [pool_rows, KVH, hd]; out [rows, H * hd].
// Softmax in fp32 with scale 1/sqrt(hd); grouped-query heads share K/V.
//
// Two forms. kDims: each warp walks its share of the context a few tokens
// at a time, its lanes splitting a head's dims (a dot product is a 32-lane
// reduction). kTokens: each half warp takes a token, its 16 lanes 8 dims
// each (one 16-byte load of K and one of V per token and lane, a dot
// product a 16-lane reduction), K and V of a warp's next tokens loaded
// together; for many rows over longer contexts, where the step reads K/V
// far more than weights. kTokens runs where TokenLanesApply; elsewhere kDims.
// The fast decode takes kTokens unless told otherwise (DecodeOptions).
// Rows whose ctx_len is 0 are skipped, their out rows untouched: where
// ChunkAttention serves a step's chunk rows, DecodeAttention gets the others.
enum class AttentionForm { kDims, kTokens };
void DecodeAttention(bool bf16, const void* q, const void* k_pool, const void* v_pool, const int32_t* block_table,
                     int64_t table_stride, const int32_t* ctx_len, int64_t block_size, void* out, int64_t rows,
                     int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream,
                     AttentionForm form = AttentionForm::kDims);
// Whether form kTokens runs for these shapes: bf16, head_dim 128, and rows
// enough to fill the device with one block per row and head group.
bool TokenLanesApply(bool bf16, int64_t rows, int64_t heads, int64_t kv_heads, int64_t head_dim);

// ChunkAttention: the rows of a step's chunk tiles (engine/sample/chunk_tiles.h)
// in bf16. One warp serves one tile (up to ChunkTileRows rows of one
// sequence), every query head of one K/V head (16 queries: rows x group)
// over one split of the tile's context: 16 context tokens a step, their K
// and V staged in shared memory, scores and weighted values on the tensor
// cores (mma m16n8k16, fp32 accumulators, the weights rounded to bf16 for
// the second product), softmax online in fp32 with scale 1/sqrt(head_dim),
// as DecodeAttention's. Row r attends to [0, ctx_len[r]) through its tile's
// first row's block table. One split: the warp writes out; several: each
// writes its maximum, sum and unnormalized values to scratch, and a second
// kernel merges a row's splits into out.
//
// plan (int32, device): tiles, splits, split_len, then tile_first
// [max_tiles], tile_rows [max_tiles]; row_tile [rows]: a row's tile or -1.
// The launches are sized for max_warps (kChunkMaxWarps) and rows, so that a
// CUDA graph captured once serves every plan (warps past the plan's exit).
inline constexpr int64_t kChunkQueries = 16;
inline constexpr int64_t kChunkMaxWarps = 2048;
// bf16, head_dim 32, 64 or 128, and a group (heads / kv_heads) dividing 16.
bool ChunkAttentionApplies(bool bf16, int64_t heads, int64_t kv_heads, int64_t head_dim);
// The rows of a tile: kChunkQueries / group.
int64_t ChunkTileRows(int64_t heads, int64_t kv_heads);
// Floats of scratch ChunkAttention needs for head_dim.
int64_t ChunkScratchFloats(int64_t head_dim);
void ChunkAttention(const void* q, const void* k_pool, const void* v_pool, const int32_t* block_table,
                    int64_t table_stride, const int32_t* ctx_len, const int32_t* plan, int64_t max_tiles,
                    const int32_t* row_tile, int64_t block_size, void* out, float* scratch, int64_t rows,
                    int64_t heads, int64_t kv_heads, int64_t head_dim, cudaStream_t stream);

}  // namespace loom::engine::cuda
