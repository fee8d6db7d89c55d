// Dgrad instantiations: dX_g = dY_g @ W_g^T (one translation unit per op keeps rebuilds local).
#include "grouped_gemm_kernel.cuh"

namespace art_gg {

int dgrad(const ArtGroupedGemmParams* p, int config) {
  if (config == ART_GG_CONFIG_PINGPONG_128x128) return run<DgradPingpong, OpKind::kDgrad>(p);
  return run<DgradCoop, OpKind::kDgrad>(p);
}

int64_t dgrad_workspace(int groups, int config) {
  if (config == ART_GG_CONFIG_PINGPONG_128x128) return workspace_bytes<DgradPingpong>(groups);
  return workspace_bytes<DgradCoop>(groups);
}

}  // namespace art_gg
