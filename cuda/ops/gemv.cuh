// Decode-sized matrix products y[b, n] = sum_k x[b, k] * W[n, k] on the tensor cores.
//
// Weights are the 16-row A operand of mma.sync.m16n8k16 and the batch is N = 8 per n-tile
// ("swap AB"), so every weight byte is read once whatever the batch. The k index inside each
// 32-wide chunk is permuted identically for A and B, which lets each thread fill its fragments
// straight from one 16-byte load per row: no shared memory, no ldmatrix, fully used sectors.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

namespace mk {

using bf16 = __nv_bfloat16;

// Streamed once: skip L1. Only for data no one writes during the kernel (weights).
__device__ __forceinline__ uint4 ld_weights(const void* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Activations may have been written by another SM in the same launch: read them at L2 (.cg).
__device__ __forceinline__ uint4 ld_activations(const void* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One step of 32 k for UNROLL consecutive chunks: all loads first (2 * UNROLL weight vectors in
// flight per thread), then the mma's.
template <int NT, int UNROLL>
__device__ __forceinline__ void gemv_step(const bf16* wa, const bf16* wb, const bf16* x, int ldx, int batch, int k,
                                          float (&acc)[NT][4]) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    uint4 a[UNROLL], b[UNROLL], xv[UNROLL][NT];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        a[u] = ld_weights(wa + k + 32 * u);
        b[u] = ld_weights(wb + k + 32 * u);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int row = 8 * nt + g;
#pragma unroll
        for (int u = 0; u < UNROLL; ++u)
            xv[u][nt] = row < batch ? ld_activations(x + (size_t)row * ldx + k + 32 * u + 8 * t) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            mma_16816(acc[nt], a[u].x, b[u].x, a[u].y, b[u].y, xv[u][nt].x, xv[u][nt].y);
            mma_16816(acc[nt], a[u].z, b[u].z, a[u].w, b[u].w, xv[u][nt].z, xv[u][nt].w);
        }
    }
}

// One warp: partial products of weight rows [row0, row0 + 16) with activation rows
// [0, 8 * NT) over k in [k_begin, k_end) (multiples of 32). Thread (g = lane / 4, t = lane % 4)
// loads k = chunk + 8t .. 8t + 7 of rows row0 + g and row0 + g + 8, and the same k of
// activation row 8 * nt + g. acc[nt][0..1] then hold (row0 + g, batch 8nt + 2t + {0,1}) and
// acc[nt][2..3] hold (row0 + g + 8, same batch). Rows of x at or beyond `batch` read as zero.
// Rows at or past `valid` (< 16 only for a matrix's ragged last tile) re-read the last valid row;
// the caller drops their sums.
template <int NT, int UNROLL>
__device__ __forceinline__ void gemv_warp_rows16(const bf16* __restrict__ w, int ldw, const bf16* x, int ldx,
                                                 int batch, int row0, int k_begin, int k_end,
                                                 float (&acc)[NT][4], int valid = 16) {
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const bf16* wa = w + (size_t)(row0 + min(g, valid - 1)) * ldw + 8 * t;
    const bf16* wb = w + (size_t)(row0 + min(g + 8, valid - 1)) * ldw + 8 * t;
    int k = k_begin;
    for (; k + 32 * UNROLL <= k_end; k += 32 * UNROLL) gemv_step<NT, UNROLL>(wa, wb, x, ldx, batch, k, acc);
    for (; k < k_end; k += 32) gemv_step<NT, 1>(wa, wb, x, ldx, batch, k, acc);
}

}  // namespace mk
