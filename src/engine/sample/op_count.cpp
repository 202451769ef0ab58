#include "engine/sample/op_count.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <utility>
#include <vector>

namespace loom::engine::sample {
namespace {

// The one live OpCount's state (callbacks are plain function pointers).
std::mutex mu;
const char* counted_scope = nullptr;
OpCounts counts;
// Per thread: inside a counted scope, and how deep in ops.
thread_local bool in_scope = false;
thread_local int depth = 0;

std::unique_ptr<at::ObserverContext> OnStart(const at::RecordFunction& fn) {
  if (fn.scope() == at::RecordScope::USER_SCOPE) {
    if (std::strcmp(fn.name(), counted_scope) == 0) in_scope = true, depth = 0;
    return nullptr;
  }
  if (!in_scope) return nullptr;
  std::lock_guard<std::mutex> lock(mu);
  ++counts.ops;
  if (depth == 0) ++counts.calls, ++counts.by_name[fn.name()];
  ++depth;
  return nullptr;
}

void OnEnd(const at::RecordFunction& fn, at::ObserverContext*) {
  if (fn.scope() == at::RecordScope::USER_SCOPE) {
    if (in_scope && std::strcmp(fn.name(), counted_scope) == 0) {
      in_scope = false;
      std::lock_guard<std::mutex> lock(mu);
      ++counts.scopes;
    }
    return;
  }
  if (in_scope && depth > 0) --depth;
}

}  // namespace

std::string OpCounts::Top(size_t n) const {
  std::vector<std::pair<int64_t, std::string>> v;
  for (const auto& [name, k] : by_name) v.emplace_back(-k, name);
  std::sort(v.begin(), v.end());
  std::string out;
  for (size_t i = 0; i < std::min(n, v.size()); ++i)
    out += (i ? ", " : "") + v[i].second + " " + std::to_string(-v[i].first);
  return out;
}

OpCount::OpCount(const char* scope) {
  {
    std::lock_guard<std::mutex> lock(mu);
    counted_scope = scope;
    counts = OpCounts{};
  }
  handle_ = at::addGlobalCallback(
      at::RecordFunctionCallback(OnStart, OnEnd).scopes({at::RecordScope::FUNCTION, at::RecordScope::USER_SCOPE}));
}

OpCount::~OpCount() { at::removeCallback(handle_); }

OpCounts OpCount::Take() {
  std::lock_guard<std::mutex> lock(mu);
  OpCounts out = std::move(counts);
  counts = OpCounts{};
  return out;
}

}  // namespace loom::engine::sample
