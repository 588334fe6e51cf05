// Host-side validation of a copy call and its split into runs (see layout.h).
// Shared by the CPU and CUDA implementations of copy_out and copy_in.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace shardgather {

// Validates the arguments of `op` and returns the runs to execute as an int64
// tensor `[N, 3]` (segment, first element, numel) on the CPU.
//   shards:   uint8 `[rows, row_bytes]`, contiguous; rows first_row .. first_row + rows - 1
//   segments: int64 `[S, kSegmentCols]`, contiguous, on the CPU
//   fulls:    contiguous tensors addressed by the segments' kFullIndex / kFullByte
// `full_device_ok(t)` decides whether a full tensor's device may be used with `shards`.
// `threads` > 0 (CPU): runs sized to keep that many threads busy; 0 (CUDA): small runs.
at::Tensor validate_and_split(const char* op, const at::Tensor& shards, int64_t first_row,
                              const at::Tensor& segments, at::TensorList fulls,
                              bool (*full_device_ok)(const at::Tensor& full,
                                                     const at::Tensor& shards),
                              int64_t threads);

// Bytes (full side) of one CUDA run, and the smallest CPU run.
constexpr int64_t kMaxRunBytes = int64_t{1} << 18;

}  // namespace shardgather
