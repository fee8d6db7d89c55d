// Local permute / unpermute between receive rows and the expert-major, P-padded layout
// (hybridep/movement.py: permute is pure data movement with zero padding; unpermute sums a
// row's local experts in fp32, in expert index order, and rounds once).
#include "hybridep_common.cuh"

namespace art_hep {
namespace {

__global__ void scatter_source_kernel(const int32_t* positions, int32_t* source, int64_t pairs) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t pos = positions[i];
    if (pos >= 0) source[pos] = static_cast<int32_t>(i);  // positions are unique
  }
}

// One block per permuted row: copy its source receive row, or zero it (padding / unused).
__global__ void permute_rows_kernel(const int32_t* source, const char* recv, const float* recv_probs,
                                    char* out, float* out_probs, int64_t rows, int64_t row_bytes,
                                    int L) {
  for (int64_t m = blockIdx.x; m < rows; m += gridDim.x) {
    const int32_t src = source[m];
    char* dst = out + m * row_bytes;
    if (src >= 0) {
      copy_row(dst, recv + int64_t(src / L) * row_bytes, row_bytes, threadIdx.x, blockDim.x);
    } else {
      zero_row(dst, row_bytes, threadIdx.x, blockDim.x);
    }
    if (out_probs && threadIdx.x == 0) out_probs[m] = src >= 0 ? recv_probs[src] : 0.0f;
  }
}

// One block per receive row; each thread owns VEC consecutive elements.
template <typename T, int VEC>
__global__ void unpermute_rows_kernel(const int32_t* positions, const T* tokens, const float* probs,
                                      T* recv, float* recv_probs, int64_t rows, int64_t H, int L) {
  for (int64_t n = blockIdx.x; n < rows; n += gridDim.x) {
    const int32_t* pos = positions + n * L;
    for (int64_t h0 = int64_t(threadIdx.x) * VEC; h0 < H; h0 += int64_t(blockDim.x) * VEC) {
      float acc[VEC];
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
      for (int l = 0; l < L; ++l) {
        const int32_t p = pos[l];
        if (p < 0) continue;
        const T* src = tokens + int64_t(p) * H + h0;
        if constexpr (VEC * sizeof(T) == 16) {  // one 16-byte load per term
          const uint4 raw = *reinterpret_cast<const uint4*>(src);
          const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], Cvt<T>::load(e[v]));
        } else {
#pragma unroll
          for (int v = 0; v < VEC; ++v) acc[v] = __fadd_rn(acc[v], Cvt<T>::load(src[v]));
        }
      }
      T* dst = recv + n * H + h0;
      if constexpr (VEC * sizeof(T) == 16) {
        uint4 raw;
        T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
        for (int v = 0; v < VEC; ++v) e[v] = Cvt<T>::store(acc[v]);
        *reinterpret_cast<uint4*>(dst) = raw;
      } else {
#pragma unroll
        for (int v = 0; v < VEC; ++v) dst[v] = Cvt<T>::store(acc[v]);
      }
    }
    if (recv_probs) {
      for (int l = threadIdx.x; l < L; l += blockDim.x) {
        const int32_t p = pos[l];
        recv_probs[n * L + l] = p >= 0 ? probs[p] : 0.0f;
      }
    }
  }
}

template <typename T>
void launch_unpermute(const ArtHepPermuteParams* p, cudaStream_t stream) {
  constexpr int kVec = 16 / sizeof(T);
  const int blocks = capped_grid(p->num_recv_rows, 1, p->max_blocks);
  auto* tokens = static_cast<const T*>(p->tokens);
  auto* recv = static_cast<T*>(const_cast<void*>(p->recv_hidden));
  auto* recv_probs = p->with_probs ? const_cast<float*>(p->recv_probs) : nullptr;
  // 16-byte loads need the row pitch *and* both base pointers aligned (a view into the
  // middle of a tensor is not); otherwise one element per access.
  if (vector_width(p->dtype, p->hidden_dim, p->tokens, p->recv_hidden) == kVec) {
    unpermute_rows_kernel<T, kVec><<<blocks, 128, 0, stream>>>(
        p->positions, tokens, p->probs, recv, recv_probs, p->num_recv_rows, p->hidden_dim,
        p->num_local_experts);
  } else {
    unpermute_rows_kernel<T, 1><<<blocks, 128, 0, stream>>>(
        p->positions, tokens, p->probs, recv, recv_probs, p->num_recv_rows, p->hidden_dim,
        p->num_local_experts);
  }
}

// Scalars first, then pointers: an array may be null exactly when it has no element (N = 0
// receive rows, M = 0 permuted rows), and probs are used only when `with_probs` says so.
int check(const ArtHepPermuteParams* p) {
  ART_CHECK_PARAMS(p, ART_HYBRIDEP_ABI_VERSION);
  if (p->dtype < kBf16 || p->dtype > kFp32 || p->num_recv_rows < 0 || p->num_permuted < 0 ||
      p->hidden_dim < 1 || p->num_local_experts < 1 || p->max_blocks < 0 ||
      (p->with_probs != 0 && p->with_probs != 1))
    return ART_ERR_BAD_ARGUMENT;
  const bool rows = p->num_recv_rows > 0, permuted = p->num_permuted > 0;
  if ((rows && (!p->positions || !p->recv_hidden)) || (permuted && !p->tokens) ||
      (p->with_probs && ((rows && !p->recv_probs) || (permuted && !p->probs))))
    return ART_ERR_BAD_ARGUMENT;
  return ART_OK;
}

}  // namespace
}  // namespace art_hep

using namespace art_hep;

ART_API int32_t art_hybridep_vector_width(int32_t dtype, int64_t hidden_dim, const void* a,
                                          const void* b) {
  if (dtype < kBf16 || dtype > kFp32 || hidden_dim < 1) return 0;
  return vector_width(dtype, hidden_dim, a, b);
}

ART_API int art_hybridep_permute(const ArtHepPermuteParams* p) {
  if (int s = check(p); s != ART_OK) return s;
  if (p->num_permuted == 0) return ART_OK;  // nothing to write: no device call at all
  if (!p->source) return ART_ERR_BAD_ARGUMENT;
  if (cudaError_t e = cudaSetDevice(p->device); e != cudaSuccess) return e;
  auto stream = static_cast<cudaStream_t>(p->stream);
  const int64_t pairs = p->num_recv_rows * p->num_local_experts;
  if (cudaError_t e = cudaMemsetAsync(p->source, 0xff, p->num_permuted * sizeof(int32_t), stream);
      e != cudaSuccess)
    return e;
  if (pairs > 0) {
    scatter_source_kernel<<<grid_for(pairs, 256, 4096), 256, 0, stream>>>(p->positions, p->source,
                                                                           pairs);
  }
  const int64_t row_bytes = p->hidden_dim * dtype_bytes(p->dtype);
  permute_rows_kernel<<<capped_grid(p->num_permuted, 1, p->max_blocks), 128, 0, stream>>>(
      p->source, static_cast<const char*>(p->recv_hidden), p->recv_probs,
      static_cast<char*>(const_cast<void*>(p->tokens)),
      p->with_probs ? const_cast<float*>(p->probs) : nullptr,
      p->num_permuted, row_bytes, p->num_local_experts);
  return cudaGetLastError();
}

ART_API int art_hybridep_unpermute(const ArtHepPermuteParams* p) {
  if (int s = check(p); s != ART_OK) return s;
  if (p->num_recv_rows == 0) return ART_OK;  // nothing to write: no device call at all
  if (cudaError_t e = cudaSetDevice(p->device); e != cudaSuccess) return e;
  auto stream = static_cast<cudaStream_t>(p->stream);
  switch (p->dtype) {
    case kBf16: launch_unpermute<__nv_bfloat16>(p, stream); break;
    case kFp16: launch_unpermute<__half>(p, stream); break;
    default: launch_unpermute<float>(p, stream); break;
  }
  return cudaGetLastError();
}
