// Shared prefixes in a training pass. The datums of one forward_backward
// call often begin with the same rows: an RL group's completions of one
// prompt (the prompt's rows have the same input tokens, and, carrying no
// advantage, the same loss inputs). Such rows have the same hidden states,
// logprobs and per-row losses in every datum, so the pass trains them once:
// a group's shared rows are one sequence, and each datum's rest a sequence
// that continues it (PackedBatch::seq_prefix: its positions follow the
// prefix's, its attention sees the prefix's keys). The shared rows' losses
// count once per datum of the group, and the continuations' attention sends
// their gradients back into the prefix, so the loss, the gradients and each
// datum's outputs are those of the datums trained one by one, to float
// rounding. On qwen3-4b's RL loop (64-token prompts, 256-token completions,
// groups of 16) a pass trains 18.5% fewer rows.
//
// Pure functions of their arguments; any thread.
#pragma once
#include <cstdint>
#include <vector>

#include "engine/api.h"

namespace loom::engine::train {

// The fewest rows a group shares (below it, a prefix saves less than its
// extra sequence costs), and the least share of a call's rows sharing must
// save for the call to share at all (a pass that shares leaves the uniform
// layout: pass_graphs.h).
inline constexpr int64_t kShareMinRows = 32;
inline constexpr double kShareMinSaved = 0.125;

// Datums [first, first + count) of a call share their first `rows` rows
// (rows == 0 and count == 1: a datum trained whole).
struct PrefixGroup {
  size_t first = 0;
  size_t count = 1;
  int64_t rows = 0;
};

// The rows two validated datums of one call share from their start, at most
// limit: the same input token and, in every loss input, the same values.
int64_t CommonRows(const Datum& a, const Datum& b, int64_t limit);

// The groups of a call's validated datums, in order, covering all of them:
// runs of neighbouring datums that share at least min_rows rows (each datum
// keeps at least one row of its own), a datum joining a run while that does
// not lower the rows the run saves. None shared (every group one datum)
// when min_rows <= 0 or the groups would save less than kShareMinSaved of
// the call's rows.
std::vector<PrefixGroup> PlanSharedPrefixes(const std::vector<Datum>& data, int64_t min_rows);

// The rows a pass of these calls trains: each call's rows less those its
// groups share (what the memory plan sizes a pass by).
int64_t SharedPassRows(const std::vector<ForwardBackwardCall>& calls, int64_t min_rows);

// Rows [begin, end) of a datum, as a datum: its tokens and every loss input.
Datum SliceDatum(const Datum& d, int64_t begin, int64_t end);

}  // namespace loom::engine::train
