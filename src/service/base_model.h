// BaseModel: everything the Service keeps per served base model, so that
// several base models share one server: its Engine (own slots, rank limit,
// memory budget), the training models bound to those slots, its saves, its
// Sampler, its snapshot writers and its engine thread. The Service looks a
// bundle up by base_model name (create_model, create_sampling_session) or by
// the model a request names; the parts shared by every base model (sessions,
// futures, idempotency, usage, the registry, the janitor) stay in Service.
//
// Invariants: a bundle's parts only touch its own Engine and Sampler; its
// options are the Service's with base_model_name (and token_budget) set to
// this base model's; the set of bundles is fixed at construction.
//
// Threading: as each part's header says; all share the Service's
// ServiceLock, and each bundle's TrainLoop runs its own engine thread.
#pragma once
#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/api.h"
#include "service/checkpoints.h"
#include "service/future_table.h"
#include "service/idempotency.h"
#include "service/metrics.h"
#include "service/options.h"
#include "service/publisher.h"
#include "service/sampling.h"
#include "service/service_lock.h"
#include "service/sessions.h"
#include "service/train_loop.h"
#include "service/training_models.h"
#include "service/usage.h"
#include "store/registry.h"

namespace loom::service {

// One base model handed to the Service: its name (the base_model clients
// send), its opened Engine, and its tokens per pass (0 = ServiceOptions').
struct BaseModelSpec {
  std::string name;
  std::unique_ptr<engine::Engine> engine;
  int64_t token_budget = 0;
};

// The Service's parts shared by every bundle.
struct SharedParts {
  store::Registry& registry;
  FutureTable& futures;
  Metrics& metrics;
  Usage& usage;
  ServiceLock& lock;
  Sessions& sessions;
  IdempotencyMemory& idempotency;
};

struct BaseModel {
  static ServiceOptions OptionsFor(ServiceOptions options, const BaseModelSpec& spec) {
    options.base_model_name = spec.name;
    if (spec.token_budget > 0) options.token_budget = spec.token_budget;
    return options;
  }

  BaseModel(const ServiceOptions& service_options, BaseModelSpec spec, SharedParts shared)
      : options(OptionsFor(service_options, spec)),
        name(spec.name),
        engine(std::move(spec.engine)),
        models(options, engine->info(), shared.registry, shared.futures, shared.lock, shared.sessions,
               shared.idempotency, shared.usage),
        checkpoints(options, *engine, shared.registry),
        sampling(options.sample_queue),
        // Room for two publications per slot: every model's newest save and one more.
        publisher(options.publish_threads, std::max<size_t>(4, 2 * static_cast<size_t>(engine->info().max_slots)),
                  checkpoints, shared.futures, shared.metrics, shared.lock, shared.sessions, sampling,
                  options.publish_staging_ahead),
        loop(options, *engine, shared.futures, shared.metrics, shared.usage, shared.lock, shared.sessions, models,
             checkpoints, publisher) {}

  // Declared in construction order: each part refers only to those above it.
  const ServiceOptions options;
  const std::string name;
  std::unique_ptr<engine::Engine> engine;
  TrainingModels models;
  Checkpoints checkpoints;
  // Above the publisher, which offers it snapshots; its Sampler stops before
  // the engine whose frozen base it shares.
  SamplingState sampling;
  // Stopped after the train loop (whose saves it writes), before the sampler.
  Publisher publisher;
  TrainLoop loop;
};

}  // namespace loom::service
