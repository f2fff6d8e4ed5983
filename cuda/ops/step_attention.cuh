// Decode attention over the paged KV cache: a split task covers keys [lo, hi) of one row and one
// KV head for the whole query group (online softmax, unnormalised partials); a combine task
// merges a (row, kv head)'s splits. Supports head_dim 128 and groups of up to 8 query heads.
#pragma once
#include "step_common.cuh"
#include "step_stream.cuh"

namespace mk {

constexpr int kHeadDim = MK_STEP_HEAD_DIM;
constexpr int kMaxGroup = MK_STEP_MAX_GROUP;
constexpr int kPage = MK_PAGE_SIZE;

#ifndef MK_KV_STAGES
#define MK_KV_STAGES 3
#endif
// Pages in shared memory: all but one in flight while one is used (a tuning knob,
// -DMK_KV_STAGES=N: fewer leave the weight ring more stages).
constexpr int kKvStages = MK_KV_STAGES;
static_assert(kKvStages >= 2, "attention keeps at least one page in flight");
constexpr int kKvPitch = kHeadDim + 8;   // bf16 per smem row: 272 bytes, so 8 rows hit 8 distinct bank groups
constexpr int kPPitch = kPage + 8;       // bf16 per row of P

// One split streams its pages through a kKvStages-deep cp.async pipeline; the query group is the
// 16-row A operand of mma.m16n8k16 (heads 0..7, rows 8..15 zero), so S = Q Kᵀ and O += P V run on
// the tensor cores: warp w takes keys 8w..8w+7 of S and dims 16w..16w+15 of O.
struct AttnSmem {
    bf16 k[kKvStages][kPage][kKvPitch];
    bf16 v[kKvStages][kPage][kKvPitch];
    bf16 p[kMaxGroup][kPPitch];
    float row_max[kWarps][kMaxGroup];
    float row_sum[kWarps][kMaxGroup];
};

__device__ __forceinline__ uint32_t lds32(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ __forceinline__ void ldmatrix_x4_trans(const void* p, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Keys [lo, hi) of split `split` for a row writing at `pos` (split_keys in rust/graph): from the
// window's start (window 0: the first key), `chunk` keys a split, the last ending at the row's own
// key. The task's words do not change from step to step; the keys do.
__device__ __forceinline__ int2 split_keys(int split, int window, int chunk, int pos) {
    const int end = pos + 1, start = window > 0 ? max(0, end - window) : 0, lo = start + split * chunk;
    return make_int2(lo, min(lo + chunk, end));
}

// Where a split's keys are: [lo, hi) of row b, which writes at pos, in pages of kPage keys from
// first_page.
struct SplitPages {
    int b, kvh, pos, lo, hi, first_page, pages;
    const int32_t* table;  // the row's block table for the task's layer

    SplitPages() = default;
    __device__ SplitPages(const MkStepArgs& a, const MkTask& t)
        : b(t.arg[0]), kvh(t.arg[1]), pos(ld_i32(ptr<int32_t>(a.positions) + t.arg[0])),
          table(ptr<int32_t>(a.block_tables) + ((size_t)t.layer * a.batch + b) * a.max_pages) {
        const int2 keys = split_keys(t.arg[2], t.arg[3], t.arg[5], pos);
        lo = keys.x, hi = keys.y, first_page = lo - lo % kPage, pages = (hi - first_page + kPage - 1) / kPage;
    }

    // Copies page i into stage i % kKvStages (one cp.async group, empty past the end): rows
    // outside [lo, hi) are zeroed (they may hold anything, and 0 * NaN would poison P V).
    __device__ void issue(const MkStepArgs& a, AttnSmem& sm, int i) const {
        if (i < pages) {
            const int start = first_page + i * kPage, st = i % kKvStages;
            const size_t block = (size_t)ld_i32(table + start / kPage);
            for (int c = threadIdx.x; c < 2 * kPage * (kHeadDim / 8); c += kThreads) {
                const int which = c / (kPage * (kHeadDim / 8)), row = (c / (kHeadDim / 8)) % kPage, col = c % (kHeadDim / 8);
                bf16* dst = (which ? &sm.v[st][row][0] : &sm.k[st][row][0]) + 8 * col;
                if (start + row >= lo && start + row < hi) {
                    const size_t off = ((block * kPage + row) * a.kv_heads + kvh) * kHeadDim + 8 * col;
                    cp_async16(dst, ptr<bf16>(which ? a.v_pool : a.k_pool) + off);
                } else {
                    *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
                }
            }
        }
        cp_async_commit();
    }
};

// Before the split waits for this step's QKV: issues the first pages (up to the kKvStages - 1
// the loop keeps in flight) whose keys all precede the row's position, which this step's QKV
// writes; the cache holds every earlier key since the step began. Returns how many it issued.
__device__ int attn_prefetch(const MkStepArgs& a, const SplitPages& sp, AttnSmem& sm) {
    int issued = 0;
    while (issued < kKvStages - 1 && issued < sp.pages && min(sp.hi, sp.first_page + (issued + 1) * kPage) <= sp.pos)
        sp.issue(a, sm, issued++);
    return issued;
}

// `issued`: the pages attn_prefetch issued before the task's wait.
__device__ void run_attn_split(const MkStepArgs& a, const MkTask& t, const SplitPages& sp, AttnSmem& sm,
                               int issued) {
    const int b = sp.b, kvh = sp.kvh, split = t.arg[2], lo = sp.lo, hi = sp.hi;
    const int group = a.heads / a.kv_heads, qw = a.heads * kHeadDim;
    const float inv_sqrt = rsqrtf((float)kHeadDim);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
    const int first_page = sp.first_page, pages = sp.pages;
    auto issue = [&](int i) { sp.issue(a, sm, i); };
    while (issued < kKvStages - 1) issue(issued++);

    // This thread's A fragments of Q (head g; rows g + 8 are zero) for the 8 k-steps of 16 dims.
    uint32_t qa[kHeadDim / 16][2];
    {
        const float* q = ptr<float>(a.q) + (size_t)b * qw + (kvh * group + g) * kHeadDim;
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
            float2 x0 = make_float2(0.f, 0.f), x1 = x0;
            if (g < group) {
                x0 = __ldcg(reinterpret_cast<const float2*>(q + 16 * ks + 2 * tq));
                x1 = __ldcg(reinterpret_cast<const float2*>(q + 16 * ks + 8 + 2 * tq));
            }
            qa[ks][0] = pack_bf16(x0.x, x0.y), qa[ks][1] = pack_bf16(x1.x, x1.y);
        }
    }

    float m_run = -INFINITY, l_run = 0.f;  // of head g, identical in every warp
    float o[2][4] = {};                    // O[head g][dims 16w + 8j + 2tq, +1] in o[j][0..1]
    for (int i = 0; i < pages; ++i) {
        cp_async_wait_pending<kKvStages - 2>();  // this thread's copies of page i have landed
        compute_sync();                          // everyone's have; everyone is done with page i - 1
        issue(i + kKvStages - 1);
        const int st = i % kKvStages, start = first_page + i * kPage;

        // S for keys 8w + 2tq, + 1 of head g.
        float sc[4] = {0.f, 0.f, 0.f, 0.f};
        const bf16* krow = &sm.k[st][8 * warp + g][0];
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks)
            mma_16816(sc, qa[ks][0], 0u, qa[ks][1], 0u, lds32(krow + 16 * ks + 2 * tq), lds32(krow + 16 * ks + 8 + 2 * tq));
        const int key = start + 8 * warp + 2 * tq;
        const bool ok0 = key >= lo && key < hi, ok1 = key + 1 >= lo && key + 1 < hi;
        const float s0 = ok0 ? sc[0] * inv_sqrt : -INFINITY, s1 = ok1 ? sc[1] * inv_sqrt : -INFINITY;
        float mx = fmaxf(s0, s1);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (tq == 0) sm.row_max[warp][g] = mx;
        compute_sync();
        float page_max = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) page_max = fmaxf(page_max, sm.row_max[w][g]);
        const float m_new = fmaxf(m_run, page_max);  // finite: every page has a key in range
        const float factor = __expf(m_run - m_new);
        const float p0 = ok0 ? __expf(s0 - m_new) : 0.f, p1 = ok1 ? __expf(s1 - m_new) : 0.f;
        float ps = p0 + p1;
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        ps += __shfl_xor_sync(0xffffffffu, ps, 2);
        if (tq == 0) sm.row_sum[warp][g] = ps;
        *reinterpret_cast<uint32_t*>(&sm.p[g][8 * warp + 2 * tq]) = pack_bf16(p0, p1);
        compute_sync();
        float page_sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) page_sum += sm.row_sum[w][g];
        l_run = l_run * factor + page_sum;
        m_run = m_new;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[j][e] *= factor;

        // O += P V for dims 16w..16w+15: V's [key][dim] tiles transposed by ldmatrix.
        const int mat = lane / 8;
#pragma unroll
        for (int ks = 0; ks < kPage / 16; ++ks) {
            const uint32_t pa0 = lds32(&sm.p[g][16 * ks + 2 * tq]), pa2 = lds32(&sm.p[g][16 * ks + 8 + 2 * tq]);
            uint32_t v0, v1, v2, v3;
            ldmatrix_x4_trans(&sm.v[st][16 * ks + (mat & 1) * 8 + lane % 8][16 * warp + (mat >> 1) * 8], v0, v1, v2, v3);
            mma_16816(o[0], pa0, 0u, pa2, 0u, v0, v1);
            mma_16816(o[1], pa0, 0u, pa2, 0u, v2, v3);
        }
    }
    if (g < group) {
        const size_t slot = ((size_t)b * a.kv_heads + kvh) * a.max_splits + split;
        float* out = ptr<float>(a.attn_o) + (slot * group + g) * kHeadDim + 16 * warp + 2 * tq;
#pragma unroll
        for (int j = 0; j < 2; ++j) *reinterpret_cast<float2*>(out + 8 * j) = make_float2(o[j][0], o[j][1]);
        if (warp == 0 && tq == 0) {
            float* ml = ptr<float>(a.attn_ml) + (slot * group + g) * 2;
            ml[0] = m_run, ml[1] = l_run;
        }
    }
}

// Warp g merges query head g's splits in rounds of 32: lane l holds split 32r + l's weight
// exp(m_s - m) (one load of every split's (max, sum) per round, not a dependent load per split),
// then every lane adds all the round's weighted partials for its dims 4l..4l+3.
__device__ void run_attn_combine(const MkStepArgs& a, const MkTask& t) {
    const int b = t.arg[0], kvh = t.arg[1], splits = t.arg[2];
    const int group = a.heads / a.kv_heads;
    const int g = threadIdx.x / 32, lane = threadIdx.x % 32, d0 = 4 * lane;
    if (g >= group) return;
    const size_t slot = (size_t)b * a.kv_heads + kvh;
    const float* o = ptr<float>(a.attn_o);
    auto ml_of = [&](int s) {
        const float* ml = ptr<float>(a.attn_ml) + ((slot * a.max_splits + s) * group + g) * 2;
        return s < splits ? __ldcg(reinterpret_cast<const float2*>(ml)) : make_float2(-INFINITY, 0.f);
    };
    const float2 first = ml_of(lane);  // the first round's, kept for the second pass
    float m = first.x;
    for (int s = lane + 32; s < splits; s += 32) m = fmaxf(m, ml_of(s).x);
    m = warp_max(m);
    float l = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int base = 0; base < splits; base += 32) {
        const float2 ms = base == 0 ? first : ml_of(base + lane);
        const float w = ms.x == -INFINITY ? 0.f : __expf(ms.x - m);
        l += w * ms.y;
        const int n = min(32, splits - base);
#pragma unroll 16
        for (int j = 0; j < n; ++j) {
            const float ws = __shfl_sync(0xffffffffu, w, j);
            const float4 os = __ldcg(reinterpret_cast<const float4*>(o + ((slot * a.max_splits + base + j) * group + g) * kHeadDim + d0));
            acc[0] += ws * os.x, acc[1] += ws * os.y, acc[2] += ws * os.z, acc[3] += ws * os.w;
        }
    }
    l = warp_sum(l);
    bf16* out = ptr<bf16>(a.attn_out) + (size_t)b * a.heads * kHeadDim + (kvh * group + g) * kHeadDim + d0;
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __float2bfloat16(acc[i] / l);
}

}  // namespace mk
