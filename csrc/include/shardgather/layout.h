// The one layout rule shared by every kernel (CPU and CUDA) and mirrored in
// shardgather/_layout.py, which the tests check against brute force.
//
// A gathered buffer is rank-major: `[rows, row_bytes]` uint8, row r holding rank r's
// padded shard. Element e (row-major in the full tensor) of a segment lives at
//
//     flat = base + e
//     row  = flat / P
//     byte = row * row_bytes + col_byte + (flat % P) * shard_elem_size
//
// FSDP1: P = shard numel of the flat param, base = the param's offset in the flat
// param, col_byte = the flat param's byte column in the bucket. FSDP2: P = the
// param's padded per-rank numel, base = 0, col_byte = its column in the bucket.
// A column chunk of a huge source is expressed as one segment per (row, chunk)
// with P = chunk width, so this rule never changes.
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace shardgather {

// Columns of the int64 segment table `[S, kSegmentCols]`.
enum SegmentCol : int64_t {
  kBase = 0,       // elements before the segment's first element in the flat layout
  kRowNumel = 1,   // P: elements per row of this source
  kColByte = 2,    // byte column where this source starts inside a row
  kNumel = 3,      // elements of the segment
  kFullIndex = 4,  // which full tensor of the TensorList
  kFullByte = 5,   // byte offset of element 0 inside that full tensor
  kShardKind = 6,  // ElemKind of the elements in the gathered/shard buffer
  kFullKind = 7,   // ElemKind of the elements in the full tensor
  kSegmentCols = 8,
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

C10_HOST_DEVICE inline int64_t row_of(int64_t base, int64_t row_numel, int64_t e) {
  return (base + e) / row_numel;
}

C10_HOST_DEVICE inline int64_t col_of(int64_t base, int64_t row_numel, int64_t e) {
  return (base + e) % row_numel;
}

// Byte address of element e of a segment inside a buffer whose first row is
// `first_row` (a whole gathered buffer: 0; one rank's local shard: its rank).
C10_HOST_DEVICE inline int64_t shard_byte(int64_t base, int64_t row_numel, int64_t col_byte,
                                          int64_t shard_elem_size, int64_t row_bytes,
                                          int64_t first_row, int64_t e) {
  return (row_of(base, row_numel, e) - first_row) * row_bytes + col_byte +
         col_of(base, row_numel, e) * shard_elem_size;
}

// Elements from e (inclusive) that stay in e's row, capped at `end`: the
// longest run that is contiguous on both sides.
C10_HOST_DEVICE inline int64_t run_in_row(int64_t base, int64_t row_numel, int64_t e, int64_t end) {
  const int64_t left_in_row = row_numel - col_of(base, row_numel, e);
  return end - e < left_in_row ? end - e : left_in_row;
}

// Element range [*lo, *hi) of a segment that lies in rows [first_row, first_row + rows).
C10_HOST_DEVICE inline void elems_in_rows(int64_t base, int64_t row_numel, int64_t numel,
                                          int64_t first_row, int64_t rows, int64_t* lo,
                                          int64_t* hi) {
  int64_t a = first_row * row_numel - base;
  int64_t b = (first_row + rows) * row_numel - base;
  a = a < 0 ? 0 : (a > numel ? numel : a);
  b = b < 0 ? 0 : (b > numel ? numel : b);
  *lo = a;
  *hi = b < a ? a : b;
}

// A run: elements [elem, elem + numel) of one segment, all in one row, so both
// the shard side and the full side are contiguous. Kernels execute runs.
struct Run {
  int64_t segment;
  int64_t elem;
  int64_t numel;
};

}  // namespace shardgather
