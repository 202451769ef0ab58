#include "wire/json_fields.h"

#include <cmath>
#include <limits>

namespace loom::wire::fields {

std::string Path(const std::string& where, const char* key) {
  return where.empty() ? std::string(key) : where + "." + key;
}

const Json* Find(const Json& obj, const char* key) {
  if (!obj.is_object()) return nullptr;
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return nullptr;
  return &*it;
}

Status RequireObject(const Json& j, const std::string& where) {
  if (!j.is_object()) return Status::Invalid(where + ": expected a JSON object");
  return Status::Ok();
}

static Status Missing(const std::string& path) { return Status::Invalid(path + ": required field is missing"); }

Status String(const Json& obj, const std::string& where, const char* key, std::string* out) {
  const Json* v = Find(obj, key);
  if (!v) return Missing(Path(where, key));
  if (!v->is_string()) return Status::Invalid(Path(where, key) + ": expected a string");
  *out = v->get<std::string>();
  return Status::Ok();
}

Status NonEmptyString(const Json& obj, const std::string& where, const char* key, std::string* out) {
  LOOM_WIRE_TRY(String(obj, where, key, out));
  if (out->empty()) return Status::Invalid(Path(where, key) + ": must not be empty");
  return Status::Ok();
}

Status OptString(const Json& obj, const std::string& where, const char* key, std::optional<std::string>* out) {
  const Json* v = Find(obj, key);
  if (!v) {
    out->reset();
    return Status::Ok();
  }
  if (!v->is_string()) return Status::Invalid(Path(where, key) + ": expected a string");
  *out = v->get<std::string>();
  return Status::Ok();
}

Status AsInt(const Json& v, const std::string& path, int64_t* out) {
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return Status::Invalid(path + ": integer out of range (max 2^63-1)");
    *out = static_cast<int64_t>(u);
    return Status::Ok();
  }
  if (v.is_number_integer()) {
    *out = v.get<int64_t>();
    return Status::Ok();
  }
  if (v.is_number_float()) {
    double d = v.get<double>();
    // 2^63 is exactly representable; anything >= it does not fit.
    if (std::isfinite(d) && d == std::trunc(d) && d >= -9223372036854775808.0 && d < 9223372036854775808.0) {
      *out = static_cast<int64_t>(d);
      return Status::Ok();
    }
  }
  return Status::Invalid(path + ": expected an integer");
}

Status AsDouble(const Json& v, const std::string& path, double* out) {
  if (!v.is_number()) return Status::Invalid(path + ": expected a number");
  *out = v.get<double>();
  return Status::Ok();
}

Status Int(const Json& obj, const std::string& where, const char* key, int64_t* out) {
  const Json* v = Find(obj, key);
  if (!v) return Missing(Path(where, key));
  return AsInt(*v, Path(where, key), out);
}

Status OptInt(const Json& obj, const std::string& where, const char* key, std::optional<int64_t>* out) {
  const Json* v = Find(obj, key);
  if (!v) {
    out->reset();
    return Status::Ok();
  }
  int64_t x = 0;
  LOOM_WIRE_TRY(AsInt(*v, Path(where, key), &x));
  *out = x;
  return Status::Ok();
}

Status OptAnyU64(const Json& obj, const std::string& where, const char* key, std::optional<uint64_t>* out) {
  const Json* v = Find(obj, key);
  if (!v) {
    out->reset();
    return Status::Ok();
  }
  if (v->is_number_unsigned()) {
    *out = v->get<uint64_t>();
    return Status::Ok();
  }
  int64_t x = 0;
  LOOM_WIRE_TRY(AsInt(*v, Path(where, key), &x));
  *out = static_cast<uint64_t>(x);
  return Status::Ok();
}

Status Double(const Json& obj, const std::string& where, const char* key, double* out) {
  const Json* v = Find(obj, key);
  if (!v) return Missing(Path(where, key));
  return AsDouble(*v, Path(where, key), out);
}

Status OptDouble(const Json& obj, const std::string& where, const char* key, std::optional<double>* out) {
  const Json* v = Find(obj, key);
  if (!v) {
    out->reset();
    return Status::Ok();
  }
  double d = 0;
  LOOM_WIRE_TRY(AsDouble(*v, Path(where, key), &d));
  *out = d;
  return Status::Ok();
}

Status Bool(const Json& obj, const std::string& where, const char* key, bool* out) {
  const Json* v = Find(obj, key);
  if (!v) return Status::Ok();
  if (!v->is_boolean()) return Status::Invalid(Path(where, key) + ": expected true or false");
  *out = v->get<bool>();
  return Status::Ok();
}

Status OptStringMap(const Json& obj, const std::string& where, const char* key,
                    std::map<std::string, std::string>* out) {
  out->clear();
  const Json* v = Find(obj, key);
  if (!v) return Status::Ok();
  if (!v->is_object()) return Status::Invalid(Path(where, key) + ": expected an object");
  for (auto it = v->begin(); it != v->end(); ++it) {
    (*out)[it.key()] = it->is_string() ? it->get<std::string>()
                                       : it->dump(-1, ' ', false, Json::error_handler_t::replace);
  }
  return Status::Ok();
}

Status OptStringList(const Json& obj, const std::string& where, const char* key, std::vector<std::string>* out) {
  out->clear();
  const Json* v = Find(obj, key);
  if (!v) return Status::Ok();
  if (!v->is_array()) return Status::Invalid(Path(where, key) + ": expected a list of strings");
  for (size_t i = 0; i < v->size(); ++i) {
    if (!(*v)[i].is_string())
      return Status::Invalid(Path(where, key) + "[" + std::to_string(i) + "]: expected a string");
    out->push_back((*v)[i].get<std::string>());
  }
  return Status::Ok();
}

}  // namespace loom::wire::fields
