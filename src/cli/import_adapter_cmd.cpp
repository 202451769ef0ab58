// `loom import-adapter`: registers a PEFT LoRA adapter directory
// (adapter_config.json + adapter_model.safetensors, from loom or from PEFT)
// as checkpoints of one tenant in a server's store, offline (the registry
// takes one process per data dir, so the server is stopped meanwhile).
//
// One import makes a training run `import:<hex>` owned by the tenant, with
// the adapter's rank and trained groups, and two checkpoints of --name:
//   sampler_weights/NAME  the adapter as a PEFT directory: sample it
//                         (create_sampling_client(model_path=...));
//   weights/NAME          a training state: continue training it
//                         (create_training_client_from_state[_with_optimizer]).
//                         An adapter file has no optimizer state, so the
//                         state holds a fresh optimizer's: zero moments, step
//                         0. Loading it with or without the optimizer is the
//                         same, and the first optim_step is a first step.
// The server gives every adapter one alpha (--lora-alpha); an adapter of
// another alpha is stored at the server's, its B scaled by
// alpha_adapter / alpha_server, which keeps (alpha / r) B A, the delta.
//
// Everything is checked before the store is opened, so a refused adapter
// leaves it unchanged: the base model (base_model_name_or_path, when the
// file states one, must be --model-name unless --ignore-base-name), the rank (<= --max-rank), the
// target modules (ones loom adapts) and every tensor's shape against the
// model's (ReadPeft), each error naming the field and the limit.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "cli/adapter_bank.h"
#include "cli/commands.h"
#include "engine/io/file_text.h"
#include "engine/io/peft.h"
#include "engine/model/config.h"
#include "http/auth.h"
#include "engine/train/adamw.h"
#include "engine/train/state.h"
#include "service/options.h"
#include "service/util.h"
#include "store/registry.h"
#include "tinker/path.h"

namespace loom::cli {
namespace {

namespace fs = std::filesystem;

int Fail(const Status& s) {
  std::fprintf(stderr, "loom import-adapter: %s\n", s.message().c_str());
  return 2;
}

// base_model_name_or_path must name the served model when the file states one.
Status CheckBaseModel(const std::string& adapter_dir, const std::string& served) {
  const std::string path = (fs::path(adapter_dir) / "adapter_config.json").string();
  auto text = engine::ReadTextFile(path);
  if (!text.ok()) return Status::NotFound("--adapter: " + text.status().message());
  const nlohmann::json j = nlohmann::json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::Invalid(path + " is not a JSON object");
  const auto it = j.find("base_model_name_or_path");
  if (it == j.end() || it->is_null() || (it->is_string() && it->get<std::string>().empty())) return Status::Ok();
  if (!it->is_string()) return Status::Invalid(path + ": base_model_name_or_path must be a string");
  if (it->get<std::string>() != served)
    return Status::Invalid(path + ": base_model_name_or_path '" + it->get<std::string>() +
                           "' is not the served model '" + served +
                           "' (--model-name); an adapter of another base cannot be served here (if it is the same "
                           "model under another name or path, pass --ignore-base-name: the shapes are still checked)");
  return Status::Ok();
}

// The tenant id the server's store uses for --tenant: an API key is turned
// into its tenant as the server authenticates it (open mode: a digest of the
// key; --api-keys: the tenant its line names); anything else is taken as a
// tenant id already.
Result<std::string> TenantOf(const std::string& tenant, const std::string& api_keys_file) {
  if (tenant.empty()) return Status::Invalid("--tenant must not be empty");
  if (api_keys_file.empty())
    return tenant.rfind("tml-", 0) == 0 ? http::ApiKeys().Authenticate(tenant) : Result<std::string>(tenant);
  auto keys = http::ApiKeys::Load(api_keys_file);
  if (!keys.ok()) return keys.status();
  auto known = keys->Authenticate(tenant);
  return known.ok() ? known : Result<std::string>(tenant);
}

}  // namespace

int ImportAdapter(int argc, char** argv) {
  CLI::App app{"Register a PEFT LoRA adapter directory as a tenant's checkpoints in a (stopped) server's store",
               "loom import-adapter"};
  std::string store_dir, tenant, api_keys_file, adapter_dir, name, model_dir, model_name;
  int max_rank = 0;
  double lora_alpha = service::ServiceOptions{}.lora_alpha;
  app.add_option("--store", store_dir, "the server's --data-dir (the server must not be running)")->required();
  app.add_option("--tenant", tenant, "the owner: its API key (tml-...), or its tenant id as the store records it")
      ->required();
  app.add_option("--api-keys", api_keys_file, "the server's --api-keys file, if it has one (maps --tenant's key)");
  app.add_option("--adapter", adapter_dir, "PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
      ->required();
  app.add_option("--name", name, "checkpoint name (default: the adapter directory's name)");
  app.add_option("--model", model_dir, "the server's --model directory (default: the store's embedded tiny qwen3)");
  app.add_option("--model-name", model_name, "the server's --model-name (default: as loom serve picks it)");
  app.add_option("--max-rank", max_rank, "the server's --max-rank; 0 = loom serve's default (128 dense, 32 MoE)")
      ->default_val(max_rank)
      ->check(CLI::Range(0, 1024));
  app.add_option("--lora-alpha", lora_alpha, "the server's --lora-alpha")->default_val(lora_alpha);
  bool ignore_base_name = false;
  app.add_flag("--ignore-base-name", ignore_base_name,
               "accept an adapter_config.json whose base_model_name_or_path names the model otherwise (a local path)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }

  // The same defaults as `loom serve` on this data dir.
  if (model_dir.empty()) {
    model_dir = (fs::path(store_dir) / "default-model").string();
    if (!fs::exists(fs::path(model_dir) / "config.json"))
      return Fail(Status::NotFound("--model: " + store_dir +
                                   " has no default model yet (run loom serve on it once, or pass --model)"));
    if (model_name.empty()) model_name = service::ServiceOptions{}.base_model_name;
  }
  if (model_name.empty()) model_name = fs::path(model_dir).filename().string();
  if (max_rank == 0) {  // serve's default (engine/api.h, kAuto*Rank): MoE slots grow with the experts
    auto config = engine::ModelConfig::Load(model_dir);
    if (!config.ok()) return Fail(Status(config.status().code(), "--model: " + config.status().message()));
    max_rank = config->num_experts > 0 ? engine::kAutoMoeRank : engine::kAutoDenseRank;
  }
  if (name.empty()) name = fs::path(adapter_dir).lexically_normal().filename().string();
  auto owner = TenantOf(tenant, api_keys_file);
  if (!owner.ok()) return Fail(Status::Invalid("--tenant: " + owner.status().message()));
  if (Status s = tinker::ValidateCheckpointName(name, "--name"); !s.ok()) return Fail(s);
  if (!(lora_alpha > 0)) return Fail(Status::Invalid("--lora-alpha must be > 0"));

  // ---- every check, before the store is touched ----
  if (!ignore_base_name)
    if (Status s = CheckBaseModel(adapter_dir, model_name); !s.ok()) return Fail(s);
  auto bank = AdapterBank(model_dir, adapter_dir, max_rank);
  if (!bank.ok()) return Fail(bank.status());
  auto adapter = engine::ReadPeft(**bank, adapter_dir);
  if (!adapter.ok()) return Fail(adapter.status());
  if (adapter->config.alpha != lora_alpha) {
    const double ratio = adapter->config.alpha / lora_alpha;
    for (auto& f : adapter->factors) f.B = f.B * ratio;
    adapter->config.alpha = lora_alpha;
  }
  adapter->config.seed = 0;
  if (Status s = engine::InstallPeft(**bank, 0, *adapter); !s.ok()) return Fail(s);
  const engine::train::SlotOptimizer fresh(**bank);  // zero moments, step 0

  // ---- write, then commit: both checkpoints, then the run that lists them ----
  auto registry = store::Registry::Open(store_dir);
  if (!registry.ok()) return Fail(registry.status());
  const std::string model_id = "import:" + service::RandomHex(8);
  const int64_t now = service::NowMs();
  const engine::LoraConfig& lora = adapter->config;
  auto state_dir = (*registry)->NewStagingPath();
  if (!state_dir.ok()) return Fail(state_dir.status());
  if (Status s = engine::train::SaveSlotState(**bank, fresh, 0, *state_dir); !s.ok()) return Fail(s);
  auto peft_dir = (*registry)->NewStagingPath();
  if (!peft_dir.ok()) return Fail(peft_dir.status());
  if (Status s = engine::WritePeft(*adapter, *peft_dir, model_name); !s.ok()) return Fail(s);

  store::CheckpointSpec spec;
  spec.owner = *owner;
  spec.model_id = model_id;
  spec.name = name;
  spec.created_ms = now;
  spec.kind = tinker::kWeightsKind;
  auto weights = (*registry)->CommitCheckpoint(*state_dir, spec);
  if (!weights.ok()) return Fail(weights.status());
  spec.kind = tinker::kSamplerWeightsKind;
  auto sampler = (*registry)->CommitCheckpoint(*peft_dir, spec);
  if (!sampler.ok()) {
    (*registry)->DeleteCheckpoint(weights->path());
    return Fail(sampler.status());
  }
  store::TrainingRun run;
  run.owner = *owner;
  run.model_id = model_id;
  run.base_model = model_name;
  run.lora_rank = lora.rank;
  run.train_attn = lora.train_attn;
  run.train_mlp = lora.train_mlp;
  run.train_unembed = lora.train_unembed;
  run.created_ms = run.last_request_ms = now;
  run.user_metadata = nlohmann::json{{"imported_from", fs::absolute(adapter_dir).lexically_normal().string()}}.dump();
  if (Status s = (*registry)->UpsertRun(run); !s.ok()) {
    (*registry)->DeleteCheckpoint(sampler->path());
    (*registry)->DeleteCheckpoint(weights->path());
    return Fail(s);
  }
  std::printf("%s\n", nlohmann::json{{"model_id", model_id},
                                     {"tenant", *owner},
                                     {"rank", lora.rank},
                                     {"sampler_path", sampler->path().ToString()},
                                     {"state_path", weights->path().ToString()}}
                          .dump()
                          .c_str());
  return 0;
}

}  // namespace loom::cli
