#include "engine/model/gpt_oss.h"

#include <vector>

namespace loom::engine {

at::Tensor GateUpFromInterleaved(const at::Tensor& w) {
  const at::Tensor rows = w.transpose(1, 2);  // [E, 2I, H], rows interleaved
  return at::cat({rows.slice(1, 0, rows.size(1), 2), rows.slice(1, 1, rows.size(1), 2)}, 1).contiguous();
}

at::Tensor GateUpBiasFromInterleaved(const at::Tensor& b) {
  const int64_t n = b.size(-1);
  return at::cat({b.slice(-1, 0, n, 2), b.slice(-1, 1, n, 2)}, -1).contiguous();
}

at::Tensor InterleaveGateUp(const at::Tensor& halves, int64_t dim) {
  const int64_t inter = halves.size(dim) / 2;
  // [.., I, 2, ..] with gate at 0 and up at 1, then merged: gate j lands at 2j.
  return at::stack({halves.narrow(dim, 0, inter), halves.narrow(dim, inter, inter)}, dim + 1)
      .flatten(dim, dim + 1)
      .contiguous();
}

GptOssLayerWeights LoadGptOssLayer(const ModelConfig& c, int64_t layer, const WeightGetter& get) {
  const std::string p = "model.layers." + std::to_string(layer) + ".";
  GptOssLayerWeights w;
  w.attn.sinks = get(p + "self_attn.sinks");
  w.attn.window = c.IsSlidingLayer(layer) ? c.sliding_window : 0;
  MoeWeights& m = w.moe;
  m.router = get(p + "mlp.router.weight");
  m.router_bias = get(p + "mlp.router.bias");
  m.gate_up = GateUpFromInterleaved(get(p + "mlp.experts.gate_up_proj"));
  m.gate_up_bias = GateUpBiasFromInterleaved(get(p + "mlp.experts.gate_up_proj_bias"));
  m.down = get(p + "mlp.experts.down_proj").transpose(1, 2).contiguous();  // [E, I, H] -> [E, H, I]
  m.down_bias = get(p + "mlp.experts.down_proj_bias");
  m.top_k = c.num_experts_per_tok;
  m.router_kind = MoeRouter::kTopKSoftmax;
  m.activation = MoeActivation::kClampedSwiGlu;
  return w;
}

at::Tensor DequantizeMxfp4(const at::Tensor& blocks, const at::Tensor& scales, at::ScalarType dtype) {
  // E2M1 by code: bit 3 the sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
  static const float kFp4[16] = {0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6};
  const at::Tensor lut = at::from_blob(const_cast<float*>(kFp4), {16}, at::kFloat).to(blocks.device());
  const at::Tensor b = blocks.to(at::kLong);
  const at::Tensor lo = lut.index_select(0, at::bitwise_and(b, 0x0F).reshape(-1)).view(b.sizes());
  const at::Tensor hi = lut.index_select(0, at::bitwise_right_shift(b, 4).reshape(-1)).view(b.sizes());
  std::vector<int64_t> shape = blocks.sizes().vec();  // [.., R, G, 16]
  shape.back() = 32;
  const at::Tensor values = at::stack({lo, hi}, -1).view(shape);  // low nibble first: element 2b, then 2b + 1
  // 2^(s - 127) built from its fp32 bits (exact; s = 0 is the subnormal
  // 2^-127, s = 255 overflows to inf as HF's ldexp does).
  const at::Tensor s = scales.to(at::kInt);
  const at::Tensor bits = at::where(s == 0, at::full_like(s, 0x00400000), at::bitwise_left_shift(s, 23));
  const at::Tensor out = values * bits.view(at::kFloat).unsqueeze(-1);  // exact in fp32
  shape.pop_back();
  shape.back() *= 32;  // [.., R, G * 32]
  return out.reshape(shape).to(dtype);
}

}  // namespace loom::engine
