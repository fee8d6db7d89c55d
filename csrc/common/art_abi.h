// Shared conventions of every C ABI in csrc/ (see docs/kernels.md).
//
// Every exported function is `extern "C"`, returns an int status (0 = ok, otherwise a
// cudaError_t or one of the ART_ERR_* codes below) and takes a params struct whose first two
// fields are `uint32_t abi_version; uint32_t struct_size;`, checked before anything runs, so a
// stale library loaded by a newer Python side fails loudly instead of reading garbage.
#pragma once
#include <cstdint>

#define ART_API extern "C" __attribute__((visibility("default")))

enum ArtStatus : int {
  ART_OK = 0,
  ART_ERR_ABI_MISMATCH = 10001,   // params.abi_version / struct_size differ from the build
  ART_ERR_BAD_ARGUMENT = 10002,   // a shape, pointer or alignment the kernel cannot take
  ART_ERR_UNSUPPORTED = 10003,    // a valid request this build does not implement
  ART_ERR_CUTLASS = 10004,        // CUTLASS can_implement/initialize/run refused
  ART_ERR_TIMEOUT = 10005,        // a spin wait exceeded its clock64 budget
};

#define ART_CHECK_PARAMS(p, VERSION)                                              \
  do {                                                                            \
    if ((p) == nullptr || (p)->abi_version != (VERSION) ||                        \
        (p)->struct_size != sizeof(*(p)))                                         \
      return ART_ERR_ABI_MISMATCH;                                                \
  } while (0)
