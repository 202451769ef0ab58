// trace_profile: a Kineto trace (CPU ops and CUDA kernels) of what the
// engine runs between Start and Stop, saved as Chrome-trace JSON for
// bench/trace_summary.py. Only with libtorch 2.x (the GPU machine); elsewhere Start
// says why not. Benches only: the service never profiles. From libtorch 2.7
// on, the CPU ops of every thread are recorded (the sampler's decode thread
// included); before, those of the calling thread and its children.
//
// Threading: Start and Stop on one thread (the bench's), one trace at a time.
#pragma once
#include <string>

#include "common/status.h"

namespace loom::cli {

Status StartTrace();
Status StopTrace(const std::string& path);

}  // namespace loom::cli
