// WaitFuture: polls a Service's future until it is finished (at most ~5 s,
// then a test failure) and returns it; for tests over a started Service.
#pragma once
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>

#include "service/service.h"

namespace loom::testing {

inline service::FutureView WaitFuture(service::Service& service, const std::string& tenant, const std::string& id) {
  for (int i = 0; i < 2500; ++i) {
    auto v = service.futures().Get(tenant, id);
    EXPECT_TRUE(v.ok()) << v.status().message();
    if (!v.ok()) return {};
    if (v->state != service::FutureState::kPending) return *v;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  ADD_FAILURE() << "future " << id << " still pending";
  return {};
}

}  // namespace loom::testing
