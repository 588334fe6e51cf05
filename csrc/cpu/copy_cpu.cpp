// CPU kernels: one at::parallel_for over the runs of a call (never per segment).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <vector>

#include "../segments.h"
#include "shardgather/layout.h"

namespace shardgather {
namespace {

at::ScalarType float_kind_dtype(int64_t kind) {
  switch (kind) {
    case kF16: return at::kHalf;
    case kBF16: return at::kBFloat16;
    case kF32: return at::kFloat;
    case kF64: return at::kDouble;
    default: TORCH_INTERNAL_ASSERT(false, "not a float kind: ", kind);
  }
}

void copy_elems(const char* src, int64_t src_kind, char* dst, int64_t dst_kind, int64_t n) {
  if (src_kind == dst_kind) {
    std::memcpy(dst, src, static_cast<size_t>(n * elem_size(src_kind)));
    return;
  }
  // Casts go through ATen's own (vectorised) copy kernel on views of the run, so the
  // bits are exactly Tensor.to's. Inside our parallel_for it runs single-threaded.
  const at::Tensor s = at::from_blob(const_cast<char*>(src), {n},
                                     at::TensorOptions().dtype(float_kind_dtype(src_kind)));
  at::Tensor d = at::from_blob(dst, {n}, at::TensorOptions().dtype(float_kind_dtype(dst_kind)));
  d.copy_(s);
}

bool cpu_full_ok(const at::Tensor& full, const at::Tensor& /*shards*/) {
  return full.device().is_cpu();
}

// kOut: shards -> fulls (copy_out); otherwise fulls -> shards (copy_in).
template <bool kOut>
void copy_cpu(const char* op, const at::Tensor& shards, int64_t first_row,
              const at::Tensor& segments, at::TensorList fulls) {
  const at::Tensor runs = validate_and_split(op, shards, first_row, segments, fulls, cpu_full_ok,
                                             at::get_num_threads());
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
      const Block b = block_of(seg);
      char* shard = shard_ptr + shard_byte(b, seg[kRowNumel], seg[kColByte], elem_size(shard_kind),
                                           row_bytes, first_row, e);
      char* full =
          full_ptrs[seg[kFullIndex]] + seg[kFullByte] + full_elem(b, e) * elem_size(full_kind);
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
