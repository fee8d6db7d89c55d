// The C ABI of libart_grouped_gemm.so: argument checks, tile-config choice, dispatch.
#include <cuda_runtime.h>

#include <algorithm>
#include <mutex>

#include "grouped_gemm.h"
#include "grouped_gemm_ops.h"

namespace art_gg {

int sm_count(int device) {
  static std::mutex mu;
  static int cached[64] = {0};
  if (device < 0 || device >= 64) return 0;
  std::lock_guard<std::mutex> lock(mu);
  if (cached[device] == 0) cudaDeviceGetAttribute(&cached[device], cudaDevAttrMultiProcessorCount, device);
  return cached[device];
}

namespace {

// Rows per group below which 128-row ping-pong tiles beat 256-row cooperative ones: a group
// of r rows wastes (256 - r % 256) rows of a cooperative tile, and ping-pong overlaps epilogues.
constexpr int64_t kPingpongBelowRowsPerGroup = 256;

// Scalars only: no pointer is read and no device call made (pick_config, workspace_size).
int check_scalars(const ArtGroupedGemmParams* p) {
  ART_CHECK_PARAMS(p, ART_GROUPED_GEMM_ABI_VERSION);
  if (p->num_groups <= 0 || p->total_rows < 0 || p->k <= 0 || p->n <= 0) return ART_ERR_BAD_ARGUMENT;
  if (p->k % kAlign != 0 || p->n % kAlign != 0) return ART_ERR_BAD_ARGUMENT;
  if (p->k > INT32_MAX || p->n > INT32_MAX || p->total_rows > INT32_MAX) return ART_ERR_BAD_ARGUMENT;
  if (p->config < ART_GG_CONFIG_AUTO || p->config >= ART_GG_NUM_CONFIGS) return ART_ERR_BAD_ARGUMENT;
  return ART_OK;
}

// Pointers a launch needs. With rows == false (total_rows == 0, wgrad) only `out` (dW, which
// is not empty) is used; the row matrices, group_end and the workspace may be null.
int check_pointers(const ArtGroupedGemmParams* p, bool rows) {
  auto misaligned = [](const void* q, uintptr_t m) { return reinterpret_cast<uintptr_t>(q) % m != 0; };
  if (!p->out || misaligned(p->out, 16)) return ART_ERR_BAD_ARGUMENT;
  if (rows) {
    if (!p->group_end || !p->a || !p->b || !p->workspace) return ART_ERR_BAD_ARGUMENT;
    if (misaligned(p->a, 16) || misaligned(p->b, 16) || misaligned(p->workspace, 256))
      return ART_ERR_BAD_ARGUMENT;
  }
  // torch's cudart and ours (linked statically) keep separate current devices: follow the caller.
  if (cudaError_t e = cudaSetDevice(p->device); e != cudaSuccess) return e;
  return ART_OK;
}

int resolve_config(const ArtGroupedGemmParams* p) {
  if (p->config != ART_GG_CONFIG_AUTO) return p->config;
  const int64_t rows_per_group = p->total_rows / p->num_groups;
  return rows_per_group < kPingpongBelowRowsPerGroup ? ART_GG_CONFIG_PINGPONG_128x128
                                                     : ART_GG_CONFIG_COOP_256x128;
}

}  // namespace
}  // namespace art_gg

using namespace art_gg;

ART_API uint32_t art_grouped_gemm_abi_version(void) { return ART_GROUPED_GEMM_ABI_VERSION; }

ART_API int art_grouped_gemm_pick_config(const ArtGroupedGemmParams* p, int32_t* config) {
  if (int s = check_scalars(p); s != ART_OK) return s;
  *config = resolve_config(p);
  return ART_OK;
}

// The largest of the three ops' needs, so one workspace serves forward and backward.
ART_API int art_grouped_gemm_workspace_size(const ArtGroupedGemmParams* p, int64_t* bytes) {
  if (int s = check_scalars(p); s != ART_OK) return s;
  if (cudaError_t e = cudaSetDevice(p->device); e != cudaSuccess) return e;
  int64_t most = 0;
  for (int c = 0; c < ART_GG_NUM_CONFIGS; ++c) {
    most = std::max({most, fwd_workspace(p->num_groups, c), dgrad_workspace(p->num_groups, c),
                     wgrad_workspace(p->num_groups, c)});
  }
  *bytes = most;
  return ART_OK;
}

ART_API int art_grouped_gemm_fwd(const ArtGroupedGemmParams* p) {
  if (int s = check_scalars(p); s != ART_OK) return s;
  if (p->total_rows == 0) return ART_OK;  // Y is empty: nothing to compute, no device call
  if (int s = check_pointers(p, true); s != ART_OK) return s;
  return fwd(p, resolve_config(p));
}

ART_API int art_grouped_gemm_dgrad(const ArtGroupedGemmParams* p) {
  if (int s = check_scalars(p); s != ART_OK) return s;
  if (p->total_rows == 0) return ART_OK;  // dX is empty
  if (int s = check_pointers(p, true); s != ART_OK) return s;
  return dgrad(p, resolve_config(p));
}

ART_API int art_grouped_gemm_wgrad(const ArtGroupedGemmParams* p) {
  if (int s = check_scalars(p); s != ART_OK) return s;
  if (int s = check_pointers(p, p->total_rows > 0); s != ART_OK) return s;
  return wgrad(p, resolve_config(p));  // total_rows == 0: zeroes dW (every group is empty)
}
