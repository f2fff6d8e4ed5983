// The one calling convention shared by the CUDA kernels and the Rust host code.
//
// Rust mirrors every struct here with #[repr(C)] (rust/gpu/abi.rs); a Rust test reads the
// sizes and offsets nvcc actually compiled (from the embedded abi_probe cubin) and compares.
// Only fixed-width fields; device pointers travel as uint64_t so the layout is the same on
// host and device. Append-only: never reorder or retype an existing field.
#pragma once
#include <stdint.h>

#define MK_ABI_VERSION 1

// Fused residual add + RMSNorm over `rows` rows of `dim` bf16 values:
//   v = x + delta (fp32);  x <- bf16(v);  out <- bf16(v * rsqrt(mean(v^2) + eps) * gamma)
// `delta` may be 0 (no add). `dim` must be a multiple of 8 (16-byte vectors).
typedef struct MkAddRmsnormArgs {
    uint64_t x;      // bf16 [rows, dim], residual stream, updated in place
    uint64_t delta;  // bf16 [rows, dim] or 0
    uint64_t gamma;  // bf16 [dim]
    uint64_t out;    // bf16 [rows, dim]
    int32_t rows;
    int32_t dim;
    float eps;
    int32_t reserved;  // keeps the struct a multiple of 8 bytes on both sides
} MkAddRmsnormArgs;

// y = x · Wᵀ for a decode batch: x bf16 [batch, k], W bf16 [n, k] (nn.Linear layout),
// y bf16 [batch, n]. n % 16 == 0, k % 32 == 0, 1 <= batch <= 64.
typedef struct MkGemvArgs {
    uint64_t w;
    uint64_t x;
    uint64_t y;
    int32_t n;
    int32_t k;
    int32_t batch;
    int32_t reserved;
} MkGemvArgs;
