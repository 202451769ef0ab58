// Helpers shared by the Sequencer tests: a bare op with a seq_id, and the
// seq_ids the sequencer releases.
#pragma once
#include <string>
#include <vector>

#include "service/sequencer.h"

namespace loom::service::testing {

inline TrainingOp Op(int64_t seq) {
  TrainingOp op;
  op.seq_id = seq;
  op.request_id = "req-" + std::to_string(seq);
  op.arrived = Sequencer::Clock::now();
  return op;
}

inline std::vector<int64_t> DrainReady(Sequencer& s) {
  std::vector<int64_t> out;
  while (s.HasReady()) out.push_back(s.PopReady().seq_id);
  return out;
}

}  // namespace loom::service::testing
