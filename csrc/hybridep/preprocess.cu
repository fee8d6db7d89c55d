// Preprocessing: the all-gathered routing map -> this rank's dispatch layout (hybridep/layout.py).
//
// Four short launches, all on the device (no host sync, so the static-budget path can be
// captured in a CUDA graph): (1) per-slot "needs rank d" bits, (2) one block per column
// (W destination columns, L local-expert columns) scanning the S slots in order, (3) padded
// expert block starts and counts, (4) final positions with the budget clamp. The elementwise
// launches (1) and (4) spread over `num_sms` SMs (HybridEPConfig.num_sms_preprocessing, so
// preprocessing can overlap compute on the other SMs); the scan is W + L blocks whatever it is.
#include <cub/block/block_scan.cuh>

#include "hybridep_common.cuh"

namespace art_hep {
namespace {

constexpr int kScanThreads = 512;

__global__ void need_kernel(const uint8_t* map, uint8_t* need, int64_t slots, int world, int L) {
  const int64_t total = slots * world;
  const int64_t experts = static_cast<int64_t>(world) * L;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t s = i / world;
    const int d = static_cast<int>(i % world);
    const uint8_t* row = map + s * experts + int64_t(d) * L;
    uint8_t any = 0;
    for (int l = 0; l < L; ++l) any |= row[l];
    need[i] = any ? 1 : 0;
  }
}

// Block c < W scans need[:, c] (exclusive prefix = row at rank c); block c >= W scans this
// rank's expert column l = c - W (exclusive prefix = rank within the expert block).
__global__ void __launch_bounds__(kScanThreads) column_scan_kernel(
    const uint8_t* map, const uint8_t* need, int32_t* sparse, int32_t* positions, int64_t* counts,
    int world, int rank, int tokens, int L, int is_static) {
  using Scan = cub::BlockScan<int, kScanThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int column = blockIdx.x;
  const int64_t slots = int64_t(world) * tokens;
  const int64_t experts = int64_t(world) * L;
  const int64_t own_lo = int64_t(rank) * tokens;
  int running = 0;
  for (int64_t base = 0; base < slots; base += kScanThreads) {
    const int64_t s = base + threadIdx.x;
    const bool in = s < slots;
    int v = 0;
    if (in) {
      v = column < world ? need[s * world + column] : map[s * experts + int64_t(rank) * L + (column - world)];
    }
    int prefix, chunk_total;
    Scan(temp).ExclusiveSum(v, prefix, chunk_total);
    __syncthreads();  // temp storage is reused by the next chunk
    prefix += running;
    running += chunk_total;
    if (!in) continue;
    if (column < world) {
      if (s >= own_lo && s < own_lo + tokens) {
        const int64_t t = s - own_lo;
        sparse[t * world + column] = v ? (is_static ? static_cast<int32_t>(s) : prefix) : -1;
      }
    } else {
      positions[s * L + (column - world)] = v ? prefix : -1;
    }
  }
  if (column >= world && threadIdx.x == 0) counts[column - world] = running;
}

// counts -> padded block starts (scratch[L + l]) and tokens_per_expert; clears the flag.
__global__ void starts_kernel(int64_t* scratch, int64_t* tokens_per_expert, int32_t* overflow,
                              int L, int P, int64_t budget) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t start = 0;
  for (int l = 0; l < L; ++l) {
    const int64_t padded = (scratch[l] + P - 1) / P * P;
    scratch[L + l] = start;
    int64_t left = budget - start;
    left = left > 0 ? left : 0;
    tokens_per_expert[l] = budget < 0 ? padded : (padded < left ? padded : left);
    start += padded;
  }
  *overflow = 0;
}

__global__ void positions_kernel(int32_t* positions, const int64_t* scratch, int32_t* overflow,
                                 int64_t slots, int L, int64_t budget) {
  const int64_t total = slots * L;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t r = positions[i];
    if (r < 0) continue;
    const int64_t pos = scratch[L + i % L] + r;
    if (budget >= 0 && pos >= budget) {
      positions[i] = -1;
      *overflow = 1;  // racing writers all store 1
    } else {
      positions[i] = static_cast<int32_t>(pos);
    }
  }
}

}  // namespace
}  // namespace art_hep

using namespace art_hep;

ART_API uint32_t art_hybridep_abi_version(void) { return ART_HYBRIDEP_ABI_VERSION; }

ART_API int art_hybridep_preprocess(const ArtHepLayoutParams* p) {
  ART_CHECK_PARAMS(p, ART_HYBRIDEP_ABI_VERSION);
  if (p->world_size < 1 || p->rank < 0 || p->rank >= p->world_size || p->num_tokens < 0 ||
      p->num_local_experts < 1 || p->pad_multiple < 1 || p->num_sms < 0)
    return ART_ERR_BAD_ARGUMENT;
  const int W = p->world_size, L = p->num_local_experts;
  const int64_t slots = int64_t(W) * p->num_tokens;
  // T = 0: the map, need, sparse_to_dense and positions arrays are empty (null pointers);
  // the counts and the flag still have to be written (all zero).
  if (!p->tokens_per_expert || !p->overflow_flag || !p->scratch) return ART_ERR_BAD_ARGUMENT;
  if (slots > 0 && (!p->global_map || !p->need || !p->sparse_to_dense || !p->positions))
    return ART_ERR_BAD_ARGUMENT;
  if (cudaError_t e = cudaSetDevice(p->device); e != cudaSuccess) return e;
  auto stream = static_cast<cudaStream_t>(p->stream);
  if (slots > 0) {
    need_kernel<<<grid_for_sms(need_kernel, 256, p->num_sms, slots * W, 256), 256, 0,
                  stream>>>(p->global_map, p->need, slots, W, L);
  }
  column_scan_kernel<<<W + L, kScanThreads, 0, stream>>>(
      p->global_map, p->need, p->sparse_to_dense, p->positions, p->scratch, W, p->rank,
      p->num_tokens, L, p->budget >= 0 ? 1 : 0);
  starts_kernel<<<1, 32, 0, stream>>>(p->scratch, p->tokens_per_expert, p->overflow_flag, L,
                                      p->pad_multiple, p->budget);
  if (slots > 0) {
    positions_kernel<<<grid_for_sms(positions_kernel, 256, p->num_sms, slots * L, 256), 256, 0,
                       stream>>>(p->positions, p->scratch, p->overflow_flag, slots, L, p->budget);
  }
  return cudaGetLastError();
}
