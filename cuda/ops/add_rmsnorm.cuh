// Residual add + RMSNorm of one row, by one thread block. The megakernel's norm task and the
// standalone kernel share this body.
#pragma once
#include <cuda_bf16.h>
#include "../abi.h"

namespace mk {

// Sum over the block; `scratch` holds one float per warp.
__device__ inline float block_sum(float v, float* scratch) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = (blockDim.x + 31) / 32;
    float total = 0.f;
    for (int w = 0; w < warps; ++w) total += scratch[w];
    __syncthreads();  // scratch may be reused by the caller right after
    return total;
}

// Rows longer than kMaxVecsPerThread * 8 * blockDim.x are refused by the host.
constexpr int kMaxVecsPerThread = 4;

__device__ inline void add_rmsnorm_row(const MkAddRmsnormArgs& a, int row, float* scratch) {
    using bf16 = __nv_bfloat16;
    const int vecs = a.dim / 8;
    uint4* x = reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(a.x) + (size_t)row * a.dim);
    const uint4* delta =
        a.delta ? reinterpret_cast<const uint4*>(reinterpret_cast<const bf16*>(a.delta) + (size_t)row * a.dim)
                : nullptr;
    const uint4* gamma = reinterpret_cast<const uint4*>(a.gamma);
    uint4* out = reinterpret_cast<uint4*>(reinterpret_cast<bf16*>(a.out) + (size_t)row * a.dim);

    float v[kMaxVecsPerThread][8];
    float sq = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxVecsPerThread; ++i) {
        const int idx = threadIdx.x + i * blockDim.x;
        if (idx >= vecs) break;
        uint4 xv = x[idx];
        const bf16* xs = reinterpret_cast<const bf16*>(&xv);
        uint4 dv = make_uint4(0, 0, 0, 0);
        if (delta) dv = delta[idx];
        const bf16* ds = reinterpret_cast<const bf16*>(&dv);
        uint4 stored;
        bf16* st = reinterpret_cast<bf16*>(&stored);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            v[i][j] = __bfloat162float(xs[j]) + (delta ? __bfloat162float(ds[j]) : 0.f);
            sq += v[i][j] * v[i][j];
            st[j] = __float2bfloat16(v[i][j]);
        }
        if (delta) x[idx] = stored;
    }
    const float rstd = rsqrtf(block_sum(sq, scratch) / (float)a.dim + a.eps);
#pragma unroll
    for (int i = 0; i < kMaxVecsPerThread; ++i) {
        const int idx = threadIdx.x + i * blockDim.x;
        if (idx >= vecs) break;
        uint4 gv = gamma[idx];
        const bf16* gs = reinterpret_cast<const bf16*>(&gv);
        uint4 ov;
        bf16* os = reinterpret_cast<bf16*>(&ov);
#pragma unroll
        for (int j = 0; j < 8; ++j) os[j] = __float2bfloat16(v[i][j] * rstd * __bfloat162float(gs[j]));
        out[idx] = ov;
    }
}

}  // namespace mk
