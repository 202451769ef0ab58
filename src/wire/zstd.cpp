#include "wire/zstd.h"

#include <zstd.h>

#include <algorithm>
#include <memory>

namespace loom::wire {

namespace {
struct DCtxFree {
  void operator()(ZSTD_DCtx* c) const { ZSTD_freeDCtx(c); }
};
}  // namespace

Result<std::string> ZstdDecompress(std::string_view compressed, size_t max_output_bytes) {
  if (compressed.empty()) return Status::Invalid("zstd: empty body");
  std::unique_ptr<ZSTD_DCtx, DCtxFree> ctx(ZSTD_createDCtx());
  if (!ctx) return Status::Internal("zstd: cannot allocate a decoder");
  // Refuse window sizes beyond 128 MiB: a frame may not ask us for more memory.
  ZSTD_DCtx_setParameter(ctx.get(), ZSTD_d_windowLogMax, 27);

  std::string out;
  const size_t step = ZSTD_DStreamOutSize();
  ZSTD_inBuffer in{compressed.data(), compressed.size(), 0};
  for (;;) {
    // Offer at most cap + 1 bytes of room in total: reaching cap + 1 proves overflow.
    if (out.size() > max_output_bytes) {
      return Status(Code::kPayloadTooLarge,
                    "zstd: decoded body exceeds the limit of " + std::to_string(max_output_bytes) + " bytes");
    }
    size_t room = std::min(step, max_output_bytes + 1 - out.size());
    size_t old = out.size();
    out.resize(old + room);
    ZSTD_outBuffer ob{out.data() + old, room, 0};
    size_t ret = ZSTD_decompressStream(ctx.get(), &ob, &in);
    out.resize(old + ob.pos);
    if (ZSTD_isError(ret)) return Status::Invalid(std::string("zstd: ") + ZSTD_getErrorName(ret));
    bool input_done = in.pos == in.size;
    bool output_full = ob.pos == room;
    if (ret == 0 && input_done) break;             // last frame complete and flushed
    if (input_done && !output_full) return Status::Invalid("zstd: truncated frame");
  }
  if (out.size() > max_output_bytes) {
    return Status(Code::kPayloadTooLarge,
                  "zstd: decoded body exceeds the limit of " + std::to_string(max_output_bytes) + " bytes");
  }
  return out;
}

std::string ZstdCompress(std::string_view raw, int level) {
  std::string out(ZSTD_compressBound(raw.size()), '\0');
  size_t n = ZSTD_compress(out.data(), out.size(), raw.data(), raw.size(), level);
  if (ZSTD_isError(n)) return {};
  out.resize(n);
  return out;
}

}  // namespace loom::wire
