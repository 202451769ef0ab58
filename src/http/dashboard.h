// Dashboard: loom's own page at GET /dashboard and the JSON it reads at
// GET /api/v1/dashboard (docs/dashboard.md; not part of the Tinker API).
//
// The page is static (HTML, CSS and JS compiled in, no third-party code),
// served without a key; it holds no data. Everything it shows comes from
// JSON endpoints that authenticate like every other one: the page keeps the
// key in sessionStorage and sends it as X-API-Key, never in a URL the server
// sees. A tenant's key gets only its own models and their recent
// forward_backward losses (service/pass_history.h); the admin key
// (--admin-key) gets the operator's view: every tenant's usage, slot
// occupancy, pass fill and sampler load, from the same snapshot /metrics
// renders (Service::LiveSnapshot).
//
// Threading: stateless; any thread.
#pragma once
#include <string>

#include "http/router.h"
#include "service/service.h"
#include "wire/json_api.h"

namespace loom::http {

// The page (text/html).
HttpResponse DashboardPage();
// The tenant's view: its live models with their queue state and loss history.
nlohmann::json TenantDashboardJson(service::Service& service, const std::string& tenant);
// The admin key's view.
nlohmann::json AdminDashboardJson(service::Service& service);

}  // namespace loom::http
