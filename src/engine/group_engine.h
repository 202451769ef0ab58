// One engine over a group of ranks (tensor / expert parallel,
// engine/model/parallel.h), as `loom serve --tp N --ep M` runs it: rank 0's
// Engine (what Engine::Open returns there) sends every call that changes
// state to the other ranks before it runs it itself; each other rank runs
// Engine::RunGroupWorker, which makes the same calls on its own part of the
// model in the same order. The calls travel over the group itself (c10d
// broadcasts of a MessagePack body), so they meet the passes' collectives
// in one order on every rank.
//
// Threading: rank 0's engine thread; a worker's calling thread.
#pragma once
#include <memory>

#include "engine/api.h"
#include "engine/model/parallel.h"

namespace loom::engine {

// The trainer of one rank (engine.cpp): Engine::Open's work, and the group
// it joined (null when it is alone).
Result<std::unique_ptr<Engine>> OpenTrainingEngine(const EngineOptions& options, std::shared_ptr<Collective>* group);

}  // namespace loom::engine
