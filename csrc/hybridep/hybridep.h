// C ABI of the HybridEP CUDA kernels (libart_hybridep.so). See docs/kernels.md and
// hybridep/backends/cuda.py; the semantics are those of hybridep/layout.py and movement.py,
// reproduced bit for bit.
//
// Vocabulary: W ranks (one NVLink domain; inter-node is refused on the Python side), T tokens
// per rank, L local experts, E = W*L, S = W*T slots (source rank, token), N receive rows,
// M permuted rows. All arrays are device pointers, row-major, int32 unless said otherwise.
#pragma once
#include <cstdint>

#include "art_abi.h"

#define ART_HYBRIDEP_ABI_VERSION 3u

// Zero rows: a pointer may be null exactly when its array has no element (PyTorch hands out
// null data pointers for 0-byte CUDA tensors), and whether probs travel is an explicit flag,
// not inferred from pointers. A call with nothing to do returns ART_OK before it touches the
// device.
//
// Status block: int32[ART_HEP_STATUS_WORDS] in mapped (pinned) host memory, written by the
// device and read by the host without a synchronization. A nonzero word 0 is sticky: every
// later cross-rank kernel of the buffer returns at once, so a late peer fails the call (the
// host raises naming the missing rank) instead of trapping and killing the CUDA context.
// A rank whose call failed between two barriers still reaches every barrier of the call, with
// `abort_flag` set (ArtHepBarrierParams): its peers record ART_HEP_STATUS_PEER_FAILED naming
// it, so nobody waits for a timeout and nobody trusts the rows of that call afterwards.
enum ArtHepStatus : int32_t {
  ART_HEP_STATUS_OK = 0,
  ART_HEP_STATUS_BARRIER_TIMEOUT = 1,  // word 1: first missing rank, word 2: barrier epoch
  ART_HEP_STATUS_PEER_FAILED = 2,      // word 1: first rank that aborted, word 2: barrier epoch
};
#define ART_HEP_STATUS_WORDS 4

// Preprocessing of one dispatch on one rank, from the all-gathered routing map.
struct ArtHepLayoutParams {
  uint32_t abi_version;
  uint32_t struct_size;
  int32_t device;
  int32_t world_size;         // W
  int32_t rank;
  int32_t num_tokens;         // T
  int32_t num_local_experts;  // L
  int32_t pad_multiple;       // P >= 1
  int32_t num_sms;            // SM budget of the elementwise scans (HybridEPConfig
                              // .num_sms_preprocessing); 0 = all. The column scan is W + L blocks.
  int32_t reserved;           // 0
  int64_t budget;             // M in static-budget mode, -1 = blocking (no clamp)
  const uint8_t* global_map;  // [S, E] 0/1 bytes, slot-major (source rank, then token)
  uint8_t* need;              // out [S, W]: slot uses an expert of rank d
  int32_t* sparse_to_dense;   // out [T, W]: own token's row at rank d, or -1
  int32_t* positions;         // out [S, L]: permuted row of (slot, local expert), or -1
  int64_t* tokens_per_expert; // out [L]: padded block sizes (clamped to the budget)
  int32_t* overflow_flag;     // out [1]
  int64_t* scratch;           // [2*L + 1] int64 workspace
  void* stream;
};

// Local permute (receive rows -> expert-major) and unpermute (the reverse, fp32 sum).
struct ArtHepPermuteParams {
  uint32_t abi_version;
  uint32_t struct_size;
  int32_t device;
  int32_t dtype;              // 0 bf16, 1 fp16, 2 fp32 (unpermute sums in fp32 and rounds once)
  int64_t num_recv_rows;      // N
  int64_t num_permuted;       // M
  int64_t hidden_dim;         // H
  int32_t num_local_experts;  // L
  int32_t max_blocks;         // grid cap (HybridEPConfig.num_blocks_(un)permute); 0 = one per row
  int32_t with_probs;         // 1: probs move too (recv_probs / probs below are used)
  int32_t reserved;           // 0
  const int32_t* positions;   // [N, L] (the handle's dense_to_expert_map)
  const void* recv_hidden;    // permute in [N, H]      | unpermute out [N, H]
  const float* recv_probs;    // permute in [N, L] / nullptr | unpermute out [N, L] / nullptr
  const void* tokens;         // permute out [M, H]     | unpermute in [M, H]
  const float* probs;         // permute out [M] / nullptr | unpermute in [M] / nullptr
  int32_t* source;            // permute scratch [M]
  void* stream;
};

// Intra-node dispatch (push into peers' receive buffers) and combine (pull and reduce).
struct ArtHepIntraParams {
  uint32_t abi_version;
  uint32_t struct_size;
  int32_t device;
  int32_t dtype;              // as above (combine's reduction)
  int32_t world_size;
  int32_t rank;
  int32_t num_tokens;         // T
  int32_t num_local_experts;  // L
  int64_t hidden_dim;         // H
  int32_t static_budget;      // 1: every own slot row is written (zeros where not routed)
  int32_t num_sms;            // SM budget (HybridEPConfig.num_sms_dispatch/combine); 0 = all
  int32_t with_probs;         // 1: prob slices move too
  int32_t reserved;           // 0
  const int32_t* sparse_to_dense;  // [T, W]
  void* const* peer_tokens;   // device array [W]: each rank's receive-row token area
  void* const* peer_probs;    // device array [W]: each rank's receive-row prob area [rows, L]
  const void* hidden;         // dispatch in [T, H]      | combine out [T, H]
  const float* probs;         // dispatch in [T, E] | combine out [T, E] (with_probs)
  const int32_t* status;      // the buffer's status block: kernels return when word 0 != 0
  void* stream;
};

// Cross-rank barrier: rank r stores its new epoch into arrivals[r] (an array in rank 0's
// registered block) and waits until every arrivals[i] reaches it (monotonic, never reset).
// On timeout it records the first missing rank in `status` and returns (no trap). An aborting
// rank posts its epoch with the top bit set; every rank (itself included) that sees it at that
// epoch records PEER_FAILED after the barrier completes (a bit seen on a later epoch than the
// reader's barrier belongs to the peer's next barrier: art_hybridep_barrier_arrival).
struct ArtHepBarrierParams {
  uint32_t abi_version;
  uint32_t struct_size;
  int32_t device;
  int32_t world_size;
  int32_t rank;
  int32_t abort_flag;           // 1: this rank's call failed; peers record PEER_FAILED
  unsigned long long* arrivals; // rank 0's arrivals[W], mapped into this process
  unsigned long long* epoch;    // this rank's own epoch word (device memory it alone uses)
  int64_t timeout_ns;           // %globaltimer budget of the spin (HybridEPConfig)
  int32_t* status;              // the buffer's status block (mapped host memory)
  void* stream;
};

ART_API uint32_t art_hybridep_abi_version(void);
ART_API int art_hybridep_preprocess(const ArtHepLayoutParams* p);
ART_API int art_hybridep_permute(const ArtHepPermuteParams* p);
ART_API int art_hybridep_unpermute(const ArtHepPermuteParams* p);
ART_API int art_hybridep_dispatch(const ArtHepIntraParams* p);
ART_API int art_hybridep_combine(const ArtHepIntraParams* p);
ART_API int art_hybridep_barrier(const ArtHepBarrierParams* p);
// The barrier's rule for one peer's arrival word `seen` at barrier `target` (host-callable, the
// device code calls the same function): 0 wait, 1 passed, 2 passed and that peer aborted this
// barrier. Exported so the CPU emulation of the device's ordering runs the compiled rule.
ART_API int art_hybridep_barrier_arrival(unsigned long long seen, unsigned long long target);
// Registered (peer-visible) memory: a plain cudaMalloc block shared through CUDA IPC.
ART_API int art_hybridep_alloc(int32_t device, int64_t bytes, void** ptr);
ART_API int art_hybridep_free(int32_t device, void* ptr);
ART_API int art_hybridep_ipc_handle(int32_t device, void* ptr, uint8_t* handle64);
ART_API int art_hybridep_ipc_open(int32_t device, const uint8_t* handle64, void** ptr);
ART_API int art_hybridep_ipc_close(int32_t device, void* ptr);
// Elements per access the (un)permute / combine kernels use for rows of `hidden_dim` elements
// of `dtype` between `a` and `b`: 16 bytes' worth when the row pitch and both base pointers
// are 16-byte aligned, else 1. Host-only (no device call), so CPU CI checks it.
ART_API int32_t art_hybridep_vector_width(int32_t dtype, int64_t hidden_dim, const void* a,
                                          const void* b);
ART_API int art_hybridep_memcpy_d2d(int32_t device, void* dst, const void* src, int64_t bytes,
                                    void* stream);
