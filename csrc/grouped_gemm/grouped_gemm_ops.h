// Internal interface between the C ABI (gg_api.cu) and the per-op translation units, kept
// free of CUTLASS headers so the ABI unit compiles in seconds.
#pragma once
#include <cstdint>

#include "grouped_gemm.h"

namespace art_gg {

constexpr int kAlign = 8;  // 8 bf16 = 16 bytes, the TMA stride alignment

// Rows [*start, *start + rows) of group g, from the device-side group_end. An inconsistent
// entry (decreasing, past total_rows, or a last end other than total_rows) makes the group
// empty, so no kernel reads or writes outside the matrices, and raises the error flag.
__device__ inline int64_t group_rows(const int32_t* group_end, int g, int groups,
                                     int64_t total_rows, int32_t* error_flag, int64_t* start) {
  const int64_t lo = g == 0 ? 0 : group_end[g - 1];
  const int64_t hi = group_end[g];
  const bool bad = lo < 0 || hi < lo || hi > total_rows || (g == groups - 1 && hi != total_rows);
  if (bad) {
    if (error_flag) *reinterpret_cast<volatile int32_t*>(error_flag) = 1;
    *start = 0;
    return 0;
  }
  *start = lo;
  return hi - lo;
}

int sm_count(int device);  // cached cudaDevAttrMultiProcessorCount (defined in gg_api.cu)

int fwd(const ArtGroupedGemmParams* p, int config);
int dgrad(const ArtGroupedGemmParams* p, int config);
int wgrad(const ArtGroupedGemmParams* p, int config);
int64_t fwd_workspace(int groups, int config);
int64_t dgrad_workspace(int groups, int config);
int64_t wgrad_workspace(int groups, int config);

}  // namespace art_gg
