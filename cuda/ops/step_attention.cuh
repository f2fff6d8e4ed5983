// Decode attention over the paged KV cache: a split task covers keys [lo, hi) of one row and one
// KV head for the whole query group (online softmax, unnormalised partials); a combine task
// merges a (row, kv head)'s splits. Supports head_dim 128 and groups of up to 8 query heads.
#pragma once
#include "step_common.cuh"

namespace mk {

constexpr int kHeadDim = 128;
constexpr int kMaxGroup = 8;
constexpr int kPage = 64;

struct AttnSmem {
    uint4 k[kPage][kHeadDim / 8 + 1];  // +16 B per row: rows land on different banks
    uint4 v[kPage][kHeadDim / 8];
    float q[kMaxGroup][kHeadDim];
    float s[kMaxGroup][kPage];
};

__device__ void run_attn_split(const MkStepArgs& a, const MkTask& t, AttnSmem& sm) {
    const int b = t.arg[0], kvh = t.arg[1], split = t.arg[2], lo = t.arg[3], hi = t.arg[4];
    const int group = a.heads / a.kv_heads, qw = a.heads * kHeadDim;
    const float inv_sqrt = rsqrtf((float)kHeadDim);
    for (int i = threadIdx.x; i < group * kHeadDim; i += kThreads)
        sm.q[i / kHeadDim][i % kHeadDim] = ld_f32(ptr<float>(a.q) + (size_t)b * qw + kvh * group * kHeadDim + i);

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int g = warp, d0 = 4 * lane;  // this thread's head and 4 output dims
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    float m_run = -INFINITY, l_run = 0.f;
    const int32_t* table = ptr<int32_t>(a.block_tables) + ((size_t)t.layer * a.batch + b) * a.max_pages;
    // Each thread carries its share of the next page (4 x 16 B of K and of V) in registers, so
    // the page's loads are in flight while the current page is computed.
    constexpr int kVecs = kPage * (kHeadDim / 8) / kThreads;
    uint4 next_k[kVecs], next_v[kVecs];
    auto fetch = [&](int page_start) {
        const int t0 = max(lo, page_start), n = min(hi, page_start + kPage) - t0;
        const size_t block = (size_t)ld_i32(table + page_start / kPage);
#pragma unroll
        for (int r = 0; r < kVecs; ++r) {
            const int i = threadIdx.x + r * kThreads, j = i / (kHeadDim / 8), c = i % (kHeadDim / 8);
            if (j < n) {
                const size_t off = ((block * kPage + (t0 - page_start + j)) * a.kv_heads + kvh) * kHeadDim;
                next_k[r] = __ldcg(reinterpret_cast<const uint4*>(ptr<bf16>(a.k_pool) + off) + c);
                next_v[r] = __ldcg(reinterpret_cast<const uint4*>(ptr<bf16>(a.v_pool) + off) + c);
            }
        }
    };
    fetch(lo - lo % kPage);
    for (int page_start = lo - lo % kPage; page_start < hi; page_start += kPage) {
        const int t0 = max(lo, page_start), t1 = min(hi, page_start + kPage), n = t1 - t0;
        __syncthreads();  // the previous page's smem is no longer read
#pragma unroll
        for (int r = 0; r < kVecs; ++r) {
            const int i = threadIdx.x + r * kThreads, j = i / (kHeadDim / 8), c = i % (kHeadDim / 8);
            if (j < n) sm.k[j][c] = next_k[r], sm.v[j][c] = next_v[r];
        }
        if (page_start + kPage < hi) fetch(page_start + kPage);
        __syncthreads();
        for (int i = threadIdx.x; i < group * n; i += kThreads) {
            const int gg = i / n, j = i % n;
            float dot = 0.f;
#pragma unroll 4
            for (int c = 0; c < kHeadDim / 8; ++c) {
                const uint4 raw = sm.k[j][c];
                const __nv_bfloat162* k2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
                const float* qq = &sm.q[gg][8 * c];
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 kf = __bfloat1622float2(k2[e]);
                    dot += qq[2 * e] * kf.x + qq[2 * e + 1] * kf.y;
                }
            }
            sm.s[gg][j] = dot * inv_sqrt;
        }
        __syncthreads();
        if (g < group) {
            float tile_max = -INFINITY;
            for (int j = lane; j < n; j += 32) tile_max = fmaxf(tile_max, sm.s[g][j]);
            const float m_new = fmaxf(m_run, warp_max(tile_max));
            const float factor = __expf(m_run - m_new);
            float psum = 0.f;
            for (int j = lane; j < n; j += 32) {
                const float p = __expf(sm.s[g][j] - m_new);
                sm.s[g][j] = p;
                psum += p;
            }
            __syncwarp();
            l_run = l_run * factor + warp_sum(psum);
            m_run = m_new;
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] *= factor;
            for (int j = 0; j < n; ++j) {
                const float p = sm.s[g][j];
                const bf16* vrow = reinterpret_cast<const bf16*>(sm.v[j]) + d0;
#pragma unroll
                for (int i = 0; i < 4; ++i) acc[i] += p * __bfloat162float(vrow[i]);
            }
        }
    }
    if (g < group) {
        const size_t slot = (size_t)b * a.kv_heads + kvh;
        float* o = ptr<float>(a.attn_o) + ((slot * a.max_splits + split) * group + g) * kHeadDim + d0;
#pragma unroll
        for (int i = 0; i < 4; ++i) o[i] = acc[i];
        if (lane == 0) {
            float* ml = ptr<float>(a.attn_ml) + ((slot * a.max_splits + split) * group + g) * 2;
            ml[0] = m_run, ml[1] = l_run;
        }
    }
}

__device__ void run_attn_combine(const MkStepArgs& a, const MkTask& t) {
    const int b = t.arg[0], kvh = t.arg[1], splits = t.arg[2];
    const int group = a.heads / a.kv_heads;
    const int g = threadIdx.x / 32, d0 = 4 * (threadIdx.x % 32);
    if (g >= group) return;
    const size_t slot = (size_t)b * a.kv_heads + kvh;
    const float* ml = ptr<float>(a.attn_ml);
    const float* o = ptr<float>(a.attn_o);
    float m = -INFINITY;
    for (int s = 0; s < splits; ++s) m = fmaxf(m, ld_f32(ml + ((slot * a.max_splits + s) * group + g) * 2));
    float l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int s = 0; s < splits; ++s) {
        const size_t base = (slot * a.max_splits + s) * group + g;
        const float w = __expf(ld_f32(ml + base * 2) - m);
        l += w * ld_f32(ml + base * 2 + 1);
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] += w * ld_f32(o + base * kHeadDim + d0 + i);
    }
    bf16* out = ptr<bf16>(a.attn_out) + (size_t)b * a.heads * kHeadDim + (kvh * group + g) * kHeadDim + d0;
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __float2bfloat16(acc[i] / l);
}

}  // namespace mk
