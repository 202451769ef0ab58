// A gpt_oss checkpoint's MXFP4 twin for the tests: the same model directory
// with every expert weight replaced by an FP4 code grid (values +-{0..6} *
// 2^-3, exactly representable) written as `_blocks` and `_scales`, as the
// hub ships GPT-OSS; `plain` receives the same weights unquantized, by name.
// The codes come from a generator of their own, so the twin is the same
// whichever tests ran before in the process (torch's global generator is not).
#pragma once
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <string>

#include "engine/io/safetensors.h"
#include "engine/io/tensor_io.h"
#include "engine/model/families/gpt_oss.h"

namespace loom::engine {

inline void WriteMxfp4Twin(const std::string& dir, const std::string& mx, std::map<std::string, at::Tensor>* plain) {
  std::filesystem::create_directories(mx);
  for (const char* f : {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"})
    if (std::filesystem::exists(std::filesystem::path(dir) / f))
      std::filesystem::copy_file(std::filesystem::path(dir) / f, std::filesystem::path(mx) / f);
  auto files = ModelWeights::Open(dir);
  ASSERT_TRUE(files.ok()) << files.status().message();
  SafetensorsWriter packed;
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(20261205);
  for (const auto& [name, view] : files->tensors()) {
    at::Tensor t = *LoadTensor(view, at::kCPU);
    const bool expert = name.size() > 5 && (name.rfind("_proj") == name.size() - 5);
    if (expert && name.find("experts") != std::string::npos) {
      const at::Tensor rows = t.transpose(1, 2).contiguous();  // [E, out, in]
      const int64_t E = rows.size(0), R = rows.size(1), in = rows.size(2);
      const at::Tensor codes = at::randint(0, 16, {E, R, in / 32, 16, 2}, gen, at::TensorOptions().dtype(at::kLong));
      const at::Tensor bytes = (codes.select(-1, 0) + 16 * codes.select(-1, 1)).to(at::kByte);
      const at::Tensor scales = at::full({E, R, in / 32}, 124, at::TensorOptions().dtype(at::kByte));
      t = DequantizeMxfp4(bytes, scales, at::kFloat).transpose(1, 2).contiguous();
      ASSERT_TRUE(AddTensor(packed, name + "_blocks", bytes).ok());
      ASSERT_TRUE(AddTensor(packed, name + "_scales", scales).ok());
    } else {
      ASSERT_TRUE(AddTensor(packed, name, t).ok());
    }
    if (plain) (*plain)[name] = t;
  }
  ASSERT_TRUE(packed.WriteAtomic((std::filesystem::path(mx) / "model.safetensors").string()).ok());
}

}  // namespace loom::engine
