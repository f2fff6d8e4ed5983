// Standalone kernels, launched one at a time from Rust through the driver API. The decode
// megakernel (megakernel.cu) reuses their bodies from ops/.
#include "abi.h"
#include "ops/add_rmsnorm.cuh"

// One block per row; 256 threads cover rows of up to 8192 values.
extern "C" __global__ void __launch_bounds__(256) mk_add_rmsnorm(const MkAddRmsnormArgs args) {
    __shared__ float scratch[32];
    if (blockIdx.x < args.rows) mk::add_rmsnorm_row(args, blockIdx.x, scratch);
}

#include "ops/gemv.cuh"

// One block per 16 weight rows; its 8 warps split k and reduce through shared memory.
template <int NT>
__device__ void gemv_block(const MkGemvArgs& a) {
    constexpr int kWarps = 8;
    __shared__ float partial[kWarps][NT][4][32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int row0 = blockIdx.x * 16;
    // Split k among the warps in whole 32-wide chunks.
    const int chunks = a.k / 32;
    const int k_begin = 32 * (warp * chunks / kWarps), k_end = 32 * ((warp + 1) * chunks / kWarps);
    float acc[NT][4] = {};
    mk::gemv_warp_rows16<NT, 4>(reinterpret_cast<const mk::bf16*>(a.w), a.k, reinterpret_cast<const mk::bf16*>(a.x),
                                a.k, a.batch, row0, k_begin, k_end, acc);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) partial[warp][nt][i][lane] = acc[nt][i];
    __syncthreads();
    // Thread i of the block owns one (nt, i, lane) slot and sums it over the warps.
    for (int s = threadIdx.x; s < NT * 4 * 32; s += blockDim.x) {
        const int nt = s / 128, i = (s / 32) % 4, l = s % 32;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += partial[w][nt][i][l];
        const int g = l / 4, t = l % 4;
        const int row = row0 + g + (i >= 2 ? 8 : 0);
        const int b = 8 * nt + 2 * t + (i & 1);
        if (b < a.batch) reinterpret_cast<mk::bf16*>(a.y)[(size_t)b * a.n + row] = __float2bfloat16(sum);
    }
}

extern "C" __global__ void __launch_bounds__(256) mk_gemv_b8(const MkGemvArgs a) { gemv_block<1>(a); }
extern "C" __global__ void __launch_bounds__(256) mk_gemv_b16(const MkGemvArgs a) { gemv_block<2>(a); }
extern "C" __global__ void __launch_bounds__(256) mk_gemv_b32(const MkGemvArgs a) { gemv_block<4>(a); }
extern "C" __global__ void __launch_bounds__(256) mk_gemv_b64(const MkGemvArgs a) { gemv_block<8>(a); }
