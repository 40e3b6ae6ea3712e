// The input check shared by the element-wise row kernels (bias_add.cpp, rms_norm.cpp, swiglu.cpp): one error
// naming the op and the argument, never a crash.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace moezero {

// `t` must be a contiguous 2-D float32 / bfloat16 CPU tensor.
inline void check_rows(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), op, ": the CPU kernel got ", name, " on ", t.device());
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              op, ": ", name, " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), op, ": ", name, " must be a contiguous 2-D tensor");
}

}  // namespace moezero
