#include "engine/sample/cuda/decode_profiler.h"

#include "common/log.h"

namespace loom::engine {

DecodeProfiler::~DecodeProfiler() {
  for (const auto& g : graphs_) {
    if (g->replays > 0) Log(*g);
    for (auto& [label, e] : g->marks) cudaEventDestroy(e);
  }
}

int DecodeProfiler::AddGraph(int64_t rows, int64_t table, bool lora) {
  auto g = std::make_unique<Graph>();
  g->rows = rows;
  g->table = table;
  g->lora = lora;
  graphs_.push_back(std::move(g));
  return static_cast<int>(graphs_.size()) - 1;
}

void DecodeProfiler::Mark(int graph, const char* label, cudaStream_t stream) {
  cudaEvent_t e;
  cudaEventCreate(&e);
  cudaEventRecordWithFlags(e, stream, cudaEventRecordExternal);
  graphs_[static_cast<size_t>(graph)]->marks.emplace_back(label, e);
}

void DecodeProfiler::Replayed(int graph, cudaStream_t stream) {
  Graph& g = *graphs_[static_cast<size_t>(graph)];
  cudaStreamSynchronize(stream);
  for (size_t i = 1; i < g.marks.size(); ++i) {
    float ms = 0;
    if (cudaEventElapsedTime(&ms, g.marks[i - 1].second, g.marks[i].second) == cudaSuccess)
      g.stage_ms[g.marks[i].first] += ms;
  }
  if (++g.replays == kReplaysPerLine) {
    Log(g);
    g.stage_ms.clear();
    g.replays = 0;
  }
}

void DecodeProfiler::Log(const Graph& g) {
  double total = 0;
  for (const auto& [label, ms] : g.stage_ms) total += ms;
  std::string line;
  for (const auto& [label, ms] : g.stage_ms)
    line += fmt::format(" {}={:.1f}", label, ms * 1e3 / static_cast<double>(g.replays));
  log::Info("fast decode profile rows={} table={} lora={} replays={} us/step: total={:.1f}{}", g.rows, g.table,
            g.lora, g.replays, total * 1e3 / static_cast<double>(g.replays), line);
}

}  // namespace loom::engine
