#include "http/dashboard.h"

namespace loom::http {

using Json = nlohmann::json;

extern const char* const kDashboardHtml;  // dashboard_page.cpp

HttpResponse DashboardPage() {
  HttpResponse r;
  r.content_type = "text/html; charset=utf-8";
  r.body = kDashboardHtml;
  // The page runs only its own inline script and talks only to this server.
  r.headers.emplace_back("Content-Security-Policy",
                         "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
                         "connect-src 'self'; img-src 'self'");
  r.headers.emplace_back("Cache-Control", "no-store");
  return r;
}

Json TenantDashboardJson(service::Service& service, const std::string& tenant) {
  const auto history = service.metrics().pass_history().Of(tenant);
  Json models = Json::array();
  for (const service::Service::ModelStatus& m : service.ModelsOf(tenant)) {
    Json passes = Json::array();
    if (auto it = history.find(m.model_id); it != history.end()) {
      for (const service::PassHistory::Point& p : it->second.points) {
        passes.push_back({{"index", p.index},
                          {"loss_sum", p.loss_sum},
                          {"tokens", p.tokens},
                          {"loss_mean", p.tokens > 0 ? p.loss_sum / static_cast<double>(p.tokens) : p.loss_sum},
                          {"at_ms", p.at_ms}});
      }
    }
    models.push_back({{"model_id", m.model_id},
                      {"base_model", m.base_model},
                      {"rank", m.rank},
                      {"queue_state", m.queue_state},
                      {"queued", m.queued},
                      {"passes", std::move(passes)}});
  }
  return {{"view", "tenant"},
          {"tenant", tenant},
          {"history_limit", service::PassHistory::kMaxPoints},
          {"models", std::move(models)}};
}

Json AdminDashboardJson(service::Service& service) {
  const service::QueueSnapshot live = service.LiveSnapshot(/*with_usage=*/true);
  const service::Metrics::Fill fill = service.metrics().fill();
  Json queues = Json::object();
  for (const auto& [model_id, q] : live.models) queues[model_id] = q.queued;
  Json sampler = {{"attached", false}};
  if (auto stats = service.sampler_stats()) {
    sampler = {{"attached", true},
               {"requests_waiting", stats->requests_waiting},
               {"requests_done", stats->requests_done},
               {"kv_blocks_free", stats->kv_blocks_free},
               {"kv_blocks_cached", stats->kv_blocks_cached}};
  }
  Json j = {{"view", "admin"},
            {"slots", {{"in_use", live.slots_in_use}, {"total", live.slots_total}}},
            {"capacity_waiters", live.capacity_waiters},
            {"pass_fill",
             {{"passes", fill.passes},
              {"last_tokens", fill.last_tokens},
              {"token_budget", live.token_budget},
              {"last_ratio", fill.last_ratio},
              {"mean_ratio", fill.mean_ratio}}},
            {"sampler", std::move(sampler)},
            {"queued_by_model", std::move(queues)}};
  j["tenants"] = wire::UsageListJson(live.usage)["tenants"];
  return j;
}

}  // namespace loom::http
