// Protobuf reports each malformed message it parses (a string field that is
// not valid UTF-8, say) as one ERROR line on stderr, so a client that sends
// such bodies in a loop could flood the server's log; the request itself is
// already refused with a 400 by the decoder. LimitProtobufLogs() routes
// protobuf's lines through loom's log, the first one of each interval
// whole and the rest counted: the next line that passes says how many were
// dropped.
//
// Threading: call LimitProtobufLogs() once at start-up, before any thread
// parses (protobuf's rule for its handler); the handler itself is safe on
// any thread. With protobuf 22 and later (Abseil logging) it does nothing.
#pragma once
#include <chrono>
#include <cstdint>

namespace loom::wire {

void LimitProtobufLogs(std::chrono::seconds interval = std::chrono::seconds(60));
// Protobuf log lines dropped since start (for tests and metrics).
uint64_t DroppedProtobufLogs();

}  // namespace loom::wire
