// CPU kernels: one at::parallel_for over the runs of a call (never per segment).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/TypeCast.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "../segments.h"
#include "shardgather/layout.h"

namespace shardgather {
namespace {

template <typename Dst, typename Src>
void cast_run(const char* src, char* dst, int64_t n) {
  const Src* s = reinterpret_cast<const Src*>(src);
  Dst* d = reinterpret_cast<Dst*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    d[i] = c10::static_cast_with_inter_type<Dst, Src>::apply(s[i]);
  }
}

// Calls f.template operator()<T>() with T the C++ type of a float kind.
template <typename F>
void float_kind_switch(int64_t kind, F&& f) {
  switch (kind) {
    case kF16: f(c10::Half{}); break;
    case kBF16: f(c10::BFloat16{}); break;
    case kF32: f(float{}); break;
    case kF64: f(double{}); break;
    default: TORCH_INTERNAL_ASSERT(false, "not a float kind: ", kind);
  }
}

void copy_elems(const char* src, int64_t src_kind, char* dst, int64_t dst_kind, int64_t n) {
  if (src_kind == dst_kind) {
    std::memcpy(dst, src, static_cast<size_t>(n * elem_size(src_kind)));
    return;
  }
  float_kind_switch(src_kind, [&](auto s) {
    float_kind_switch(dst_kind, [&](auto d) { cast_run<decltype(d), decltype(s)>(src, dst, n); });
  });
}

bool cpu_full_ok(const at::Tensor& full, const at::Tensor& /*shards*/) {
  return full.device().is_cpu();
}

// kOut: shards -> fulls (copy_out); otherwise fulls -> shards (copy_in).
template <bool kOut>
void copy_cpu(const char* op, const at::Tensor& shards, int64_t first_row,
              const at::Tensor& segments, at::TensorList fulls) {
  const at::Tensor runs = validate_and_split(op, shards, first_row, segments, fulls, cpu_full_ok);
  const int64_t num_runs = runs.size(0);
  if (num_runs == 0) {
    return;
  }
  std::vector<char*> full_ptrs(fulls.size());
  for (size_t i = 0; i < fulls.size(); ++i) {
    full_ptrs[i] = static_cast<char*>(fulls[i].data_ptr());
  }
  char* shard_ptr = static_cast<char*>(shards.data_ptr());
  const int64_t row_bytes = shards.size(1);
  const int64_t* seg_table = segments.data_ptr<int64_t>();
  const int64_t* run_table = runs.data_ptr<int64_t>();

  at::parallel_for(0, num_runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t* run = run_table + 3 * r;
      const int64_t* seg = seg_table + kSegmentCols * run[0];
      const int64_t e = run[1], n = run[2];
      const int64_t shard_kind = seg[kShardKind], full_kind = seg[kFullKind];
      char* shard = shard_ptr + shard_byte(seg[kBase], seg[kRowNumel], seg[kColByte],
                                           elem_size(shard_kind), row_bytes, first_row, e);
      char* full = full_ptrs[seg[kFullIndex]] + seg[kFullByte] + e * elem_size(full_kind);
      if (kOut) {
        copy_elems(shard, shard_kind, full, full_kind, n);
      } else {
        copy_elems(full, full_kind, shard, shard_kind, n);
      }
    }
  });
}

void copy_out_cpu(const at::Tensor& shards, int64_t first_row, const at::Tensor& segments,
                  at::TensorList fulls) {
  copy_cpu<true>("copy_out", shards, first_row, segments, fulls);
}

void copy_in_cpu(at::TensorList fulls, const at::Tensor& segments, const at::Tensor& shards,
                 int64_t first_row) {
  copy_cpu<false>("copy_in", shards, first_row, segments, fulls);
}

}  // namespace

TORCH_LIBRARY_IMPL(shardgather, CPU, m) {
  m.impl("copy_out", &copy_out_cpu);
  m.impl("copy_in", &copy_in_cpu);
}

}  // namespace shardgather
