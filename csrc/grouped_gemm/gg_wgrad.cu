// Wgrad instantiation: dW_g = X_g^T @ dY_g. One tile config: M = k and N = n are the fixed
// weight extents, only K (rows of the group) varies, so short groups do not shrink the tiles.
#include "grouped_gemm_kernel.cuh"

namespace art_gg {

// dW_g of a group with no rows is zero; its GEMM has no tiles, so zero it here instead (a
// group made empty by an inconsistent group_end is zeroed too).
__global__ void zero_empty_groups(const int32_t* group_end, int groups, int64_t total_rows,
                                  int64_t elems_per_group, uint4* dw) {
  const int g = blockIdx.y;
  int64_t start = 0;
  if (group_rows(group_end, g, groups, total_rows, nullptr, &start) != 0) return;
  const int64_t vecs = elems_per_group * sizeof(Bf16) / sizeof(uint4);
  uint4* out = dw + g * vecs;
  for (int64_t i = blockIdx.x * blockDim.x + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = make_uint4(0, 0, 0, 0);
}

int wgrad(const ArtGroupedGemmParams* p, int /*config*/) {
  auto stream = static_cast<cudaStream_t>(p->stream);
  if (p->total_rows == 0) {  // every group empty: dW = 0 is the whole answer (no group_end read)
    return cudaMemsetAsync(p->out, 0, p->num_groups * p->k * p->n * sizeof(Bf16), stream);
  }
  dim3 grid(8, p->num_groups);
  zero_empty_groups<<<grid, 256, 0, stream>>>(p->group_end, p->num_groups, p->total_rows,
                                             p->k * p->n, static_cast<uint4*>(p->out));
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  return run<WgradCoop, OpKind::kWgrad>(p);
}

int64_t wgrad_workspace(int groups, int /*config*/) { return workspace_bytes<WgradCoop>(groups); }

}  // namespace art_gg
