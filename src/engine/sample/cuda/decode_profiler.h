// DecodeProfiler: the GPU time of each stage of the fast decode's captured
// graphs (DecodeOptions::profile, `--decode-profile`). While a graph is
// captured, Mark puts an event node between two of its stages; after each
// replay, Replayed charges the time between consecutive marks to the later
// mark's label, and every kReplaysPerLine replays of a graph logs one line
// of microseconds per step. The times mean something only when the stages
// run one after another: the step runs its LoRA branch on the main stream
// while it has a profiler (event nodes add ~1.6 us per stage).
//
// CUDA builds only. Threading: the sampler's decode thread only.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace loom::engine {

class DecodeProfiler {
 public:
  static constexpr int64_t kReplaysPerLine = 64;

  DecodeProfiler() = default;
  DecodeProfiler(const DecodeProfiler&) = delete;
  DecodeProfiler& operator=(const DecodeProfiler&) = delete;
  // Logs each graph's replays since its last line; destroys the events.
  ~DecodeProfiler();

  // A graph keyed (rows, table, lora) is about to be captured: the id its
  // Mark and Replayed calls name.
  int AddGraph(int64_t rows, int64_t table, bool lora);
  // During graph's capture: an event node at this point of `stream`; the
  // stage since the previous mark is charged to `label` (a literal).
  void Mark(int graph, const char* label, cudaStream_t stream);
  // After a replay of graph on `stream`: waits for it, adds up its stages.
  void Replayed(int graph, cudaStream_t stream);

 private:
  struct Graph {
    int64_t rows = 0, table = 0;
    bool lora = false;
    std::vector<std::pair<const char*, cudaEvent_t>> marks;
    std::map<std::string, double> stage_ms;  // GPU ms per label over `replays`
    int64_t replays = 0;
  };
  static void Log(const Graph& g);

  std::vector<std::unique_ptr<Graph>> graphs_;
};

}  // namespace loom::engine
