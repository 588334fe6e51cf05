// CUDA kernels: one launch per call, one block per run (layout.h). Full tensors
// may live in device memory or in pinned host memory, which the kernel writes
// through its mapped device pointer (no separate cudaMemcpy).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <c10/util/TypeCast.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <vector>

#include "../segments.h"
#include "shardgather/layout.h"

namespace shardgather {
namespace {

constexpr int kThreads = 256;

// Byte copy of one contiguous run; 16-byte vector accesses when src and dst
// share their alignment modulo 16 (the common case: both from allocators).
__device__ void copy_bytes(const char* src, char* dst, int64_t n) {
  const int64_t mis = reinterpret_cast<uintptr_t>(src) & 15;
  if (mis == (reinterpret_cast<uintptr_t>(dst) & 15)) {
    const int64_t head = mis == 0 ? 0 : (16 - mis < n ? 16 - mis : n);
    for (int64_t i = threadIdx.x; i < head; i += blockDim.x) dst[i] = src[i];
    const int64_t vecs = (n - head) / 16;
    const uint4* vs = reinterpret_cast<const uint4*>(src + head);
    uint4* vd = reinterpret_cast<uint4*>(dst + head);
    for (int64_t i = threadIdx.x; i < vecs; i += blockDim.x) vd[i] = vs[i];
    for (int64_t i = head + vecs * 16 + threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  } else {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) dst[i] = src[i];
  }
}

template <typename Dst, typename Src>
__device__ void cast_elems(const char* src, char* dst, int64_t n) {
  const Src* s = reinterpret_cast<const Src*>(src);
  Dst* d = reinterpret_cast<Dst*>(dst);
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    d[i] = c10::static_cast_with_inter_type<Dst, Src>::apply(s[i]);
  }
}

template <typename Src>
__device__ void cast_to(const char* src, char* dst, int64_t dst_kind, int64_t n) {
  switch (dst_kind) {
    case kF16: cast_elems<c10::Half, Src>(src, dst, n); break;
    case kBF16: cast_elems<c10::BFloat16, Src>(src, dst, n); break;
    case kF32: cast_elems<float, Src>(src, dst, n); break;
    case kF64: cast_elems<double, Src>(src, dst, n); break;
  }
}

__device__ void copy_elems(const char* src, int64_t src_kind, char* dst, int64_t dst_kind,
                           int64_t n) {
  if (src_kind == dst_kind) {
    copy_bytes(src, dst, n * elem_size(src_kind));
    return;
  }
  switch (src_kind) {
    case kF16: cast_to<c10::Half>(src, dst, dst_kind, n); break;
    case kBF16: cast_to<c10::BFloat16>(src, dst, dst_kind, n); break;
    case kF32: cast_to<float>(src, dst, dst_kind, n); break;
    case kF64: cast_to<double>(src, dst, dst_kind, n); break;
  }
}

// meta = [full pointers (F) | segments (S * kSegmentCols) | runs (N * 3)], int64.
template <bool kOut>
__global__ void copy_kernel(char* shards, int64_t row_bytes, int64_t first_row,
                            const int64_t* __restrict__ meta, int64_t num_fulls,
                            int64_t num_segments) {
  const int64_t* full_ptrs = meta;
  const int64_t* seg_table = meta + num_fulls;
  const int64_t* run = seg_table + num_segments * kSegmentCols + 3 * int64_t(blockIdx.x);
  const int64_t* seg = seg_table + kSegmentCols * run[0];
  const int64_t e = run[1], n = run[2];
  const int64_t shard_kind = seg[kShardKind], full_kind = seg[kFullKind];
  const Block b = block_of(seg);
  char* shard = shards + shard_byte(b, seg[kRowNumel], seg[kColByte], elem_size(shard_kind),
                                    row_bytes, first_row, e);
  char* full = reinterpret_cast<char*>(full_ptrs[seg[kFullIndex]]) + seg[kFullByte] +
               full_elem(b, e) * elem_size(full_kind);
  if (kOut) {
    copy_elems(shard, shard_kind, full, full_kind, n);
  } else {
    copy_elems(full, full_kind, shard, shard_kind, n);
  }
}

bool cuda_full_ok(const at::Tensor& full, const at::Tensor& shards) {
  if (full.device() == shards.device()) return true;
  return full.device().is_cpu() && (full.numel() == 0 || full.is_pinned());
}

// Device address of a full tensor: its own for device memory, the mapped
// address for pinned host memory (UVA maps cudaHostAlloc'ed memory).
int64_t device_address(const at::Tensor& full) {
  void* ptr = full.data_ptr();
  if (full.is_cuda() || ptr == nullptr) return reinterpret_cast<int64_t>(ptr);
  void* mapped = nullptr;
  C10_CUDA_CHECK(cudaHostGetDevicePointer(&mapped, ptr, 0));
  return reinterpret_cast<int64_t>(mapped);
}

template <bool kOut>
void copy_cuda(const char* op, const at::Tensor& shards, int64_t first_row,
               const at::Tensor& segments, at::TensorList fulls) {
  TORCH_CHECK(shards.is_cuda(), "shardgather::", op,
              ": argument 'shards' must be a CUDA tensor when any tensor is on CUDA, got ",
              shards.device());
  const c10::cuda::CUDAGuard guard(shards.device());
  const at::Tensor runs = validate_and_split(op, shards, first_row, segments, fulls, cuda_full_ok,
                                             /*threads=*/0);
  const int64_t num_runs = runs.size(0);
  if (num_runs == 0) return;
  TORCH_CHECK(num_runs < (int64_t{1} << 31), "shardgather::", op, ": too many runs (", num_runs,
              ") for one launch");

  const int64_t num_fulls = static_cast<int64_t>(fulls.size());
  const int64_t num_segments = segments.size(0);
  // The table is staged in pinned memory and copied without blocking the host: a
  // pageable source would make every launch wait for the copy (and for the stream).
  at::Tensor meta = at::empty({num_fulls + num_segments * kSegmentCols + num_runs * 3},
                              segments.options().pinned_memory(true));
  int64_t* m = meta.data_ptr<int64_t>();
  for (int64_t i = 0; i < num_fulls; ++i) m[i] = device_address(fulls[i]);
  std::copy_n(segments.data_ptr<int64_t>(), num_segments * kSegmentCols, m + num_fulls);
  std::copy_n(runs.data_ptr<int64_t>(), num_runs * 3, m + num_fulls + num_segments * kSegmentCols);
  // Asynchronous on the current stream. `meta` may die at the end of this scope: a
  // pinned block copied with non_blocking records an event on the stream, and the
  // caching host allocator does not hand the block out again before that event.
  const at::Tensor meta_dev = meta.to(shards.device(), meta.scalar_type(), /*non_blocking=*/true);

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  copy_kernel<kOut><<<static_cast<unsigned>(num_runs), kThreads, 0, stream>>>(
      static_cast<char*>(shards.data_ptr()), shards.size(1), first_row,
      meta_dev.data_ptr<int64_t>(), num_fulls, num_segments);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // meta_dev is freed by the caching allocator on this stream: safe reuse.
}

void copy_out_cuda(const at::Tensor& shards, int64_t first_row, const at::Tensor& segments,
                   at::TensorList fulls) {
  copy_cuda<true>("copy_out", shards, first_row, segments, fulls);
}

void copy_in_cuda(at::TensorList fulls, const at::Tensor& segments, const at::Tensor& shards,
                  int64_t first_row) {
  copy_cuda<false>("copy_in", shards, first_row, segments, fulls);
}

}  // namespace

TORCH_LIBRARY_IMPL(shardgather, CUDA, m) {
  m.impl("copy_out", &copy_out_cuda);
  m.impl("copy_in", &copy_in_cuda);
}

}  // namespace shardgather
