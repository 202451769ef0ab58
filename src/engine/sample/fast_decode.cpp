// Builds without the CUDA kernels (the CPU build) have no fast decode; the
// CUDA build defines MakeFastDecode in engine/sample/cuda/fast_decode_cuda.cpp.
#include "engine/sample/fast_decode.h"

#ifndef LOOM_CUDA_KERNELS
namespace loom::engine {

std::unique_ptr<FastDecode> MakeFastDecode(std::shared_ptr<const Transformer>, const SlotBank*, KvCache*, int64_t,
                                           int64_t, const DecodeOptions&) {
  return nullptr;
}

}  // namespace loom::engine
#endif
