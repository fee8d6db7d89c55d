// Intra-node dispatch (push) and combine (pull) through peers' CUDA-IPC-mapped buffers, the
// cross-rank barrier, and the registered-memory helpers.
//
// Dispatch: one warp per (own token, destination rank); the token row and its prob slice for
// that rank's experts go straight to the destination's receive row (`sparse_to_dense`), so a
// token read once from HBM feeds every rank that needs it. In static-budget mode every own
// slot row is written, zeros where not routed (the reference's fixed-size exchange).
// Combine: each rank pulls its tokens' rows back from every peer and sums them in fp32 in rank
// order, rounding once; prob slices are scattered (rank slices are disjoint).
#include <cstdio>
#include <cstring>

#include "hybridep_common.cuh"

namespace art_hep {
namespace {

__global__ void dispatch_kernel(const int32_t* sparse, void* const* peer_tokens,
                                void* const* peer_probs, const char* hidden, const float* probs,
                                int world, int rank, int tokens, int L, int64_t row_bytes,
                                int is_static) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t pairs = int64_t(tokens) * world;
  for (int64_t w = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; w < pairs;
       w += warps) {
    const int64_t t = w / world;
    const int d = static_cast<int>(w % world);
    const int32_t row = sparse[w];
    if (row < 0 && !is_static) continue;
    const int64_t dst_row = is_static ? int64_t(rank) * tokens + t : row;
    char* dst = static_cast<char*>(peer_tokens[d]) + dst_row * row_bytes;
    if (row >= 0) {
      copy_row(dst, hidden + t * row_bytes, row_bytes, lane, 32);
    } else {
      zero_row(dst, row_bytes, lane, 32);
    }
    if (probs) {
      float* pdst = static_cast<float*>(peer_probs[d]) + dst_row * L;
      const float* psrc = probs + (t * world + d) * L;
      for (int l = lane; l < L; l += 32) pdst[l] = row >= 0 ? psrc[l] : 0.0f;
    }
  }
}

template <typename T, int VEC>
__global__ void combine_kernel(const int32_t* sparse, void* const* peer_tokens,
                               void* const* peer_probs, T* out, float* out_probs, int world,
                               int tokens, int L, int64_t H) {
  for (int64_t t = blockIdx.x; t < tokens; t += gridDim.x) {
    const int32_t* rows = sparse + t * world;
    for (int64_t h0 = int64_t(threadIdx.x) * VEC; h0 < H; h0 += int64_t(blockDim.x) * VEC) {
      float acc[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
      for (int d = 0; d < world; ++d) {
        const int32_t r = rows[d];
        if (r < 0) continue;
        const T* src = static_cast<const T*>(peer_tokens[d]) + int64_t(r) * H + h0;
#pragma unroll
        for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], Cvt<T>::load(src[v]));
      }
#pragma unroll
      for (int v = 0; v < VEC; ++v) out[t * H + h0 + v] = Cvt<T>::store(acc[v]);
    }
    if (out_probs) {
      for (int i = threadIdx.x; i < world * L; i += blockDim.x) {
        const int d = i / L;
        const int32_t r = rows[d];
        out_probs[t * world * L + i] =
            r >= 0 ? static_cast<const float*>(peer_probs[d])[int64_t(r) * L + (i % L)] : 0.0f;
      }
    }
  }
}

template <typename T>
void launch_combine(const ArtHepIntraParams* p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int blocks = capped_grid(p->num_tokens, 1, p->max_blocks);
  auto* out = static_cast<T*>(const_cast<void*>(p->hidden));
  auto* out_probs = const_cast<float*>(p->probs);
  if (p->hidden_dim % kVec == 0) {
    combine_kernel<T, kVec><<<blocks, 128, 0, stream>>>(p->sparse_to_dense, p->peer_tokens,
                                                        p->peer_probs, out, out_probs,
                                                        p->world_size, p->num_tokens,
                                                        p->num_local_experts, p->hidden_dim);
  } else {
    combine_kernel<T, 1><<<blocks, 128, 0, stream>>>(p->sparse_to_dense, p->peer_tokens,
                                                     p->peer_probs, out, out_probs, p->world_size,
                                                     p->num_tokens, p->num_local_experts,
                                                     p->hidden_dim);
  }
}

__global__ void barrier_kernel(unsigned long long* counter, unsigned long long* epoch, int world,
                               long long timeout_cycles) {
  __threadfence_system();  // this rank's earlier writes (into peers) are visible first
  const unsigned long long target = (*epoch + 1) * static_cast<unsigned long long>(world);
  atomicAdd_system(counter, 1ull);
  const long long start = clock64();
  while (true) {
    unsigned long long seen;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(seen) : "l"(counter) : "memory");
    if (seen >= target) break;
    if (clock64() - start > timeout_cycles) {
      printf("art_hybridep barrier timed out: counter %llu, waiting for %llu\n", seen, target);
      __trap();
    }
    __nanosleep(256);
  }
  *epoch += 1;
  __threadfence_system();
}

int check_intra(const ArtHepIntraParams* p) {
  ART_CHECK_PARAMS(p, ART_HYBRIDEP_ABI_VERSION);
  if (p->world_size < 1 || p->rank < 0 || p->rank >= p->world_size || p->num_tokens < 0 ||
      p->num_local_experts < 1 || p->hidden_dim < 1 || p->dtype < kBf16 || p->dtype > kFp32 ||
      p->max_blocks < 0 ||
      !p->sparse_to_dense || !p->peer_tokens || !p->peer_probs ||
      (p->num_tokens > 0 && !p->hidden))
    return ART_ERR_BAD_ARGUMENT;
  if (cudaError_t e = cudaSetDevice(p->device); e != cudaSuccess) return e;
  return ART_OK;
}

}  // namespace
}  // namespace art_hep

using namespace art_hep;

ART_API int art_hybridep_dispatch(const ArtHepIntraParams* p) {
  if (int s = check_intra(p); s != ART_OK) return s;
  const int64_t pairs = int64_t(p->num_tokens) * p->world_size;
  if (pairs == 0) return ART_OK;
  auto stream = static_cast<cudaStream_t>(p->stream);
  dispatch_kernel<<<capped_grid(pairs, 16, p->max_blocks), 512, 0, stream>>>(
      p->sparse_to_dense, p->peer_tokens, p->peer_probs, static_cast<const char*>(p->hidden),
      p->probs, p->world_size, p->rank, p->num_tokens, p->num_local_experts,
      p->hidden_dim * dtype_bytes(p->dtype), p->static_budget);
  return cudaGetLastError();
}

ART_API int art_hybridep_combine(const ArtHepIntraParams* p) {
  if (int s = check_intra(p); s != ART_OK) return s;
  if (p->num_tokens == 0) return ART_OK;
  auto stream = static_cast<cudaStream_t>(p->stream);
  switch (p->dtype) {
    case kBf16: launch_combine<__nv_bfloat16>(p, stream); break;
    case kFp16: launch_combine<__half>(p, stream); break;
    default: launch_combine<float>(p, stream); break;
  }
  return cudaGetLastError();
}

ART_API int art_hybridep_barrier(const ArtHepBarrierParams* p) {
  ART_CHECK_PARAMS(p, ART_HYBRIDEP_ABI_VERSION);
  if (p->world_size < 1 || !p->counter || !p->epoch || p->timeout_cycles <= 0)
    return ART_ERR_BAD_ARGUMENT;
  if (cudaError_t e = cudaSetDevice(p->device); e != cudaSuccess) return e;
  barrier_kernel<<<1, 1, 0, static_cast<cudaStream_t>(p->stream)>>>(
      p->counter, p->epoch, p->world_size, p->timeout_cycles);
  return cudaGetLastError();
}

ART_API int art_hybridep_alloc(int32_t device, int64_t bytes, void** ptr) {
  if (bytes <= 0 || !ptr) return ART_ERR_BAD_ARGUMENT;
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return e;
  if (cudaError_t e = cudaMalloc(ptr, bytes); e != cudaSuccess) return e;
  if (cudaError_t e = cudaMemset(*ptr, 0, bytes); e != cudaSuccess) return e;
  // Counters and epochs must read zero before any peer can map this block (the handle is
  // published right after we return), and cudaMemset may still be running on the device.
  return cudaDeviceSynchronize();
}

ART_API int art_hybridep_free(int32_t device, void* ptr) {
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return e;
  return cudaFree(ptr);
}

ART_API int art_hybridep_ipc_handle(int32_t device, void* ptr, uint8_t* handle64) {
  static_assert(sizeof(cudaIpcMemHandle_t) == 64, "CUDA IPC handles are 64 bytes");
  if (!ptr || !handle64) return ART_ERR_BAD_ARGUMENT;
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return e;
  cudaIpcMemHandle_t h;
  if (cudaError_t e = cudaIpcGetMemHandle(&h, ptr); e != cudaSuccess) return e;
  memcpy(handle64, &h, sizeof(h));
  return ART_OK;
}

ART_API int art_hybridep_ipc_open(int32_t device, const uint8_t* handle64, void** ptr) {
  if (!handle64 || !ptr) return ART_ERR_BAD_ARGUMENT;
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return e;
  cudaIpcMemHandle_t h;
  memcpy(&h, handle64, sizeof(h));
  return cudaIpcOpenMemHandle(ptr, h, cudaIpcMemLazyEnablePeerAccess);
}

ART_API int art_hybridep_ipc_close(int32_t device, void* ptr) {
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return e;
  return cudaIpcCloseMemHandle(ptr);
}

ART_API int art_hybridep_memcpy_d2d(int32_t device, void* dst, const void* src, int64_t bytes,
                                    void* stream) {
  if (bytes < 0 || (bytes > 0 && (!dst || !src))) return ART_ERR_BAD_ARGUMENT;
  if (bytes == 0) return ART_OK;
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) return e;
  return cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice,
                         static_cast<cudaStream_t>(stream));
}
