// libFuzzer target: the protobuf ForwardBackwardRequest decoder
// (wire/forward_backward.h) on an uncompressed body, with the gateway's
// options (http/router.cpp). zstd bodies are zstd_fuzz.cpp's part.
//
// Beyond "no crash": a decoded request must keep api.h's invariant (an
// Array holds exactly numel() values of its dtype), and must survive the
// round trip through EncodeForwardBackwardRequest unchanged.
#include <cstdint>
#include <cstring>
#include <string_view>

#include <google/protobuf/stubs/logging.h>

#include "wire/errors.h"
#include "wire/forward_backward.h"
#include "require.h"

namespace {

using loom::fuzz::Require;
using namespace loom;

void CheckArray(const tinker::Array& a) {
  int64_t n = 1;
  for (int64_t d : a.shape) {
    Require(d >= 0, "a negative dimension was accepted");
    Require(d == 0 || n <= INT64_MAX / d, "a shape whose numel overflows was accepted");
    n *= d;
  }
  const bool f32 = a.dtype == tinker::Array::DType::kFloat32;
  Require(static_cast<int64_t>(f32 ? a.f32.size() : a.i64.size()) == n, "an Array does not hold numel() values");
  Require((f32 ? a.i64.size() : a.f32.size()) == 0, "an Array holds values of both dtypes");
}

bool SameArray(const tinker::Array& x, const tinker::Array& y) {
  // Bitwise: NaN payloads must survive too.
  return x.dtype == y.dtype && x.shape == y.shape && x.f32.size() == y.f32.size() && x.i64 == y.i64 &&
         (x.f32.empty() || std::memcmp(x.f32.data(), y.f32.data(), x.f32.size() * sizeof(float)) == 0);
}

bool SameRequest(const tinker::ForwardBackwardRequest& x, const tinker::ForwardBackwardRequest& y) {
  if (x.model_id != y.model_id || x.seq_id != y.seq_id || x.call.loss_fn != y.call.loss_fn ||
      x.call.forward_only != y.call.forward_only || x.call.data.size() != y.call.data.size() ||
      x.call.loss_fn_config.size() != y.call.loss_fn_config.size())
    return false;
  for (auto i = x.call.loss_fn_config.begin(), j = y.call.loss_fn_config.begin(); i != x.call.loss_fn_config.end();
       ++i, ++j)
    if (i->first != j->first || std::memcmp(&i->second, &j->second, sizeof(double)) != 0) return false;
  for (size_t d = 0; d < x.call.data.size(); ++d) {
    const tinker::Datum& a = x.call.data[d];
    const tinker::Datum& b = y.call.data[d];
    if (a.tokens != b.tokens || a.loss_fn_inputs.size() != b.loss_fn_inputs.size()) return false;
    for (auto i = a.loss_fn_inputs.begin(), j = b.loss_fn_inputs.begin(); i != a.loss_fn_inputs.end(); ++i, ++j)
      if (i->first != j->first || !SameArray(i->second, j->second)) return false;
  }
  return true;
}

}  // namespace

// libprotobuf logs every string field with invalid UTF-8 to stderr (the
// decoder refuses the body anyway); the noise would slow the fuzzer down.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view body(reinterpret_cast<const char*>(data), size);
  wire::ForwardBackwardDecodeOptions options;  // the gateway's: 512 MiB, no zstd
  auto req = wire::DecodeForwardBackwardRequest(body, options);
  if (!req.ok()) {
    Require(!wire::ErrorBody(req.status()).empty(), "an empty error body");
    return 0;
  }
  for (const tinker::Datum& d : req->call.data)
    for (const auto& [name, array] : d.loss_fn_inputs) CheckArray(array);

  const std::string again = wire::EncodeForwardBackwardRequest(*req);
  auto back = wire::DecodeForwardBackwardRequest(again, options);
  if (!back.ok() && back.status().code() == Code::kPayloadTooLarge) return 0;  // a dense form past the cap
  Require(back.ok(), "a decoded request does not decode again after encoding");
  Require(SameRequest(*req, *back), "a decoded request changes through encode + decode");
  return 0;
}
