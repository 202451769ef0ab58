// forward_backward bodies built to hurt the server (issue 15): a few bytes of
// sparse CSR that densify to gigabytes, and loss inputs or loss_fn_config
// values that turn an adapter into inf/NaN. Each is refused at decode time with
// a 400 naming the field and the limit, before the dense form is allocated.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>

#include "tinker_public.pb.h"
#include "wire/forward_backward.h"

// The largest single allocation made through operator new since the last
// reset: a decoder that refuses a tensor must not have allocated its dense
// form first. (Replaces the global operator new for this test binary; the
// other wire tests only see it count.)
static std::atomic<size_t> g_largest_alloc{0};

void* operator new(size_t n) {
  size_t seen = g_largest_alloc.load(std::memory_order_relaxed);
  while (n > seen && !g_largest_alloc.compare_exchange_weak(seen, n, std::memory_order_relaxed)) {
  }
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
void* operator new[](size_t n) { return ::operator new(n); }
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, size_t) noexcept { std::free(p); }
void operator delete[](void* p, size_t) noexcept { std::free(p); }

namespace loom::wire {
namespace {

using namespace loom::tinker;  // the vocabulary wire/ encodes

namespace pb = ::tinker_public;

void ExpectInvalid(const Status& s, const std::string& prefix) {
  EXPECT_EQ(s.code(), Code::kInvalidArgument) << s.message();
  EXPECT_EQ(s.message().rfind(prefix, 0), 0u) << "want prefix '" << prefix << "', got '" << s.message() << "'";
}

void ExpectMentions(const Status& s, const std::string& text) {
  EXPECT_NE(s.message().find(text), std::string::npos) << "want '" << text << "' in '" << s.message() << "'";
}

// ------------------------------------------------------- forward_backward

template <typename T>
std::string Raw(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

pb::Tensor EmptyCsr(int64_t rows, int64_t cols, int dtype = pb::DTYPE_INT64) {
  pb::Tensor t;
  t.set_dtype(static_cast<pb::DType>(dtype));
  t.add_shape(rows);
  t.add_shape(cols);
  t.mutable_sparse_csr()->set_crow_indices(Raw(std::vector<int64_t>(rows + 1, 0)));  // nnz 0
  return t;
}

pb::ForwardBackwardRequest Request(int tokens_per_datum, const std::vector<pb::Tensor>& target_per_datum) {
  pb::ForwardBackwardRequest req;
  req.set_model_id("m");
  req.set_seq_id(1);
  req.set_loss_fn("cross_entropy");
  for (const pb::Tensor& t : target_per_datum) {
    auto* d = req.add_data();
    d->add_model_input()->mutable_encoded_text()->set_tokens(Raw(std::vector<int32_t>(tokens_per_datum, 1)));
    (*d->mutable_loss_fn_inputs())["target_tokens"] = t;
  }
  return req;
}

Status Decode(const pb::ForwardBackwardRequest& req) {
  return DecodeForwardBackwardRequest(req.SerializeAsString()).status();
}

TEST(HostileForwardBackward, SparseShapeIsCheckedAgainstTheDatumBeforeDensifying) {
  // The body: [1, 2^27] with nnz 0 densified to 1 GiB before any check.
  const std::string body = Request(3, {EmptyCsr(1, int64_t{1} << 27)}).SerializeAsString();
  ASSERT_LT(body.size(), 200u);
  g_largest_alloc = 0;
  Status s = DecodeForwardBackwardRequest(body).status();
  EXPECT_LT(g_largest_alloc.load(), size_t{1} << 20);
  ExpectInvalid(s, "data[0].loss_fn_inputs[target_tokens]: leading dimension 1 of shape [1,134217728] does not match "
                   "the datum's 3 input tokens");
}

TEST(HostileForwardBackward, DenseBytesAreBoundedPerRequestNotPerTensor) {
  // The right leading dimension, but 1 GiB of dense int64 from a 180-byte body.
  auto one = Request(1, {EmptyCsr(1, int64_t{1} << 27)});
  g_largest_alloc = 0;
  Status s = Decode(one);
  EXPECT_LT(g_largest_alloc.load(), size_t{1} << 20);
  ExpectInvalid(s, "data[0].loss_fn_inputs[target_tokens]: sparse shape [1,134217728] needs 1073741824 dense bytes");
  ExpectMentions(s, "which takes the request over its limit of");
  ExpectMentions(s, "decoded bytes (2 x the body + 16 MiB)");

  // 8 MiB each is fine alone; four of them (the four datums) are not.
  const pb::Tensor eight_mib = EmptyCsr(1, int64_t{1} << 20);
  EXPECT_TRUE(Decode(Request(1, {eight_mib})).ok());
  g_largest_alloc = 0;
  s = Decode(Request(1, {eight_mib, eight_mib, eight_mib, eight_mib}));
  EXPECT_LE(g_largest_alloc.load(), size_t{8} << 20);  // the two that fit, never the rest
  ExpectInvalid(s, "data[2].loss_fn_inputs[target_tokens]: sparse shape [1,1048576] needs 8388608 dense bytes");
  ExpectMentions(s, "which takes the request over its limit of");
}

TEST(HostileForwardBackward, ParsingItselfIsBoundedByTheSameBudget) {
  // 1M empty datums: a 2 MB body that parsed into ~250 MB.
  std::string body;
  for (int i = 0; i < 1000000; ++i) body += std::string("\x1a\x00", 2);
  g_largest_alloc = 0;
  Status s = DecodeForwardBackwardRequest(body).status();
  EXPECT_LT(g_largest_alloc.load(), size_t{1} << 20);
  ExpectInvalid(s, "forward_backward: the body's protobuf messages and fields need about");
  ExpectMentions(s, "bytes once parsed, over the request's limit of");
  // The SDK's biggest chunk of the smallest datums still decodes.
  pb::Tensor tt;
  tt.set_dtype(pb::DTYPE_INT64);
  tt.add_shape(1);
  tt.set_dense(Raw(std::vector<int64_t>{5}));
  auto req = Request(1, std::vector<pb::Tensor>(1024, tt));
  auto r = DecodeForwardBackwardRequest(req.SerializeAsString());
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->call.data.size(), 1024u);
  // A million-dimension shape is refused with a short message.
  pb::Tensor wide;
  wide.set_dtype(pb::DTYPE_INT64);
  for (int i = 0; i < 1000000; ++i) wide.add_shape(1);
  s = Decode(Request(1, {wide}));
  ExpectInvalid(s, "data[0].loss_fn_inputs[target_tokens]: shape [1,1,1,1,1,1,1,1,...] (1000000 dims) has 1000000 "
                   "dimensions");
  EXPECT_LT(s.message().size(), 200u);
}

TEST(HostileForwardBackward, NonFiniteLossInputsAndConfigAreRefused) {
  auto with_weights = [](pb::Tensor w) {
    pb::Tensor tt;
    tt.set_dtype(pb::DTYPE_INT64);
    tt.add_shape(3);
    tt.set_dense(Raw(std::vector<int64_t>{1, 2, 3}));
    auto req = Request(3, {tt});
    (*req.mutable_data(0)->mutable_loss_fn_inputs())["weights"] = w;
    return req;
  };
  const float inf = std::numeric_limits<float>::infinity();
  pb::Tensor w;
  w.set_dtype(pb::DTYPE_FLOAT32);
  w.add_shape(3);
  w.set_dense(Raw(std::vector<float>{1, std::nanf(""), 1}));
  ExpectInvalid(Decode(with_weights(w)), "data[0].loss_fn_inputs[weights]: value at flat index 1 is not finite");
  w.set_dense(Raw(std::vector<float>{1, 1, -inf}));
  ExpectInvalid(Decode(with_weights(w)), "data[0].loss_fn_inputs[weights]: value at flat index 2 is not finite");
  w.set_dtype(pb::DTYPE_BFLOAT16);
  w.set_dense(Raw(std::vector<uint16_t>{0x3F80, 0x7F80, 0x3F80}));  // 1, +inf, 1
  ExpectInvalid(Decode(with_weights(w)), "data[0].loss_fn_inputs[weights]: value at flat index 1 is not finite");
  pb::Tensor sw;  // sparse [3, 2] with one +inf value at (1, 1)
  sw.set_dtype(pb::DTYPE_FLOAT32);
  sw.add_shape(3);
  sw.add_shape(2);
  sw.mutable_sparse_csr()->set_values(Raw(std::vector<float>{inf}));
  sw.mutable_sparse_csr()->set_crow_indices(Raw(std::vector<int64_t>{0, 0, 1, 1}));
  sw.mutable_sparse_csr()->set_col_indices(Raw(std::vector<int64_t>{1}));
  ExpectInvalid(Decode(with_weights(sw)), "data[0].loss_fn_inputs[weights]: value at flat index 3 is not finite");

  w.set_dtype(pb::DTYPE_FLOAT32);
  w.set_dense(Raw(std::vector<float>{1, 0, 1}));
  auto req = with_weights(w);
  EXPECT_TRUE(Decode(req).ok());
  (*req.mutable_loss_fn_config())["beta"] = std::numeric_limits<double>::infinity();
  ExpectInvalid(Decode(req), "loss_fn_config.beta: must be finite, got inf");
  (*req.mutable_loss_fn_config())["beta"] = std::nan("");
  ExpectInvalid(Decode(req), "loss_fn_config.beta: must be finite");
}

}  // namespace
}  // namespace loom::wire
