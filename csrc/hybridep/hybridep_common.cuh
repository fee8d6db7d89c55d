// Small device helpers shared by the HybridEP translation units.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "hybridep.h"

namespace art_hep {

enum Dtype : int32_t { kBf16 = 0, kFp16 = 1, kFp32 = 2 };

inline int dtype_bytes(int32_t dtype) { return dtype == kFp32 ? 4 : 2; }

__host__ __device__ inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Elements per 16-byte access for rows of `hidden` elements between `a` and `b`, or 1 when
// the row pitch or a base pointer is not 16-byte aligned (see art_hybridep_vector_width).
inline int vector_width(int32_t dtype, int64_t hidden, const void* a, const void* b) {
  const int bytes = dtype_bytes(dtype);
  const bool ok = (hidden * bytes) % 16 == 0 && aligned16(a) && aligned16(b);
  return ok ? 16 / bytes : 1;
}

// A cross-rank kernel skips its work once the buffer's status block reports a failure
// (a barrier that timed out): peers are not where the protocol expects them.
__device__ inline bool failed(const int32_t* status) {
  return status != nullptr && *reinterpret_cast<const volatile int32_t*>(status) != 0;
}

// `failed` for a whole block with one read (the status block is host memory, so one PCIe
// read per block instead of one per thread). Every thread of the block must call it.
__device__ inline bool block_failed(const int32_t* status) {
  __shared__ int flag;
  if (threadIdx.x == 0) flag = failed(status) ? 1 : 0;
  __syncthreads();
  return flag != 0;
}

// fp32 accumulation and one round-to-nearest-even store, as torch's `.to(dtype)` does.
template <typename T> struct Cvt;
template <> struct Cvt<__nv_bfloat16> {
  static __device__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};
template <> struct Cvt<__half> {
  static __device__ float load(__half v) { return __half2float(v); }
  static __device__ __half store(float v) { return __float2half_rn(v); }
};
template <> struct Cvt<float> {
  static __device__ float load(float v) { return v; }
  static __device__ float store(float v) { return v; }
};

// Copy `bytes` from src to dst with the threads of one group. Aligned rows move as 16-byte
// vectors, four loads in flight per thread before their stores (the copy is latency-bound
// otherwise: one outstanding load per thread cannot cover HBM/NVLink latency).
__device__ inline void copy_row(char* __restrict__ dst, const char* __restrict__ src,
                                int64_t bytes, int lane, int lanes) {
  if ((bytes % 16 == 0) && (reinterpret_cast<uintptr_t>(dst) % 16 == 0) &&
      (reinterpret_cast<uintptr_t>(src) % 16 == 0)) {
    auto* d = reinterpret_cast<uint4*>(dst);
    auto* s = reinterpret_cast<const uint4*>(src);
    const int64_t n = bytes / 16;
    int64_t i = lane;
    for (; i + 3 * lanes < n; i += 4 * lanes) {
      const uint4 a = s[i], b = s[i + lanes], c = s[i + 2 * lanes], e = s[i + 3 * lanes];
      d[i] = a;
      d[i + lanes] = b;
      d[i + 2 * lanes] = c;
      d[i + 3 * lanes] = e;
    }
    for (; i < n; i += lanes) d[i] = s[i];
  } else {
    for (int64_t i = lane; i < bytes; i += lanes) dst[i] = src[i];
  }
}

__device__ inline void zero_row(char* dst, int64_t bytes, int lane, int lanes) {
  if ((bytes % 16 == 0) && (reinterpret_cast<uintptr_t>(dst) % 16 == 0)) {
    auto* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = lane; i < bytes / 16; i += lanes) d[i] = make_uint4(0, 0, 0, 0);
  } else {
    for (int64_t i = lane; i < bytes; i += lanes) dst[i] = 0;
  }
}

inline int grid_for(int64_t work, int per_block, int max_blocks = 65535) {
  int64_t blocks = (work + per_block - 1) / per_block;
  return static_cast<int>(blocks < max_blocks ? (blocks < 1 ? 1 : blocks) : max_blocks);
}

// Grid of a kernel that spreads over an SM budget: `num_sms` SMs (0 or more than the device
// has = all of them) times the blocks of `threads` threads one SM holds, but no more blocks
// than there is work for.
template <typename Kernel>
int grid_for_sms(Kernel kernel, int threads, int32_t num_sms, int64_t work, int per_block) {
  int device = 0, sms = 0, per_sm = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0);
  const int budget = (num_sms > 0 && num_sms < sms ? num_sms : sms) * (per_sm > 0 ? per_sm : 1);
  const int64_t needed = (work + per_block - 1) / per_block;
  return static_cast<int>(needed < budget ? (needed < 1 ? 1 : needed) : budget);
}

// A kernel's grid: enough blocks for the work, capped by the caller's SM budget (0 = none).
inline int capped_grid(int64_t work, int per_block, int32_t cap) {
  const int blocks = grid_for(work, per_block);
  return cap > 0 && cap < blocks ? cap : blocks;
}

}  // namespace art_hep
