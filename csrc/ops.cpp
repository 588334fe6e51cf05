// Every schema of the library, in one TORCH_LIBRARY block. Backends add their
// kernels with TORCH_LIBRARY_IMPL (cpu/copy_cpu.cpp, cuda/copy_cuda.cu).
#include <torch/extension.h>

#include "shardgather/layout.h"

TORCH_LIBRARY(shardgather, m) {
  // Gathered shards -> full tensors. `shards` is uint8 `[rows, row_bytes]` holding
  // rows first_row .. first_row + rows - 1 of the rank-major layout; `segments` is
  // the int64 `[S, 11]` table of layout.h (on the CPU). Elements outside those rows
  // are left alone, so one rank can copy out just its own row.
  m.def("copy_out(Tensor shards, int first_row, Tensor segments, Tensor(a!)[] fulls) -> ()");
  // Full tensors -> shards: the exact inverse of copy_out (padding is not written).
  m.def("copy_in(Tensor[] fulls, Tensor segments, Tensor(a!) shards, int first_row) -> ()");
  // Delta of a weight sync: `src` (a rank's own elements, 1-D) cast to `ref`'s dtype and
  // compared bitwise with `ref` (what was last sent); every element that differs is
  // written into `ref`, and the first `positions.numel()` of them recorded as
  // (`base` + index) in `positions` (int32/int64) and their new value in `values`.
  // `count` (int64 [1], CPU) takes how many differed (possibly more than were recorded).
  m.def(
      "diff_update(Tensor src, Tensor(a!) ref, Tensor(b!) positions, Tensor(c!) values, "
      "Tensor(d!) count, int base) -> ()");
}

namespace {

bool with_cuda() {
#ifdef SHARDGATHER_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "shardgather compiled ops (registered as torch.ops.shardgather.*)";
  m.def("with_cuda", &with_cuda, "Whether the CUDA kernels were compiled into this build.");
  m.attr("segment_cols") = static_cast<int64_t>(shardgather::kSegmentCols);
}
