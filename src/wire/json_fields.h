// Typed, path-naming reads of JSON object fields, shared by the wire parsers
// (internal to wire/). Every error is kInvalidArgument and starts with the
// dotted field path: "<where>.<key>: expected an integer".
//
// Conventions: a key that is absent or null is "missing"; optional getters
// leave their output untouched (or nullopt) then. Floats accept JSON
// integers; integers accept integral floats (pydantic's lax mode does too).
//
// Pure functions; any thread may call them.
#pragma once
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/status.h"
#include "wire/try.h"

namespace loom::wire::fields {

using Json = nlohmann::json;

std::string Path(const std::string& where, const char* key);

// The value at key, or nullptr when absent or null.
const Json* Find(const Json& obj, const char* key);

Status RequireObject(const Json& j, const std::string& where);

Status String(const Json& obj, const std::string& where, const char* key, std::string* out);
Status NonEmptyString(const Json& obj, const std::string& where, const char* key, std::string* out);
Status OptString(const Json& obj, const std::string& where, const char* key, std::optional<std::string>* out);

Status Int(const Json& obj, const std::string& where, const char* key, int64_t* out);
Status OptInt(const Json& obj, const std::string& where, const char* key, std::optional<int64_t>* out);
// Any 64-bit integer (signed or unsigned JSON), stored as its two's-complement bits.
Status OptAnyU64(const Json& obj, const std::string& where, const char* key, std::optional<uint64_t>* out);

Status Double(const Json& obj, const std::string& where, const char* key, double* out);
Status OptDouble(const Json& obj, const std::string& where, const char* key, std::optional<double>* out);

// Absent keeps *out (the default).
Status Bool(const Json& obj, const std::string& where, const char* key, bool* out);

// A JSON value (not a field) as an integer / number; `path` is the full name.
Status AsInt(const Json& v, const std::string& path, int64_t* out);
Status AsDouble(const Json& v, const std::string& path, double* out);

// {str: any} -> {str: str}; non-string values are kept as their JSON text.
Status OptStringMap(const Json& obj, const std::string& where, const char* key, std::map<std::string, std::string>* out);
Status OptStringList(const Json& obj, const std::string& where, const char* key, std::vector<std::string>* out);

}  // namespace loom::wire::fields
