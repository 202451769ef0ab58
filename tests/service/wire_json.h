// A typed Service answer in the JSON form http/ sends (wire/), so that tests
// can check the fields a client reads.
#pragma once
#include <nlohmann/json.hpp>

#include "common/status.h"
#include "wire/json_api.h"

namespace loom::testing {

template <typename T, typename Encode>
Result<nlohmann::json> AsJson(const Result<T>& answer, Encode encode) {
  if (!answer.ok()) return answer.status();
  return encode(answer.value());
}

}  // namespace loom::testing
