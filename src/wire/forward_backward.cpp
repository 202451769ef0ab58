#include "wire/forward_backward.h"

#include <algorithm>
#include <bit>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "tinker_public.pb.h"
#include "wire/proto_bytes.h"
#include "wire/try.h"
#include "wire/zstd.h"

namespace loom::wire {

static_assert(std::endian::native == std::endian::little, "the Tinker wire is little-endian");

namespace pb = ::tinker_public;

namespace {

// "[3,4]"; a shape of more than 8 dims is cut ("[1,1,...] (1000000 dims)") so
// that an error message stays small.
std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size() && i < 8; ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  if (shape.size() > 8) return s + ",...] (" + std::to_string(shape.size()) + " dims)";
  return s + "]";
}

// A wire-chosen name as it appears in an error message: at most 64 bytes.
std::string Shown(const std::string& name) { return name.size() <= 64 ? name : name.substr(0, 64) + "..."; }

const char* DTypeName(int dtype) {
  switch (dtype) {
    case pb::DTYPE_FLOAT32: return "float32";
    case pb::DTYPE_INT64: return "int64";
    case pb::DTYPE_INT32: return "int32";
    case pb::DTYPE_BFLOAT16: return "bfloat16";
    default: return "unspecified";
  }
}

// Bytes per element of a wire dtype, 0 if unsupported.
size_t DTypeSize(int dtype) {
  switch (dtype) {
    case pb::DTYPE_FLOAT32: return 4;
    case pb::DTYPE_INT64: return 8;
    case pb::DTYPE_INT32: return 4;
    case pb::DTYPE_BFLOAT16: return 2;
    default: return 0;
  }
}

bool IsFloatDType(int dtype) { return dtype == pb::DTYPE_FLOAT32 || dtype == pb::DTYPE_BFLOAT16; }

template <typename T>
T Load(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

float Bf16ToFloat(uint16_t b) { return std::bit_cast<float>(static_cast<uint32_t>(b) << 16); }

// Appends n values of a wire dtype from raw bytes to the Array's storage.
void AppendValues(const char* p, size_t n, int dtype, tinker::Array* a) {
  switch (dtype) {
    case pb::DTYPE_FLOAT32: {
      size_t old = a->f32.size();
      a->f32.resize(old + n);
      if (n) std::memcpy(a->f32.data() + old, p, 4 * n);
      break;
    }
    case pb::DTYPE_BFLOAT16:
      for (size_t i = 0; i < n; ++i) a->f32.push_back(Bf16ToFloat(Load<uint16_t>(p + 2 * i)));
      break;
    case pb::DTYPE_INT64: {
      size_t old = a->i64.size();
      a->i64.resize(old + n);
      if (n) std::memcpy(a->i64.data() + old, p, 8 * n);
      break;
    }
    case pb::DTYPE_INT32:
      for (size_t i = 0; i < n; ++i) a->i64.push_back(Load<int32_t>(p + 4 * i));
      break;
  }
}

// numel of a shape, rejecting negative dims and overflow.
Status Numel(const std::vector<int64_t>& shape, const std::string& where, int64_t* out) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) return Status::Invalid(where + ": negative dimension in shape " + ShapeText(shape));
    if (__builtin_mul_overflow(n, d, &n))
      return Status::Invalid(where + ": shape " + ShapeText(shape) + " has too many elements");
  }
  *out = n;
  return Status::Ok();
}

// An upper bound of what ParseFromArray allocates beyond the body's own bytes,
// from one pass over the wire format: an empty submessage is 2 bytes on the
// wire but a few hundred once parsed (the message, its slot, the engine-side
// Datum or Array), a packed shape entry 1 byte but 16 (its copy included), and
// an unknown field 16. The schema is fixed, so the walk is at most 4 deep.
class ParseCostScan {
 public:
  static constexpr uint64_t kMessageBytes = 256, kFieldBytes = 16, kShapeEntryBytes = 16;

  // False when the framing is broken (ParseFromArray would refuse it too).
  bool Scan(std::string_view bytes) { return Message(bytes, Kind::kRequest); }
  uint64_t cost() const { return cost_; }

 private:
  enum class Kind { kRequest, kDatum, kInputEntry, kTensor, kLeaf };

  static bool Varint(std::string_view b, size_t* at, uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64 && *at < b.size(); shift += 7) {
      const uint8_t byte = static_cast<uint8_t>(b[(*at)++]);
      *v |= uint64_t{byte & 0x7fu} << shift;
      if (!(byte & 0x80)) return true;
    }
    return false;
  }

  // The submessage kind of (kind, field), or kLeaf for bytes/strings and
  // messages that are not walked further.
  static Kind Child(Kind kind, uint64_t field) {
    switch (kind) {
      case Kind::kRequest: return field == 3 ? Kind::kDatum : Kind::kLeaf;   // data; loss_fn_config entries
      case Kind::kDatum: return field == 2 ? Kind::kInputEntry : Kind::kLeaf;  // loss_fn_inputs; chunks
      case Kind::kInputEntry: return field == 2 ? Kind::kTensor : Kind::kLeaf;
      default: return Kind::kLeaf;
    }
  }
  static bool IsMessage(Kind kind, uint64_t field) {
    switch (kind) {
      case Kind::kRequest: return field == 3 || field == 5;
      case Kind::kDatum: return field == 1 || field == 2;
      case Kind::kInputEntry: return field == 2;
      case Kind::kTensor: return field == 2;
      default: return false;
    }
  }

  bool Message(std::string_view b, Kind kind) {
    size_t at = 0;
    while (at < b.size()) {
      uint64_t tag = 0, v = 0;
      if (!Varint(b, &at, &tag)) return false;
      const uint64_t field = tag >> 3;
      cost_ += kFieldBytes;
      switch (tag & 7) {
        case 0:
          if (!Varint(b, &at, &v)) return false;
          if (kind == Kind::kTensor && field == 4) cost_ += kShapeEntryBytes;  // an unpacked shape entry
          break;
        case 1:
          if (b.size() - at < 8) return false;
          at += 8;
          break;
        case 5:
          if (b.size() - at < 4) return false;
          at += 4;
          break;
        case 2: {
          if (!Varint(b, &at, &v) || v > b.size() - at) return false;
          const std::string_view sub = b.substr(at, v);
          at += v;
          if (kind == Kind::kTensor && field == 4) {  // packed shape: one entry per final varint byte
            for (char c : sub) cost_ += (static_cast<uint8_t>(c) & 0x80) ? 0 : kShapeEntryBytes;
          } else if (IsMessage(kind, field)) {
            cost_ += kMessageBytes;
            const Kind child = Child(kind, field);
            if (child != Kind::kLeaf && !Message(sub, child)) return false;
          }
          break;
        }
        default:
          return false;  // groups are not in this schema
      }
    }
    return true;
  }

  uint64_t cost_ = 0;
};

// What decoding one request may still allocate: every array is charged here
// before it is built, so a request's arrays never exceed the cap.
class DenseBudget {
 public:
  DenseBudget(size_t body_bytes, const ForwardBackwardDecodeOptions& opt) {
    size_t scaled = 0;
    if (__builtin_mul_overflow(body_bytes, opt.dense_bytes_per_body_byte, &scaled) ||
        __builtin_add_overflow(scaled, opt.dense_bytes_slack, &limit_))
      limit_ = SIZE_MAX;
    const size_t slack = opt.dense_bytes_slack;
    what_ = std::to_string(opt.dense_bytes_per_body_byte) + " x the body + " +
            (slack % (size_t{1} << 20) == 0 ? std::to_string(slack >> 20) + " MiB" : std::to_string(slack) + " bytes");
  }

  // Takes numel elements of esize bytes, or says why not; `what` names them
  // ("data[0].loss_fn_inputs[weights]: sparse shape [3,4]").
  Status Take(int64_t numel, size_t esize, const std::string& what) {
    size_t bytes = 0;
    const bool overflow = __builtin_mul_overflow(static_cast<size_t>(numel), esize, &bytes);
    if (overflow || bytes > limit_ - used_)
      return Status::Invalid(what + " needs " + (overflow ? std::string("more than 2^64") : std::to_string(bytes)) +
                             " dense bytes, which takes the request over its limit of " + LimitText());
    used_ += bytes;
    return Status::Ok();
  }

  size_t limit() const { return limit_; }
  std::string LimitText() const { return std::to_string(limit_) + " decoded bytes (" + what_ + ")"; }

 private:
  size_t limit_ = 0;
  size_t used_ = 0;
  std::string what_;
};

Status CheckLeadingDim(const std::vector<int64_t>& shape, int64_t tokens, const std::string& where) {
  if (shape.empty() || shape[0] != tokens)
    return Status::Invalid(where + ": leading dimension " + (shape.empty() ? std::string("(none)") : std::to_string(shape[0])) +
                           " of shape " + ShapeText(shape) + " does not match the datum's " + std::to_string(tokens) +
                           " input tokens");
  return Status::Ok();
}

// Float loss inputs reach the loss and its gradient: a NaN or inf there
// poisons the slot's weights, so it is refused here.
Status CheckFinite(const std::vector<float>& v, const std::string& where) {
  for (size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      return Status::Invalid(where + ": value at flat index " + std::to_string(i) + " is not finite (" +
                             (std::isnan(v[i]) ? "nan" : v[i] > 0 ? "inf" : "-inf") + ")");
  return Status::Ok();
}

// Decodes one loss input of a datum with `tokens` input tokens. Every shape
// check runs before the dense form is allocated, and the allocation is taken
// from the request's budget first.
Status DecodeTensor(const pb::Tensor& t, const std::string& where, int64_t tokens, DenseBudget* budget,
                    tinker::Array* out) {
  const int dtype = t.dtype();
  const size_t esize = DTypeSize(dtype);
  if (esize == 0) return Status::Invalid(where + ": unsupported dtype " + std::to_string(dtype));
  out->dtype = IsFloatDType(dtype) ? tinker::Array::DType::kFloat32 : tinker::Array::DType::kInt64;
  const size_t out_esize = out->dtype == tinker::Array::DType::kFloat32 ? sizeof(float) : sizeof(int64_t);
  out->shape.assign(t.shape().begin(), t.shape().end());
  out->f32.clear();
  out->i64.clear();

  if (t.encoding_case() == pb::Tensor::kSparseCsr) {
    const pb::SparseCsr& csr = t.sparse_csr();
    if (out->shape.size() != 2)
      return Status::Invalid(where + ": sparse_csr needs a 2-D shape, got " + ShapeText(out->shape));
    int64_t numel = 0;
    LOOM_WIRE_TRY(Numel(out->shape, where, &numel));
    LOOM_WIRE_TRY(CheckLeadingDim(out->shape, tokens, where));
    LOOM_WIRE_TRY(budget->Take(numel, out_esize, where + ": sparse shape " + ShapeText(out->shape)));
    const int64_t rows = out->shape[0], cols = out->shape[1];  // rows = tokens: (rows + 1) x 8 cannot overflow
    const std::string& crow = csr.crow_indices();
    const std::string& col = csr.col_indices();
    const std::string& vals = csr.values();
    if (crow.size() != static_cast<size_t>(rows + 1) * 8)
      return Status::Invalid(where + ": sparse_csr crow_indices has " + std::to_string(crow.size()) +
                             " bytes, expected (rows+1) x 8 = " + std::to_string((rows + 1) * 8));
    if (col.size() % 8 != 0)
      return Status::Invalid(where + ": sparse_csr col_indices byte length " + std::to_string(col.size()) +
                             " is not a multiple of 8");
    const int64_t nnz = static_cast<int64_t>(col.size() / 8);
    if (vals.size() != static_cast<size_t>(nnz) * esize)
      return Status::Invalid(where + ": sparse_csr values has " + std::to_string(vals.size()) + " bytes, expected nnz " +
                             std::to_string(nnz) + " x " + std::to_string(esize) + " bytes (" + DTypeName(dtype) + ")");
    if (Load<int64_t>(crow.data()) != 0) return Status::Invalid(where + ": sparse_csr crow_indices must start at 0");
    if (Load<int64_t>(crow.data() + 8 * rows) != nnz)
      return Status::Invalid(where + ": sparse_csr crow_indices must end at nnz = " + std::to_string(nnz));
    // Check every row's columns (range, no column twice) with scratch of at
    // most nnz entries, before the dense form exists.
    std::vector<int64_t> row_cols;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t b = Load<int64_t>(crow.data() + 8 * r), e = Load<int64_t>(crow.data() + 8 * (r + 1));
      if (b > e || e > nnz)
        return Status::Invalid(where + ": sparse_csr crow_indices is not non-decreasing at row " + std::to_string(r));
      row_cols.clear();
      for (int64_t k = b; k < e; ++k) {
        int64_t c = Load<int64_t>(col.data() + 8 * k);
        if (c < 0 || c >= cols)
          return Status::Invalid(where + ": sparse_csr col_indices[" + std::to_string(k) + "] = " + std::to_string(c) +
                                 " is outside [0, " + std::to_string(cols) + ")");
        row_cols.push_back(c);
      }
      std::sort(row_cols.begin(), row_cols.end());
      if (auto dup = std::adjacent_find(row_cols.begin(), row_cols.end()); dup != row_cols.end())
        return Status::Invalid(where + ": sparse_csr has column " + std::to_string(*dup) + " twice in row " +
                               std::to_string(r));
    }
    // Decode the nnz values once, then scatter them row by row.
    tinker::Array values;
    AppendValues(vals.data(), static_cast<size_t>(nnz), dtype, &values);
    if (out->dtype == tinker::Array::DType::kFloat32) out->f32.assign(numel, 0.0f);
    else out->i64.assign(numel, 0);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t b = Load<int64_t>(crow.data() + 8 * r), e = Load<int64_t>(crow.data() + 8 * (r + 1));
      for (int64_t k = b; k < e; ++k) {
        const size_t at = static_cast<size_t>(r * cols + Load<int64_t>(col.data() + 8 * k));
        if (out->dtype == tinker::Array::DType::kFloat32) out->f32[at] = values.f32[k];
        else out->i64[at] = values.i64[k];
      }
    }
    return out->dtype == tinker::Array::DType::kFloat32 ? CheckFinite(out->f32, where) : Status::Ok();
  }

  const std::string& dense = t.dense();
  if (out->shape.empty()) {  // shape is optional in TensorData: a flat vector
    if (dense.size() % esize != 0)
      return Status::Invalid(where + ": dense byte length " + std::to_string(dense.size()) + " is not a multiple of " +
                             std::to_string(esize) + " bytes (" + DTypeName(dtype) + ")");
    out->shape = {static_cast<int64_t>(dense.size() / esize)};
  }
  if (out->shape.size() > 2)
    return Status::Invalid(where + ": shape " + ShapeText(out->shape) + " has " + std::to_string(out->shape.size()) +
                           " dimensions; loss inputs are (N,) or (N, K)");
  int64_t numel = 0;
  LOOM_WIRE_TRY(Numel(out->shape, where, &numel));
  if (static_cast<uint64_t>(numel) > dense.size() / esize || dense.size() != static_cast<size_t>(numel) * esize)
    return Status::Invalid(where + ": dense byte length " + std::to_string(dense.size()) + " does not match shape " +
                           ShapeText(out->shape) + " x " + std::to_string(esize) + " bytes (" + DTypeName(dtype) + ")");
  LOOM_WIRE_TRY(CheckLeadingDim(out->shape, tokens, where));
  LOOM_WIRE_TRY(budget->Take(numel, out_esize, where + ": shape " + ShapeText(out->shape)));
  if (out->dtype == tinker::Array::DType::kFloat32) out->f32.reserve(numel);
  else out->i64.reserve(numel);
  AppendValues(dense.data(), static_cast<size_t>(numel), dtype, out);
  return out->dtype == tinker::Array::DType::kFloat32 ? CheckFinite(out->f32, where) : Status::Ok();
}

Status DecodeDatum(const pb::Datum& d, const std::string& where, DenseBudget* budget, tinker::Datum* out) {
  for (int i = 0; i < d.model_input_size(); ++i) {
    const pb::Chunk& c = d.model_input(i);
    const std::string cw = where + ".model_input chunk " + std::to_string(i);
    switch (c.chunk_case()) {
      case pb::Chunk::kEncodedText: {
        const std::string& b = c.encoded_text().tokens();
        if (b.size() % 4 != 0)
          return Status::Invalid(cw + ": encoded_text tokens byte length " + std::to_string(b.size()) +
                                 " is not a multiple of 4 (int32)");
        size_t n = b.size() / 4, old = out->tokens.size();
        LOOM_WIRE_TRY(budget->Take(static_cast<int64_t>(n), sizeof(int32_t), cw + ": " + std::to_string(n) + " tokens"));
        out->tokens.resize(old + n);
        if (n) std::memcpy(out->tokens.data() + old, b.data(), b.size());
        break;
      }
      case pb::Chunk::kImage:
        return Status::Invalid(cw + ": image chunks are not supported by this text-only model");
      case pb::Chunk::kDmel:
        return Status::Invalid(cw + ": dmel (audio) chunks are not supported by this text-only model");
      default:
        return Status::Invalid(cw + ": empty chunk (no encoded_text)");
    }
  }
  const int64_t tokens = static_cast<int64_t>(out->tokens.size());
  for (const auto& [name, tensor] : d.loss_fn_inputs()) {
    tinker::Array a;
    LOOM_WIRE_TRY(DecodeTensor(tensor, where + ".loss_fn_inputs[" + Shown(name) + "]", tokens, budget, &a));
    out->loss_fn_inputs.emplace(name, std::move(a));
  }
  return Status::Ok();
}

Status CheckArray(const tinker::Array& a, const std::string& where) {
  int64_t numel = 0;
  LOOM_WIRE_TRY(Numel(a.shape, where, &numel));
  size_t have = a.dtype == tinker::Array::DType::kFloat32 ? a.f32.size() : a.i64.size();
  if (have != static_cast<size_t>(numel))
    return Status::Internal(where + ": array holds " + std::to_string(have) + " values but its shape " +
                            ShapeText(a.shape) + " needs " + std::to_string(numel));
  return Status::Ok();
}

// What must agree between datums that share one ArrayRecord.
struct FieldSignature {
  std::string name;
  tinker::Array::DType dtype;
  std::vector<int64_t> trailing;
  bool operator==(const FieldSignature&) const = default;
};

std::vector<FieldSignature> SignatureOf(const std::map<std::string, tinker::Array>& outputs) {
  std::vector<FieldSignature> sig;
  for (const auto& [name, a] : outputs) {
    std::vector<int64_t> trailing;
    if (a.shape.size() > 1) trailing.assign(a.shape.begin() + 1, a.shape.end());
    sig.push_back({name, a.dtype, std::move(trailing)});
  }
  return sig;
}

void AppendArrayBytes(const tinker::Array& a, std::string* data) {
  if (a.dtype == tinker::Array::DType::kFloat32)
    data->append(reinterpret_cast<const char*>(a.f32.data()), a.f32.size() * sizeof(float));
  else
    data->append(reinterpret_cast<const char*>(a.i64.data()), a.i64.size() * sizeof(int64_t));
}

template <typename T>
void AppendPod(T v, std::string* s) {
  s->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

}  // namespace

bool IsValidMetricKey(std::string_view key) {
  size_t colons = 0;
  for (char c : key) colons += c == ':';
  return colons == 1;
}

Result<tinker::ForwardBackwardRequest> DecodeForwardBackwardRequest(std::string_view body,
                                                            const ForwardBackwardDecodeOptions& options) {
  std::string decoded;
  std::string_view bytes = body;
  if (options.zstd) {
    auto r = ZstdDecompress(body, options.max_decoded_bytes);
    if (!r.ok()) return r.status();
    decoded = std::move(r.value());
    bytes = decoded;
  } else if (body.size() > options.max_decoded_bytes) {
    return Status(Code::kPayloadTooLarge, "forward_backward: body of " + std::to_string(body.size()) +
                                              " bytes exceeds the limit of " +
                                              std::to_string(options.max_decoded_bytes) + " bytes");
  }
  if (bytes.size() > static_cast<size_t>(INT_MAX))
    return Status(Code::kPayloadTooLarge, "forward_backward: protobuf bodies are limited to 2 GiB");

  // Parsing itself amplifies (2 bytes of empty Datum become hundreds): bound
  // it with the same formula as the decoded arrays, before parsing.
  ParseCostScan scan;
  if (!scan.Scan(bytes)) return Status::Invalid("forward_backward: body is not a valid protobuf ForwardBackwardRequest");
  if (const DenseBudget parse_budget(bytes.size(), options); scan.cost() > parse_budget.limit())
    return Status::Invalid("forward_backward: the body's protobuf messages and fields need about " +
                           std::to_string(scan.cost()) + " bytes once parsed, over the request's limit of " +
                           parse_budget.LimitText());
  pb::ForwardBackwardRequest msg;
  if (!msg.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())))
    return Status::Invalid("forward_backward: body is not a valid protobuf ForwardBackwardRequest");

  tinker::ForwardBackwardRequest req;
  req.model_id = msg.model_id();
  req.seq_id = msg.seq_id();
  req.call.loss_fn = msg.loss_fn();
  req.call.forward_only = msg.forward_only();
  for (const auto& [k, v] : msg.loss_fn_config()) {
    // Clip thresholds and beta enter every token's loss: non-finite is poison.
    if (!std::isfinite(v))
      return Status::Invalid("loss_fn_config." + Shown(k) + ": must be finite, got " + fmt::format("{}", v));
    req.call.loss_fn_config[k] = v;
  }
  DenseBudget budget(bytes.size(), options);
  req.call.data.resize(msg.data_size());
  for (int i = 0; i < msg.data_size(); ++i) {
    LOOM_WIRE_TRY(DecodeDatum(msg.data(i), "data[" + std::to_string(i) + "]", &budget, &req.call.data[i]));
  }
  return req;
}

Result<std::string> EncodeForwardBackwardOutput(const tinker::ForwardBackwardOutput& output) {
  pb::ForwardBackwardOutput msg;
  msg.set_loss_fn_output_type("ArrayRecord");
  for (const auto& [key, value] : output.metrics) {
    if (!IsValidMetricKey(key))
      return Status::Internal("metric key '" + key + "' must contain exactly one ':' (name:reduction)");
    (*msg.mutable_metrics())[key] = value;
  }
  const auto& outs = output.outputs;
  for (size_t d = 0; d < outs.size(); ++d)
    for (const auto& [name, a] : outs[d]) LOOM_WIRE_TRY(CheckArray(a, "outputs[" + std::to_string(d) + "][" + name + "]"));

  size_t begin = 0;
  while (begin < outs.size()) {
    const auto sig = SignatureOf(outs[begin]);
    size_t end = begin + 1;
    while (end < outs.size() && SignatureOf(outs[end]) == sig) ++end;

    pb::ArrayRecord* rec = msg.add_loss_fn_outputs();
    rec->set_num_datums(static_cast<int64_t>(end - begin));
    for (const FieldSignature& f : sig) {
      pb::BatchedTensor& bt = (*rec->mutable_fields())[f.name];
      bt.set_dtype(f.dtype == tinker::Array::DType::kFloat32 ? pb::DTYPE_FLOAT32 : pb::DTYPE_INT64);
      for (int64_t t : f.trailing) bt.add_trailing_shape(t);
      std::string data, offsets;
      AppendPod<int64_t>(0, &offsets);
      for (size_t d = begin; d < end; ++d) {
        AppendArrayBytes(outs[d].at(f.name), &data);
        AppendPod<int64_t>(static_cast<int64_t>(data.size()), &offsets);
      }
      bt.set_data(std::move(data));
      bt.set_offsets(std::move(offsets));
    }
    begin = end;
  }
  return SerializeDeterministic(msg);
}

std::string EncodeForwardBackwardRequest(const tinker::ForwardBackwardRequest& request) {
  pb::ForwardBackwardRequest msg;
  msg.set_model_id(request.model_id);
  msg.set_seq_id(request.seq_id);
  msg.set_loss_fn(request.call.loss_fn);
  msg.set_forward_only(request.call.forward_only);
  for (const auto& [k, v] : request.call.loss_fn_config) (*msg.mutable_loss_fn_config())[k] = v;
  for (const tinker::Datum& d : request.call.data) {
    pb::Datum* pd = msg.add_data();
    std::string tokens(reinterpret_cast<const char*>(d.tokens.data()), d.tokens.size() * sizeof(int32_t));
    pd->add_model_input()->mutable_encoded_text()->set_tokens(std::move(tokens));
    for (const auto& [name, a] : d.loss_fn_inputs) {
      pb::Tensor& t = (*pd->mutable_loss_fn_inputs())[name];
      t.set_dtype(a.dtype == tinker::Array::DType::kFloat32 ? pb::DTYPE_FLOAT32 : pb::DTYPE_INT64);
      for (int64_t s : a.shape) t.add_shape(s);
      std::string bytes;
      AppendArrayBytes(a, &bytes);
      t.set_dense(std::move(bytes));
    }
  }
  return SerializeDeterministic(msg);
}

Result<tinker::ForwardBackwardOutput> DecodeForwardBackwardOutput(std::string_view bytes) {
  pb::ForwardBackwardOutput msg;
  if (bytes.size() > static_cast<size_t>(INT_MAX) ||
      !msg.ParseFromArray(bytes.data(), static_cast<int>(bytes.size())))
    return Status::Invalid("ForwardBackwardOutput: not a valid protobuf message");
  tinker::ForwardBackwardOutput out;
  for (const auto& [k, v] : msg.metrics()) out.metrics[k] = v;
  for (int r = 0; r < msg.loss_fn_outputs_size(); ++r) {
    const pb::ArrayRecord& rec = msg.loss_fn_outputs(r);
    const std::string rw = "loss_fn_outputs[" + std::to_string(r) + "]";
    int64_t n = rec.num_datums();
    if (n == 0 && !rec.fields().empty()) n = static_cast<int64_t>(rec.fields().begin()->second.offsets().size() / 8) - 1;
    if (n < 0) return Status::Invalid(rw + ": negative num_datums");
    const size_t first = out.outputs.size();
    out.outputs.resize(first + static_cast<size_t>(n));
    for (const auto& [name, bt] : rec.fields()) {
      const std::string fw = rw + ".fields[" + name + "]";
      const size_t esize = DTypeSize(bt.dtype());
      if (esize == 0) return Status::Invalid(fw + ": unsupported dtype");
      if (bt.offsets().size() != static_cast<size_t>(n + 1) * 8)
        return Status::Invalid(fw + ": offsets must hold num_datums + 1 int64 values");
      int64_t inner = 1;
      for (int64_t t : bt.trailing_shape()) inner *= t;
      if (inner <= 0) return Status::Invalid(fw + ": bad trailing_shape");
      for (int64_t d = 0; d < n; ++d) {
        int64_t b = Load<int64_t>(bt.offsets().data() + 8 * d), e = Load<int64_t>(bt.offsets().data() + 8 * (d + 1));
        if (d == 0 && b != 0) return Status::Invalid(fw + ": offsets must start at 0");
        if (b > e || e > static_cast<int64_t>(bt.data().size()) || (e - b) % static_cast<int64_t>(esize) != 0)
          return Status::Invalid(fw + ": bad byte offsets for datum " + std::to_string(d));
        int64_t elems = (e - b) / static_cast<int64_t>(esize);
        if (elems % inner != 0) return Status::Invalid(fw + ": datum size is not a multiple of trailing_shape");
        tinker::Array a;
        a.dtype = IsFloatDType(bt.dtype()) ? tinker::Array::DType::kFloat32 : tinker::Array::DType::kInt64;
        a.shape = {elems / inner};
        a.shape.insert(a.shape.end(), bt.trailing_shape().begin(), bt.trailing_shape().end());
        AppendValues(bt.data().data() + b, static_cast<size_t>(elems), bt.dtype(), &a);
        out.outputs[first + d][name] = std::move(a);
      }
      if (n > 0 && Load<int64_t>(bt.offsets().data() + 8 * n) != static_cast<int64_t>(bt.data().size()))
        return Status::Invalid(fw + ": last offset must equal the data length");
    }
  }
  return out;
}

}  // namespace loom::wire
