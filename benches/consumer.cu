// The compute warps' side of a GEMV weight stage, alone: how long a block's eight compute warps
// take to multiply one 24 KB stage of bf16 weights with 8 (or 16) activation rows, with nothing
// copied and no ring hand-off (a lower bound on what a stage costs the megakernel's consumers).
// Four ways, on the same 64 x 768 weights and 8 (16) x 768 activations held in shared memory:
//   mma_dense     mma.sync m16n8k16, weights the A operand loaded by each thread from dense
//                 [16][256] boxes (the default megakernel, cuda/ops/step_gemv.cuh)
//   mma_swizzled  the same from [16][64] boxes in the 128-byte swizzle (MK_WEIGHT_SWIZZLE)
//   wgmma         wgmma m64n8k16: each warpgroup multiplies [64][64] boxes in the 128-byte swizzle
//                 straight from shared memory (no loads of the weights into registers); a stage
//                 is then 64 rows x 192 columns instead of 16 x 768
//   mma_dense_16  mma_dense with 16 activation rows: each weight fragment times two n-tiles
//                 (gemv_compute_wide, the wide megakernel image)
// Each block runs `reps` passes over the 4 stages (one pass = the whole 64 x 768 product), the
// results are checked against the host's float64 product, and the time per stage is printed as
// one JSON line per way (benches/consumer.py builds, runs and tabulates this).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "ops/step_common.cuh"
#include "ops/step_stream.cuh"

namespace {

constexpr int kRows = 64, kCols = 768, kBatch = 16, kStages = 4;  // (8 rows but for mma_dense_16)
constexpr int kStageBytes = 24 * 1024;
constexpr int kThreads = 256;
constexpr int kActPitch = 2 * kCols + 64;  // as the megakernel's act_pitch(768)
constexpr int kActBytes = kBatch * kActPitch;  // [16][kActPitch], or wgmma's [96][8][8] core matrices
constexpr int kSmemBytes = kStages * kStageBytes + kActBytes + kRows * kBatch * 4 * 8;

enum Way { kMmaDense = 0, kMmaSwizzled = 1, kWgmma = 2, kMmaDense16 = 3 };
constexpr int kWays = 4;
const char* const kWayNames[] = {"mma_dense", "mma_swizzled", "wgmma", "mma_dense_16"};
__host__ __device__ constexpr int rows_of(int way) { return way == kMmaDense16 ? 16 : 8; }  // activation rows

__device__ __forceinline__ int swz(int r, int unit) { return r * 128 + 16 * (unit ^ (r & 7)); }

// Byte offset of weight (row r, column c) in the stages, for each way.
__device__ __forceinline__ int weight_offset(int way, int r, int c) {
    if (way == kMmaDense || way == kMmaDense16) {  // stage = 16 rows, 3 boxes of [16][256]
        return (r / 16) * kStageBytes + (c / 256) * 8192 + (r % 16) * 512 + (c % 256) * 2;
    }
    if (way == kMmaSwizzled) {  // stage = 16 rows, 12 boxes of [16][64] swizzled
        return (r / 16) * kStageBytes + (c / 64) * 2048 + swz(r % 16, (c % 64) / 8) + (c % 8) * 2;
    }
    // wgmma: stage = 192 columns, 3 boxes of [64][64] swizzled (8-row groups 1024 bytes apart)
    return (c / 192) * kStageBytes + ((c % 192) / 64) * 8192 + swz(r, (c % 64) / 8) + (c % 8) * 2;
}

// Byte offset of activation (row b, column c): row-major for mma.sync, and for wgmma's B operand
// K-major core matrices of 8 rows x 16 bytes, one per 8 columns, 128 bytes apart.
__device__ __forceinline__ int act_offset(int way, int b, int c) {
    return way == kWgmma ? (c / 8) * 128 + b * 16 + (c % 8) * 2 : b * kActPitch + c * 2;
}

// A wgmma shared-memory matrix descriptor: start address, leading and stride byte offsets (>> 4),
// swizzle mode (1: 128 bytes).
__device__ __forceinline__ uint64_t smem_desc(const void* p, uint32_t lbo, uint32_t sbo, uint32_t swizzle) {
    const uint64_t a = mk::smem_addr(p);
    return ((a & 0x3FFFFu) >> 4) | ((uint64_t)(lbo >> 4) << 16) | ((uint64_t)(sbo >> 4) << 32) |
           ((uint64_t)swizzle << 62);
}

__device__ __forceinline__ void wgmma_m64n8k16(float (&d)[4], uint64_t a, uint64_t b) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0,%1,%2,%3}, %4, %5, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b), "r"(1));
}

template <int way>
__global__ void __launch_bounds__(kThreads, 1)
    consume(int reps, const __nv_bfloat16* w, const __nv_bfloat16* x, float* out) {
    extern __shared__ __align__(1024) unsigned char smem[];
    unsigned char* stages = smem;
    unsigned char* act = smem + kStages * kStageBytes;
    float* partial = reinterpret_cast<float*>(act + kActBytes);  // [8 warps][64 rows][kBatch]
    for (int i = threadIdx.x; i < kRows * kCols; i += kThreads) {
        const int r = i / kCols, c = i % kCols;
        *reinterpret_cast<__nv_bfloat16*>(stages + weight_offset(way, r, c)) = w[i];
    }
    for (int i = threadIdx.x; i < rows_of(way) * kCols; i += kThreads) {
        const int b = i / kCols, c = i % kCols;
        *reinterpret_cast<__nv_bfloat16*>(act + act_offset(way, b, c)) = x[i];
    }
    for (int i = threadIdx.x; i < 8 * kRows * kBatch; i += kThreads) partial[i] = 0.f;
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");  // (wgmma reads through the async proxy)
    __syncthreads();

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    if constexpr (way == kWgmma) {
        // Warpgroup g takes the k-steps j = g, g + 2, ... of each stage (12 of 16 columns).
        const int g = warp / 4;
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        for (int rep = 0; rep < reps; ++rep) {
            for (int s = 0; s < kStages; ++s) {
                const unsigned char* st = stages + s * kStageBytes;
#pragma unroll
                for (int jj = 0; jj < 6; ++jj) {
                    const int j = 2 * jj + g;
                    const uint64_t a = smem_desc(st + (j / 4) * 8192 + (j % 4) * 32, 16, 1024, 1);
                    const uint64_t b = smem_desc(act + ((s * 192 + 16 * j) / 8) * 128, 128, 128, 0);
                    wgmma_m64n8k16(acc, a, b);
                }
                asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
                asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        // acc: rows 16 (warp % 4) + gi (+ 8), columns 2 ti (+ 1).
        float* part = partial + g * kRows * kBatch;
        const int row = 16 * (warp % 4) + gi;
#pragma unroll
        for (int i = 0; i < 4; ++i) part[(row + (i >= 2 ? 8 : 0)) * kBatch + 2 * ti + (i & 1)] = acc[i];
    } else {
        // Warp w takes 32-column chunks w, w + 8, w + 16 of each 16-row stage, as gemv_compute.
        const int wrow = way == kMmaSwizzled ? (gi & 1) * 4 + gi / 2 : gi;
        float acc[kStages][4] = {}, acc2[kStages][4] = {};
        const unsigned char* x_row = act + gi * kActPitch + 16 * ti;
        float acc3[way == kMmaDense16 ? kStages : 1][4] = {};  // the second n-tile (rows gi + 8)
        for (int rep = 0; rep < reps; ++rep) {
#pragma unroll
            for (int s = 0; s < kStages; ++s) {
                const unsigned char* st = stages + s * kStageBytes;
#pragma unroll
                for (int ch = warp; ch < kCols / 32; ch += 8) {
                    const unsigned char* wp = way == kMmaSwizzled
                                                  ? st + (ch / 2) * 2048 + swz(wrow, (ch % 2) * 4 + ti)
                                                  : st + (ch / 8) * 8192 + gi * 512 + 16 * ti + 64 * (ch % 8);
                    const int next8 = way == kMmaSwizzled ? 16 * 64 : 16 * 256;  // row + 8
                    const uint4 wa = *reinterpret_cast<const uint4*>(wp);
                    const uint4 wb = *reinterpret_cast<const uint4*>(wp + next8);
                    const uint4 xv = *reinterpret_cast<const uint4*>(x_row + 64 * ch);
                    if constexpr (way == kMmaDense16) {  // as gemv_compute_wide: one accumulator a tile
                        const uint4 yv = *reinterpret_cast<const uint4*>(x_row + 8 * kActPitch + 64 * ch);
                        mk::mma_16816(acc[s], wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
                        mk::mma_16816(acc[s], wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
                        mk::mma_16816(acc3[s], wa.x, wb.x, wa.y, wb.y, yv.x, yv.y);
                        mk::mma_16816(acc3[s], wa.z, wb.z, wa.w, wb.w, yv.z, yv.w);
                    } else {
                        mk::mma_16816(acc[s], wa.x, wb.x, wa.y, wb.y, xv.x, xv.y);
                        mk::mma_16816(acc2[s], wa.z, wb.z, wa.w, wb.w, xv.z, xv.w);
                    }
                }
            }
        }
        float* part = partial + warp * kRows * kBatch;
#pragma unroll
        for (int s = 0; s < kStages; ++s)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const int row = 16 * s + wrow + (i >= 2 ? 8 : 0), col = 2 * ti + (i & 1);
                part[row * kBatch + col] = acc[s][i] + acc2[s][i];
                if constexpr (way == kMmaDense16) part[row * kBatch + col + 8] = acc3[s][i];
            }
    }
    __syncthreads();
    if (blockIdx.x == 0) {
        for (int i = threadIdx.x; i < kRows * kBatch; i += kThreads) {
            float sum = 0.f;
            for (int p = 0; p < 8; ++p) sum += partial[p * kRows * kBatch + i];
            out[i] = sum;
        }
    }
}

#define CHECK(call)                                                                          \
    do {                                                                                     \
        cudaError_t e = (call);                                                              \
        if (e != cudaSuccess) {                                                              \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e)); \
            return 1;                                                                        \
        }                                                                                    \
    } while (0)

}  // namespace

int main(int argc, char** argv) {
    const int reps = argc > 1 ? atoi(argv[1]) : 2000;
    int sms = 0;
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::vector<__nv_bfloat16> w(kRows * kCols), x(kBatch * kCols);  // (the 8-row ways use x's first 8 rows)
    uint32_t seed = 12345;
    auto next = [&] { return ((seed = seed * 1664525u + 1013904223u) >> 8) / float(1 << 24) - 0.5f; };
    for (auto& v : w) v = __float2bfloat16(next());
    for (auto& v : x) v = __float2bfloat16(next());
    std::vector<double> want(kRows * kBatch, 0.0);
    for (int r = 0; r < kRows; ++r)
        for (int b = 0; b < kBatch; ++b)
            for (int c = 0; c < kCols; ++c)
                want[r * kBatch + b] += (double)__bfloat162float(w[r * kCols + c]) * __bfloat162float(x[b * kCols + c]);
    __nv_bfloat16 *dw, *dx;
    float* dout;
    CHECK(cudaMalloc(&dw, w.size() * 2));
    CHECK(cudaMalloc(&dx, x.size() * 2));
    CHECK(cudaMalloc(&dout, kRows * kBatch * 4));
    CHECK(cudaMemcpy(dw, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(dx, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
    void (*const kernels[kWays])(int, const __nv_bfloat16*, const __nv_bfloat16*, float*) = {
        consume<kMmaDense>, consume<kMmaSwizzled>, consume<kWgmma>, consume<kMmaDense16>};
    for (auto k : kernels) CHECK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    cudaEvent_t t0, t1;
    CHECK(cudaEventCreate(&t0));
    CHECK(cudaEventCreate(&t1));
    for (int way = 0; way < kWays; ++way) {
        // Correctness: one pass, every output against the float64 product.
        CHECK(cudaMemset(dout, 0xff, kRows * kBatch * 4));  // poisoned (NaN)
        kernels[way]<<<1, kThreads, kSmemBytes>>>(1, dw, dx, dout);
        CHECK(cudaGetLastError());
        CHECK(cudaDeviceSynchronize());
        std::vector<float> got(kRows * kBatch);
        CHECK(cudaMemcpy(got.data(), dout, got.size() * 4, cudaMemcpyDeviceToHost));
        double err = 0.0, norm = 0.0;
        for (int i = 0; i < kRows * kBatch; ++i) {
            if (i % kBatch >= rows_of(way)) continue;  // columns the way does not compute
            err += (got[i] - want[i]) * (got[i] - want[i]);
            norm += want[i] * want[i];
        }
        const double rel = std::isfinite(err) ? std::sqrt(err / norm) : INFINITY;
        // Timing: every SM, reps passes of 4 stages; the best of 5 launches.
        float best = INFINITY;
        for (int t = 0; t < 5; ++t) {
            CHECK(cudaEventRecord(t0));
            kernels[way]<<<sms, kThreads, kSmemBytes>>>(reps, dw, dx, dout);
            CHECK(cudaEventRecord(t1));
            CHECK(cudaEventSynchronize(t1));
            CHECK(cudaGetLastError());
            float ms = 0.f;
            CHECK(cudaEventElapsedTime(&ms, t0, t1));
            best = ms < best ? ms : best;
        }
        const double us_per_stage = best * 1e3 / ((double)reps * kStages);
        printf("{\"way\": \"%s\", \"us_per_stage\": %.5f, \"stage_bytes\": %d, \"sms\": %d, \"reps\": %d, "
               "\"rel_err\": %.3e, \"ok\": %s, \"batch\": %d}\n",
               kWayNames[way], us_per_stage, kStageBytes, sms, reps, rel, rel < 1e-3 ? "true" : "false", rows_of(way));
        fflush(stdout);
    }
    return 0;
}
