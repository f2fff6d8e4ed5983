// The residual + norm task that ends a layer (the embedding task, step_embed.cuh, ends with its norm too).
#pragma once
#include "step_common.cuh"
#include "step_routing.cuh"

namespace mk {

// These tasks sit on every layer's critical path, so each thread owns 8 consecutive values of the
// row and issues all its loads before the first use (one memory latency per task, not one per
// value). hidden is a multiple of 32.
constexpr int kVec = 8;

__device__ __forceinline__ void load8_f32(const float* p, float (&v)[kVec]) {
    const float4 lo = __ldcg(reinterpret_cast<const float4*>(p)), hi = __ldcg(reinterpret_cast<const float4*>(p) + 1);
    v[0] = lo.x, v[1] = lo.y, v[2] = lo.z, v[3] = lo.w, v[4] = hi.x, v[5] = hi.y, v[6] = hi.z, v[7] = hi.w;
}

__device__ __forceinline__ void store8_f32(float* p, const float (&v)[kVec]) {
    reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
}

// 8 bf16 values another SM wrote in this launch (at L2), as floats.
__device__ __forceinline__ void load8_bf16_cg(const bf16* p, float (&v)[kVec]) {
    const uint4 raw = ld_activations(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
}

// 8 bf16 values of data no one writes during the step (weights), as floats.
__device__ __forceinline__ void load8_bf16(const bf16* p, float (&v)[kVec]) {
    const uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(h[i]);
        v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
}

// h[b] = bf16(rmsnorm(v) * gamma) for the fp32 row v (in shared memory), which is also stored
// to x[b] (and, when logging, as the residual after layer `done`). The thread's first 8 gamma
// values are loaded before the reduction (they are the only ones at hidden 2048).
__device__ __forceinline__ void load_first_gamma(const MkStepArgs& a, const bf16* gamma, float (&g0)[kVec]) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) g0[j] = 0.f;
    if (kVec * threadIdx.x < a.hidden) load8_bf16(gamma + kVec * threadIdx.x, g0);
}

// Row b's slot in the residual log for the residual after layer `done`, or null (not logging).
__device__ __forceinline__ float* residual_log_row(const MkStepArgs& a, int b, int done) {
    return done >= 0 && a.residual_log ? ptr<float>(a.residual_log) + ((size_t)done * a.batch + b) * a.hidden
                                       : nullptr;
}

// Values i0..i0+7 of row b: v to x (and the log), bf16(v * rstd * g) to h.
__device__ __forceinline__ void store_normed_vec(const MkStepArgs& a, int b, int i0, const float (&v)[kVec],
                                                 float rstd, const float* g, float* log) {
    store8_f32(ptr<float>(a.x) + (size_t)b * a.hidden + i0, v);
    if (log) store8_f32(log + i0, v);
    uint4 out;
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
    for (int j = 0; j < 4; ++j)
        o[j] = __floats2bfloat162_rn(v[2 * j] * rstd * g[2 * j], v[2 * j + 1] * rstd * g[2 * j + 1]);
    *reinterpret_cast<uint4*>(ptr<bf16>(a.h) + (size_t)b * a.hidden + i0) = out;
}

__device__ void store_normed(const MkStepArgs& a, int b, const float* v_smem, const bf16* gamma, float* scratch,
                             int done = -1, const float* g_early = nullptr) {
    float g0[kVec];
    if (g_early != nullptr) {
#pragma unroll
        for (int j = 0; j < kVec; ++j) g0[j] = g_early[j];
    } else {
        load_first_gamma(a, gamma, g0);
    }
    float sq = 0.f;
    for (int i = threadIdx.x; i < a.hidden; i += kThreads) sq += v_smem[i] * v_smem[i];
    const float rstd = rsqrtf(block_sum(sq, scratch) / (float)a.hidden + a.eps);
    float* log = residual_log_row(a, b, done);
    for (int i0 = kVec * threadIdx.x; i0 < a.hidden; i0 += kVec * kThreads) {
        float g[kVec], v[kVec];
        if (i0 == kVec * (int)threadIdx.x) {
#pragma unroll
            for (int j = 0; j < kVec; ++j) g[j] = g0[j];
        } else {
            load8_bf16(gamma + i0, g);
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[j] = v_smem[i0 + j];
        store_normed_vec(a, b, i0, v, rstd, g, log);
    }
}

__device__ const bf16* norm_weight(const MkStepArgs& a, int layer) {
    if (layer == a.layers) return ptr<const bf16>(a.final_norm);
    return ptr<const bf16>(ptr<uint64_t>(a.layer_weights)[(size_t)layer * MK_LW_COUNT + MK_LW_NORM]);
}

// x[b] += y_attn[b] + ffn[b]; then the next layer's (or the final) norm. The main loop has waited
// only for the O projection (wait0): what does not depend on the FFN (x + y_attn, and warp 0's
// loads of the row's choices, which it orders by slot in registers, once the top-k has run) is
// done before the task waits for the FFN (wait1), so that one L2 round trip, the expert outputs'
// loads, follows the last down tile (docs/PERF.md, tuning decisions). Marks: the FFN's wait over;
// the FFN's outputs added.
__device__ void run_residual_norm(const MkStepArgs& a, const MkTask& t, const uint32_t* counters, float* v,
                                  float* scratch, int* slots, float* scores, PhaseMarks& marks) {
    const int b = t.arg[0], layer = t.layer;
    const bool moe = ptr<uint64_t>(a.layer_weights)[(size_t)layer * MK_LW_COUNT + MK_LW_ROUTER] != 0;
    // The thread's first gamma values loaded now, before any wait: store_normed needs them after
    // the FFN, and a weight nothing else reads often comes from HBM (a prefetch into L1 instead
    // was slower: docs/PERF.md, tuning decisions).
    float g_early[kVec];
    load_first_gamma(a, norm_weight(a, layer + 1), g_early);
    if (moe && threadIdx.x < 32) {
        // Sorted by slot (= ascending expert; slots are distinct): the reference's summation
        // order. Each choice's rank is the number of smaller slots.
        if (threadIdx.x == 0) spin_until(counters + layer * MK_COUNTERS_PER_LAYER + MK_CTR_TOPK, 1);
        __syncwarp();
        const int lane = threadIdx.x;
        const bool mine = lane < a.top_k;
        const int slot = mine ? ld_i32(ptr<int32_t>(a.topk_slot) + b * a.top_k + lane) : 0x7fffffff;
        const float score = mine ? ld_f32(ptr<float>(a.topk_score) + b * a.top_k + lane) : 0.f;
        int rank = 0;
        for (int k = 0; k < a.top_k; ++k) rank += __shfl_sync(0xffffffffu, slot, k) < slot;
        if (mine) slots[rank] = slot, scores[rank] = score;
    }
    for (int i0 = kVec * threadIdx.x; i0 < a.hidden; i0 += kVec * kThreads) {
        const size_t at = (size_t)b * a.hidden + i0;
        float x[kVec], y[kVec];
        load8_f32(ptr<float>(a.x) + at, x);
        load8_f32(ptr<float>(a.y_attn) + at, y);
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[i0 + j] = x[j] + y[j];
    }
    if (threadIdx.x == 0 && t.wait1 >= 0) spin_until(counters + t.wait1, (uint32_t)t.target1);
    compute_sync();  // the FFN's outputs are visible (and the sorted choices)
    marks.mark(0);
    float r[kVec] = {};  // the thread's last (at hidden <= kVec * kThreads: only) finished vector
    for (int i0 = kVec * threadIdx.x; i0 < a.hidden; i0 += kVec * kThreads) {
        float ffn[kVec] = {};
        if (!moe) {
            load8_f32(ptr<float>(a.ffn_out) + (size_t)b * a.hidden + i0, ffn);
        } else if (a.top_k == kMaxTopK) {
            // The model's top-k: no `break` test, so the eight parts' loads go out together (one
            // round trip instead of eight: docs/PERF.md, tuning decisions); the sum keeps slot order.
            // The parts are bf16 (16 bytes each here): half the bytes of fp32 after the FFN's wait.
            uint4 part[kMaxTopK];
#pragma unroll
            for (int k = 0; k < kMaxTopK; ++k)
                part[k] = ld_activations(ptr<bf16>(a.expert_out) + ((size_t)slots[k] * a.batch + b) * a.hidden + i0);
#pragma unroll
            for (int k = 0; k < kMaxTopK; ++k) {
                const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&part[k]);
#pragma unroll
                for (int j = 0; j < kVec / 2; ++j) {
                    const float2 f = __bfloat1622float2(h2[j]);
                    ffn[2 * j] += f.x * scores[k], ffn[2 * j + 1] += f.y * scores[k];
                }
            }
        } else {
            // A smaller top-k: each load waits for its `break` test (copying the parts into shared
            // memory with cp.async was slower: docs/PERF.md, tuning decisions).
#pragma unroll
            for (int k = 0; k < kMaxTopK; ++k) {
                if (k >= a.top_k) break;
                float part[kVec];
                load8_bf16_cg(ptr<bf16>(a.expert_out) + ((size_t)slots[k] * a.batch + b) * a.hidden + i0, part);
#pragma unroll
                for (int j = 0; j < kVec; ++j) ffn[j] += part[j] * scores[k];
            }
        }
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[i0 + j] += ffn[j];
#pragma unroll
        for (int j = 0; j < kVec; ++j) r[j] = v[i0 + j];
    }
    // (Not in the stream-ledger diagnostic build: its wide image would spill at the register cap.)
    if (!MK_STREAM_LEDGER && a.hidden <= kVec * kThreads) {
        // At most one vector a thread (hidden 2048; the GPU tests' 384): the sum of squares and the
        // stores start from the registers that summed the row, with no barrier and no shared-memory
        // pass between the FFN's loads and the reduction (docs/PERF.md, tuning decisions).
        marks.mark(1);
        float sq = 0.f;
#pragma unroll
        for (int j = 0; j < kVec; ++j) sq += r[j] * r[j];
        const float rstd = rsqrtf(block_sum(sq, scratch) / (float)a.hidden + a.eps);
        const int i0 = kVec * threadIdx.x;
        if (i0 < a.hidden) store_normed_vec(a, b, i0, r, rstd, g_early, residual_log_row(a, b, layer));
        return;
    }
    compute_sync();  // (a wider row: through shared memory)
    marks.mark(1);
    store_normed(a, b, v, norm_weight(a, layer + 1), scratch, layer, g_early);
}

}  // namespace mk
