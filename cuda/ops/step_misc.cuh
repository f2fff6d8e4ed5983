// The small tasks of a decode step: embedding, routing, residual + norm, greedy sampling.
#pragma once
#include "step_common.cuh"

namespace mk {

// h[b] = bf16(rmsnorm(v) * gamma) for the fp32 row v, which is also stored to x[b].
__device__ void store_normed(const MkStepArgs& a, int b, float* v_smem, const bf16* gamma, float* scratch) {
    float sq = 0.f;
    for (int i = threadIdx.x; i < a.hidden; i += kThreads) sq += v_smem[i] * v_smem[i];
    const float rstd = rsqrtf(block_sum(sq, scratch) / (float)a.hidden + a.eps);
    for (int i = threadIdx.x; i < a.hidden; i += kThreads) {
        ptr<float>(a.x)[(size_t)b * a.hidden + i] = v_smem[i];
        ptr<bf16>(a.h)[(size_t)b * a.hidden + i] = __float2bfloat16(v_smem[i] * rstd * __bfloat162float(gamma[i]));
    }
}

__device__ const bf16* norm_weight(const MkStepArgs& a, int layer) {
    if (layer == a.layers) return ptr<const bf16>(a.final_norm);
    return ptr<const bf16>(ptr<uint64_t>(a.layer_weights)[(size_t)layer * MK_LW_COUNT + MK_LW_NORM]);
}

__device__ void run_embed(const MkStepArgs& a, const MkTask& t, float* v, float* scratch) {
    const int b = t.arg[0];
    const int token = ld_i32(ptr<int32_t>(a.tokens) + b);
    const bf16* row = ptr<const bf16>(a.embed) + (size_t)token * a.hidden;
    for (int i = threadIdx.x; i < a.hidden; i += kThreads) v[i] = __bfloat162float(row[i]);
    __syncthreads();
    store_normed(a, b, v, norm_weight(a, 0), scratch);
}

// x[b] += y_attn[b] + ffn[b]; then the next layer's (or the final) norm.
__device__ void run_residual_norm(const MkStepArgs& a, const MkTask& t, float* v, float* scratch, int* order) {
    const int b = t.arg[0], layer = t.layer;
    const bool moe = ptr<uint64_t>(a.layer_weights)[(size_t)layer * MK_LW_COUNT + MK_LW_ROUTER] != 0;
    if (moe && threadIdx.x == 0) {
        // The top-k choices in ascending slot (= expert) order: the reference's summation order.
        const int32_t* ts = ptr<int32_t>(a.topk_slot) + b * a.top_k;
        for (int k = 0; k < a.top_k; ++k) order[k] = k;
        for (int i = 1; i < a.top_k; ++i)
            for (int j = i; j > 0 && ld_i32(ts + order[j]) < ld_i32(ts + order[j - 1]); --j) {
                const int tmp = order[j];
                order[j] = order[j - 1], order[j - 1] = tmp;
            }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < a.hidden; i += kThreads) {
        const size_t at = (size_t)b * a.hidden + i;
        float ffn = 0.f;
        if (moe) {
            for (int k = 0; k < a.top_k; ++k) {
                const int c = order[k];
                const int slot = ld_i32(ptr<int32_t>(a.topk_slot) + b * a.top_k + c);
                const float score = ld_f32(ptr<float>(a.topk_score) + b * a.top_k + c);
                ffn += ld_f32(ptr<float>(a.expert_out) + ((size_t)slot * a.batch + b) * a.hidden + i) * score;
            }
        } else {
            ffn = ld_f32(ptr<float>(a.ffn_out) + at);
        }
        v[i] = ld_f32(ptr<float>(a.x) + at) + ld_f32(ptr<float>(a.y_attn) + at) + ffn;
    }
    __syncthreads();
    store_normed(a, b, v, norm_weight(a, layer + 1), scratch);
}

// Top-k of every row's router logits (ties -> lower expert), sigmoid scores, and the slots:
// the distinct chosen experts in ascending order. One thread per row, then one for the slots.
__device__ void run_topk(const MkStepArgs& a, int* chosen /* [8 * 8] */, int* slot_of /* [experts] */) {
    const float* logits = ptr<float>(a.router);
    if (threadIdx.x < a.batch) {
        const int b = threadIdx.x;
        for (int k = 0; k < a.top_k; ++k) {
            int best = -1;
            float best_v = -INFINITY;
            for (int e = 0; e < a.experts; ++e) {
                bool taken = false;
                for (int j = 0; j < k; ++j) taken |= chosen[b * 8 + j] == e;
                const float v = ld_f32(logits + b * a.experts + e);
                if (!taken && (best < 0 || v > best_v)) best = e, best_v = v;
            }
            chosen[b * 8 + k] = best;
            ptr<float>(a.topk_score)[b * a.top_k + k] = 1.f / (1.f + expf(-best_v));
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int e = 0; e < a.experts; ++e) slot_of[e] = -1;
        for (int i = 0; i < a.batch * a.top_k; ++i) slot_of[chosen[(i / a.top_k) * 8 + i % a.top_k]] = 0;
        int count = 0;
        for (int e = 0; e < a.experts; ++e)
            if (slot_of[e] == 0) {
                ptr<int32_t>(a.slot_expert)[count] = e;
                slot_of[e] = count++;
            }
        ptr<int32_t>(a.slot_count)[0] = count;
        for (int i = 0; i < a.batch * a.top_k; ++i)
            ptr<int32_t>(a.topk_slot)[i] = slot_of[chosen[(i / a.top_k) * 8 + i % a.top_k]];
    }
}

// Greedy: the best (logit, lowest id) of a vocabulary slice, then over the slices.
__device__ void run_sample_part(const MkStepArgs& a, const MkTask& t, float* sv, int* si) {
    const int b = t.arg[0], part = t.arg[1], lo = t.arg[2], hi = t.arg[3];
    float best = -INFINITY;
    int id = hi;
    for (int i = lo + threadIdx.x; i < hi; i += kThreads) {
        const float v = ld_f32(ptr<float>(a.logits) + (size_t)b * a.vocab + i);
        if (v > best) best = v, id = i;  // ascending i per thread: keeps the lowest id on ties
    }
    sv[threadIdx.x] = best, si[threadIdx.x] = id;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < kThreads; ++i)
            if (sv[i] > best || (sv[i] == best && si[i] < id)) best = sv[i], id = si[i];
        ptr<float>(a.sample_score)[b * a.sample_parts + part] = best;
        ptr<int32_t>(a.sample_id)[b * a.sample_parts + part] = id;
    }
}

__device__ void run_sample_final(const MkStepArgs& a, const MkTask& t) {
    if (threadIdx.x != 0) return;
    const int b = t.arg[0], parts = t.arg[1];
    float best = -INFINITY;
    int id = a.vocab;
    for (int p = 0; p < parts; ++p) {
        const float v = ld_f32(ptr<float>(a.sample_score) + b * a.sample_parts + p);
        const int i = ld_i32(ptr<int32_t>(a.sample_id) + b * a.sample_parts + p);
        if (v > best || (v == best && i < id)) best = v, id = i;
    }
    ptr<int32_t>(a.sampled)[b] = id;
}

}  // namespace mk
