// loom: a multi-tenant LoRA fine-tuning service speaking Tinker's wire protocol.
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
}  // namespace

int main(int argc, char** argv) {
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
