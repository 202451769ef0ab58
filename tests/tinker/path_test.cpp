// Tests of tinker path parsing and the one name rule.
#include "tinker/path.h"

#include <gtest/gtest.h>

namespace loom::tinker {
namespace {

TEST(TinkerPathTest, ParsesValidPaths) {
  auto p = ParseTinkerPath("tinker://sess-1:train:0/weights/step_10");
  ASSERT_TRUE(p.ok()) << p.status().message();
  EXPECT_EQ(p->training_run_id, "sess-1:train:0");
  EXPECT_STREQ(p->kind_segment(), "weights");
  EXPECT_EQ(p->name, "step_10");
  EXPECT_EQ(p->checkpoint_id(), "weights/step_10");
  EXPECT_EQ(p->ToString(), "tinker://sess-1:train:0/weights/step_10");
  auto s = ParseTinkerPath("tinker://m/sampler_weights/final.v2");
  ASSERT_TRUE(s.ok());
  EXPECT_STREQ(s->kind_segment(), "sampler_weights");
}

TEST(TinkerPathTest, RejectsMalformedPathsNamingTheField) {
  for (const char* bad : {"m/weights/a", "tinker://m/weights", "tinker://m/weights/a/b",
                          "tinker://m/optimizer/a", "tinker://m/weights/..", "tinker:///weights/a",
                          "tinker://m/weights/", "tinker://m/weights/a b", "tinker://m/weights/a..b",
                          "tinker://m%2f/weights/a"}) {
    auto p = ParseTinkerPath(bad, "model_path");
    EXPECT_EQ(p.status().code(), Code::kInvalidArgument) << bad;
    EXPECT_NE(p.status().message().find("model_path"), std::string::npos) << p.status().message();
  }
}

TEST(TinkerPathTest, NameLengthLimit) {
  EXPECT_TRUE(ValidateCheckpointName(std::string(kMaxNameLength, 'a')).ok());
  Status s = ValidateCheckpointName(std::string(kMaxNameLength + 1, 'a'), "path");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("path"), std::string::npos);
  EXPECT_NE(s.message().find("128"), std::string::npos);
  EXPECT_FALSE(ValidateCheckpointName(".").ok());
  EXPECT_FALSE(ValidateCheckpointName("").ok());
  EXPECT_FALSE(ValidateModelId("a/b").ok());
  EXPECT_TRUE(ValidateModelId("de58946a-6bfd:train:12").ok());
}

TEST(TinkerPathTest, ParsesCheckpointIds) {
  auto p = ParseCheckpointId("run1", "sampler_weights/final");
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->ToString(), "tinker://run1/sampler_weights/final");
  EXPECT_FALSE(ParseCheckpointId("run1", "final").ok());
  EXPECT_FALSE(ParseCheckpointId("run1", "weights/a/b").ok());
  EXPECT_FALSE(ParseCheckpointId("run/1", "weights/a").ok());
}

}  // namespace
}  // namespace loom::tinker
