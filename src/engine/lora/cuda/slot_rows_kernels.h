// The slot bank's row copies on CUDA (lora/slot_rows.h): the pass's factors
// gathered from the bank's fp32 rows and cast to the compute type, and the
// pass's gradient buffer added back into the bank's gradient rows. Each is
// one kernel over every slot, where ATen takes an index_select, a cast and
// an index_add (with its own cast) a slot or a group.
//
// Conventions as model/cuda/lean_kernels.h: raw pointers and a stream,
// asynchronous on `stream`. T is bf16 (`bf16`) or fp32.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

namespace loom::engine::cuda {

// out[u, j] = T(flat[slots[u] * ld + j]) for u < U, j < len (out [U, len]
// contiguous; flat points at the first of the columns).
void GatherSlotRows(bool bf16, const float* flat, int64_t ld, const int64_t* slots, int64_t U, int64_t len, void* out,
                    cudaStream_t stream);

// flat[slots[u] * ld + j] += float(rows[u, j]). A slot may repeat (the
// uniform layout routes each sequence, and a slot may have several): its
// rows add in row order. With distinct slots, one add an element: the bits
// of index_add_ with the rows cast to fp32.
void AddSlotRows(bool bf16, const void* rows, const int64_t* slots, int64_t U, int64_t len, float* flat, int64_t ld,
                 cudaStream_t stream);

}  // namespace loom::engine::cuda
