// The weight-sync delta on the CPU: the cast (ATen's), then one pass that compares
// bitwise with what was last sent, updates it and records what changed.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#include "../diff.h"

namespace shardgather {
namespace {

template <typename R>
struct BitsOf;
template <>
struct BitsOf<float> {
  using type = uint32_t;
};
template <>
struct BitsOf<c10::BFloat16> {
  using type = uint16_t;
};
template <>
struct BitsOf<c10::Half> {
  using type = uint16_t;
};

// `cur` is src already cast (by ATen's own copy kernel, so the bits are Tensor.to's —
// its vectorised NaN conversion differs from c10's scalar one).
template <typename R, typename I>
int64_t diff_loop(const R* cur, R* ref, int64_t n, I* pos, R* val, int64_t cap, int64_t base) {
  using Bits = typename BitsOf<R>::type;
  int64_t k = 0;
  for (int64_t i = 0; i < n; ++i) {
    const R v = cur[i];
    Bits a, b;
    std::memcpy(&a, &v, sizeof(Bits));
    std::memcpy(&b, ref + i, sizeof(Bits));
    if (a != b) {
      ref[i] = v;
      if (k < cap) {
        pos[k] = static_cast<I>(base + i);
        val[k] = v;
      }
      ++k;
    }
  }
  return k;
}

template <typename R>
int64_t with_index(const at::Tensor& cur, at::Tensor& ref, at::Tensor& positions,
                   at::Tensor& values, int64_t base) {
  const int64_t cap = positions.numel();
  if (positions.scalar_type() == at::kInt) {
    return diff_loop(cur.const_data_ptr<R>(), ref.data_ptr<R>(), cur.numel(),
                     positions.data_ptr<int32_t>(), values.data_ptr<R>(), cap, base);
  }
  return diff_loop(cur.const_data_ptr<R>(), ref.data_ptr<R>(), cur.numel(),
                   positions.data_ptr<int64_t>(), values.data_ptr<R>(), cap, base);
}

int64_t diff_cpu(const at::Tensor& src, const at::Tensor& ref, const at::Tensor& positions,
                 const at::Tensor& values, int64_t base) {
  TORCH_CHECK(src.scalar_type() == at::kFloat || src.scalar_type() == at::kBFloat16 ||
                  src.scalar_type() == at::kHalf,
              "diff_update: src must be float32, bfloat16 or float16");
  const at::Tensor cur = src.scalar_type() == ref.scalar_type() ? src : src.to(ref.scalar_type());
  at::Tensor r = ref, p = positions, v = values;
  switch (ref.scalar_type()) {
    case at::kFloat: return with_index<float>(cur, r, p, v, base);
    case at::kBFloat16: return with_index<c10::BFloat16>(cur, r, p, v, base);
    case at::kHalf: return with_index<c10::Half>(cur, r, p, v, base);
    default: TORCH_CHECK(false, "diff_update: ref must be float32, bfloat16 or float16");
  }
}

void diff_update_cpu(const at::Tensor& src, const at::Tensor& ref, const at::Tensor& positions,
                     const at::Tensor& values, const at::Tensor& count, int64_t base) {
  check_diff_args(src, ref, positions, values, count, base, /*cuda=*/false);
  count.data_ptr<int64_t>()[0] = diff_cpu(src, ref, positions, values, base);
}

}  // namespace

TORCH_LIBRARY_IMPL(shardgather, CPU, m) {
  m.impl("diff_update", &diff_update_cpu);
}

}  // namespace shardgather
