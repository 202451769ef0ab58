// The writer threads of save_weights_for_sampler (service/publisher.h).
#include "service/publisher.h"

#include <chrono>

#include "common/log.h"

namespace loom::service {

Publisher::Publisher(int threads, size_t capacity, Checkpoints& checkpoints, FutureTable& futures, Metrics& metrics,
                     ServiceLock& lock, Sessions& sessions, SamplingState& sampling, bool staging_ahead)
    : threads_(std::max(1, threads)),
      capacity_(std::max<size_t>(1, capacity)),
      checkpoints_(checkpoints),
      futures_(futures),
      metrics_(metrics),
      lock_(lock),
      sessions_(sessions),
      sampling_(sampling),
      staging_ahead_(staging_ahead) {}

Publisher::~Publisher() { Stop(); }

void Publisher::Start() {
  std::unique_lock<std::mutex> lock(mu_);
  if (!writers_.empty() || stopping_) return;
  for (int i = 0; i < threads_; ++i) writers_.emplace_back([this] { Writer(); });
  changed_.wait(lock, [&] { return ready_ == threads_; });
}

void Publisher::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  changed_.notify_all();
  for (std::thread& w : writers_)
    if (w.joinable()) w.join();
}

void Publisher::OpenEphemeral(Job& job) {
  if (!job.sampler) return;
  {
    std::lock_guard<std::mutex> lock(lock_.mu);
    const engine::Sampler* sampler = sampling_.sampler.get();  // lives until ~Service, after Stop()
    if (sampler == nullptr || !sampler->SamplesFromMemory()) return;
    Sessions::SamplingSession session = *job.sampler;
    session.snapshot = job.publication.snapshot;
    session.snapshot_key = "snapshot:" + job.request_id;  // no directory's name; one per save
    sessions_.AddSamplerLocked(std::move(session), job.session_id);
  }
  job.answered = true;
  futures_.Complete(job.request_id, tinker::SaveWeightsForSamplerResult{std::nullopt, job.sampler->sampler_id});
}

void Publisher::Submit(Job job) {
  OpenEphemeral(job);  // before the queue's lock (lock order: ServiceLock::mu first)
  std::unique_lock<std::mutex> lock(mu_);
  changed_.wait(lock, [&] { return queue_.size() + writing_.size() < capacity_; });
  queue_.push_back(std::move(job));
  changed_.notify_all();
}

size_t Publisher::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return queue_.size() + writing_.size();
}

std::optional<Publisher::Job> Publisher::TakeLocked() {
  for (auto it = queue_.begin(); it != queue_.end(); ++it) {
    const std::string& model = it->publication.spec.model_id;
    if (writing_.count(model)) continue;
    writing_.insert(model);
    Job job = std::move(*it);
    queue_.erase(it);
    return job;
  }
  return std::nullopt;
}

void Publisher::Writer() {
  if (staging_ahead_) checkpoints_.PrepareWriter();
  std::unique_lock<std::mutex> lock(mu_);
  ++ready_;
  changed_.notify_all();
  while (true) {
    std::optional<Job> job;
    changed_.wait(lock, [&] { return (job = TakeLocked()).has_value() || (stopping_ && queue_.empty()); });
    if (!job) break;
    lock.unlock();
    const std::string model = job->publication.spec.model_id;
    Finish(*job);
    job.reset();
    lock.lock();
    writing_.erase(model);
    changed_.notify_all();
  }
  lock.unlock();
  if (staging_ahead_) checkpoints_.ReleaseWriter();
}

void Publisher::Finish(Job& job) {
  Checkpoints::Publication& pub = job.publication;
  const auto t0 = std::chrono::steady_clock::now();
  auto committed = checkpoints_.Publish(pub);
  metrics_.RecordPublish(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
                         committed.ok());
  if (!committed.ok()) {
    log::Warn("publish_failed model={} path={} error=\"{}\"", pub.spec.model_id, pub.path.ToString(),
              committed.status().message());
    // An answered ephemeral sampler keeps sampling its snapshot from memory.
    if (!job.answered) futures_.Fail(job.request_id, committed.status());
    return;
  }
  engine::Sampler* sampler = nullptr;
  std::optional<std::string> sampler_id;
  {
    std::lock_guard<std::mutex> lock(lock_.mu);
    sampler = sampling_.sampler.get();  // lives until ~Service, after Stop()
    if (job.answered) {  // the ephemeral sampler samples the committed copy from now on
      sessions_.CommitSamplerLocked(job.sampler->sampler_id, pub.path);
    } else if (job.sampler) {  // an unnamed save opens a sampling session on its snapshot
      job.sampler->model_path = pub.path;
      sampler_id = job.sampler->sampler_id;
      sessions_.AddSamplerLocked(*job.sampler, job.session_id);
    }
  }
  // Before the answer: a sample the client sends once it has the path finds
  // the offer. An ephemeral sampler's samples took the snapshot itself; an
  // offer for its committed copy would wait in the sampler's bounded queue,
  // holding device memory, for samples that mostly never come (a later one
  // reads the files).
  if (sampler && !job.answered) sampler->Offer(committed->dir, pub.snapshot);
  pub.snapshot.reset();
  if (!job.answered)
    futures_.Complete(job.request_id,
                      tinker::SaveWeightsForSamplerResult{job.sampler ? std::nullopt : std::optional(pub.path), sampler_id});
}

}  // namespace loom::service
