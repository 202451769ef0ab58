// The forward_backward protobuf codec against the spec's golden bytes (§14),
// the BatchedTensor layout of §8.10, and every way a body can be malformed.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>

#include "tinker_public.pb.h"
#include "wire/forward_backward.h"
#include "wire/proto_log.h"
#include "wire/zstd.h"
#include "wire_test_util.h"

namespace loom::wire {
namespace {

using namespace loom::tinker;  // the vocabulary wire/ encodes

namespace pb = ::tinker_public;
using testing::HexDecode;

const char* kGoldenRequest =
    "0a09533a747261696e3a3010011a640a100a0e0a0c010000000200000003000000121e0a077765696768747312130a0c000000000000803f0000"
    "803f180122010312300a0d7461726765745f746f6b656e73121f0a18020000000000000003000000000000000400000000000000180222010322"
    "0d63726f73735f656e74726f7079";
const char* kGoldenOutput =
    "0a0b41727261795265636f7264123a12360a086c6f6770726f6273122a0a0c000000bf000080bf000080be1218000000000000000008000000"
    "000000000c00000000000000180118021a130a086c6f73733a73756d11000000000000f83f";

template <typename T>
std::string Raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

std::vector<int64_t> Offsets(const std::string& bytes) {
  std::vector<int64_t> out(bytes.size() / 8);
  std::memcpy(out.data(), bytes.data(), out.size() * 8);
  return out;
}

// A one-datum request whose loss input `name` is the given tensor.
std::string RequestWithTensor(const pb::Tensor& t, const std::string& name = "weights") {
  pb::ForwardBackwardRequest req;
  req.set_model_id("m");
  req.set_seq_id(1);
  req.set_loss_fn("cross_entropy");
  auto* d = req.add_data();
  d->add_model_input()->mutable_encoded_text()->set_tokens(Raw(std::vector<int32_t>{1, 2, 3}));
  (*d->mutable_loss_fn_inputs())[name] = t;
  return req.SerializeAsString();
}

pb::Tensor CsrTensor(std::vector<int64_t> shape, std::vector<float> values, std::vector<int64_t> crow,
                     std::vector<int64_t> col) {
  pb::Tensor t;
  t.set_dtype(pb::DTYPE_FLOAT32);
  for (auto s : shape) t.add_shape(s);
  t.mutable_sparse_csr()->set_values(Raw(values));
  t.mutable_sparse_csr()->set_crow_indices(Raw(crow));
  t.mutable_sparse_csr()->set_col_indices(Raw(col));
  return t;
}

Status DecodeStatus(const std::string& body, ForwardBackwardDecodeOptions opt = {}) {
  auto r = DecodeForwardBackwardRequest(body, opt);
  return r.status();
}

TEST(ForwardBackwardRequest, GoldenBytesDecode) {
  auto r = DecodeForwardBackwardRequest(HexDecode(kGoldenRequest));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->model_id, "S:train:0");
  EXPECT_EQ(r->seq_id, 1);
  EXPECT_EQ(r->call.loss_fn, "cross_entropy");
  EXPECT_FALSE(r->call.forward_only);
  EXPECT_TRUE(r->call.loss_fn_config.empty());
  ASSERT_EQ(r->call.data.size(), 1u);
  const auto& d = r->call.data[0];
  EXPECT_EQ(d.tokens, (std::vector<int32_t>{1, 2, 3}));
  const auto& tt = d.loss_fn_inputs.at("target_tokens");
  EXPECT_EQ(tt.dtype, tinker::Array::DType::kInt64);
  EXPECT_EQ(tt.shape, (std::vector<int64_t>{3}));
  EXPECT_EQ(tt.i64, (std::vector<int64_t>{2, 3, 4}));
  const auto& w = d.loss_fn_inputs.at("weights");
  EXPECT_EQ(w.dtype, tinker::Array::DType::kFloat32);
  EXPECT_EQ(w.f32, (std::vector<float>{0.f, 1.f, 1.f}));
}

TEST(ForwardBackwardRequest, EncodeRoundTripsThroughTheGoldenMessage) {
  auto r = DecodeForwardBackwardRequest(HexDecode(kGoldenRequest));
  ASSERT_TRUE(r.ok());
  // Map order may differ from the golden bytes, so compare parsed messages.
  pb::ForwardBackwardRequest golden, ours;
  ASSERT_TRUE(golden.ParseFromString(HexDecode(kGoldenRequest)));
  ASSERT_TRUE(ours.ParseFromString(EncodeForwardBackwardRequest(r.value())));
  EXPECT_EQ(ours.model_id(), golden.model_id());
  EXPECT_EQ(ours.seq_id(), golden.seq_id());
  EXPECT_EQ(ours.loss_fn(), golden.loss_fn());
  ASSERT_EQ(ours.data_size(), 1);
  EXPECT_EQ(ours.data(0).model_input(0).encoded_text().tokens(), golden.data(0).model_input(0).encoded_text().tokens());
  for (const char* k : {"target_tokens", "weights"}) {
    const auto& a = ours.data(0).loss_fn_inputs().at(k);
    const auto& b = golden.data(0).loss_fn_inputs().at(k);
    EXPECT_EQ(a.dense(), b.dense()) << k;
    EXPECT_EQ(a.dtype(), b.dtype()) << k;
    EXPECT_EQ(a.shape_size(), b.shape_size()) << k;
  }
}

TEST(ForwardBackwardRequest, ConfigForwardOnlyAndSeveralTextChunks) {
  pb::ForwardBackwardRequest req;
  req.set_model_id("s:train:3");
  req.set_seq_id(7);
  req.set_loss_fn("ppo");
  req.set_forward_only(true);
  (*req.mutable_loss_fn_config())["clip_low_threshold"] = 0.75;
  auto* d = req.add_data();
  d->add_model_input()->mutable_encoded_text()->set_tokens(Raw(std::vector<int32_t>{10, 11}));
  d->add_model_input()->mutable_encoded_text()->set_tokens(Raw(std::vector<int32_t>{12}));
  auto r = DecodeForwardBackwardRequest(req.SerializeAsString());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_TRUE(r->call.forward_only);
  EXPECT_EQ(r->call.loss_fn, "ppo");
  EXPECT_DOUBLE_EQ(r->call.loss_fn_config.at("clip_low_threshold"), 0.75);
  EXPECT_EQ(r->call.data[0].tokens, (std::vector<int32_t>{10, 11, 12}));
}

TEST(ForwardBackwardRequest, ImageAndDmelChunksAreRejectedByIndex) {
  pb::ForwardBackwardRequest req;
  auto* d = req.add_data();
  d->add_model_input()->mutable_encoded_text()->set_tokens(Raw(std::vector<int32_t>{1}));
  d->add_model_input()->mutable_image()->set_data("png");
  Status s = DecodeStatus(req.SerializeAsString());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("data[0].model_input chunk 1: image chunks are not supported by this text-only model"),
            std::string::npos)
      << s.message();
  d->mutable_model_input(1)->mutable_dmel()->set_dmel("x");
  s = DecodeStatus(req.SerializeAsString());
  EXPECT_NE(s.message().find("chunk 1: dmel"), std::string::npos) << s.message();
}

TEST(ForwardBackwardRequest, TokenBytesMustBeWholeInt32s) {
  pb::ForwardBackwardRequest req;
  req.add_data()->add_model_input()->mutable_encoded_text()->set_tokens(std::string(6, '\0'));
  Status s = DecodeStatus(req.SerializeAsString());
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("multiple of 4"), std::string::npos) << s.message();
}

// A string field that is not UTF-8 is refused (400), and protobuf's own
// error line for it passes once per interval, not once per request.
TEST(ForwardBackwardRequest, InvalidUtf8IsRefusedAndItsLogLinesAreLimited) {
  pb::ForwardBackwardRequest req;
  req.set_model_id(std::string("m\xff\xfe", 3));
  std::string body;
  req.AppendPartialToString(&body);
  LimitProtobufLogs(std::chrono::hours(1));
  const uint64_t dropped_before = DroppedProtobufLogs();
  ::testing::internal::CaptureStderr();
  for (int i = 0; i < 50; ++i) EXPECT_EQ(DecodeStatus(body).code(), Code::kInvalidArgument);
  const std::string err = ::testing::internal::GetCapturedStderr();
  size_t lines = 0;
  for (size_t at = err.find("UTF-8"); at != std::string::npos; at = err.find("UTF-8", at + 1)) ++lines;
  EXPECT_LE(lines, 1u) << err;
  EXPECT_GE(DroppedProtobufLogs() - dropped_before, 49u);
}

TEST(ForwardBackwardRequest, WidensInt32AndBfloat16) {
  pb::Tensor i32;
  i32.set_dtype(pb::DTYPE_INT32);
  i32.add_shape(3);
  i32.set_dense(Raw(std::vector<int32_t>{-1, 7, 151645}));
  auto r = DecodeForwardBackwardRequest(RequestWithTensor(i32, "target_tokens"));
  ASSERT_TRUE(r.ok()) << r.status().message();
  const auto& a = r->call.data[0].loss_fn_inputs.at("target_tokens");
  EXPECT_EQ(a.dtype, tinker::Array::DType::kInt64);
  EXPECT_EQ(a.i64, (std::vector<int64_t>{-1, 7, 151645}));

  pb::Tensor bf;
  bf.set_dtype(pb::DTYPE_BFLOAT16);
  bf.add_shape(3);
  bf.set_dense(Raw(std::vector<uint16_t>{0x3FC0, 0xBF80, 0x0000}));  // 1.5, -1.0, 0.0
  r = DecodeForwardBackwardRequest(RequestWithTensor(bf));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->call.data[0].loss_fn_inputs.at("weights").f32, (std::vector<float>{1.5f, -1.0f, 0.0f}));
}

TEST(ForwardBackwardRequest, DenseByteLengthMustMatchShape) {
  pb::Tensor t;
  t.set_dtype(pb::DTYPE_FLOAT32);
  t.add_shape(7);
  t.set_dense(Raw(std::vector<float>{1, 2, 3}));
  Status s = DecodeStatus(RequestWithTensor(t));
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("data[0].loss_fn_inputs[weights]"), std::string::npos) << s.message();
  EXPECT_NE(s.message().find("12"), std::string::npos) << s.message();

  t.clear_shape();
  t.add_shape(-3);
  EXPECT_EQ(DecodeStatus(RequestWithTensor(t)).code(), Code::kInvalidArgument);

  t.clear_shape();
  t.add_shape(int64_t{1} << 62);  // numel x 4 overflows: no allocation, just an error
  t.add_shape(8);
  EXPECT_EQ(DecodeStatus(RequestWithTensor(t)).code(), Code::kInvalidArgument);

  pb::Tensor u;  // DTYPE_UNSPECIFIED
  u.add_shape(1);
  u.set_dense(std::string(4, '\0'));
  s = DecodeStatus(RequestWithTensor(u));
  EXPECT_NE(s.message().find("unsupported dtype"), std::string::npos) << s.message();
}

TEST(ForwardBackwardRequest, SparseCsrBecomesDense) {
  // 3x4, one value per row (the capture's 2-D target shape).
  auto t = CsrTensor({3, 4}, {1.f, 0.5f, 2.f}, {0, 1, 2, 3}, {0, 1, 2});
  auto r = DecodeForwardBackwardRequest(RequestWithTensor(t));
  ASSERT_TRUE(r.ok()) << r.status().message();
  const auto& a = r->call.data[0].loss_fn_inputs.at("weights");
  EXPECT_EQ(a.shape, (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(a.f32, (std::vector<float>{1, 0, 0, 0, 0, 0.5f, 0, 0, 0, 0, 2, 0}));
  // An empty row in the middle.
  t = CsrTensor({3, 2}, {4.f, 5.f}, {0, 1, 1, 2}, {1, 0});
  r = DecodeForwardBackwardRequest(RequestWithTensor(t));
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->call.data[0].loss_fn_inputs.at("weights").f32, (std::vector<float>{0, 4, 0, 0, 5, 0}));
}

TEST(ForwardBackwardRequest, BadSparseCsrIsInvalid) {
  struct Case {
    const char* what;
    pb::Tensor t;
  };
  std::vector<Case> cases = {
      {"crow_indices", CsrTensor({3, 4}, {1, 1, 1}, {0, 1, 3}, {0, 1, 2})},         // rows+1 = 4 entries needed
      {"outside", CsrTensor({3, 4}, {1, 1, 1}, {0, 1, 2, 3}, {0, 1, 4})},           // column 4 >= 4
      {"start at 0", CsrTensor({3, 4}, {1, 1, 1}, {1, 1, 2, 3}, {0, 1, 2})},
      {"non-decreasing", CsrTensor({3, 4}, {1, 1, 1}, {0, 2, 1, 3}, {0, 1, 2})},
      {"end at nnz", CsrTensor({3, 4}, {1, 1, 1}, {0, 1, 2, 2}, {0, 1, 2})},
      {"twice", CsrTensor({3, 4}, {1, 1}, {0, 2, 2, 2}, {3, 3})},
      {"values has", CsrTensor({3, 4}, {1, 1}, {0, 1, 2, 3}, {0, 1, 2})},
      {"2-D shape", CsrTensor({12}, {1}, {0, 1}, {0})},
      {"dense bytes", CsrTensor({3, 1 << 22}, {}, {0, 0, 0, 0}, {})},  // 48 MiB dense from a few bytes
  };
  for (const auto& c : cases) {
    Status s = DecodeStatus(RequestWithTensor(c.t));
    EXPECT_EQ(s.code(), Code::kInvalidArgument) << c.what;
    EXPECT_NE(s.message().find(c.what), std::string::npos) << c.what << " -> " << s.message();
    EXPECT_NE(s.message().find("data[0].loss_fn_inputs[weights]"), std::string::npos) << s.message();
  }
}

TEST(ForwardBackwardRequest, MalformedProtobufIsInvalid) {
  std::string golden = HexDecode(kGoldenRequest);
  for (const std::string& body : {std::string("\xff\xff\xff\xff", 4), golden.substr(0, golden.size() - 5),
                                  std::string("\x0a\x7f", 2) /* length past the end */}) {
    Status s = DecodeStatus(body);
    EXPECT_EQ(s.code(), Code::kInvalidArgument);
    EXPECT_NE(s.message().find("not a valid protobuf"), std::string::npos) << s.message();
  }
}

TEST(ForwardBackwardRequest, ZstdBodiesAndTheirLimits) {
  const std::string golden = HexDecode(kGoldenRequest);
  ForwardBackwardDecodeOptions opt;
  opt.zstd = true;
  auto r = DecodeForwardBackwardRequest(ZstdCompress(golden), opt);
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->model_id, "S:train:0");

  // A bomb: 64 MiB of zeros is a few KiB compressed; the cap stops it at 1 MiB.
  const std::string bomb = ZstdCompress(std::string(64 << 20, '\0'));
  ASSERT_LT(bomb.size(), 64u << 10);
  opt.max_decoded_bytes = 1 << 20;
  EXPECT_EQ(DecodeStatus(bomb, opt).code(), Code::kPayloadTooLarge);
  auto z = ZstdDecompress(bomb, 1 << 20);
  EXPECT_EQ(z.status().code(), Code::kPayloadTooLarge);
  // Exactly at the cap is fine.
  const std::string exact(1 << 20, 'a');
  auto e = ZstdDecompress(ZstdCompress(exact), exact.size());
  ASSERT_TRUE(e.ok()) << e.status().message();
  EXPECT_EQ(e.value(), exact);
  EXPECT_EQ(ZstdDecompress(ZstdCompress(exact), exact.size() - 1).status().code(), Code::kPayloadTooLarge);

  // Corrupt and truncated frames.
  std::string z1 = ZstdCompress(golden);
  EXPECT_EQ(ZstdDecompress(z1.substr(0, z1.size() - 3), 1 << 20).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(ZstdDecompress("not zstd at all", 1 << 20).status().code(), Code::kInvalidArgument);
  // Two concatenated frames decode to the concatenation.
  auto two = ZstdDecompress(ZstdCompress("ab") + ZstdCompress("cd"), 100);
  ASSERT_TRUE(two.ok()) << two.status().message();
  EXPECT_EQ(two.value(), "abcd");

  // Uncompressed bodies obey the same cap.
  ForwardBackwardDecodeOptions plain;
  plain.max_decoded_bytes = 10;
  EXPECT_EQ(DecodeStatus(golden, plain).code(), Code::kPayloadTooLarge);
}

tinker::Array F32(std::vector<float> v, std::vector<int64_t> shape = {}) {
  tinker::Array a = tinker::Array::Floats(std::move(v));
  if (!shape.empty()) a.shape = std::move(shape);
  return a;
}

TEST(ForwardBackwardOutput, GoldenBytesExactly) {
  tinker::ForwardBackwardOutput o;
  o.outputs = {{{"logprobs", F32({-0.5f, -1.0f})}}, {{"logprobs", F32({-0.25f})}}};
  o.metrics = {{"loss:sum", 1.5}};
  auto bytes = EncodeForwardBackwardOutput(o);
  ASSERT_TRUE(bytes.ok()) << bytes.status().message();
  EXPECT_EQ(bytes.value(), HexDecode(kGoldenOutput));
}

TEST(ForwardBackwardOutput, ByteOffsetsStartAtZeroAndCountBytes) {
  tinker::ForwardBackwardOutput o;
  o.outputs = {{{"logprobs", F32({1, 2})}, {"elementwise_loss", F32({3, 4})}},
               {{"logprobs", F32({})}, {"elementwise_loss", F32({})}},
               {{"logprobs", F32({5, 6, 7})}, {"elementwise_loss", F32({8, 9, 10})}}};
  o.metrics = {{"loss:sum", 2.0}, {"tokens:sum", 5}};
  auto bytes = EncodeForwardBackwardOutput(o);
  ASSERT_TRUE(bytes.ok());
  pb::ForwardBackwardOutput msg;
  ASSERT_TRUE(msg.ParseFromString(bytes.value()));
  EXPECT_EQ(msg.loss_fn_output_type(), "ArrayRecord");
  ASSERT_EQ(msg.loss_fn_outputs_size(), 1);
  const auto& rec = msg.loss_fn_outputs(0);
  EXPECT_EQ(rec.num_datums(), 3);
  for (const char* k : {"logprobs", "elementwise_loss"}) {
    const auto& bt = rec.fields().at(k);
    EXPECT_EQ(Offsets(bt.offsets()), (std::vector<int64_t>{0, 8, 8, 20})) << k;
    EXPECT_EQ(bt.data().size(), 20u);
    EXPECT_EQ(bt.dtype(), pb::DTYPE_FLOAT32);
    EXPECT_EQ(bt.trailing_shape_size(), 0);
  }
  EXPECT_EQ(msg.metrics().at("tokens:sum"), 5);
  auto back = DecodeForwardBackwardOutput(bytes.value());
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->outputs[2].at("logprobs").f32, (std::vector<float>{5, 6, 7}));
  EXPECT_EQ(back->outputs[1].at("logprobs").shape, (std::vector<int64_t>{0}));
}

TEST(ForwardBackwardOutput, OneRecordPerRunOfEqualTrailingShapes) {
  tinker::ForwardBackwardOutput o;
  o.outputs = {{{"logprobs", F32({1, 2})}},
               {{"logprobs", F32({1, 2, 3, 4, 5, 6}, {3, 2})}},   // (N, K=2)
               {{"logprobs", F32({7, 8, 9, 10}, {2, 2})}},        // same trailing shape: same record
               {{"logprobs", F32({0.5f})}}};
  o.metrics = {{"loss:sum", 0}};
  auto bytes = EncodeForwardBackwardOutput(o);
  ASSERT_TRUE(bytes.ok());
  pb::ForwardBackwardOutput msg;
  ASSERT_TRUE(msg.ParseFromString(bytes.value()));
  ASSERT_EQ(msg.loss_fn_outputs_size(), 3);
  EXPECT_EQ(msg.loss_fn_outputs(0).num_datums(), 1);
  EXPECT_EQ(msg.loss_fn_outputs(1).num_datums(), 2);
  EXPECT_EQ(msg.loss_fn_outputs(2).num_datums(), 1);
  const auto& bt = msg.loss_fn_outputs(1).fields().at("logprobs");
  ASSERT_EQ(bt.trailing_shape_size(), 1);
  EXPECT_EQ(bt.trailing_shape(0), 2);
  EXPECT_EQ(Offsets(bt.offsets()), (std::vector<int64_t>{0, 24, 40}));
  auto back = DecodeForwardBackwardOutput(bytes.value());
  ASSERT_TRUE(back.ok());
  ASSERT_EQ(back->outputs.size(), 4u);
  EXPECT_EQ(back->outputs[1].at("logprobs").shape, (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(back->outputs[2].at("logprobs").shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(back->outputs[2].at("logprobs").f32, (std::vector<float>{7, 8, 9, 10}));
  EXPECT_EQ(back->outputs[3].at("logprobs").shape, (std::vector<int64_t>{1}));
}

TEST(ForwardBackwardOutput, Int64OutputsAndEmptyBatch) {
  tinker::ForwardBackwardOutput o;
  o.outputs = {{{"ids", tinker::Array::Ints({1, -2, 3})}}};
  auto bytes = EncodeForwardBackwardOutput(o);
  ASSERT_TRUE(bytes.ok());
  auto back = DecodeForwardBackwardOutput(bytes.value());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->outputs[0].at("ids").i64, (std::vector<int64_t>{1, -2, 3}));

  tinker::ForwardBackwardOutput empty;
  auto e = EncodeForwardBackwardOutput(empty);
  ASSERT_TRUE(e.ok());
  pb::ForwardBackwardOutput msg;
  ASSERT_TRUE(msg.ParseFromString(e.value()));
  EXPECT_EQ(msg.loss_fn_output_type(), "ArrayRecord");
  EXPECT_EQ(msg.loss_fn_outputs_size(), 0);
}

TEST(ForwardBackwardOutput, MetricKeysNeedExactlyOneColon) {
  EXPECT_TRUE(IsValidMetricKey("loss:sum"));
  EXPECT_TRUE(IsValidMetricKey("e_max_violation:max"));
  EXPECT_FALSE(IsValidMetricKey("loss"));
  EXPECT_FALSE(IsValidMetricKey("a:b:sum"));
  EXPECT_FALSE(IsValidMetricKey(""));
  for (const char* bad : {"loss", "ns:loss:sum"}) {
    tinker::ForwardBackwardOutput o;
    o.metrics = {{"loss:sum", 1.0}, {bad, 2.0}};
    auto r = EncodeForwardBackwardOutput(o);
    EXPECT_EQ(r.status().code(), Code::kInternal) << bad;
    EXPECT_NE(r.status().message().find(bad), std::string::npos);
  }
}

TEST(ForwardBackwardOutput, ArrayWhoseDataDisagreesWithItsShapeIsRefused) {
  tinker::ForwardBackwardOutput o;
  o.outputs = {{{"logprobs", F32({1, 2, 3}, {2})}}};
  EXPECT_EQ(EncodeForwardBackwardOutput(o).status().code(), Code::kInternal);
}

}  // namespace
}  // namespace loom::wire
