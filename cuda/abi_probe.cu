// Not a kernel: a table of the ABI struct layouts as nvcc compiled them for the device. The Rust
// test `abi_layout_matches_nvcc` reads this symbol out of the embedded cubin. Order of entries:
// see rust/gpu/abi.rs (ABI_PROBE_FIELDS).
#include <stddef.h>
#include "abi.h"

extern "C" __device__ const unsigned long long mk_abi_layout[] = {
    MK_ABI_VERSION,
    sizeof(MkAddRmsnormArgs),
    offsetof(MkAddRmsnormArgs, x),
    offsetof(MkAddRmsnormArgs, delta),
    offsetof(MkAddRmsnormArgs, gamma),
    offsetof(MkAddRmsnormArgs, out),
    offsetof(MkAddRmsnormArgs, rows),
    offsetof(MkAddRmsnormArgs, dim),
    offsetof(MkAddRmsnormArgs, eps),
    offsetof(MkAddRmsnormArgs, reserved),
    sizeof(MkGemvArgs),
    offsetof(MkGemvArgs, w),
    offsetof(MkGemvArgs, x),
    offsetof(MkGemvArgs, y),
    offsetof(MkGemvArgs, n),
    offsetof(MkGemvArgs, k),
    offsetof(MkGemvArgs, batch),
    offsetof(MkGemvArgs, reserved),
};
