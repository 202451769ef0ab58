// `loom bench rl`: the client-driven RL loop (sample, train, publish) of N
// tenants on the in-process service. bench_cmd.cpp dispatches
// `loom bench rl ...` here with argv[0] = "rl".
#pragma once

namespace loom::cli {
int BenchRl(int argc, char** argv);
}  // namespace loom::cli
