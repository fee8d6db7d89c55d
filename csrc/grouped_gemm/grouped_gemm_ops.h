// Internal interface between the C ABI (gg_api.cu) and the per-op translation units, kept
// free of CUTLASS headers so the ABI unit compiles in seconds.
#pragma once
#include <cstdint>

#include "grouped_gemm.h"

namespace art_gg {

constexpr int kAlign = 8;  // 8 bf16 = 16 bytes, the TMA stride alignment

int sm_count(int device);  // cached cudaDevAttrMultiProcessorCount (defined in gg_api.cu)

int fwd(const ArtGroupedGemmParams* p, int config);
int dgrad(const ArtGroupedGemmParams* p, int config);
int wgrad(const ArtGroupedGemmParams* p, int config);
int64_t fwd_workspace(int groups, int config);
int64_t dgrad_workspace(int groups, int config);
int64_t wgrad_workspace(int groups, int config);

}  // namespace art_gg
