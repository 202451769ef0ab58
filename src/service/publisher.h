// Publisher: the writer threads of save_weights_for_sampler. The engine
// thread only takes the slot's snapshot (Checkpoints::SnapshotForSampler, a
// device-to-device copy) and hands it here; a writer thread then writes it
// into the registry's staging area and commits it (Checkpoints::Publish),
// offers the snapshot to the sampler under the committed directory (so the
// next sample of that version reads no file), opens the sampling session of
// an unnamed save, and only then answers the future: a path a client has
// been given is on disk, in the registry, and survives a restart. An unnamed
// save (the wire's ephemeral sampler, which the cookbook's RL recipes make
// every step) gets no path: where the sampler samples from memory its
// session opens on the snapshot itself and the future is answered at once
// (OpenEphemeral), and the write follows off the client's path.
//
// Owns: the queue of publications waiting or being written, the writer
// threads.
//
// Invariants:
//  - one model's publications are written and committed in the order they
//    were submitted (its seq_id order), never two at once; different
//    models' run in parallel on up to `threads` writers;
//  - a publication that fails (disk, registry) fails its own future only,
//    with the cause; the writers go on with the others;
//  - at most `capacity` publications wait or run: Submit waits for room
//    beyond that. Only a client that saves faster than the disk writes,
//    without awaiting its saves, gets there; then the engine thread waits
//    for one write, as it did for every save before;
//  - Stop() writes every publication already submitted, then joins.
//
// Threading: Submit on the engine thread; pending() any thread. A writer
// takes ServiceLock::mu only to open a sampling session, never while
// holding the queue's own lock (lock order: ServiceLock::mu first), and the
// sampler's Offer never waits for a decode step, so a publication never
// waits behind another tenant's sampling.
#pragma once
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "service/checkpoints.h"
#include "service/future_table.h"
#include "service/metrics.h"
#include "service/sampling.h"
#include "service/service_lock.h"
#include "service/sessions.h"

namespace loom::service {

class Publisher {
 public:
  // One save_weights_for_sampler to finish: its future, and for an unnamed
  // save the sampling session to open on its path.
  struct Job {
    std::string request_id;
    Checkpoints::Publication publication;
    std::optional<Sessions::SamplingSession> sampler;  // model_path set once committed
    std::string session_id;                            // the sampler's session
    bool answered = false;  // an ephemeral sampler's save, answered at Submit (OpenEphemeral)
  };

  // staging_ahead: each writer readies itself to write when it starts
  // (ServiceOptions::publish_staging_ahead).
  Publisher(int threads, size_t capacity, Checkpoints& checkpoints, FutureTable& futures, Metrics& metrics,
            ServiceLock& lock, Sessions& sessions, SamplingState& sampling, bool staging_ahead = false);
  ~Publisher();

  // Starts the writers; returns once each has started and, with
  // staging_ahead, readied itself to write (Checkpoints::PrepareWriter: on
  // CUDA, its pinned staging memory), so that no first write takes it while
  // the trainer runs.
  void Start();
  // Writes what was submitted, then joins the writers. Idempotent.
  void Stop();

  // Queues job (waits while `capacity` are queued or running).
  void Submit(Job job);
  // Publications queued or being written.
  size_t pending() const;

 private:
  // An unnamed save (job.sampler set) where the sampler samples from
  // memory: opens its sampling session on the snapshot itself and answers
  // the future now (sampling_session_id, no path, as the wire's ephemeral
  // sampler: spec 5.17), so the client's next sample waits for no write;
  // the write and commit follow as for any save, then point the session at
  // the committed directory. Else nothing (answered after the commit).
  void OpenEphemeral(Job& job);
  void Writer();
  // The oldest queued job whose model has none being written, taken out; nullopt when none.
  std::optional<Job> TakeLocked();
  void Finish(Job& job);

  const int threads_;
  const size_t capacity_;
  Checkpoints& checkpoints_;
  FutureTable& futures_;
  Metrics& metrics_;
  ServiceLock& lock_;
  Sessions& sessions_;      // [lock_.mu]
  SamplingState& sampling_;  // [lock_.mu] (its sampler pointer)

  mutable std::mutex mu_;
  std::condition_variable changed_;  // a job was queued or finished, a writer ready, or Stop()
  const bool staging_ahead_;
  int ready_ = 0;                    // [mu_] writers started (past PrepareWriter with staging_ahead_)
  std::deque<Job> queue_;            // [mu_] in submission order
  std::set<std::string> writing_;    // [mu_] models with a job being written
  bool stopping_ = false;            // [mu_]
  std::vector<std::thread> writers_;
};

}  // namespace loom::service
