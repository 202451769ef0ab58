// OpCount: how many ATen ops the sampler's steps dispatch, for benches and
// tests (the op count is what an eager step costs in launches and host
// overhead on a GPU, and it can be counted on the CPU). The scheduler names
// its steps with RecordFunction user scopes, kPrefillScope and kDecodeScope;
// an OpCount counts the ops dispatched inside scopes of one name, on any
// thread, from its construction to Take(). "calls" are the outermost ops (the
// ones engine code calls); "ops" include the ops those run inside them.
//
// Threading: one OpCount at a time in the process (construct, Take and
// destroy it on one thread); the steps it counts may run on any thread.
#pragma once
#include <cstdint>
#include <map>
#include <string>

namespace loom::engine::sample {

inline constexpr const char* kPrefillScope = "sampler prefill";
inline constexpr const char* kDecodeScope = "sampler decode";

struct OpCounts {
  int64_t scopes = 0;  // steps (scopes of the name) that ended
  int64_t calls = 0;   // outermost ops inside them
  int64_t ops = 0;     // every op inside them, nested ones included
  std::map<std::string, int64_t> by_name;  // outermost ops by name
  // The n most frequent outermost ops, "name count, ...".
  std::string Top(size_t n) const;
};

class OpCount {
 public:
  // Starts counting the ops inside user scopes named `scope`.
  explicit OpCount(const char* scope);
  ~OpCount();
  OpCount(const OpCount&) = delete;
  OpCount& operator=(const OpCount&) = delete;
  // What was counted since construction or the last Take, and resets it.
  OpCounts Take();

 private:
  uint64_t handle_;
};

}  // namespace loom::engine::sample
