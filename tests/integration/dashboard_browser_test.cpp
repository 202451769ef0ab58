// The dashboard in a real browser: `loom serve` with an admin key, two
// tenants train a few steps over the wire, then headless Chromium (Debian's
// `chromium`, which setup.sh installs; the test fails without it) loads
// /dashboard#key=... and dumps the DOM after the page's script ran. Alice's
// view names her model and draws its loss curve with one point per
// forward_backward, and shows nothing of Bob's model; the admin key's view
// lists both models and both tenants.
//
// LOOM_DASHBOARD_SCREENSHOT=PATH also writes alice's view there as a PNG
// after a longer run (how docs/dashboard.png was made).
#include <gtest/gtest.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>

#include "serve_process.h"
#include "tenant_client.h"

namespace loom {
namespace {

constexpr const char* kAdmin = "dash-admin-key";

std::string Chromium() {
  const char* env = std::getenv("LOOM_CHROMIUM");
  return env && *env ? env : "/usr/bin/chromium";
}

// The DOM of the page after its script ran (virtual time: the fetches and
// the rendering finish before the dump, whatever the machine's load).
std::string DumpDom(const std::string& url, const std::string& profile_dir) {
  const std::string cmd = "timeout 120 " + Chromium() +
                          " --headless --no-sandbox --disable-gpu --no-first-run --user-data-dir=" + profile_dir +
                          " --virtual-time-budget=3000 --dump-dom '" + url + "' 2>/dev/null";
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (!p) return out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  pclose(p);
  return out;
}

// The `points` of the polyline drawn for `model_id`'s curve, or "" if none.
std::string CurvePoints(const std::string& dom, const std::string& model_id) {
  const size_t svg = dom.find("data-model=\"" + model_id + "\"");
  if (svg == std::string::npos) return "";
  std::smatch m;
  const std::string rest = dom.substr(svg, dom.find("</svg>", svg) - svg);
  static const std::regex points("<polyline points=\"([^\"]*)\"");
  return std::regex_search(rest, m, points) ? m[1].str() : "";
}

int CountPairs(const std::string& points) {
  static const std::regex pair("-?[0-9.]+,-?[0-9.]+");
  return static_cast<int>(std::distance(std::sregex_iterator(points.begin(), points.end(), pair), {}));
}

TEST(DashboardBrowserTest, ShowsTheTenantsLossCurveAndNothingOfAnotherTenant) {
  ASSERT_EQ(access(Chromium().c_str(), X_OK), 0)
      << Chromium() << " is missing: install Debian's chromium (setup.sh does) or set LOOM_CHROMIUM";
  const std::string dir = ::testing::TempDir() + "/loom_dash_" + std::to_string(getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  test::ServeProcess server(dir + "/data", {"--max-adapters", "4", "--max-rank", "8", "--admin-key", kAdmin});
  ASSERT_NE(server.port(), 0) << server.banner();

  const char* screenshot = std::getenv("LOOM_DASHBOARD_SCREENSHOT");
  const int kSteps = screenshot ? 30 : 3;
  test::TenantClient alice(server.port(), "tml-dash-alice");
  test::TenantClient bob(server.port(), "tml-dash-bob");
  alice.Start();
  bob.Start();
  for (int i = 0; i < kSteps; ++i) alice.TrainStep(/*salt=*/0);  // one batch again: its loss falls
  bob.TrainStep(7);

  const std::string base = "http://127.0.0.1:" + std::to_string(server.port()) + "/dashboard#key=";
  const std::string dom = DumpDom(base + "tml-dash-alice", dir + "/profile-a");
  ASSERT_NE(dom.find("data-state=\"loaded\""), std::string::npos) << dom;
  EXPECT_NE(dom.find(alice.model()), std::string::npos) << dom;
  EXPECT_EQ(CountPairs(CurvePoints(dom, alice.model())), kSteps) << dom;
  EXPECT_NE(dom.find("data-points=\"" + std::to_string(kSteps) + "\""), std::string::npos);
  EXPECT_EQ(dom.find(bob.model()), std::string::npos) << "bob's model shows in alice's dashboard";

  if (screenshot) {
    const std::string cmd = "timeout 120 " + Chromium() + " --headless --no-sandbox --disable-gpu --no-first-run" +
                            " --user-data-dir=" + dir + "/profile-shot --hide-scrollbars --window-size=1280,900" +
                            " --virtual-time-budget=3000 --screenshot=" + screenshot + " '" + base +
                            "tml-dash-alice' >/dev/null 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  }

  const std::string admin = DumpDom(base + kAdmin, dir + "/profile-admin");
  ASSERT_NE(admin.find("data-state=\"loaded\""), std::string::npos) << admin;
  EXPECT_NE(admin.find(alice.model()), std::string::npos) << admin;
  EXPECT_NE(admin.find(bob.model()), std::string::npos) << admin;
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace loom
