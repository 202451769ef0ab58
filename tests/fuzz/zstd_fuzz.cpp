// libFuzzer target: zstd decoding of request bodies (wire/zstd.h), and the
// forward_backward decoder behind it as the gateway runs it (Content-Encoding:
// zstd). libzstd itself is Debian's, not instrumented: this covers loom's
// streaming loop and its cap, and catches what libzstd does to memory.
//
// Input: one mode byte, then the data.
//   mode % 3 == 0: decompress the data with a 1 MiB cap; check the cap.
//   mode % 3 == 1: compress the data, decompress it, compare (the round trip
//                  the SDK's bodies take); any prefix of the frame must be
//                  refused, not decoded into something shorter silently.
//   mode % 3 == 2: DecodeForwardBackwardRequest(data, zstd = true).
#include <cstdint>
#include <string>
#include <string_view>

#include <google/protobuf/stubs/logging.h>

#include "wire/forward_backward.h"
#include "wire/zstd.h"
#include "require.h"

namespace {

using loom::fuzz::Require;
using namespace loom;

constexpr size_t kCap = size_t{1} << 20;

}  // namespace

// libprotobuf logs every string field with invalid UTF-8 to stderr (the
// decoder refuses the body anyway); the noise would slow the fuzzer down.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view in(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 3) {
    case 0: {
      auto out = wire::ZstdDecompress(in, kCap);
      if (out.ok()) Require(out->size() <= kCap, "decoded past the cap");
      else
        Require(out.status().code() == Code::kInvalidArgument || out.status().code() == Code::kPayloadTooLarge,
                "an error that is neither Invalid nor PayloadTooLarge");
      break;
    }
    case 1: {
      const std::string frame = wire::ZstdCompress(in);
      Require(!frame.empty(), "compression failed");
      auto out = wire::ZstdDecompress(frame, in.size());
      Require(out.ok() && *out == in, "round trip changed the data");
      if (!in.empty()) {
        auto small = wire::ZstdDecompress(frame, in.size() - 1);
        Require(!small.ok() && small.status().code() == Code::kPayloadTooLarge, "a cap one byte short was not hit");
      }
      const std::string_view cut = std::string_view(frame).substr(0, frame.size() / 2);
      auto part = wire::ZstdDecompress(cut, in.size() + 1);
      Require(!part.ok(), "a truncated frame decoded");
      break;
    }
    default: {
      wire::ForwardBackwardDecodeOptions options;
      options.zstd = true;
      options.max_decoded_bytes = kCap;
      (void)wire::DecodeForwardBackwardRequest(in, options);
      break;
    }
  }
  return 0;
}
