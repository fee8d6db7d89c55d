// Forward instantiations: Y_g = X_g @ W_g (one translation unit per op keeps rebuilds local).
#include "grouped_gemm_kernel.cuh"

namespace art_gg {

int fwd(const ArtGroupedGemmParams* p, int config) {
  if (config == ART_GG_CONFIG_PINGPONG_128x128) return run<FwdPingpong, OpKind::kFwd>(p);
  return run<FwdCoop, OpKind::kFwd>(p);
}

int64_t fwd_workspace(int groups, int config) {
  if (config == ART_GG_CONFIG_PINGPONG_128x128) return workspace_bytes<FwdPingpong>(groups);
  return workspace_bytes<FwdCoop>(groups);
}

}  // namespace art_gg
