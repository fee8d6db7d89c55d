// C ABI of the CUTLASS sm_90a grouped GEMM (libart_grouped_gemm.so). See docs/kernels.md.
//
// Groups are consecutive row blocks of the token matrices: group g owns rows
// [group_end[g-1], group_end[g]) (group_end[-1] = 0); zero-row groups are allowed.
// All matrices are row-major bf16, fp32 accumulation:
//   fwd   : X[T,k] , W[G,k,n] -> Y[T,n]      Y_g  = X_g  @ W_g
//   dgrad : dY[T,n], W[G,k,n] -> dX[T,k]     dX_g = dY_g @ W_g^T
//   wgrad : X[T,k] , dY[T,n]  -> dW[G,k,n]   dW_g = X_g^T @ dY_g  (zero for an empty group)
// k and n must be multiples of 8 (16-byte TMA strides); the Python op pads to that.
//
// Zero rows: with total_rows == 0 the row matrices are empty and their pointers may be null
// (PyTorch hands out null data pointers for 0-byte CUDA tensors); fwd/dgrad then return
// ART_OK without touching the device and wgrad only zeroes dW.
// Device-side counts: group_end lives on the GPU, so it is validated there (non-decreasing,
// last == total_rows). A group that breaks this is treated as empty (no out-of-bounds access)
// and, when `error_flag` is set, the device stores 1 there; the caller reads it later without
// a synchronization (mapped host memory) and raises.
#pragma once
#include <cstdint>

#include "art_abi.h"

#define ART_GROUPED_GEMM_ABI_VERSION 2u

enum ArtGroupedGemmConfig : int32_t {
  ART_GG_CONFIG_AUTO = -1,
  ART_GG_CONFIG_COOP_256x128 = 0,  // cooperative, 2 consumer warpgroups: long groups
  ART_GG_CONFIG_PINGPONG_128x128 = 1,  // ping-pong: short groups (few rows per expert)
  ART_GG_NUM_CONFIGS = 2,
};

struct ArtGroupedGemmParams {
  uint32_t abi_version;  // ART_GROUPED_GEMM_ABI_VERSION
  uint32_t struct_size;  // sizeof(ArtGroupedGemmParams)
  int32_t num_groups;
  int32_t config;         // ArtGroupedGemmConfig; AUTO picks by rows per group
  int64_t total_rows;     // T (= group_end[G-1], known on the host from the tensor shape)
  int64_t k;
  int64_t n;
  const int32_t* group_end;  // device, num_groups entries, non-decreasing, last = total_rows
  const void* a;             // fwd: X, dgrad: dY, wgrad: X
  const void* b;             // fwd: W, dgrad: W,  wgrad: dY
  void* out;                 // fwd: Y, dgrad: dX, wgrad: dW
  void* workspace;           // device, >= art_grouped_gemm_workspace_size bytes, 256-B aligned
  int64_t workspace_bytes;
  void* stream;              // cudaStream_t of `device`
  int32_t device;            // CUDA ordinal; set current in this library's (static) runtime
  int32_t reserved;          // 0
  int32_t* error_flag;       // optional (may be null): set to 1 on inconsistent group_end
};

ART_API uint32_t art_grouped_gemm_abi_version(void);
// Bytes of device workspace a call with these params needs (pointers may be null here).
ART_API int art_grouped_gemm_workspace_size(const ArtGroupedGemmParams* p, int64_t* bytes);
// The config AUTO resolves to for these params (for benchmarks and logs).
ART_API int art_grouped_gemm_pick_config(const ArtGroupedGemmParams* p, int32_t* config);
ART_API int art_grouped_gemm_fwd(const ArtGroupedGemmParams* p);
ART_API int art_grouped_gemm_dgrad(const ArtGroupedGemmParams* p);
ART_API int art_grouped_gemm_wgrad(const ArtGroupedGemmParams* p);
