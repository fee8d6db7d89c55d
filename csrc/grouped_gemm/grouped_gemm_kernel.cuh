// CUTLASS 3.x sm_90a ptr-array grouped GEMM, instantiated per (operand layouts, tile config).
//
// Why ptr-array with device-side problem shapes: group sizes live on the GPU (the router made
// them), so a tiny setup kernel turns `group_end` into per-group shapes and pointers, and the
// persistent group tile scheduler skips zero-row groups by itself. No host sync, no per-shape
// instantiation: one binary covers every routing.
#pragma once
#include <cuda_runtime.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "grouped_gemm.h"
#include "grouped_gemm_ops.h"

namespace art_gg {

using namespace cute;
using Bf16 = cutlass::bfloat16_t;
using ProblemShape = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;  // (M, N, K)
using GroupShape = ProblemShape::UnderlyingProblemShape;
using RowMajor = cutlass::layout::RowMajor;
using ColMajor = cutlass::layout::ColumnMajor;

// Long groups: 2 consumer warpgroups share one 256x128 tile; a 2x1 cluster multicasts B.
struct CoopConfig {
  using Tile = Shape<_256, _128, _64>;
  using Cluster = Shape<_2, _1, _1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};

// Short groups (few rows per expert): 128-row tiles waste less, and two consumer warpgroups
// alternate so one's epilogue hides under the other's MMA; a 1x2 cluster multicasts A.
struct PingpongConfig {
  using Tile = Shape<_128, _128, _64>;
  using Cluster = Shape<_1, _2, _1>;
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

template <class LayoutA, class LayoutB, class Cfg>
struct GroupedGemm {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile,
      typename Cfg::Cluster, cutlass::epilogue::collective::EpilogueTileAuto, float, float,
      void, RowMajor*, kAlign, Bf16, RowMajor*, kAlign, typename Cfg::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<Bf16, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Bf16, LayoutA*, kAlign, Bf16,
      LayoutB*, kAlign, float, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::Kernel>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Device = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

enum class OpKind { kFwd, kDgrad, kWgrad };

// Per-group device arrays CUTLASS reads, carved out of the caller's workspace.
template <class G>
struct GroupArrays {
  GroupShape* shapes;
  const Bf16** a;
  const Bf16** b;
  Bf16** d;
  typename G::StrideA* stride_a;
  typename G::StrideB* stride_b;
  typename G::StrideD* stride_d;
  void* cutlass_workspace;
};

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

template <class G>
int64_t group_arrays_bytes(int64_t groups) {
  int64_t b = 0;
  b += round_up(groups * sizeof(GroupShape), 256);
  b += 3 * round_up(groups * sizeof(void*), 256);
  b += round_up(groups * sizeof(typename G::StrideA), 256);
  b += round_up(groups * sizeof(typename G::StrideB), 256);
  b += round_up(groups * sizeof(typename G::StrideD), 256);
  return b;
}

template <class G>
GroupArrays<G> carve(void* workspace, int64_t groups) {
  char* p = static_cast<char*>(workspace);
  auto take = [&](int64_t bytes) {
    char* q = p;
    p += round_up(bytes, 256);
    return q;
  };
  GroupArrays<G> g;
  g.shapes = reinterpret_cast<GroupShape*>(take(groups * sizeof(GroupShape)));
  g.a = reinterpret_cast<const Bf16**>(take(groups * sizeof(void*)));
  g.b = reinterpret_cast<const Bf16**>(take(groups * sizeof(void*)));
  g.d = reinterpret_cast<Bf16**>(take(groups * sizeof(void*)));
  g.stride_a = reinterpret_cast<typename G::StrideA*>(take(groups * sizeof(typename G::StrideA)));
  g.stride_b = reinterpret_cast<typename G::StrideB*>(take(groups * sizeof(typename G::StrideB)));
  g.stride_d = reinterpret_cast<typename G::StrideD*>(take(groups * sizeof(typename G::StrideD)));
  g.cutlass_workspace = p;
  return g;
}

// One thread per group: shape, pointers and (group-invariant) strides of group g.
template <class G, OpKind kOp>
__global__ void setup_groups(GroupArrays<G> g, const int32_t* group_end, int groups, int k, int n,
                             int64_t total_rows, int32_t* error_flag, const Bf16* a,
                             const Bf16* b, Bf16* d, typename G::StrideA sa,
                             typename G::StrideB sb, typename G::StrideD sd) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= groups) return;
  int64_t start = 0;
  const int rows = static_cast<int>(group_rows(group_end, i, groups, total_rows, error_flag,
                                               &start));
  const int64_t kn = static_cast<int64_t>(k) * n;
  if constexpr (kOp == OpKind::kFwd) {  // Y_g[r,n] = X_g[r,k] @ W_g[k,n]
    g.shapes[i] = GroupShape(rows, n, k);
    g.a[i] = a + start * k;
    g.b[i] = b + i * kn;
    g.d[i] = d + start * n;
  } else if constexpr (kOp == OpKind::kDgrad) {  // dX_g[r,k] = dY_g[r,n] @ W_g^T[n,k]
    g.shapes[i] = GroupShape(rows, k, n);
    g.a[i] = a + start * n;
    g.b[i] = b + i * kn;
    g.d[i] = d + start * k;
  } else {  // dW_g[k,n] = X_g^T[k,r] @ dY_g[r,n]; an empty group gets no tiles (zeroed apart)
    g.shapes[i] = GroupShape(rows == 0 ? 0 : k, n, rows);
    g.a[i] = a + start * k;
    g.b[i] = b + start * n;
    g.d[i] = d + i * kn;
  }
  g.stride_a[i] = sa;
  g.stride_b[i] = sb;
  g.stride_d[i] = sd;
}

template <class G>
cutlass::KernelHardwareInfo hw_info() {
  cutlass::KernelHardwareInfo hw;
  cudaGetDevice(&hw.device_id);
  hw.sm_count = sm_count(hw.device_id);
  return hw;
}

template <class G>
typename G::Device::Arguments make_arguments(const GroupArrays<G>& g, int groups) {
  typename G::Device::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGrouped,
      {groups, g.shapes, nullptr},
      {g.a, g.stride_a, g.b, g.stride_b},
      {{}, nullptr, nullptr, g.d, g.stride_d},
      hw_info<G>()};
  args.epilogue.thread.alpha = 1.0f;
  args.epilogue.thread.beta = 0.0f;
  return args;
}

template <class G>
int64_t workspace_bytes(int groups) {
  GroupArrays<G> g{};
  auto args = make_arguments<G>(g, groups);
  return group_arrays_bytes<G>(groups) + round_up(G::Device::get_workspace_size(args), 256);
}

// Strides are the same for every group (row pitch k or n); M/N/K extents only pick which.
template <class G, OpKind kOp>
int run(const ArtGroupedGemmParams* p) {
  const int groups = p->num_groups;
  const int k = static_cast<int>(p->k), n = static_cast<int>(p->n);
  if (p->workspace_bytes < workspace_bytes<G>(groups)) return ART_ERR_BAD_ARGUMENT;
  auto stream = static_cast<cudaStream_t>(p->stream);
  auto g = carve<G>(p->workspace, groups);
  typename G::StrideA sa;
  typename G::StrideB sb;
  typename G::StrideD sd;
  if constexpr (kOp == OpKind::kFwd) {
    sa = cutlass::make_cute_packed_stride(typename G::StrideA{}, {1, k, 1});
    sb = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
    sd = cutlass::make_cute_packed_stride(typename G::StrideD{}, {1, n, 1});
  } else if constexpr (kOp == OpKind::kDgrad) {
    sa = cutlass::make_cute_packed_stride(typename G::StrideA{}, {1, n, 1});
    sb = cutlass::make_cute_packed_stride(typename G::StrideB{}, {k, n, 1});
    sd = cutlass::make_cute_packed_stride(typename G::StrideD{}, {1, k, 1});
  } else {
    sa = cutlass::make_cute_packed_stride(typename G::StrideA{}, {k, 1, 1});
    sb = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, 1, 1});
    sd = cutlass::make_cute_packed_stride(typename G::StrideD{}, {k, n, 1});
  }
  const int threads = 128;
  setup_groups<G, kOp><<<(groups + threads - 1) / threads, threads, 0, stream>>>(
      g, p->group_end, groups, k, n, p->total_rows, p->error_flag, static_cast<const Bf16*>(p->a),
      static_cast<const Bf16*>(p->b), static_cast<Bf16*>(p->out), sa, sb, sd);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  auto args = make_arguments<G>(g, groups);
  typename G::Device gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return ART_ERR_CUTLASS;
  if (gemm.initialize(args, g.cutlass_workspace, stream) != cutlass::Status::kSuccess)
    return ART_ERR_CUTLASS;
  if (gemm.run(stream) != cutlass::Status::kSuccess) {
    cudaError_t e = cudaGetLastError();
    return e != cudaSuccess ? static_cast<int>(e) : static_cast<int>(ART_ERR_CUTLASS);
  }
  return cudaGetLastError();
}

// Forward: X row-major (K-major A), W[k,n] row-major (N-major B).
using FwdCoop = GroupedGemm<RowMajor, RowMajor, CoopConfig>;
using FwdPingpong = GroupedGemm<RowMajor, RowMajor, PingpongConfig>;
// Dgrad: dY row-major (K-major A), W^T read from W[k,n] (K-major B).
using DgradCoop = GroupedGemm<RowMajor, ColMajor, CoopConfig>;
using DgradPingpong = GroupedGemm<RowMajor, ColMajor, PingpongConfig>;
// Wgrad: X^T (M-major A), dY (N-major B); M = k and N = n are fixed, K = rows varies.
using WgradCoop = GroupedGemm<ColMajor, RowMajor, CoopConfig>;

}  // namespace art_gg
