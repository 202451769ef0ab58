// The forward_backward wire codec: protobuf `tinker_public.ForwardBackwardRequest`
// bodies (spec §8.9, optionally zstd-compressed) in, protobuf
// `tinker_public.ForwardBackwardOutput` bytes (spec §8.10) out. No Tinker
// semantics beyond shapes and byte lengths: the engine validates vocabulary,
// loss names and context windows.
//
// Pure functions; any thread may call them (the gateway calls them on I/O
// threads). Only Tinker types (tinker/) cross this border; protobuf stays inside.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/status.h"
#include "tinker/requests.h"
#include "tinker/types.h"

namespace loom::wire {

struct ForwardBackwardDecodeOptions {
  bool zstd = false;                            // body has Content-Encoding: zstd
  size_t max_decoded_bytes = size_t{512} << 20;  // cap on the protobuf after zstd
  // Cap on the bytes that all decoded arrays of one request may take (tokens,
  // and loss inputs after widening and sparse expansion), checked before each
  // is allocated: dense_bytes_per_body_byte x the size of the protobuf body +
  // dense_bytes_slack. Widening at most doubles a dense tensor, so any dense
  // body fits; a few bytes of sparse CSR cannot allocate gigabytes. The same
  // cap bounds, separately, what protobuf parsing itself allocates (estimated
  // from one pass over the wire format before parsing: empty datums are 2
  // bytes each on the wire and hundreds once parsed).
  size_t dense_bytes_per_body_byte = 2;
  size_t dense_bytes_slack = size_t{16} << 20;
};

// Decodes a request body. Errors (all kInvalidArgument unless noted) name the
// datum and the field, e.g. "data[1].loss_fn_inputs[weights]: dense byte
// length 12 does not match shape [7] x 4 bytes (float32)":
//  - not a protobuf ForwardBackwardRequest (malformed bytes), or one whose
//    parsed form would exceed the cap above;
//  - loss_fn_config: a value that is not finite;
//  - model_input: image / dmel chunks ("data[d].model_input chunk i: image
//    chunks are not supported by this text-only model"), token bytes not a
//    multiple of 4;
//  - tensors: unknown dtype, more than 2 dims, negative dims, byte length !=
//    numel x dtype size, a leading dimension other than the datum's token
//    count (checked before anything is expanded), inconsistent sparse CSR
//    (crow_indices length rows+1, monotone, ending at nnz; col_indices within
//    the column count, no column twice in a row), a float that is not finite;
//  - the request's decoded arrays would exceed the dense-bytes cap above;
//  - kPayloadTooLarge when the body (decoded) exceeds max_decoded_bytes.
// Tensor dtypes widen: FLOAT32/BFLOAT16 -> Array f32, INT64/INT32 -> Array i64.
// Several encoded_text chunks concatenate into Datum::tokens.
Result<tinker::ForwardBackwardRequest> DecodeForwardBackwardRequest(std::string_view body,
                                                            const ForwardBackwardDecodeOptions& options = {});

// Encodes a forward_backward result per spec §8.10: loss_fn_output_type
// "ArrayRecord"; one ArrayRecord per run of consecutive datums whose outputs
// have the same names, dtypes and trailing shapes (shape[1:]); each field is a
// BatchedTensor with int64 byte offsets (num_datums + 1, from 0). Fails with
// kInternal if a metric key does not contain exactly one ':' (the SDK's chunk
// merge would crash on it) or an Array's data does not match its shape.
Result<std::string> EncodeForwardBackwardOutput(const tinker::ForwardBackwardOutput& output);

// The inverse directions, for tests and for C++ clients (integration tests):
// request -> protobuf bytes (dense tensors; f32 -> FLOAT32, i64 -> INT64), and
// protobuf ForwardBackwardOutput -> per-datum arrays (records concatenated,
// INT32 widened to i64, BFLOAT16 to f32), as the SDK decodes it.
std::string EncodeForwardBackwardRequest(const tinker::ForwardBackwardRequest& request);
Result<tinker::ForwardBackwardOutput> DecodeForwardBackwardOutput(std::string_view bytes);

// True iff key has exactly one ':' ("loss:sum").
bool IsValidMetricKey(std::string_view key);

}  // namespace loom::wire
