// Service's sampling side (I/O threads): sampling sessions, asample admission
// (ownership, dedup, validation before queueing) and the hand-off to the
// engine Sampler, whose decode thread completes the futures.
#include "service/sampling.h"

#include <fmt/format.h>

#include "common/log.h"
#include "service/service.h"
#include "service/util.h"

namespace loom::service {

// ------------------------------------------------------------ the service

Status Service::AttachSampler(std::unique_ptr<engine::Sampler> sampler, const std::string& base) {
  BaseModel* into = base.empty() ? bases_.front().get() : FindBase(base);
  if (into == nullptr) return NotServed("sampler", base);
  std::lock_guard<std::mutex> lock(lock_.mu);
  into->sampling.sampler = std::move(sampler);
  return Status::Ok();
}

Result<std::string> Service::CreateSamplingSession(const Caller& caller,
                                                   const tinker::CreateSamplingSessionRequest& request) {
  std::lock_guard<std::mutex> lock(lock_.mu);
  if (lock_.stopping) return Status::Unavailable("server is shutting down");
  const Sessions::Session* session = sessions_.FindLocked(request.session_id);
  if (session == nullptr || session->owner != caller.tenant) {
    return Status::NotFound("create_sampling_session.session_id: session '" + request.session_id + "' not found");
  }
  if (session->expired) {
    return Status::Precondition("create_sampling_session.session_id: session '" + request.session_id +
                                "' expired (no heartbeat); create a new ServiceClient");
  }
  if (request.sampling_session_seq_id < 0) {
    return Status::Invalid(fmt::format("create_sampling_session.sampling_session_seq_id: {} must be >= 0",
                                       request.sampling_session_seq_id));
  }
  const std::string id = fmt::format("{}:sample:{}", request.session_id, request.sampling_session_seq_id);
  if (const auto* known = sessions_.FindSamplerLocked(id); known != nullptr && known->owner == caller.tenant) {
    sessions_.TouchSessionLocked(request.session_id);
    return id;  // a retried create answers the same session
  }
  if (request.base_model && FindBase(*request.base_model) == nullptr) {
    return NotServed("create_sampling_session.base_model", *request.base_model);
  }
  Sessions::SamplingSession s{id, caller.tenant, request.base_model.value_or(bases_.front()->name), std::nullopt};
  if (request.model_path) {
    const std::string& path = *request.model_path;
    auto parsed = tinker::ParseTinkerPath(path);
    if (!parsed.ok()) return Status::Invalid("create_sampling_session.model_path: " + parsed.status().message());
    if (parsed->kind != tinker::TinkerPath::Kind::kSampler) {
      return Status::Invalid("create_sampling_session.model_path: '" + path +
                             "' is a training-state (/weights/) checkpoint; sampling needs a /sampler_weights/ "
                             "checkpoint from save_weights_for_sampler");
    }
    auto ckpt = registry_->GetCheckpoint(*parsed);
    if (!ckpt.ok() || !ckpt->AccessibleBy(caller.tenant)) {
      return Status::NotFound("create_sampling_session.model_path: checkpoint '" + path + "' not found");
    }
    s.model_path = ckpt->path();
    // The snapshot is sampled on the base model its run trained on.
    if (auto run = registry_->GetRun(ckpt->model_id); run.ok()) s.base_model = run->base_model;
    if (FindBase(s.base_model) == nullptr) {
      return NotServed("create_sampling_session.model_path: checkpoint '" + path + "' is an adapter of base model",
                       s.base_model);
    }
  } else if (!request.base_model) {
    return Status::Invalid("create_sampling_session: one of base_model / model_path is required");
  }
  sessions_.AddSamplerLocked(s, request.session_id);
  sessions_.TouchSessionLocked(request.session_id);
  log::Info("sampling_session_created id={} tenant={} model_path={}", id, caller.tenant,
            s.model_path ? s.model_path->ToString() : "");
  return id;
}

Result<tinker::SamplingSessionInfo> Service::GetSampler(const Caller& caller, const std::string& sampler_id) {
  std::lock_guard<std::mutex> lock(lock_.mu);
  const Sessions::SamplingSession* found = sessions_.FindSamplerLocked(sampler_id);
  if (found == nullptr || found->owner != caller.tenant) {
    return Status::NotFound("samplers/" + sampler_id + ": sampling session '" + sampler_id + "' not found");
  }
  const Sessions::SamplingSession& s = *found;
  return tinker::SamplingSessionInfo{s.sampler_id, s.base_model, s.model_path};
}

Result<SampleSubmitted> Service::Sample(const Caller& caller, const tinker::SampleRequest& request) {
  engine::SampleCall call;
  call.prompt = request.prompt;
  call.num_samples = request.num_samples;
  call.params = request.sampling_params;
  call.prompt_logprobs = request.prompt_logprobs;
  call.topk_prompt_logprobs = request.topk_prompt_logprobs;
  call.tenant = caller.tenant;  // the sampler shares its batch fairly by tenant, then by session
  call.session = request.sampling_session_id;
  engine::Sampler* sampler = nullptr;
  TenantGate* queue = nullptr;  // declared before its sampler, so it outlives it
  SampleSubmitted out;
  {
    std::lock_guard<std::mutex> lock(lock_.mu);
    if (lock_.stopping) return Status::Unavailable("server is shutting down");
    const Sessions::SamplingSession* found = sessions_.FindSamplerLocked(request.sampling_session_id);
    if (found == nullptr || found->owner != caller.tenant) {
      return Status::NotFound("asample.sampling_session_id: sampling session '" + request.sampling_session_id +
                              "' not found");
    }
    const Sessions::SamplingSession& session = *found;
    const auto key = std::make_pair(request.sampling_session_id, request.seq_id);
    const auto now = Clock::now();
    if (BaseModel* base = FindBase(session.base_model); base != nullptr) {
      if (auto prior = base->sampling.admitted.find(key); prior != base->sampling.admitted.end()) {
        return prior->second.first;
      }
    }
    const std::string session_id = session.sampler_id.substr(0, session.sampler_id.rfind(":sample:"));
    if (const Sessions::Session* owner = sessions_.FindLocked(session_id); owner != nullptr && owner->expired) {
      return Status::Precondition("asample.sampling_session_id: session '" + session_id +
                                  "' expired (no heartbeat), so its samples were cancelled; create a new ServiceClient");
    }
    BaseModel* base = FindBase(session.base_model);
    if (base == nullptr || !base->sampling.sampler) {
      return Status::Unavailable("asample: sampling of '" + session.base_model +
                                 "' is not served by this server (no sampler was started)");
    }
    SamplingState& sampling = base->sampling;
    if (request.base_model && *request.base_model != session.base_model) {
      return Status::Invalid(fmt::format("asample.base_model: '{}' differs from the sampling session's '{}'",
                                         *request.base_model, session.base_model));
    }
    if (session.snapshot) {
      // An ephemeral sampler whose snapshot is not committed yet: from memory.
      call.adapter_dir = session.snapshot_key;
      call.snapshot = session.snapshot;
    } else if (session.model_path) {
      // Resolved now, not at session creation: a deleted or unpublished
      // snapshot stops being sampleable.
      auto ckpt = registry_->GetCheckpoint(*session.model_path);
      if (!ckpt.ok() || !ckpt->AccessibleBy(caller.tenant)) {
        return Status::NotFound("asample: checkpoint '" + session.model_path->ToString() + "' of sampling session '" +
                                session.sampler_id + "' not found (deleted or no longer public)");
      }
      call.adapter_dir = ckpt->dir;
    }
    sampler = sampling.sampler.get();
    if (Status st = sampler->Validate(call); !st.ok()) {
      return Status(st.code(), "asample." + st.message());
    }
    int held = 0;
    switch (sampling.queue.Enter(caller.tenant, &held)) {
      case TenantGate::Verdict::kEntered:
        break;
      case TenantGate::Verdict::kFull:
        return Status::Exhausted(fmt::format("asample: the sampler already holds {} samples queued or running, the "
                                             "most it takes (--sample-queue {}); retry shortly",
                                             held, sampling.queue.capacity()));
      case TenantGate::Verdict::kTenantFull:
        return Status::Exhausted(fmt::format("asample: this key already has {} samples queued or running, the most "
                                             "one tenant may (half of --sample-queue {}); retry when one is answered",
                                             held, sampling.queue.capacity()));
    }
    out.request_id = futures_.Create(caller.tenant, "Sample");
    for (int32_t i = 0; i < call.num_samples; ++i) out.sample_sequence_ids.push_back(fmt::format("{}:{}", out.request_id, i));
    if (now - sampling.last_prune > std::chrono::minutes(1)) {
      for (auto a = sampling.admitted.begin(); a != sampling.admitted.end();) {
        a = now - a->second.second > std::chrono::hours(1) ? sampling.admitted.erase(a) : std::next(a);
      }
      sampling.last_prune = now;
    }
    sampling.admitted[key] = {out, now};
    queue = &sampling.queue;  // the bundle outlives its sampler's callbacks
    sessions_.TouchSessionLocked(session_id);
  }
  // The sampler lives until ~Service (after Stop), so the pointer stays valid.
  // The callback runs on the decode thread; FutureTable is thread-safe and
  // wakes parked polls from there, as the engine thread's completions do.
  FutureTable* futures = &futures_;
  const std::string request_id = out.request_id;
  Metrics* metrics = &metrics_;  // declared before bases_, so it outlives the sampler
  Usage* usage = &usage_;        // likewise
  const auto prompt_tokens = static_cast<int64_t>(call.prompt.size());
  sampler->Submit(std::move(call), [futures, metrics, usage, queue, request_id, prompt_tokens, tenant = caller.tenant](
                                       Result<engine::SampleOutput> result) {
    queue->Leave(tenant);
    if (!result.ok()) return futures->Fail(request_id, result.status());
    int64_t generated = 0;
    for (const auto& seq : result->sequences) generated += static_cast<int64_t>(seq.tokens.size());
    metrics->AddSamplingTokens(generated);
    usage->AddSample(tenant, prompt_tokens, result->prompt_cache_hit_tokens, generated);
    futures->Complete(request_id, std::move(*result));
  });
  return out;
}

}  // namespace loom::service
