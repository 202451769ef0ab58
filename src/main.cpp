// loom: a multi-tenant LoRA fine-tuning service speaking Tinker's wire protocol.
#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>

#include "cli/commands.h"

namespace {
void Usage() {
  std::fprintf(stderr,
               "usage: loom <command> [flags]\n"
               "commands:\n"
               "  serve       run the Tinker-compatible service (default: embedded tiny qwen3)\n"
               "  demo        start the service and train several tenants at once\n"
               "  make-model  write a random-initialised model in Hugging Face layout\n"
               "  forward     run the engine once on a packed batch and print logprobs\n"
               "  bench       benchmarks: train | multi-tenant | sample\n"
               "  import-adapter  register a PEFT adapter as a tenant's checkpoints in a stopped server's store\n"
               "  export      write a LoRA snapshot as a merged HF model or a vLLM LoRA directory\n"
               "run `loom <command> --help` for its flags\n");
}

// A fatal signal (a fault in loom or a library under it) writes the signal
// and the stack to stderr before the process ends as it would have, so a
// crash on a machine without a debugger still says where it was (resolve
// the `loom(+0x...)` frames with `addr2line -Cfe loom`). Only calls safe in
// a signal handler: write(2), backtrace_symbols_fd.
void OnFatalSignal(int sig) {
  char head[] = "loom: fatal signal 00; stack:\n";
  head[19] = static_cast<char>('0' + sig / 10 % 10);
  head[20] = static_cast<char>('0' + sig % 10);
  (void)!::write(STDERR_FILENO, head, sizeof head - 1);
  void* frames[64];
  ::backtrace_symbols_fd(frames, ::backtrace(frames, 64), STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void InstallFatalSignalHandlers() {
  void* warm[1];
  ::backtrace(warm, 1);  // loads libgcc's unwinder now, not inside the handler
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, OnFatalSignal);
}
}  // namespace

int main(int argc, char** argv) {
  InstallFatalSignalHandlers();
  if (argc < 2 || !std::strcmp(argv[1], "--help") || !std::strcmp(argv[1], "-h")) {
    Usage();
    return argc < 2 ? 2 : 0;
  }
  const std::string cmd = argv[1];
  // Each subcommand sees argv from its own name on.
  if (cmd == "make-model") return loom::cli::MakeModel(argc - 1, argv + 1);
  if (cmd == "serve") return loom::cli::Serve(argc - 1, argv + 1);
  if (cmd == "demo") return loom::cli::Demo(argc - 1, argv + 1);
  if (cmd == "bench") return loom::cli::Bench(argc - 1, argv + 1);
  if (cmd == "forward") return loom::cli::Forward(argc - 1, argv + 1);
  if (cmd == "import-adapter") return loom::cli::ImportAdapter(argc - 1, argv + 1);
  if (cmd == "export") return loom::cli::Export(argc - 1, argv + 1);
  std::fprintf(stderr, "loom: unknown command '%s'\n", cmd.c_str());
  Usage();
  return 2;
}
