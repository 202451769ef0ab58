// `loom bench sample`: decode throughput of the sampler. bench_cmd.cpp
// dispatches `loom bench sample ...` here with argv[0] = "sample".
#pragma once

namespace loom::cli {
int BenchSample(int argc, char** argv);
}  // namespace loom::cli
