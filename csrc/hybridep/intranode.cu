// Intra-node dispatch (push) and combine (pull) through peers' CUDA-IPC-mapped buffers, the
// cross-rank barrier, and the registered-memory helpers.
//
// Dispatch: one warp per (own token, destination rank); the token row and its prob slice for
// that rank's experts go straight to the destination's receive row (`sparse_to_dense`), so a
// token read once from HBM feeds every rank that needs it. In static-budget mode every own
// slot row is written, zeros where not routed (the reference's fixed-size exchange).
// Combine: each rank pulls its tokens' rows back from every peer and sums them in fp32 in rank
// order, rounding once; prob slices are scattered (rank slices are disjoint).
// Grids are sized from the SM budget of HybridEPConfig (num_sms_dispatch / num_sms_combine)
// times the blocks one SM holds, so the default leaves the other SMs to overlapping compute.
#include <cstring>

#include "hybridep_common.cuh"

namespace art_hep {
namespace {

__global__ void dispatch_kernel(
    const int32_t* sparse, void* const* peer_tokens, void* const* peer_probs, const char* hidden,
    const float* probs, int world, int rank, int tokens, int L, int64_t row_bytes, int is_static,
    const int32_t* status) {
  if (block_failed(status)) return;
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

constexpr int kCombineThreads = 512;    // 16 warps; one warp per token
constexpr int kCombineBlocksPerSm = 2;  // 32 resident warps per SM
constexpr int kRankBatch = 4;           // peer rows loaded together before they are summed

// Combine: one warp per own token (tokens spread over every warp of the grid). For each
// 16-byte column chunk a lane first loads the chunk of up to kRankBatch peer rows of the
// token, then sums them in rank order in fp32 and stores once: the summation order of
// hybridep/movement.py, with the ranks' loads overlapped instead of serialized. Rows whose
// pitch or base is not 16-byte aligned take the one-element path.
// Occupancy: the launch bounds hold a thread to 64 registers so two blocks fit on an SM
// (at 86 registers only one did, and each SM had 512 lanes x W x 16 B in flight at most).
// kRankBatch = 4 is what fits in 64 without spilling (8 spilled ~170 bytes a thread); at
// W <= 4 a lane still loads every rank at once, and twice the lanes are resident.
template <typename T>
__global__ void __launch_bounds__(kCombineThreads, kCombineBlocksPerSm) combine_kernel(
    const int32_t* sparse, void* const* peer_tokens, void* const* peer_probs, T* out,
    float* out_probs, int world, int tokens, int L, int64_t H, int vec_ok,
    const int32_t* status) {
  if (block_failed(status)) return;
  constexpr int kVec = 16 / sizeof(T);
  const int lane = threadIdx.x % 32;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  // every peer region must be aligned too (they are: 256-byte offsets in a cudaMalloc block)
  bool vec = vec_ok != 0;
  for (int d = 0; d < world && vec; ++d) vec = aligned16(peer_tokens[d]);
  for (int64_t t = blockIdx.x * int64_t(blockDim.x / 32) + threadIdx.x / 32; t < tokens;
       t += warps) {
    const int32_t* rows = sparse + t * world;
    if (vec) {
      const int64_t chunks = H / kVec;
      for (int64_t c = lane; c < chunks; c += 32) {
        float acc[kVec];
#pragma unroll
        for (int v = 0; v < kVec; ++v) acc[v] = 0.0f;
        for (int d0 = 0; d0 < world; d0 += kRankBatch) {
          uint4 raw[kRankBatch];
          bool have[kRankBatch];
#pragma unroll
          for (int j = 0; j < kRankBatch; ++j) {
            const int d = d0 + j;
            const int32_t r = d < world ? rows[d] : -1;
            have[j] = r >= 0;
            if (have[j]) {
              raw[j] = reinterpret_cast<const uint4*>(static_cast<const T*>(peer_tokens[d]) +
                                                      int64_t(r) * H)[c];
            }
          }
#pragma unroll
          for (int j = 0; j < kRankBatch; ++j) {
            if (!have[j]) continue;
            const T* e = reinterpret_cast<const T*>(&raw[j]);
#pragma unroll
            for (int v = 0; v < kVec; ++v) acc[v] = __fadd_rn(acc[v], Cvt<T>::load(e[v]));
          }
        }
        uint4 packed;
        T* e = reinterpret_cast<T*>(&packed);
#pragma unroll
        for (int v = 0; v < kVec; ++v) e[v] = Cvt<T>::store(acc[v]);
        reinterpret_cast<uint4*>(out + t * H)[c] = packed;
      }
    } else {
      for (int64_t h = lane; h < H; h += 32) {
        float acc = 0.0f;
        for (int d = 0; d < world; ++d) {
          const int32_t r = rows[d];
          if (r >= 0)
            acc = __fadd_rn(acc, Cvt<T>::load(static_cast<const T*>(peer_tokens[d])[r * H + h]));
        }
        out[t * H + h] = Cvt<T>::store(acc);
      }
    }
    if (out_probs) {
      for (int i = lane; i < world * L; i += 32) {
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
  constexpr int kWarps = kCombineThreads / 32;
  const int blocks = grid_for_sms(combine_kernel<T>, kCombineThreads, p->num_sms, p->num_tokens,
                                  kWarps);
  auto* out = static_cast<T*>(const_cast<void*>(p->hidden));
  auto* out_probs = p->with_probs ? const_cast<float*>(p->probs) : nullptr;
  const int vec_ok = vector_width(p->dtype, p->hidden_dim, out, out) > 1;
  combine_kernel<T><<<blocks, kCombineThreads, 0, stream>>>(
      p->sparse_to_dense, p->peer_tokens, p->peer_probs, out, out_probs, p->world_size,
      p->num_tokens, p->num_local_experts, p->hidden_dim, vec_ok, p->status);
}

__device__ inline unsigned long long global_ns() {
  unsigned long long ns;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));
  return ns;
}

// Every rank posts its new epoch in arrivals[rank] (rank 0's block) and waits for all of
// them. A rank missing after `timeout_ns` is recorded in the status block and the kernel
// returns without advancing the epoch; later cross-rank kernels of the buffer then skip
// their work and the host raises naming that rank (the CUDA context survives). A rank whose
// call failed posts its epoch with kAbortBit: everyone still passes the barrier (nobody waits
// for a timeout), then records PEER_FAILED naming the first aborting rank, so later calls
// raise instead of using rows that rank never wrote.
//
// An arrival word holds the newest barrier its rank reached, so a peer read by a slow rank
// may already be one barrier further: it passed this barrier and posted the next (never two:
// that needs this rank's next post). An abort bit then belongs to that next barrier, not to
// this one: taking it here (the first GPU run did) made the slow rank record PEER_FAILED one
// barrier early, skip its next barrier without posting (`failed(status)`), and leave the
// aborting rank waiting for it until the timeout. `arrival_verdict` is the rule; the CPU
// emulation of the device's ordering calls the compiled rule (art_hybridep_barrier_arrival).
constexpr unsigned long long kAbortBit = 1ull << 63;
enum ArrivalVerdict : int { kArrivalWait = 0, kArrivalPassed = 1, kArrivalAborted = 2 };

__host__ __device__ inline int arrival_verdict(unsigned long long seen,
                                               unsigned long long target) {
  const unsigned long long reached = seen & ~kAbortBit;
  if (reached < target) return kArrivalWait;
  return (seen & kAbortBit) && reached == target ? kArrivalAborted : kArrivalPassed;
}

// Record a failure in the status block: the rank and epoch first, then the code the host and
// later kernels test, each made visible to the host before the next.
__device__ inline void record_status(int32_t* status, int32_t code, int rank,
                                     unsigned long long epoch) {
  volatile int32_t* s = status;
  s[1] = rank;
  s[2] = static_cast<int32_t>(epoch);
  __threadfence_system();
  s[0] = code;
  __threadfence_system();
}

__global__ void barrier_kernel(unsigned long long* arrivals, unsigned long long* epoch, int world,
                               int rank, int abort_flag, long long timeout_ns, int32_t* status) {
  if (failed(status)) return;
  __threadfence_system();  // this rank's earlier writes (into peers) are visible first
  const unsigned long long target = *epoch + 1;
  const unsigned long long posted = abort_flag ? (target | kAbortBit) : target;
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(arrivals + rank), "l"(posted)
               : "memory");
  const unsigned long long start = global_ns();
  int aborted = -1;
  for (int r = 0; r < world; ++r) {
    while (true) {
      unsigned long long seen;
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(seen) : "l"(arrivals + r)
                   : "memory");
      const int verdict = arrival_verdict(seen, target);
      if (verdict != kArrivalWait) {
        if (verdict == kArrivalAborted && aborted < 0) aborted = r;
        break;
      }
      if (static_cast<long long>(global_ns() - start) > timeout_ns) {
        record_status(status, ART_HEP_STATUS_BARRIER_TIMEOUT, r, target);
        return;
      }
      __nanosleep(256);
    }
  }
  *epoch = target;
  __threadfence_system();
  if (aborted >= 0) record_status(status, ART_HEP_STATUS_PEER_FAILED, aborted, target);
}

// Scalars first; with no own token there is nothing to move (arrays may then be null).
int check_intra(const ArtHepIntraParams* p) {
  ART_CHECK_PARAMS(p, ART_HYBRIDEP_ABI_VERSION);
  if (p->world_size < 1 || p->rank < 0 || p->rank >= p->world_size || p->num_tokens < 0 ||
      p->num_local_experts < 1 || p->hidden_dim < 1 || p->dtype < kBf16 || p->dtype > kFp32 ||
      p->num_sms < 0 || (p->with_probs != 0 && p->with_probs != 1))
    return ART_ERR_BAD_ARGUMENT;
  if (p->num_tokens == 0) return ART_OK;
  if (!p->sparse_to_dense || !p->peer_tokens || !p->peer_probs || !p->hidden ||
      (p->with_probs && !p->probs))
    return ART_ERR_BAD_ARGUMENT;
  return ART_OK;
}

}  // namespace
}  // namespace art_hep

using namespace art_hep;

ART_API int art_hybridep_dispatch(const ArtHepIntraParams* p) {
  if (int s = check_intra(p); s != ART_OK) return s;
  const int64_t pairs = int64_t(p->num_tokens) * p->world_size;
  if (pairs == 0) return ART_OK;  // no own token: nothing to send, no device call
  if (cudaError_t e = cudaSetDevice(p->device); e != cudaSuccess) return e;
  auto stream = static_cast<cudaStream_t>(p->stream);
  const int blocks = grid_for_sms(dispatch_kernel, 512, p->num_sms, pairs, 16);
  dispatch_kernel<<<blocks, 512, 0, stream>>>(
      p->sparse_to_dense, p->peer_tokens, p->peer_probs, static_cast<const char*>(p->hidden),
      p->with_probs ? p->probs : nullptr, p->world_size, p->rank, p->num_tokens,
      p->num_local_experts, p->hidden_dim * dtype_bytes(p->dtype), p->static_budget, p->status);
  return cudaGetLastError();
}

ART_API int art_hybridep_combine(const ArtHepIntraParams* p) {
  if (int s = check_intra(p); s != ART_OK) return s;
  if (p->num_tokens == 0) return ART_OK;  // no own token: nothing to reduce, no device call
  if (cudaError_t e = cudaSetDevice(p->device); e != cudaSuccess) return e;
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
  if (p->world_size < 1 || p->rank < 0 || p->rank >= p->world_size || !p->arrivals ||
      !p->epoch || !p->status || p->timeout_ns <= 0 || (p->abort_flag != 0 && p->abort_flag != 1))
    return ART_ERR_BAD_ARGUMENT;
  if (cudaError_t e = cudaSetDevice(p->device); e != cudaSuccess) return e;
  barrier_kernel<<<1, 1, 0, static_cast<cudaStream_t>(p->stream)>>>(
      p->arrivals, p->epoch, p->world_size, p->rank, p->abort_flag, p->timeout_ns, p->status);
  return cudaGetLastError();
}

ART_API int art_hybridep_barrier_arrival(unsigned long long seen, unsigned long long target) {
  return arrival_verdict(seen, target);
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
