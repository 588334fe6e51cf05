#include "segments.h"

#include <ATen/ops/empty.h>

#include <algorithm>
#include <vector>

#include "shardgather/checks.h"
#include "shardgather/layout.h"

namespace shardgather {

at::Tensor validate_and_split(const char* op, const at::Tensor& shards, int64_t first_row,
                              const at::Tensor& segments, at::TensorList fulls,
                              bool (*full_device_ok)(const at::Tensor& full,
                                                     const at::Tensor& shards),
                              int64_t threads) {
  SG_CHECK_DTYPE(op, shards, at::kByte);
  SG_CHECK_DIM(op, shards, 2);
  SG_CHECK_CONTIGUOUS(op, shards);
  SG_CHECK_DTYPE(op, segments, at::kLong);
  SG_CHECK_DIM(op, segments, 2);
  SG_CHECK_CONTIGUOUS(op, segments);
  SG_CHECK(op, segments.device().is_cpu(), "argument 'segments' must be on the CPU, got ",
           segments.device());
  SG_CHECK(op, segments.size(1) == kSegmentCols, "argument 'segments' must have ", kSegmentCols,
           " columns, got ", segments.size(1));
  SG_CHECK(op, first_row >= 0, "argument 'first_row' must be >= 0, got ", first_row);

  const int64_t rows = shards.size(0);
  const int64_t row_bytes = shards.size(1);
  const auto shards_addr = reinterpret_cast<uintptr_t>(shards.data_ptr());
  for (size_t i = 0; i < fulls.size(); ++i) {
    const at::Tensor& full = fulls[i];
    SG_CHECK(op, full.is_contiguous(), "argument 'fulls[", i, "]' must be contiguous");
    SG_CHECK(op, full_device_ok(full, shards), "argument 'fulls[", i, "]' is on ", full.device(),
             " but 'shards' is on ", shards.device(),
             " (CUDA shards accept CUDA or pinned CPU full tensors)");
  }

  const int64_t num_segments = segments.size(0);
  const int64_t* seg = segments.data_ptr<int64_t>();
  struct Range {
    int64_t segment, lo, hi;
  };
  std::vector<Range> ranges;
  int64_t total_bytes = 0;
  for (int64_t s = 0; s < num_segments; ++s, seg += kSegmentCols) {
    const int64_t base = seg[kBase], row_numel = seg[kRowNumel], col_byte = seg[kColByte],
                  numel = seg[kNumel], full_index = seg[kFullIndex], full_byte = seg[kFullByte],
                  shard_kind = seg[kShardKind], full_kind = seg[kFullKind], run = seg[kRun],
                  shard_stride = seg[kShardStride], full_stride = seg[kFullStride];
    SG_CHECK(
        op, shard_kind >= 0 && shard_kind < kNumKinds && full_kind >= 0 && full_kind < kNumKinds,
        "segment ", s, ": unknown element kind (shard ", shard_kind, ", full ", full_kind, ")");
    SG_CHECK(op, kinds_compatible(shard_kind, full_kind), "segment ", s,
             ": cannot cast between element kinds ", shard_kind, " and ", full_kind,
             " (only floating-point kinds cast)");
    SG_CHECK(op, numel >= 0 && base >= 0, "segment ", s, ": negative numel (", numel, ") or base (",
             base, ")");
    if (numel == 0) {
      continue;
    }
    const int64_t shard_size = elem_size(shard_kind), full_size = elem_size(full_kind);
    SG_CHECK(op, row_numel > 0, "segment ", s, ": row numel (P) must be > 0, got ", row_numel);
    // Runs must not overlap on either side: flat positions then grow with the element
    // index (elem_at_or_after relies on it) and no full element is written twice.
    SG_CHECK(op, run > 0 && numel % run == 0, "segment ", s, ": run (", run,
             ") must be > 0 and divide numel (", numel, ")");
    const int64_t count = numel / run;
    SG_CHECK(op, count == 1 || (shard_stride >= run && full_stride >= run), "segment ", s,
             ": strides (shard ", shard_stride, ", full ", full_stride, ") must be >= run (", run,
             ") when a segment has several runs");
    SG_CHECK(op, col_byte >= 0 && col_byte + row_numel * shard_size <= row_bytes, "segment ", s,
             ": columns [", col_byte, ", ", col_byte + row_numel * shard_size,
             ") do not fit a row of ", row_bytes, " bytes");
    SG_CHECK(op, full_index >= 0 && full_index < static_cast<int64_t>(fulls.size()), "segment ", s,
             ": full tensor index ", full_index, " out of range for ", fulls.size(), " tensors");
    const at::Tensor& full = fulls[full_index];
    const int64_t full_bytes = full.numel() * full.element_size();
    const int64_t full_extent = ((count - 1) * (count > 1 ? full_stride : 0) + run) * full_size;
    SG_CHECK(op, full_byte >= 0 && full_byte + full_extent <= full_bytes, "segment ", s,
             ": bytes [", full_byte, ", ", full_byte + full_extent, ") out of range of fulls[",
             full_index, "] (", full_bytes, " bytes)");
    // Casting kernels load/store typed elements: they must be aligned.
    if (shard_kind != full_kind) {
      const auto full_addr = reinterpret_cast<uintptr_t>(full.data_ptr()) + full_byte;
      SG_CHECK(op, full_addr % full_size == 0, "segment ", s, ": fulls[", full_index, "] + ",
               full_byte, " is not aligned to ", full_size, " bytes");
      SG_CHECK(op, (shards_addr + col_byte) % shard_size == 0 && row_bytes % shard_size == 0,
               "segment ", s, ": shard column ", col_byte, " is not aligned to ", shard_size,
               " bytes");
    }

    const Block b{base, run, count > 1 ? shard_stride : run, count > 1 ? full_stride : run};
    int64_t lo = 0, hi = 0;
    elems_in_rows(b, row_numel, numel, first_row, rows, &lo, &hi);
    if (hi > lo) {
      ranges.push_back({s, lo, hi});
      total_bytes += (hi - lo) * std::max(shard_size, full_size);
    }
  }
  // CPU (threads > 0): as few runs as keep every thread busy, since large memcpys
  // stream (non-temporal stores) where small ones pay for reading the destination.
  // CUDA (threads == 0): fixed small runs, one block each.
  const int64_t max_run_bytes =
      threads > 0 ? std::max(kMaxRunBytes, (total_bytes + 2 * threads - 1) / (2 * threads))
                  : kMaxRunBytes;
  std::vector<int64_t> runs;
  for (const auto& [s, lo, hi] : ranges) {
    const int64_t* sg = segments.data_ptr<int64_t>() + s * kSegmentCols;
    const int64_t size = std::max(elem_size(sg[kShardKind]), elem_size(sg[kFullKind]));
    const int64_t max_run = std::max<int64_t>(1, max_run_bytes / size);
    const bool strided = sg[kNumel] > sg[kRun];
    const Block b{sg[kBase], sg[kRun], strided ? sg[kShardStride] : sg[kRun],
                  strided ? sg[kFullStride] : sg[kRun]};
    for (int64_t e = lo; e < hi;) {
      const int64_t n = std::min(run_length(b, sg[kRowNumel], e, hi), max_run);
      runs.push_back(s);
      runs.push_back(e);
      runs.push_back(n);
      e += n;
    }
  }
  const int64_t num_runs = static_cast<int64_t>(runs.size() / 3);
  at::Tensor out = at::empty({num_runs, 3}, segments.options());
  std::copy(runs.begin(), runs.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace shardgather
