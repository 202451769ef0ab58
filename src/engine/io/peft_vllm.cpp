#include "engine/io/peft_vllm.h"

#include <c10/core/GradMode.h>

namespace loom::engine {

Result<PeftAdapter> VllmLayout(const PeftAdapter& adapter, bool drop_lm_head) {
  c10::NoGradGuard no_grad;
  PeftAdapter out;
  out.config = adapter.config;
  for (const PeftAdapter::Factor& f : adapter.factors) {
    if (f.module == "lm_head") {
      if (!drop_lm_head)
        return Status::Invalid(
            "the adapter trains lm_head (train_unembed), which vLLM's LoRA loader does not take for this model "
            "family; export --format merged, or pass --drop-lm-head to leave the head's LoRA out (the exported "
            "adapter then differs from the trained one)");
      out.config.train_unembed = false;
      continue;
    }
    const bool gate_up = f.B.dim() == 3, down = f.A.dim() == 3;
    if (!gate_up && !down) {
      out.factors.push_back({f.module, f.A.clone(), f.B.clone()});
      continue;
    }
    if (f.hf_interleaved)
      return Status::Invalid("adapter module '" + f.module +
                             "': no vLLM layout is written for gpt_oss's interleaved experts; export --format merged");
    const std::string prefix = f.module.substr(0, f.module.rfind('.')) + ".";  // "model.layers.0.mlp.experts."
    const int64_t E = gate_up ? f.B.size(0) : f.A.size(0);
    for (int64_t e = 0; e < E; ++e) {
      const std::string expert = prefix + std::to_string(e) + ".";
      if (down) {
        out.factors.push_back({expert + "down_proj", f.A[e].clone(), f.B.clone()});
        continue;
      }
      const int64_t I = f.B.size(1) / 2;  // expert e's B: rows gate then up
      out.factors.push_back({expert + "gate_proj", f.A.clone(), f.B[e].narrow(0, 0, I).clone()});
      out.factors.push_back({expert + "up_proj", f.A.clone(), f.B[e].narrow(0, I, I).clone()});
    }
  }
  return out;
}

}  // namespace loom::engine
