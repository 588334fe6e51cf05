// Argument checks of diff_update, shared by the CPU and CUDA kernels: every error
// names the op and the argument.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

namespace shardgather {

inline void check_diff_args(const at::Tensor& src, const at::Tensor& ref,
                            const at::Tensor& positions, const at::Tensor& values,
                            const at::Tensor& count, int64_t base, bool cuda) {
  TORCH_CHECK(count.scalar_type() == at::kLong && count.numel() == 1 && count.device().is_cpu(),
              "diff_update: count must be one int64 on the CPU");
  TORCH_CHECK(src.dim() == 1 && ref.dim() == 1 && positions.dim() == 1 && values.dim() == 1,
              "diff_update: src, ref, positions and values must be 1-D");
  TORCH_CHECK(src.is_contiguous() && ref.is_contiguous() && positions.is_contiguous() &&
                  values.is_contiguous(),
              "diff_update: every tensor must be contiguous");
  TORCH_CHECK(src.numel() == ref.numel(), "diff_update: src has ", src.numel(), " elements, ref ",
              ref.numel());
  TORCH_CHECK(positions.numel() == values.numel(), "diff_update: positions hold ",
              positions.numel(), " entries, values ", values.numel());
  TORCH_CHECK(positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong,
              "diff_update: positions must be int32 or int64");
  TORCH_CHECK(values.scalar_type() == ref.scalar_type(),
              "diff_update: values must have ref's dtype (", ref.scalar_type(), "), got ",
              values.scalar_type());
  TORCH_CHECK(base >= 0, "diff_update: base must be >= 0");
  TORCH_CHECK(positions.scalar_type() == at::kLong || base + src.numel() <= INT32_MAX,
              "diff_update: positions up to ", base + src.numel(), " need int64");
  for (const at::Tensor* t : {&src, &ref, &positions, &values}) {
    TORCH_CHECK(t->device() == src.device(), "diff_update: every tensor must be on ", src.device(),
                " (got one on ", t->device(), ")");
  }
  TORCH_CHECK(src.is_cuda() == cuda, "diff_update: wrong backend");
}

}  // namespace shardgather
