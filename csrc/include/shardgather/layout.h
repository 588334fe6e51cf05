// The one layout rule shared by every kernel (CPU and CUDA) and mirrored in
// shardgather/_layout.py, which the tests check against brute force.
//
// A gathered buffer is rank-major: `[rows, row_bytes]` uint8, row r holding rank r's
// padded shard. A segment is `numel` elements of one full tensor, laid out as runs of
// `run` elements (a *block*: run i starts `shard_stride` elements after run i-1 on the
// shard side and `full_stride` elements after it on the full side). Element s of a
// segment lives at
//
//     i = s / run, j = s % run
//     flat = base + i * shard_stride + j            (the rank-major concatenation of rows)
//     row  = flat / P
//     byte = row * row_bytes + col_byte + (flat % P) * shard_elem_size
//     full = full_byte + (i * full_stride + j) * full_elem_size
//
// FSDP1: one run (run = numel): P = shard numel of the flat param, base = the param's
// offset in the flat param, so a segment may span several rows. FSDP2 dim-0: one run,
// P = the param's padded per-rank numel, base = 0. Tensor parallel and N-D layouts
// (a rank's local block of a DTensor): one segment per block, base = row * P + the
// block's offset in the rank's local tensor, and full_stride the full tensor's row
// pitch (row-wise TP: many equal runs). col_byte = the source's column in the bucket.
// A column chunk of a huge source is expressed as one segment per (row, chunk) with
// P = chunk width, so this rule never changes.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace shardgather {

// Columns of the int64 segment table `[S, kSegmentCols]`.
enum SegmentCol : int64_t {
  kBase = 0,         // flat shard position of the segment's element 0
  kRowNumel = 1,     // P: elements per row of this source
  kColByte = 2,      // byte column where this source starts inside a row
  kNumel = 3,        // elements of the segment (a multiple of kRun)
  kFullIndex = 4,    // which full tensor of the TensorList
  kFullByte = 5,     // byte offset of element 0 inside that full tensor
  kShardKind = 6,    // ElemKind of the elements in the gathered/shard buffer
  kFullKind = 7,     // ElemKind of the elements in the full tensor
  kRun = 8,          // elements per run (numel: one contiguous run)
  kShardStride = 9,  // elements from one run's start to the next, shard side
  kFullStride = 10,  // elements from one run's start to the next, full side
  kSegmentCols = 11,
};

// Element kinds. Raw kinds copy bytes (any dtype of that size: ints, bool,
// complex); float kinds may be cast into one another.
enum ElemKind : int64_t {
  kRaw1 = 0,
  kRaw2 = 1,
  kRaw4 = 2,
  kRaw8 = 3,
  kRaw16 = 4,
  kF16 = 5,
  kBF16 = 6,
  kF32 = 7,
  kF64 = 8,
  kNumKinds = 9,
};

C10_HOST_DEVICE inline int64_t elem_size(int64_t kind) {
  switch (kind) {
    case kRaw1: return 1;
    case kRaw2:
    case kF16:
    case kBF16: return 2;
    case kRaw4:
    case kF32: return 4;
    case kRaw8:
    case kF64: return 8;
    case kRaw16: return 16;
    default: return 0;
  }
}

C10_HOST_DEVICE inline bool is_float_kind(int64_t kind) {
  return kind >= kF16 && kind <= kF64;
}

// Two kinds can be copied between iff they are equal or both floating point.
C10_HOST_DEVICE inline bool kinds_compatible(int64_t a, int64_t b) {
  return a == b || (is_float_kind(a) && is_float_kind(b));
}

// The shape of a segment's block: runs of `run` elements, strided on both sides.
struct Block {
  int64_t base;          // flat shard position of element 0
  int64_t run;           // elements per run
  int64_t shard_stride;  // flat distance between run starts
  int64_t full_stride;   // full-tensor distance between run starts (elements)
};

C10_HOST_DEVICE inline Block block_of(const int64_t* seg) {
  return {seg[kBase], seg[kRun], seg[kShardStride], seg[kFullStride]};
}

// Flat shard position (row-major over the rank-major rows) of element s.
C10_HOST_DEVICE inline int64_t shard_flat(const Block& b, int64_t s) {
  return b.base + (s / b.run) * b.shard_stride + s % b.run;
}

// Element index, in the full tensor's memory order from the segment's full_byte, of s.
C10_HOST_DEVICE inline int64_t full_elem(const Block& b, int64_t s) {
  return (s / b.run) * b.full_stride + s % b.run;
}

C10_HOST_DEVICE inline int64_t row_of(int64_t row_numel, int64_t flat) {
  return flat / row_numel;
}

C10_HOST_DEVICE inline int64_t col_of(int64_t row_numel, int64_t flat) {
  return flat % row_numel;
}

// Byte address of element s of a segment inside a buffer whose first row is
// `first_row` (a whole gathered buffer: 0; one rank's local shard: its rank).
C10_HOST_DEVICE inline int64_t shard_byte(const Block& b, int64_t row_numel, int64_t col_byte,
                                          int64_t shard_elem_size, int64_t row_bytes,
                                          int64_t first_row, int64_t s) {
  const int64_t flat = shard_flat(b, s);
  return (row_of(row_numel, flat) - first_row) * row_bytes + col_byte +
         col_of(row_numel, flat) * shard_elem_size;
}

// Elements from s (inclusive) that stay in s's run and in its row, capped at `end`:
// the longest piece that is contiguous on both sides.
C10_HOST_DEVICE inline int64_t run_length(const Block& b, int64_t row_numel, int64_t s,
                                          int64_t end) {
  const int64_t left_in_run = b.run - s % b.run;
  const int64_t left_in_row = row_numel - col_of(row_numel, shard_flat(b, s));
  int64_t n = end - s;
  n = left_in_run < n ? left_in_run : n;
  return left_in_row < n ? left_in_row : n;
}

// The first element whose flat shard position is >= f (numel if none): flat positions
// grow with s (shard_stride >= run), so the elements in any flat range are one range.
C10_HOST_DEVICE inline int64_t elem_at_or_after(const Block& b, int64_t numel, int64_t f) {
  const int64_t d = f - b.base;
  if (d <= 0) return 0;
  const int64_t i = d / b.shard_stride, j = d % b.shard_stride;
  const int64_t s = j >= b.run ? (i + 1) * b.run : i * b.run + j;
  return s < numel ? s : numel;
}

// Element range [*lo, *hi) of a segment that lies in rows [first_row, first_row + rows).
C10_HOST_DEVICE inline void elems_in_rows(const Block& b, int64_t row_numel, int64_t numel,
                                          int64_t first_row, int64_t rows, int64_t* lo,
                                          int64_t* hi) {
  *lo = elem_at_or_after(b, numel, first_row * row_numel);
  const int64_t h = elem_at_or_after(b, numel, (first_row + rows) * row_numel);
  *hi = h < *lo ? *lo : h;
}

// A run: elements [elem, elem + numel) of one segment, in one run of its block and in
// one row, so both the shard side and the full side are contiguous. Kernels execute runs.
struct Run {
  int64_t segment;
  int64_t elem;
  int64_t numel;
};

}  // namespace shardgather
