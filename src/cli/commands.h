// The `loom` subcommands. Each lives in its own file in cli/ and parses its
// own flags; main.cpp only dispatches. Return value = process exit code.
#pragma once

namespace loom::cli {
int MakeModel(int argc, char** argv);  // loom make-model --arch ... --preset ... --out DIR
int Serve(int argc, char** argv);      // loom serve --model DIR --port P ...
int Demo(int argc, char** argv);       // loom demo: the multi-tenant demo (README's main job)
int Bench(int argc, char** argv);      // loom bench train|multi-tenant|sample
int Forward(int argc, char** argv);    // loom forward: run the engine on a prompt (debugging aid)
int ImportAdapter(int argc, char** argv);  // loom import-adapter --store DIR --tenant T --adapter PEFT_DIR
int Export(int argc, char** argv);     // loom export --model DIR --adapter DIR --out DIR --format merged|vllm
}  // namespace loom::cli
