#include "engine/train/shared_prefix.h"

#include <algorithm>
#include <cstring>

namespace loom::engine::train {
namespace {

// Values a row of an array holds (shape[0] rows).
int64_t RowWidth(const Array& a) { return a.shape.empty() || a.shape[0] == 0 ? 0 : a.numel() / a.shape[0]; }

// The leading rows (at most limit) where a and b hold the same values.
int64_t SameRows(const Array& a, const Array& b, int64_t limit) {
  if (a.dtype != b.dtype || a.shape.size() != b.shape.size() ||
      !std::equal(a.shape.begin() + 1, a.shape.end(), b.shape.begin() + 1))
    return 0;
  const int64_t w = RowWidth(a);
  limit = std::min({limit, a.shape.empty() ? 0 : a.shape[0], b.shape.empty() ? 0 : b.shape[0]});
  if (w <= 0) return 0;
  // Rows whose values are there (the memory plan may see a call before its validation).
  auto held = [&](const Array& x) {
    return static_cast<int64_t>(x.dtype == Array::DType::kFloat32 ? x.f32.size() : x.i64.size()) / w;
  };
  limit = std::min({limit, held(a), held(b)});
  for (int64_t r = 0; r < limit; ++r) {
    const bool same = a.dtype == Array::DType::kFloat32
                          ? std::memcmp(a.f32.data() + r * w, b.f32.data() + r * w, sizeof(float) * w) == 0
                          : std::memcmp(a.i64.data() + r * w, b.i64.data() + r * w, sizeof(int64_t) * w) == 0;
    if (!same) return r;
  }
  return limit;
}

// The rows a group of count datums sharing rows saves.
int64_t Saved(size_t count, int64_t rows) { return static_cast<int64_t>(count - 1) * rows; }

}  // namespace

int64_t CommonRows(const Datum& a, const Datum& b, int64_t limit) {
  if (a.loss_fn_inputs.size() != b.loss_fn_inputs.size()) return 0;
  int64_t n = std::min({limit, static_cast<int64_t>(a.tokens.size()), static_cast<int64_t>(b.tokens.size())});
  n = std::mismatch(a.tokens.begin(), a.tokens.begin() + std::max<int64_t>(n, 0), b.tokens.begin()).first -
      a.tokens.begin();
  auto ib = b.loss_fn_inputs.begin();
  for (auto ia = a.loss_fn_inputs.begin(); ia != a.loss_fn_inputs.end() && n > 0; ++ia, ++ib) {
    if (ia->first != ib->first) return 0;
    n = SameRows(ia->second, ib->second, n);
  }
  return std::max<int64_t>(n, 0);
}

std::vector<PrefixGroup> PlanSharedPrefixes(const std::vector<Datum>& data, int64_t min_rows) {
  std::vector<PrefixGroup> groups;
  int64_t total = 0, saved = 0;
  for (size_t i = 0; i < data.size();) {
    PrefixGroup g;
    g.first = i;
    // Each datum keeps a row of its own: the rows it shares stop one short of its end.
    int64_t rows = static_cast<int64_t>(data[i].tokens.size()) - 1;
    size_t j = i + 1;
    for (; min_rows > 0 && j < data.size(); ++j) {
      const int64_t r = CommonRows(data[i], data[j], std::min(rows, static_cast<int64_t>(data[j].tokens.size()) - 1));
      const size_t count = j - i + 1;
      if (r < min_rows || (count > 2 && Saved(count, r) < Saved(count - 1, rows))) break;
      rows = r;
    }
    if (j - i >= 2) {
      g.count = j - i;
      g.rows = rows;
      saved += Saved(g.count, rows);
    }
    for (size_t d = i; d < j; ++d) total += static_cast<int64_t>(data[d].tokens.size());
    groups.push_back(g);
    i = j;
  }
  if (saved > 0 && static_cast<double>(saved) >= kShareMinSaved * static_cast<double>(total)) return groups;
  groups.clear();
  for (size_t i = 0; i < data.size(); ++i) groups.push_back(PrefixGroup{i, 1, 0});
  return groups;
}

int64_t SharedPassRows(const std::vector<ForwardBackwardCall>& calls, int64_t min_rows) {
  int64_t rows = 0;
  for (const ForwardBackwardCall& c : calls) {
    for (const Datum& d : c.data) rows += static_cast<int64_t>(d.tokens.size());
    if (min_rows > 0)
      for (const PrefixGroup& g : PlanSharedPrefixes(c.data, min_rows)) rows -= Saved(g.count, g.rows);
  }
  return rows;
}

Datum SliceDatum(const Datum& d, int64_t begin, int64_t end) {
  Datum s;
  s.tokens.assign(d.tokens.begin() + begin, d.tokens.begin() + end);
  for (const auto& [key, a] : d.loss_fn_inputs) {
    Array& t = s.loss_fn_inputs[key];
    t.dtype = a.dtype;
    t.shape = a.shape;
    if (!t.shape.empty()) t.shape[0] = end - begin;
    const int64_t w = RowWidth(a);
    if (a.dtype == Array::DType::kFloat32)
      t.f32.assign(a.f32.begin() + begin * w, a.f32.begin() + end * w);
    else
      t.i64.assign(a.i64.begin() + begin * w, a.i64.begin() + end * w);
  }
  return s;
}

}  // namespace loom::engine::train
