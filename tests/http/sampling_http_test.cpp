// The sampling routes over loopback HTTP (Router + HttpServer on a FakeEngine
// and a FakeSampler): create_sampling_session, asample's submit answer with
// sample_sequence_ids, the result as protobuf SampleResponse or legacy JSON,
// GET samplers/{id}, and the 4xx JSON answers (bad params naming the field,
// context window, foreign tenants); 429 with Retry-After beyond --sample-queue.
#include <gtest/gtest.h>


#include "gateway_fixture.h"
#include "wire/sample.h"

namespace loom::http {
namespace {

using namespace std::chrono_literals;
using Json = nlohmann::json;
using testing::Reply;

using testing::kAlice;
using testing::kBob;

class SamplingGatewayTest : public testing::GatewayFixture {
 protected:
  void SetUp() override { StartGateway("loom_http_sampling_", /*with_sampler=*/true); }
  std::string SamplingSession(const std::string& session, int seq = 0, const char* key = kAlice) {
    Json j = PostOk("create_sampling_session", {{"session_id", session}, {"sampling_session_seq_id", seq},
                                                {"base_model", "test/base"}, {"type", "create_sampling_session"}},
                    key);
    EXPECT_EQ(j.value("type", ""), "create_sampling_session");
    return j.value("sampling_session_id", "");
  }
  static Json Asample(const std::string& sampling, int64_t seq, Json params, int num_samples = 1,
                      bool prompt_logprobs = false) {
    return {{"sampling_session_id", sampling}, {"seq_id", seq}, {"num_samples", num_samples},
            {"prompt", {{"chunks", {{{"type", "encoded_text"}, {"tokens", {4, 5, 6}}}}}}},
            {"sampling_params", std::move(params)}, {"prompt_logprobs", prompt_logprobs},
            {"topk_prompt_logprobs", 0}, {"type", "sample"}};
  }
  static void ExpectJsonError(const Reply& r, int status, const std::string& fragment) {
    EXPECT_EQ(r.status, status) << r.body;
    Json j = Json::parse(r.body, nullptr, false);
    ASSERT_TRUE(j.is_object() && j.contains("error")) << r.body;
    EXPECT_NE(r.body.find(fragment), std::string::npos) << r.body;
  }

};

TEST_F(SamplingGatewayTest, AsampleAnswersSequenceIdsAndProtobufResult) {
  const std::string sampling = SamplingSession(Session());
  Json sub = PostOk("asample", Asample(sampling, 0, {{"max_tokens", 3}, {"temperature", 0.0}}, 2));
  ASSERT_TRUE(sub.contains("request_id"));
  ASSERT_TRUE(sub["sample_sequence_ids"].is_array()) << sub.dump();
  ASSERT_EQ(sub["sample_sequence_ids"].size(), 2u);
  EXPECT_NE(sub["sample_sequence_ids"][0], sub["sample_sequence_ids"][1]);

  Reply r = Retrieve(sub["request_id"], kAlice, /*proto=*/true);
  ASSERT_EQ(r.status, 200) << r.body;
  EXPECT_EQ(r.content_type, "application/x-protobuf");
  auto decoded = wire::DecodeSampleResponse(r.body);
  ASSERT_TRUE(decoded.ok()) << decoded.status().message();
  ASSERT_EQ(decoded->sequences.size(), 2u);
  EXPECT_EQ(decoded->sequences[0].tokens, (std::vector<int32_t>{7, 8, 9}));  // (6 + 1 + j) % 100
  EXPECT_EQ(decoded->sequences[1].tokens, (std::vector<int32_t>{8, 9, 10}));
  EXPECT_EQ(decoded->sequences[0].logprobs.size(), 3u);
  EXPECT_FALSE(decoded->prompt_logprobs.has_value());

  // Same future without protobuf in Accept: the legacy JSON shape.
  Reply legacy = Retrieve(sub["request_id"], kAlice, /*proto=*/false);
  Json j = Json::parse(legacy.body, nullptr, false);
  ASSERT_TRUE(j.is_object()) << legacy.body;
  EXPECT_EQ(j["type"], "sample");
  ASSERT_EQ(j["sequences"].size(), 2u);
  EXPECT_EQ(j["sequences"][1]["tokens"], Json({8, 9, 10}));
  EXPECT_EQ(j["sequences"][1]["stop_reason"], "length");
  EXPECT_NEAR(j["sequences"][0]["logprobs"][2].get<double>(), -0.3, 1e-6);
}

TEST_F(SamplingGatewayTest, ComputeLogprobsShapeReturnsPromptLogprobsWithNullFirst) {
  const std::string sampling = SamplingSession(Session());
  Json sub = PostOk("asample", Asample(sampling, 0, {{"max_tokens", 1}}, 1, /*prompt_logprobs=*/true));
  auto decoded = wire::DecodeSampleResponse(Retrieve(sub["request_id"], kAlice, true).body);
  ASSERT_TRUE(decoded.ok());
  ASSERT_TRUE(decoded->prompt_logprobs.has_value());
  ASSERT_EQ(decoded->prompt_logprobs->size(), 3u);
  EXPECT_TRUE(std::isnan((*decoded->prompt_logprobs)[0]));
  Json legacy = Json::parse(Retrieve(sub["request_id"], kAlice, false).body);
  EXPECT_TRUE(legacy["prompt_logprobs"][0].is_null());
  EXPECT_NEAR(legacy["prompt_logprobs"][1].get<double>(), -0.5, 1e-6);
}

TEST_F(SamplingGatewayTest, GetSamplerAndTenantIsolation) {
  const std::string sampling = SamplingSession(Session());
  // The id has colons; the SDK sends it as is (also accept it percent-encoded).
  Reply r = client_->Call("GET", "/api/v1/samplers/" + sampling, "", {{"X-API-Key", kAlice}});
  ASSERT_EQ(r.status, 200) << r.body;
  Json j = Json::parse(r.body);
  EXPECT_EQ(j["sampler_id"], sampling);
  EXPECT_EQ(j["base_model"], "test/base");
  std::string encoded = sampling;
  for (size_t p = encoded.find(':'); p != std::string::npos; p = encoded.find(':', p)) encoded.replace(p, 1, "%3A");
  EXPECT_EQ(client_->Call("GET", "/api/v1/samplers/" + encoded, "", {{"X-API-Key", kAlice}}).status, 200);

  ExpectJsonError(client_->Call("GET", "/api/v1/samplers/" + sampling, "", {{"X-API-Key", kBob}}), 404, "not found");
  ExpectJsonError(Post("asample", Asample(sampling, 0, {{"max_tokens", 1}}), kBob), 404, "sampling_session_id");
  Json sub = PostOk("asample", Asample(sampling, 0, {{"max_tokens", 1}}));
  ExpectJsonError(client_->Call("POST", "/api/v1/retrieve_future",
                                Json{{"request_id", sub["request_id"]}, {"allow_metadata_only", true}}.dump(),
                                {{"X-API-Key", kBob}}),
                  404, "not found");
}

TEST_F(SamplingGatewayTest, BadRequestsAre400NamingTheFieldOr404) {
  const std::string session = Session();
  const std::string sampling = SamplingSession(session);
  ExpectJsonError(Post("create_sampling_session", {{"session_id", session}, {"sampling_session_seq_id", 1},
                                                   {"base_model", "someone/else"}}),
                  400, "base_model");
  ExpectJsonError(Post("create_sampling_session", {{"session_id", session}, {"sampling_session_seq_id", 2},
                                                   {"model_path", "tinker://nobody:train:0/sampler_weights/x"}}),
                  404, "model_path");
  ExpectJsonError(Post("asample", Asample(sampling, 0, {{"max_tokens", 3}, {"top_p", 2.0}})), 400, "top_p");
  ExpectJsonError(Post("asample", Asample(sampling, 1, {{"max_tokens", 3}, {"temperature", -1.0}})), 400,
                  "temperature");
  ExpectJsonError(Post("asample", Asample(sampling, 2, {{"max_tokens", 30}})), 400, "context window");
  ExpectJsonError(Post("asample", Asample(sampling, 3, {{"max_tokens", 3}, {"stop", "END"}})), 400,
                  "tokenizer.json");
  ExpectJsonError(Post("asample", Asample("nope:sample:0", 0, {{"max_tokens", 1}})), 404, "nope:sample:0");
}

}  // namespace
}  // namespace loom::http

namespace loom::http {
namespace {

class SampleQueueGatewayTest : public SamplingGatewayTest {
 protected:
  void SetUp() override {
    sample_queue_ = 4;  // one tenant may hold 2
    StartGateway("loom_http_sample_queue_", /*with_sampler=*/true);
  }
};

TEST_F(SampleQueueGatewayTest, AsampleBeyondTheQueueBoundIs429WithRetryAfter) {
  const std::string alice = SamplingSession(Session());
  const std::string bob = SamplingSession(Session(kBob), 0, kBob);
  sampler_->Hold();
  const Json params = {{"max_tokens", 2}};
  for (int seq = 0; seq < 2; ++seq) PostOk("asample", Asample(alice, seq, params));
  Reply over = Post("asample", Asample(alice, 2, params));
  ExpectJsonError(over, 429, "half of --sample-queue 4");
  EXPECT_EQ(over.headers["Retry-After"], "1");
  // The other tenant still gets its half.
  for (int seq = 0; seq < 2; ++seq) PostOk("asample", Asample(bob, seq, params), kBob);
  ExpectJsonError(Post("asample", Asample(bob, 2, params), kBob), 429, "already holds 4 samples");  // all 4 taken
  // Once answered, the places are free again: the SDK's resubmission gets in.
  sampler_->Release();
  for (int i = 0; i < 500 && sampler_->stats().requests_done < 4; ++i) std::this_thread::sleep_for(2ms);
  ASSERT_EQ(sampler_->stats().requests_done, 4);  // counted after their callbacks left the gate
  PostOk("asample", Asample(alice, 3, params));
  EXPECT_EQ(sampler_->calls().size(), 5u);
}

}  // namespace
}  // namespace loom::http
