// Tests of the model_id -> folder map.
#include "store/dir_names.h"

#include <gtest/gtest.h>

namespace loom::store {
namespace {

TEST(DirNamesTest, SanitizeIsInjectiveAndSafe) {
  EXPECT_EQ(SanitizeForPath("s:train:0"), "s_3Atrain_3A0");
  EXPECT_NE(SanitizeForPath("a_b"), SanitizeForPath("a:b"));
  EXPECT_NE(SanitizeForPath("a_3Ab"), SanitizeForPath("a:b"));
  EXPECT_EQ(SanitizeForPath("A-z.9"), "A-z.9");
  for (char c : SanitizeForPath("x@y:z_w")) EXPECT_NE(c, '/');
}

}  // namespace
}  // namespace loom::store
