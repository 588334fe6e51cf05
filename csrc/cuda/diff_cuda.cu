// diff_update on CUDA (see ops.cpp), composed of ATen's device kernels (cast, compare,
// nonzero, index): the compaction nonzero does is what a hand-written kernel would need
// too, and the GPU is not where a weight sync's time goes.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "../diff.h"

namespace shardgather {
namespace {

void diff_update_cuda(const at::Tensor& src, const at::Tensor& ref, const at::Tensor& positions,
                      const at::Tensor& values, const at::Tensor& count, int64_t base) {
  // count lives on the CPU; the other tensors on the device (checked).
  check_diff_args(src, ref, positions, values, count, base, /*cuda=*/true);
  TORCH_CHECK(ref.scalar_type() == at::kFloat || ref.scalar_type() == at::kBFloat16 ||
                  ref.scalar_type() == at::kHalf,
              "diff_update: ref must be float32, bfloat16 or float16");
  const c10::cuda::CUDAGuard guard(src.device());
  const at::ScalarType bits = ref.element_size() == 4 ? at::kInt : at::kShort;
  const at::Tensor cur = src.to(ref.scalar_type());
  const at::Tensor idx = cur.view(bits).ne(ref.view(bits)).nonzero().view(-1);
  const int64_t k = idx.numel();
  at::Tensor r = ref;
  r.index_put_({idx}, cur.index({idx}));
  const int64_t m = std::min<int64_t>(k, positions.numel());
  if (m > 0) {
    const at::Tensor kept = idx.narrow(0, 0, m);
    at::Tensor p = positions, v = values;
    p.narrow(0, 0, m).copy_(kept + base);
    v.narrow(0, 0, m).copy_(cur.index({kept}));
  }
  count.data_ptr<int64_t>()[0] = k;
}

}  // namespace

TORCH_LIBRARY_IMPL(shardgather, CUDA, m) {
  m.impl("diff_update", &diff_update_cuda);
}

}  // namespace shardgather
