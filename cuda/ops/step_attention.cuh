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

#ifndef MK_RING_KV_MAX_BATCH
#define MK_RING_KV_MAX_BATCH 8
#endif
// Up to this batch a split's KV pages come through the weight ring, copied by the producer warp
// as its walk reaches the split (ring_kv); above it they come through attention's own cp.async
// stages in the ops' union (AttnSmem), which leaves the ring fewer stages. A tuning knob
// (-DMK_RING_KV_MAX_BATCH=N; 0: never through the ring).
__host__ __device__ constexpr bool ring_kv(int batch) { return batch <= MK_RING_KV_MAX_BATCH; }

// A page of K or V in shared memory: kPage rows of kKvPitch bf16.
typedef bf16 KvTile[kPage][kKvPitch];

// The softmax's cross-warp exchange and the probabilities P (bf16) of one page.
struct AttnScratch {
    bf16 p[kMaxGroup][kPPitch];
    float row_max[kWarps][kMaxGroup];
    float row_sum[kWarps][kMaxGroup];
};

// Attention's own pipeline (batches above MK_RING_KV_MAX_BATCH): kKvStages pages through
// cp.async, all but one in flight while one is used.
struct AttnSmem {
    KvTile k[kKvStages];
    KvTile v[kKvStages];
    AttnScratch x;
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

    // Row `row` of page i for the split's KV head in the K (which 0) or V pool.
    __device__ const bf16* row_at(const MkStepArgs& a, int which, int i, int row) const {
        const size_t block = (size_t)ld_i32(table + (first_page + i * kPage) / kPage);
        return ptr<const bf16>(which ? a.v_pool : a.k_pool) + ((block * kPage + row) * a.kv_heads + kvh) * kHeadDim;
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

// The running state of a split's online softmax, of query head g = lane / 4 (identical in every
// warp), and the thread's share of its output.
struct SplitState {
    uint32_t qa[kHeadDim / 16][2];  // the thread's A fragments of Q (head g; rows g + 8 are zero)
    float m_run = -INFINITY, l_run = 0.f;
    float o[2][4] = {};  // O[head g][dims 16w + 8j + 2tq, +1] in o[j][0..1]

    __device__ SplitState(const MkStepArgs& a, const SplitPages& sp) {
        const int group = a.heads / a.kv_heads, g = threadIdx.x % 32 / 4, tq = threadIdx.x % 4;
        const float* q = ptr<float>(a.q) + (size_t)sp.b * a.heads * kHeadDim + (sp.kvh * group + g) * kHeadDim;
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

    // One page (keys start.., those outside [lo, hi) masked; their V rows must be finite): S = Q Kᵀ
    // for keys 8w..8w+7 (warp w), the running max and sum over the block, O += P V for dims
    // 16w..16w+15 (V's [key][dim] tiles transposed by ldmatrix). Two block barriers.
    __device__ __forceinline__ void page(const KvTile& k, const KvTile& v, int start, int lo, int hi,
                                         AttnScratch& x) {
        const float inv_sqrt = rsqrtf((float)kHeadDim);
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
        float sc[4] = {0.f, 0.f, 0.f, 0.f};
        const bf16* krow = &k[8 * warp + g][0];
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks)
            mma_16816(sc, qa[ks][0], 0u, qa[ks][1], 0u, lds32(krow + 16 * ks + 2 * tq), lds32(krow + 16 * ks + 8 + 2 * tq));
        const int key = start + 8 * warp + 2 * tq;
        const bool ok0 = key >= lo && key < hi, ok1 = key + 1 >= lo && key + 1 < hi;
        const float s0 = ok0 ? sc[0] * inv_sqrt : -INFINITY, s1 = ok1 ? sc[1] * inv_sqrt : -INFINITY;
        float mx = fmaxf(s0, s1);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        if (tq == 0) x.row_max[warp][g] = mx;
        compute_sync();
        float page_max = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) page_max = fmaxf(page_max, x.row_max[w][g]);
        const float m_new = fmaxf(m_run, page_max);  // finite: every page has a key in range
        const float factor = __expf(m_run - m_new);
        const float p0 = ok0 ? __expf(s0 - m_new) : 0.f, p1 = ok1 ? __expf(s1 - m_new) : 0.f;
        float ps = p0 + p1;
        ps += __shfl_xor_sync(0xffffffffu, ps, 1);
        ps += __shfl_xor_sync(0xffffffffu, ps, 2);
        if (tq == 0) x.row_sum[warp][g] = ps;
        *reinterpret_cast<uint32_t*>(&x.p[g][8 * warp + 2 * tq]) = pack_bf16(p0, p1);
        compute_sync();
        float page_sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) page_sum += x.row_sum[w][g];
        l_run = l_run * factor + page_sum;
        m_run = m_new;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) o[j][e] *= factor;
        const int mat = lane / 8;
#pragma unroll
        for (int ks = 0; ks < kPage / 16; ++ks) {
            const uint32_t pa0 = lds32(&x.p[g][16 * ks + 2 * tq]), pa2 = lds32(&x.p[g][16 * ks + 8 + 2 * tq]);
            uint32_t v0, v1, v2, v3;
            ldmatrix_x4_trans(&v[16 * ks + (mat & 1) * 8 + lane % 8][16 * warp + (mat >> 1) * 8], v0, v1, v2, v3);
            mma_16816(o[0], pa0, 0u, pa2, 0u, v0, v1);
            mma_16816(o[1], pa0, 0u, pa2, 0u, v2, v3);
        }
    }

    // The unnormalised partial and its (max, sum) for the combine.
    __device__ void store(const MkStepArgs& a, const SplitPages& sp, int split) const {
        const int group = a.heads / a.kv_heads, warp = threadIdx.x / 32, g = threadIdx.x % 32 / 4, tq = threadIdx.x % 4;
        if (g >= group) return;
        const size_t slot = ((size_t)sp.b * a.kv_heads + sp.kvh) * a.max_splits + split;
        float* out = ptr<float>(a.attn_o) + (slot * group + g) * kHeadDim + 16 * warp + 2 * tq;
#pragma unroll
        for (int j = 0; j < 2; ++j) *reinterpret_cast<float2*>(out + 8 * j) = make_float2(o[j][0], o[j][1]);
        if (warp == 0 && tq == 0) {
            float* ml = ptr<float>(a.attn_ml) + (slot * group + g) * 2;
            ml[0] = m_run, ml[1] = l_run;
        }
    }
};

// `issued`: the pages attn_prefetch issued before the task's wait.
__device__ void run_attn_split(const MkStepArgs& a, const MkTask& t, const SplitPages& sp, AttnSmem& sm,
                               int issued) {
    auto issue = [&](int i) { sp.issue(a, sm, i); };
    while (issued < kKvStages - 1) issue(issued++);
    SplitState st(a, sp);
    for (int i = 0; i < sp.pages; ++i) {
        cp_async_wait_pending<kKvStages - 2>();  // this thread's copies of page i have landed
        compute_sync();                          // everyone's have; everyone is done with page i - 1
        issue(i + kKvStages - 1);
        st.page(sm.k[i % kKvStages], sm.v[i % kKvStages], sp.first_page + i * kPage, sp.lo, sp.hi, sm.x);
    }
    st.store(a, sp, t.arg[2]);
}

// The producer's copies of one ring stage of a split (ring_kv): page i's K (which 0) or V rows in
// [lo, hi) except the row at the row's position, which this step's QKV writes (the consumer
// copies it itself after its wait); the rest of the page is zero-filled.
struct KvStage {
    const bf16* row0;  // row 0 of the page for the split's KV head
    int first, end;    // rows [first, end) of the page in [lo, hi)
    int skip;          // the row at the position, or -1
};

__device__ __forceinline__ KvStage kv_stage(const MkStepArgs& a, const SplitPages& sp, int i, int which) {
    const int start = sp.first_page + i * kPage;
    return {sp.row_at(a, which, i, 0), max(sp.lo - start, 0), min(sp.hi - start, kPage),
            sp.pos >= start && sp.pos < start + kPage ? sp.pos - start : -1};
}

// A split whose pages came through the ring (ring_kv): stage n + 2i holds page i's K, n + 2i + 1
// its V, rows outside [lo, hi) zero. On the page holding the row's position, the new key and value
// (written by this step's QKV, which the task waited for) are copied in once the stages are full.
// Before a stage is released, a proxy fence orders this block's generic-proxy accesses of it
// (the cp.async copies, the new row) before the copy engine's next writes into it.
__device__ void run_attn_split_ring(const MkStepArgs& a, const MkTask& t, const SplitPages& sp, AttnScratch& x,
                                    const Ring& r, uint32_t& n) {
    SplitState st(a, sp);
    constexpr int kRowVecs = kHeadDim / 8;  // 16-byte pieces of a row
    for (int i = 0; i < sp.pages; ++i, n += 2) {
        const int start = sp.first_page + i * kPage;
        mbar_wait(r.full_of(n), r.parity(n));
        mbar_wait(r.full_of(n + 1), r.parity(n + 1));
        KvTile& k = *reinterpret_cast<KvTile*>(r.stage(n));
        KvTile& v = *reinterpret_cast<KvTile*>(r.stage(n + 1));
        const int own = sp.pos - start;  // the new token's row, if it is in this page and split
        if (own < kPage && sp.pos < sp.hi) {
            if (threadIdx.x < 2 * kRowVecs) {
                const int col = threadIdx.x % kRowVecs, which = threadIdx.x / kRowVecs;
                *reinterpret_cast<uint4*>(&(which ? v : k)[own][8 * col]) = ld_activations(sp.row_at(a, which, i, own) + 8 * col);
            }
            compute_sync();
        }
        st.page(k, v, start, sp.lo, sp.hi, x);
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        __syncwarp();
        if (threadIdx.x % 32 == 0) mbar_arrive(r.empty_of(n)), mbar_arrive(r.empty_of(n + 1));
    }
    st.store(a, sp, t.arg[2]);
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
