// SampleResponse protobuf encoding (spec §8.11, golden bytes of §14) and
// SampleRequest JSON parsing (§5.19, §8.4).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "tinker_public.pb.h"
#include "wire/json_api.h"
#include "wire/sample.h"
#include "wire_test_util.h"

namespace loom::wire {
namespace {

using namespace loom::tinker;  // the vocabulary wire/ encodes

const char* kGoldenSample = "0a160801120805000000060000001a08cdccccbdcdcc4cbe12080000c07f000080bf";

Result<SampleRequest> Parse(const std::string& text) {
  auto j = ParseJsonObject(text, "asample");
  if (!j.ok()) return j.status();
  return ParseSampleRequest(j.value());
}

TEST(SampleResponse, GoldenBytesExactly) {
  SampleResult r;
  r.sequences.push_back({StopReason::kLength, {5, 6}, {-0.1f, -0.2f}});
  r.prompt_logprobs = std::vector<float>{std::numeric_limits<float>::quiet_NaN(), -1.0f};
  auto bytes = EncodeSampleResponse(r);
  ASSERT_TRUE(bytes.ok()) << bytes.status().message();
  EXPECT_EQ(bytes.value(), testing::HexDecode(kGoldenSample));
}

TEST(SampleResponse, RoundTripWithTopkPaddingAndPromptNaN) {
  SampleResult r;
  r.sequences.push_back({StopReason::kStop, {9, 151645}, {-0.5f, -0.01f}});
  r.sequences.push_back({StopReason::kLength, {1, 2, 3}, {-1, -2, -3}});
  r.prompt_logprobs = std::vector<float>{std::nanf(""), -0.64f, -0.78f};
  TopkPromptLogprobs t;
  t.k = 2;
  t.prompt_length = 3;
  t.token_ids = {0, 0, 200, 201, 300, 0};
  t.logprobs = {TopkPromptLogprobs::kTopkPadLogprob, TopkPromptLogprobs::kTopkPadLogprob, -0.64f, -1.64f, -0.78f,
                TopkPromptLogprobs::kTopkPadLogprob};
  r.topk_prompt_logprobs = t;
  r.prompt_cache_hit_tokens = 2;
  auto bytes = EncodeSampleResponse(r);
  ASSERT_TRUE(bytes.ok());
  tinker_public::SampleResponse msg;
  ASSERT_TRUE(msg.ParseFromString(bytes.value()));
  EXPECT_EQ(msg.sequences(0).stop_reason(), tinker_public::STOP_REASON_STOP);
  EXPECT_EQ(msg.sequences(1).stop_reason(), tinker_public::STOP_REASON_LENGTH);
  EXPECT_EQ(msg.topk_prompt_logprobs().k(), 2u);
  EXPECT_EQ(msg.topk_prompt_logprobs().prompt_length(), 3u);
  EXPECT_EQ(msg.prompt_cache_hit_tokens(), 2);
  auto back = DecodeSampleResponse(bytes.value());
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->sequences[0].tokens, r.sequences[0].tokens);
  EXPECT_EQ(back->sequences[1].logprobs, r.sequences[1].logprobs);
  ASSERT_TRUE(back->prompt_logprobs.has_value());
  EXPECT_TRUE(std::isnan((*back->prompt_logprobs)[0]));
  EXPECT_FLOAT_EQ((*back->prompt_logprobs)[2], -0.78f);
  EXPECT_EQ(back->topk_prompt_logprobs->token_ids, t.token_ids);
  EXPECT_EQ(back->topk_prompt_logprobs->logprobs[5], -99999.0f);
}

TEST(SampleResponse, TheSamplersCacheHitsReachTheWire) {
  tinker::SampleOutput out;
  out.sequences.resize(1);
  out.prompt_cache_hit_tokens = 48;
  const SampleResult r = SampleResultOf(out);
  EXPECT_EQ(r.prompt_cache_hit_tokens, 48);
  auto bytes = EncodeSampleResponse(r);
  ASSERT_TRUE(bytes.ok());
  tinker_public::SampleResponse msg;
  ASSERT_TRUE(msg.ParseFromString(bytes.value()));
  EXPECT_EQ(msg.prompt_cache_hit_tokens(), 48);
}

TEST(SampleResponse, AbsentOptionalsStayAbsent) {
  SampleResult r;
  r.sequences.push_back({StopReason::kStop, {1}, {-1}});
  auto bytes = EncodeSampleResponse(r);
  ASSERT_TRUE(bytes.ok());
  tinker_public::SampleResponse msg;
  ASSERT_TRUE(msg.ParseFromString(bytes.value()));
  EXPECT_FALSE(msg.has_prompt_logprobs());
  EXPECT_FALSE(msg.has_topk_prompt_logprobs());
}

TEST(SampleResponse, InconsistentSizesAreRefused) {
  SampleResult r;
  r.sequences.push_back({StopReason::kStop, {1, 2}, {-1}});
  EXPECT_EQ(EncodeSampleResponse(r).status().code(), Code::kInternal);
  SampleResult t;
  t.topk_prompt_logprobs = TopkPromptLogprobs{2, 2, {0, 0, 1}, {0, 0, 0}};
  EXPECT_EQ(EncodeSampleResponse(t).status().code(), Code::kInternal);
}

TEST(SampleRequest, ParsesEveryField) {
  auto r = Parse(R"({"num_samples":3,"prompt":{"chunks":[{"tokens":[1,2],"type":"encoded_text"},
      {"tokens":[3],"type":"encoded_text"}]},"sampling_params":{"max_tokens":16,"seed":18446744073709551615,
      "temperature":0,"top_k":40,"top_p":0.95,"stop":"</s>"},"sampling_session_id":"s:sample:0",
      "seq_id":5000000000000000000,"prompt_logprobs":true,"topk_prompt_logprobs":5,"type":"sample",
      "record_stability_info":true})");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->num_samples, 3);
  EXPECT_EQ(r->prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(*r->sampling_params.max_tokens, 16);
  EXPECT_EQ(*r->sampling_params.seed, 18446744073709551615ull);
  EXPECT_EQ(r->sampling_params.temperature, 0.0);
  EXPECT_EQ(r->sampling_params.top_k, 40);
  EXPECT_DOUBLE_EQ(r->sampling_params.top_p, 0.95);
  EXPECT_EQ(r->sampling_params.stop_strings, (std::vector<std::string>{"</s>"}));
  EXPECT_EQ(r->seq_id, 5000000000000000000LL);
  EXPECT_TRUE(r->prompt_logprobs);
  EXPECT_EQ(r->topk_prompt_logprobs, 5);
}

TEST(SampleRequest, DefaultsStopFormsAndNegativeSeed) {
  auto r = Parse(R"({"prompt":{"chunks":[{"tokens":[7],"type":"encoded_text"}]},
      "sampling_params":{"temperature":1,"top_p":1,"stop":[151645,151643],"seed":-1},
      "sampling_session_id":"x","seq_id":0})");
  ASSERT_TRUE(r.ok()) << r.status().message();
  EXPECT_EQ(r->num_samples, 1);
  EXPECT_FALSE(r->sampling_params.max_tokens.has_value());
  EXPECT_EQ(r->sampling_params.top_k, -1);
  EXPECT_EQ(r->sampling_params.stop_tokens, (std::vector<int32_t>{151645, 151643}));
  EXPECT_TRUE(r->sampling_params.stop_strings.empty());
  EXPECT_EQ(*r->sampling_params.seed, ~uint64_t{0});  // -1 as 64 bits
  EXPECT_FALSE(r->prompt_logprobs);
  r = Parse(R"({"prompt":{"chunks":[{"tokens":[7],"type":"encoded_text"}]},
      "sampling_params":{"stop":["\n","###"]},"sampling_session_id":"x","seq_id":0})");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(r->sampling_params.stop_strings, (std::vector<std::string>{"\n", "###"}));
}

TEST(SampleRequest, ErrorsNameTheField) {
  const std::string ok_prompt = R"("prompt":{"chunks":[{"tokens":[7],"type":"encoded_text"}]})";
  struct Case {
    std::string body, field;
  };
  std::vector<Case> cases = {
      {R"({"sampling_session_id":"x","seq_id":0})", "asample.prompt: required"},
      {R"({)" + ok_prompt + R"(,"seq_id":0})", "asample.sampling_session_id: required"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x"})", "asample.seq_id: required"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x","seq_id":"1"})", "asample.seq_id: expected an integer"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x","seq_id":0,"num_samples":0})", "asample.num_samples"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x","seq_id":0,"sampling_params":{"top_p":"high"}})",
       "asample.sampling_params.top_p: expected a number"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x","seq_id":0,"sampling_params":{"top_p":0}})",
       "asample.sampling_params.top_p: must be in (0, 1]"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x","seq_id":0,"sampling_params":{"temperature":-1}})",
       "asample.sampling_params.temperature"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x","seq_id":0,"sampling_params":{"top_k":0}})",
       "asample.sampling_params.top_k"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x","seq_id":0,"sampling_params":{"max_tokens":-2}})",
       "asample.sampling_params.max_tokens"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x","seq_id":0,"sampling_params":{"stop":[1,"a"]}})",
       "asample.sampling_params.stop: mixes"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x","seq_id":0,"sampling_params":{"stop":{"a":1}}})",
       "asample.sampling_params.stop: expected"},
      {R"({"prompt":{"chunks":[{"tokens":[1],"type":"encoded_text"},{"data":"iVBO","format":"png","type":"image"}]},
          "sampling_session_id":"x","seq_id":0})",
       "asample.prompt chunk 1: image chunks are not supported by this text-only model"},
      {R"({"prompt":{"chunks":[{"tokens":[1, 4294967296],"type":"encoded_text"}]},"sampling_session_id":"x","seq_id":0})",
       "asample.prompt chunk 0.tokens[1]"},
      {R"({"prompt":{"chunks":[]},"sampling_session_id":"x","seq_id":0})", "asample.prompt: must hold"},
      {R"({)" + ok_prompt + R"(,"sampling_session_id":"x","seq_id":0,"topk_prompt_logprobs":-1})",
       "asample.topk_prompt_logprobs"},
      {R"([1,2])", "asample: body must be a JSON object"},
      {R"({"prompt":)", "asample: body is not valid JSON"},
  };
  for (const auto& c : cases) {
    auto r = Parse(c.body);
    ASSERT_FALSE(r.ok()) << c.body;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_EQ(r.status().message().rfind(c.field, 0), 0u) << "want prefix '" << c.field << "', got '"
                                                          << r.status().message() << "'";
  }
}

}  // namespace
}  // namespace loom::wire
