#include <utility>  // before asio: Boost 1.74's awaitable.hpp misses it

#include "replica/remote_sampler.h"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "common/log.h"
#include "replica/replica_api.h"
#include "wire/errors.h"
#include "wire/sample.h"

namespace loom::replica {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = boost::beast::http;
using tcp = asio::ip::tcp;
using Json = nlohmann::json;
using Clock = std::chrono::steady_clock;

namespace {

constexpr auto kTuple = asio::as_tuple(asio::use_awaitable);
// A submit is answered at once (the replica only validates and queues).
constexpr std::chrono::seconds kSubmitTimeout{30};
// Top-k prompt logprobs of a long prompt are megabytes.
constexpr uint64_t kMaxAnswerBytes = uint64_t{1} << 30;

struct Reply {
  int status = 0;
  std::string content_type;
  std::string body;
};

// The Status a replica's error body names (wire/errors.h's code names);
// a body without one takes its HTTP status's meaning.
Status ErrorOf(const Reply& reply) {
  Json j = Json::parse(reply.body, nullptr, false);
  std::string message = "sampler replica answered HTTP " + std::to_string(reply.status);
  if (j.is_object() && j.contains("error") && j["error"].is_string()) message = j["error"].get<std::string>();
  if (j.is_object() && j.contains("code") && j["code"].is_string()) {
    for (Code code : {Code::kInvalidArgument, Code::kNotFound, Code::kAlreadyExists, Code::kResourceExhausted,
                      Code::kFailedPrecondition, Code::kUnauthenticated, Code::kPayloadTooLarge, Code::kInternal,
                      Code::kUnavailable}) {
      if (j["code"].get<std::string>() == wire::CodeName(code)) return Status(code, message);
    }
  }
  if (reply.status == 404) return Status::NotFound(message);
  if (reply.status == 429) return Status::Exhausted(message);
  if (reply.status == 503) return Status::Unavailable(message);
  if (reply.status >= 400 && reply.status < 500) return Status::Invalid(message);
  return Status::Internal(message);
}

struct Replica {
  std::string address, host, port;
  bool up = false;
  bool checked = false;  // its info was read and agrees with the gateway's
  int64_t rows = 0;
  int64_t routed = 0, warm_hits = 0, downs = 0;
  std::list<std::string> warm;  // most recent first, at most warm_capacity
  size_t warm_capacity = 1;
  engine::SamplerStats stats;
  std::set<std::shared_ptr<beast::tcp_stream>> streams;  // exchanges open now
};

struct Op {
  engine::SampleCall call;
  engine::SampleCallback done;
  std::string body;  // the call as the replica's JSON
  bool finished = false;
  // An attempt's answer, handed to done only after the attempt's rows are
  // released: whoever the answer wakes sees the replica's load without it.
  std::optional<Result<engine::SampleOutput>> answer;
};

enum class Outcome { kFinished, kResubmit };

}  // namespace

struct RemoteSampler::Impl {
  RemoteOptions options;
  engine::SamplerInfo info;
  asio::io_context ioc;
  std::optional<asio::executor_work_guard<asio::io_context::executor_type>> guard;
  std::thread thread;
  std::atomic<bool> stopping{false};

  mutable std::mutex mu;  // everything below
  std::vector<std::unique_ptr<Replica>> replicas;
  std::map<std::string, Status> cancelled;  // sticky, as the in-process sampler's
  int64_t resubmitted = 0;

  explicit Impl(RemoteOptions o) : options(std::move(o)), guard(asio::make_work_guard(ioc)) {}

  std::string Addresses() const {
    std::string all;
    for (const auto& r : replicas) all += (all.empty() ? "" : ",") + r->address;
    return all;
  }

  static asio::awaitable<void> Sleep(std::chrono::milliseconds d) {
    asio::steady_timer timer(co_await asio::this_coro::executor, d);
    co_await timer.async_wait(kTuple);
  }

  // One HTTP/1.1 exchange on a fresh connection; transport failures (and
  // the connection closed by MarkDown) are Unavailable.
  asio::awaitable<Result<Reply>> Exchange(Replica* r, bhttp::verb verb, std::string target, std::string body,
                                          std::chrono::milliseconds timeout) {
    auto exec = co_await asio::this_coro::executor;
    auto stream = std::make_shared<beast::tcp_stream>(exec);
    {
      std::lock_guard<std::mutex> lock(mu);
      if (stopping) co_return Status::Unavailable("the sampler is shutting down");
      r->streams.insert(stream);
    }
    struct Drop {
      Impl* self;
      Replica* r;
      std::shared_ptr<beast::tcp_stream> s;
      ~Drop() {
        std::lock_guard<std::mutex> lock(self->mu);
        r->streams.erase(s);
      }
    } drop{this, r, stream};
    const auto fail = [&](const char* stage, const beast::error_code& ec) -> Status {
      return Status::Unavailable(fmt::format("sampler replica {}: {} failed: {}", r->address, stage, ec.message()));
    };
    tcp::resolver resolver(exec);
    auto [rec, endpoints] = co_await resolver.async_resolve(r->host, r->port, kTuple);
    if (rec) co_return fail("resolve", rec);
    stream->expires_after(timeout);
    auto [cec, ep] = co_await stream->async_connect(endpoints, kTuple);
    if (cec) co_return fail("connect", cec);
    bhttp::request<bhttp::string_body> req{verb, target, 11};
    req.set(bhttp::field::host, r->host);
    req.set(bhttp::field::content_type, "application/json");
    if (!options.key.empty()) req.set(kKeyHeader, options.key);
    req.keep_alive(false);
    req.body() = std::move(body);
    req.prepare_payload();
    auto [wec, wn] = co_await bhttp::async_write(*stream, req, kTuple);
    if (wec) co_return fail("send", wec);
    beast::flat_buffer buffer;
    bhttp::response_parser<bhttp::string_body> parser;
    parser.body_limit(kMaxAnswerBytes);
    auto [aec, an] = co_await bhttp::async_read(*stream, buffer, parser, kTuple);
    if (aec) co_return fail("answer", aec);
    beast::error_code ignored;
    stream->socket().shutdown(tcp::socket::shutdown_both, ignored);
    auto& res = parser.get();
    co_return Reply{static_cast<int>(res.result_int()), std::string(res[bhttp::field::content_type]),
                    std::move(res.body())};
  }

  // Closes every connection to r, so that the calls waiting on it fail
  // over to another replica now. On the I/O thread.
  void MarkDown(Replica* r, const std::string& why) {
    std::set<std::shared_ptr<beast::tcp_stream>> streams;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (r->up) {
        r->up = false;
        r->checked = false;  // what answers next is checked again (a restart may bring other limits)
        ++r->downs;
        r->warm.clear();  // a replica that comes back has a cold cache
        log::Warn("sampler_replica_down address={} why={}", r->address, why);
      }
      streams = r->streams;
    }
    for (const auto& s : streams) {
      beast::error_code ignored;
      s->socket().close(ignored);
    }
  }

  // What a replica's info must agree on before it takes calls.
  Status Compatible(const engine::SamplerInfo& theirs) const {
    if (theirs.vocab_size != info.vocab_size || theirs.context_window != info.context_window)
      return Status::Invalid(fmt::format("vocabulary {} and context window {}, where the others have {} and {}",
                                         theirs.vocab_size, theirs.context_window, info.vocab_size,
                                         info.context_window));
    if (theirs.kv_blocks * theirs.block_size < info.kv_tokens || theirs.max_num_samples < info.max_num_samples ||
        theirs.max_rank < info.max_rank || (info.has_tokenizer && !theirs.has_tokenizer))
      return Status::Invalid("smaller limits (KV budget, num_samples, rank or tokenizer) than the gateway checks");
    return Status::Ok();
  }

  asio::awaitable<Result<engine::SamplerInfo>> FetchInfo(Replica* r, std::chrono::milliseconds timeout) {
    auto got = co_await Exchange(r, bhttp::verb::get, "/replica/v1/info", "", timeout);
    if (!got.ok()) co_return got.status();
    if (got->status != 200) co_return ErrorOf(*got);
    co_return ParseSamplerInfo(Json::parse(got->body, nullptr, false));
  }

  asio::awaitable<void> Health(Replica* r) {
    while (!stopping) {
      bool checked;
      {
        std::lock_guard<std::mutex> lock(mu);
        checked = r->checked;
      }
      if (!checked) {
        auto theirs = co_await FetchInfo(r, options.health_timeout);
        if (theirs.ok()) {
          if (Status st = Compatible(*theirs); st.ok()) {
            std::lock_guard<std::mutex> lock(mu);
            r->checked = true;
            r->warm_capacity = static_cast<size_t>(std::max(1, theirs->sampler_adapters));
          } else {
            log::Error("sampler_replica_refused address={} why={}", r->address, st.message());
          }
        }
      }
      if (checked) {
        auto got = co_await Exchange(r, bhttp::verb::get, "/replica/v1/health", "", options.health_timeout);
        if (got.ok() && got->status == 200) {
          const Json j = Json::parse(got->body, nullptr, false);
          std::lock_guard<std::mutex> lock(mu);
          if (j.is_object() && j.contains("stats")) r->stats = ParseSamplerStats(j["stats"]);
          if (!r->up && !stopping) {
            r->up = true;
            log::Info("sampler_replica_up address={}", r->address);
          }
        } else {
          MarkDown(r, got.ok() ? "health answered HTTP " + std::to_string(got->status) : got.status().message());
        }
      }
      if (!stopping) co_await Sleep(options.health_period);
    }
  }

  // The replica for op's next attempt (nullptr: none is up); counts its rows there.
  Replica* Pick(const Op& op) {
    std::lock_guard<std::mutex> lock(mu);
    Replica *least = nullptr, *warm = nullptr;
    for (const auto& r : replicas) {
      if (!r->up) continue;
      if (least == nullptr || r->rows < least->rows) least = r.get();
      const bool has = op.call.adapter_dir.empty() ||
                       std::find(r->warm.begin(), r->warm.end(), op.call.adapter_dir) != r->warm.end();
      if (has && (warm == nullptr || r->rows < warm->rows)) warm = r.get();
    }
    if (least == nullptr) return nullptr;
    Replica* chosen = warm != nullptr && warm->rows <= least->rows + info.max_num_samples ? warm : least;
    chosen->rows += op.call.num_samples;
    ++chosen->routed;
    if (chosen == warm) ++chosen->warm_hits;
    if (!op.call.adapter_dir.empty()) {
      chosen->warm.remove(op.call.adapter_dir);
      chosen->warm.push_front(op.call.adapter_dir);
      if (chosen->warm.size() > chosen->warm_capacity) chosen->warm.pop_back();
    }
    return chosen;
  }

  void Release(Replica* r, const Op& op) {
    std::lock_guard<std::mutex> lock(mu);
    r->rows -= op.call.num_samples;
  }

  std::optional<Status> CancelledWhy(const std::string& session) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cancelled.find(session);
    if (it == cancelled.end()) return std::nullopt;
    return it->second;
  }

  static void Finish(Op& op, Result<engine::SampleOutput> result) {
    if (op.finished) return;
    op.finished = true;
    if (op.done) op.done(std::move(result));
  }

  static void Answer(Op& op, Result<engine::SampleOutput> result) { op.answer = std::move(result); }

  // One submit-and-poll on r: kFinished with op.answer set, or kResubmit.
  asio::awaitable<Outcome> Attempt(Replica* r, Op& op) {
    auto sub = co_await Exchange(r, bhttp::verb::post, "/replica/v1/sample", op.body,
                                 std::chrono::duration_cast<std::chrono::milliseconds>(kSubmitTimeout));
    if (!sub.ok() || sub->status == 503) {
      MarkDown(r, sub.ok() ? "sample answered 503: " + ErrorOf(*sub).message() : sub.status().message());
      co_return Outcome::kResubmit;
    }
    if (sub->status != 200) {
      Answer(op, ErrorOf(*sub));
      co_return Outcome::kFinished;
    }
    const Json j = Json::parse(sub->body, nullptr, false);
    if (!j.is_object() || !j.contains("request_id") || !j["request_id"].is_string()) {
      Answer(op, Status::Internal("sampler replica " + r->address + " answered a sample without a request_id"));
      co_return Outcome::kFinished;
    }
    const std::string poll = Json{{"request_id", j["request_id"]}}.dump();
    while (true) {
      auto got = co_await Exchange(r, bhttp::verb::post, "/replica/v1/retrieve", poll, options.poll_timeout);
      if (!got.ok() || got->status == 503) {
        MarkDown(r, got.ok() ? "retrieve answered 503: " + ErrorOf(*got).message() : got.status().message());
        co_return Outcome::kResubmit;
      }
      if (got->status == 404) co_return Outcome::kResubmit;  // a restarted replica lost the call
      if (got->status != 200) {
        Answer(op, ErrorOf(*got));
        co_return Outcome::kFinished;
      }
      if (got->content_type == "application/x-protobuf") {
        auto decoded = wire::DecodeSampleResponse(got->body);
        if (!decoded.ok()) {
          Answer(op, Status::Internal("sampler replica " + r->address + ": " + decoded.status().message()));
        } else {
          Answer(op, wire::SampleOutputOf(*decoded));
        }
        co_return Outcome::kFinished;
      }
      // {"type":"try_again"}: the hold ran out; poll again.
    }
  }

  asio::awaitable<void> Run(std::shared_ptr<Op> op) {
    try {
      auto waiting_since = Clock::now();
      bool again = false;
      while (true) {
        if (auto why = CancelledWhy(op->call.session)) co_return Finish(*op, *why);
        if (stopping) co_return Finish(*op, Status::Unavailable("the sampler is shutting down"));
        Replica* r = Pick(*op);
        if (r == nullptr) {
          if (Clock::now() - waiting_since > options.no_replica_wait) {
            std::lock_guard<std::mutex> lock(mu);
            co_return Finish(*op, Status::Unavailable(fmt::format(
                                      "asample: none of the sampler replicas ({}) answered for {} ms; retry shortly",
                                      Addresses(), options.no_replica_wait.count())));
          }
          co_await Sleep(std::chrono::milliseconds(50));
          continue;
        }
        if (again) {
          std::lock_guard<std::mutex> lock(mu);
          ++resubmitted;
          log::Info("sample_resubmitted session={} replica={}", op->call.session, r->address);
        }
        const Outcome outcome = co_await Attempt(r, *op);
        Release(r, *op);
        if (outcome == Outcome::kFinished) co_return Finish(*op, std::move(*op->answer));
        again = true;
        waiting_since = Clock::now();
      }
    } catch (const std::exception& e) {
      Finish(*op, Status::Internal(std::string("gateway sampling: ") + e.what()));
    }
  }

  asio::awaitable<void> SendCancel(Replica* r, std::string body) {
    auto got = co_await Exchange(r, bhttp::verb::post, "/replica/v1/cancel", std::move(body), options.health_timeout);
    if (!got.ok() || got->status != 200)
      log::Warn("sampler_replica_cancel_failed address={} why={}", r->address,
                got.ok() ? ErrorOf(*got).message() : got.status().message());
  }
};

RemoteSampler::RemoteSampler(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Result<std::unique_ptr<RemoteSampler>> RemoteSampler::Open(const RemoteOptions& options) {
  if (options.replicas.empty()) return Status::Invalid("--sampler-replicas: no replica given");
  auto impl = std::make_unique<Impl>(options);
  for (const std::string& address : options.replicas) {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos || colon == 0 || colon + 1 == address.size())
      return Status::Invalid("--sampler-replicas: '" + address + "' is not HOST:PORT");
    auto r = std::make_unique<Replica>();
    r->address = address;
    r->host = address.substr(0, colon);
    r->port = address.substr(colon + 1);
    for (const auto& other : impl->replicas)
      if (other->address == address) return Status::Invalid("--sampler-replicas: '" + address + "' is given twice");
    impl->replicas.push_back(std::move(r));
  }
  Impl* s = impl.get();
  s->thread = std::thread([s] { s->ioc.run(); });
  std::unique_ptr<RemoteSampler> out(new RemoteSampler(std::move(impl)));
  // Rounds over every replica until one answers: the gateway's limits are
  // the smallest of those that answered in that round.
  const auto deadline = Clock::now() + options.open_wait;
  std::vector<std::pair<Replica*, engine::SamplerInfo>> answered;
  std::string last_error;
  while (answered.empty()) {
    for (const auto& r : s->replicas) {
      // use_future needs a default-constructible value: a pair, not a Result.
      auto fetch = [s, r = r.get()]() -> asio::awaitable<std::pair<Status, engine::SamplerInfo>> {
        auto got = co_await s->FetchInfo(r, std::chrono::milliseconds(5000));
        if (!got.ok()) co_return std::make_pair(got.status(), engine::SamplerInfo{});
        co_return std::make_pair(Status::Ok(), *got);
      };
      auto [st, theirs] = asio::co_spawn(s->ioc, fetch(), asio::use_future).get();
      if (st.ok()) {
        answered.emplace_back(r.get(), theirs);
      } else {
        last_error = st.message();
      }
    }
    if (!answered.empty()) break;
    if (Clock::now() > deadline)
      return Status::Unavailable(fmt::format("--sampler-replicas: none of {} answered within {} s (last: {})",
                                             s->Addresses(), options.open_wait.count() / 1000, last_error));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  engine::SamplerInfo info = answered.front().second;
  for (const auto& [r, theirs] : answered) {
    if (theirs.vocab_size != info.vocab_size || theirs.context_window != info.context_window)
      return Status::Invalid(fmt::format("--sampler-replicas: {} has vocabulary {} and context window {}, {} has {} "
                                         "and {}: every replica must serve the same model and window",
                                         r->address, theirs.vocab_size, theirs.context_window,
                                         answered.front().first->address, info.vocab_size, info.context_window));
    if (theirs.kv_tokens < info.kv_tokens) {
      info.kv_tokens = theirs.kv_tokens;
      info.kv_blocks = theirs.kv_blocks;
      info.block_size = theirs.block_size;
    }
    info.max_num_samples = std::min(info.max_num_samples, theirs.max_num_samples);
    info.max_rank = std::min(info.max_rank, theirs.max_rank);
    info.has_tokenizer = info.has_tokenizer && theirs.has_tokenizer;
    info.sampler_adapters = std::min(info.sampler_adapters, theirs.sampler_adapters);
  }
  s->info = info;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    for (const auto& [r, theirs] : answered) {
      r->checked = true;
      r->up = true;
      r->warm_capacity = static_cast<size_t>(std::max(1, theirs.sampler_adapters));
    }
  }
  for (const auto& r : s->replicas) asio::co_spawn(s->ioc, s->Health(r.get()), asio::detached);
  return out;
}

RemoteSampler::~RemoteSampler() {
  Impl& s = *impl_;
  s.stopping = true;
  asio::post(s.ioc, [&s] {
    for (const auto& r : s.replicas) {
      std::set<std::shared_ptr<beast::tcp_stream>> streams;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        streams = r->streams;
      }
      for (const auto& st : streams) {
        beast::error_code ignored;
        st->socket().close(ignored);
      }
    }
  });
  s.guard.reset();
  if (s.thread.joinable()) s.thread.join();
}

const engine::SamplerInfo& RemoteSampler::info() const { return impl_->info; }

Status RemoteSampler::Validate(const engine::SampleCall& call) const {
  return engine::ValidateSampleCall(impl_->info, call);
}

void RemoteSampler::Submit(engine::SampleCall call, engine::SampleCallback done) {
  if (Status st = Validate(call); !st.ok()) {
    if (done) done(st);
    return;
  }
  if (auto why = impl_->CancelledWhy(call.session)) {
    if (done) done(*why);
    return;
  }
  if (impl_->stopping) {
    if (done) done(Status::Unavailable("the sampler is shutting down"));
    return;
  }
  auto op = std::make_shared<Op>();
  op->body = SampleCallJson(call).dump();
  op->call = std::move(call);
  op->done = std::move(done);
  asio::co_spawn(impl_->ioc, impl_->Run(std::move(op)), asio::detached);
}

void RemoteSampler::Cancel(const std::string& session, const Status& why) {
  if (session.empty()) return;
  std::vector<Replica*> up;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->cancelled.emplace(session, why);
    for (const auto& r : impl_->replicas)
      if (r->up) up.push_back(r.get());
  }
  const std::string body = Json{{"session", session}, {"message", why.message()}}.dump();
  for (Replica* r : up) asio::co_spawn(impl_->ioc, impl_->SendCancel(r, body), asio::detached);
}

engine::SamplerStats RemoteSampler::stats() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  engine::SamplerStats sum;
  for (const auto& r : impl_->replicas) {
    sum = AddStats(sum, r->stats);
    ++sum.replicas;
    if (r->up) ++sum.replicas_live;
  }
  sum.resubmitted = impl_->resubmitted;
  return sum;
}

RoutingStats RemoteSampler::routing() const {
  std::lock_guard<std::mutex> lock(impl_->mu);
  RoutingStats out;
  out.resubmitted = impl_->resubmitted;
  for (const auto& r : impl_->replicas)
    out.replicas.push_back({r->address, r->up, r->rows, r->routed, r->warm_hits, r->downs});
  return out;
}

}  // namespace loom::replica
