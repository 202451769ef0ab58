// `loom bench multi-tenant`: the service's scheduler packing N tenants'
// requests into shared passes vs the same requests one tenant at a time.
#pragma once

namespace loom::cli {
int BenchMultiTenant(int argc, char** argv);  // argv[0] = "multi-tenant"
}  // namespace loom::cli
