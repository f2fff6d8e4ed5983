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

constexpr int kPPitch = kPage + 8;  // bf16 per row of P

#ifndef MK_SPLIT_MARKS
#define MK_SPLIT_MARKS 0
#endif

// A page of K or V of one KV head in a ring stage, as the producer's two bulk tensor copies write
// it: two boxes of kPage rows x MK_KV_BOX_COLS columns (128 bytes) with the copy engine's 128-byte
// swizzle, the 16-byte piece p of row r at piece p ^ (r % 8) of the row, so that 8 rows read at
// one column hit 8 distinct bank groups. A box must start at a multiple of 1024 bytes.
constexpr int kKvBoxCols = MK_KV_BOX_COLS;
constexpr int kKvBoxBytes = kPage * kKvBoxCols * 2;
static_assert(kKvBoxCols * 2 == 128 && kHeadDim == 2 * kKvBoxCols, "a page row is two 128-byte swizzled rows");

struct SwizzledKv {
    unsigned char* base;
    // Byte address of dims d, d + 1, ... of a row (up to the end of d's 16-byte piece).
    __device__ unsigned char* at(int row, int d) const {
        const int c = d % kKvBoxCols;
        return base + (d / kKvBoxCols) * kKvBoxBytes + row * 128 + (((c / 8) ^ (row % 8)) * 16) + (c % 8) * 2;
    }
};

// Row pitch of q in shared memory (fp32): rows g and g + 4 of a quarter-warp's loads share banks.
constexpr int kQPitch = kHeadDim + 8;

// The split's query group (fp32), the softmax's cross-warp exchange and the probabilities P (bf16)
// of one page.
struct AttnScratch {
    float q[kMaxGroup][kQPitch];
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
    int before;  // the position of the launch's row before this one (-2: none)
    const int32_t* table;  // the row's block table for the task's layer

    SplitPages() = default;
    __device__ SplitPages(const MkStepArgs& a, const MkTask& t)
        : b(t.arg[0]), kvh(t.arg[1]), pos(ld_i32(ptr<int32_t>(a.positions) + t.arg[0])),
          before(t.arg[0] > 0 ? ld_i32(ptr<int32_t>(a.positions) + t.arg[0] - 1) : -2),
          table(ptr<int32_t>(a.block_tables) + ((size_t)t.layer * a.batch + b) * a.max_pages) {
        const int2 keys = split_keys(t.arg[2], t.arg[3], t.arg[5], pos);
        lo = keys.x, hi = keys.y, first_page = lo - lo % kPage, pages = (hi - first_page + kPage - 1) / kPage;
    }

    // The keys before the row's own that this step writes too: those of the rows just before it
    // in the launch at the positions just before, mapped to the same block (a draft's
    // verification rows, sharing their sequence's table). Only for a split that can hold them.
    // (`before` settles it for a row of a plain step, with no load of its own.)
    __device__ int fresh_keys(const MkStepArgs& a, int layer) const {
        int j = 0;
        if (before != pos - 1 || hi + b <= pos) return 0;  // (at most b rows come before this one)
        const int32_t* positions = ptr<int32_t>(a.positions);
        for (int r = b - 1; r >= 0; --r) {
            const int q = pos - (b - r);
            if (q < 0 || ld_i32(positions + r) != q) break;
            const int32_t* other = ptr<int32_t>(a.block_tables) + ((size_t)layer * a.batch + r) * a.max_pages;
            if (ld_i32(other + q / kPage) != ld_i32(table + q / kPage)) break;
            ++j;
        }
        return j;
    }

    // Row `row` of page i for the split's KV head in the K (which 0) or V pool.
    __device__ const bf16* row_at(const MkStepArgs& a, int which, int i, int row) const {
        const size_t block = (size_t)ld_i32(table + (first_page + i * kPage) / kPage);
        return ptr<const bf16>(which ? a.v_pool : a.k_pool) + ((block * kPage + row) * a.kv_heads + kvh) * kHeadDim;
    }
};

// The running state of a split's online softmax, of query head g = lane / 4 (identical in every
// warp), and the thread's share of its output.
struct SplitState {
    uint32_t qa[kHeadDim / 16][2];  // the thread's A fragments of Q (head g; rows g + 8 are zero)
    float m_run = -INFINITY, l_run = 0.f;
    float o[2][4] = {};  // O[head g][dims 16w + 8j + 2tq, +1] in o[j][0..1]

    // Every split of a KV head reads the same q at about the same moment: one 16-byte load a
    // thread into shared memory, not each warp all of it (8x the bytes from the few L2 slices that
    // hold it arrive late under the weight stream; docs/PERF.md, tuning decisions).
    __device__ SplitState(const MkStepArgs& a, const SplitPages& sp, AttnScratch& x) {
        const int group = a.heads / a.kv_heads, g = threadIdx.x % 32 / 4, tq = threadIdx.x % 4;
        const float4* q = reinterpret_cast<const float4*>(ptr<float>(a.q) + ((size_t)sp.b * a.heads + sp.kvh * group) * kHeadDim);
        for (int i = threadIdx.x; i < group * kHeadDim / 4; i += kThreads)
            *reinterpret_cast<float4*>(&x.q[i / (kHeadDim / 4)][4 * (i % (kHeadDim / 4))]) = __ldcg(q + i);
        compute_sync();
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
            float2 x0 = make_float2(0.f, 0.f), x1 = x0;
            if (g < group) {
                x0 = *reinterpret_cast<const float2*>(&x.q[g][16 * ks + 2 * tq]);
                x1 = *reinterpret_cast<const float2*>(&x.q[g][16 * ks + 8 + 2 * tq]);
            }
            qa[ks][0] = pack_bf16(x0.x, x0.y), qa[ks][1] = pack_bf16(x1.x, x1.y);
        }
    }

    // One page (keys start.., those outside [lo, hi) masked; their V rows must be finite): S = Q Kᵀ
    // for keys 8w..8w+7 (warp w), the running max and sum over the block, O += P V for dims
    // 16w..16w+15 (V's [key][dim] tiles transposed by ldmatrix). Two block barriers.
    __device__ __forceinline__ void page(SwizzledKv k, SwizzledKv v, int start, int lo, int hi, AttnScratch& x) {
        const float inv_sqrt = rsqrtf((float)kHeadDim);
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, tq = lane % 4;
        float sc[4] = {0.f, 0.f, 0.f, 0.f};
        const int krow = 8 * warp + g;
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks)
            mma_16816(sc, qa[ks][0], 0u, qa[ks][1], 0u, lds32(k.at(krow, 16 * ks + 2 * tq)),
                      lds32(k.at(krow, 16 * ks + 8 + 2 * tq)));
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
            ldmatrix_x4_trans(v.at(16 * ks + (mat & 1) * 8 + lane % 8, 16 * warp + (mat >> 1) * 8), v0, v1, v2, v3);
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

// A split: its pages come through the weight ring, copied by the producer warp as its walk reaches
// the split (often during earlier tasks): stage n + 2i holds page i's K, n + 2i + 1 its V, whole
// pages of the pool. Once both are full, the rows the split must not see from the
// pool are fixed: V's rows outside [lo, hi) are zeroed (they may hold anything, and 0 * NaN would
// poison P V; K's are masked out of S), and the keys and values this step wrote (the row's own,
// and a draft's earlier rows': written by this step's QKV, which the task waited for) are copied
// in from the pool. Such writes are fenced against the copy engine's next writes into the stage.
// Marks: the first page done (q loaded, the pages' fixes, one page's softmax); every page done.
// With -DMK_SPLIT_MARKS=1 instead: q loaded; the first page's K and V full.
__device__ void run_attn_split(const MkStepArgs& a, const MkTask& t, const SplitPages& sp, AttnScratch& x,
                                    const Ring& r, uint32_t& n, PhaseMarks& marks) {
    SplitState st(a, sp, x);
#if MK_SPLIT_MARKS
    // A diagnostic placement (MK_SPLIT_MARKS=1): q loaded (its fragments built), then the first
    // page's K and V full; a mark keeps its first point, so the ones below then change nothing.
#pragma unroll
    for (int ks = 0; ks < kHeadDim / 16; ++ks) asm volatile("" ::"r"(st.qa[ks][0]), "r"(st.qa[ks][1]));
    marks.mark(0);
#endif
    constexpr int kRowPieces = kHeadDim / 8;  // 16-byte pieces of a row
    const int fresh_lo = sp.pos - sp.fresh_keys(a, t.layer);  // the first key this step wrote
    for (int i = 0; i < sp.pages; ++i, n += 2) {
        const int start = sp.first_page + i * kPage;
        r.wait_full(n);
        r.wait_full(n + 1);
        if (MK_SPLIT_MARKS && i == 0) marks.mark(1);
        const SwizzledKv ks{r.stage(n)}, vs{r.stage(n + 1)};
        const int first = max(sp.lo - start, 0), end = min(sp.hi - start, kPage);
        const int own_lo = fresh_lo - start, own_hi = sp.pos - start;  // this step's keys' rows (may lie outside)
        if (first > 0 || end < kPage || (own_hi >= first && own_lo < end)) {
            for (int c = threadIdx.x; c < kPage * kRowPieces; c += kThreads) {
                const int row = c / kRowPieces, d = 8 * (c % kRowPieces);
                if (row < first || row >= end) {
                    *reinterpret_cast<uint4*>(vs.at(row, d)) = make_uint4(0, 0, 0, 0);
                } else if (row >= own_lo && row <= own_hi) {
                    *reinterpret_cast<uint4*>(ks.at(row, d)) =
                        ld_activations(sp.row_at(a, 0, i, row) + d);
                    *reinterpret_cast<uint4*>(vs.at(row, d)) =
                        ld_activations(sp.row_at(a, 1, i, row) + d);
                }
            }
            asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
            compute_sync();
        }
        st.page(ks, vs, start, sp.lo, sp.hi, x);
        __syncwarp();
        if (threadIdx.x % 32 == 0) mbar_arrive(r.empty_of(n)), mbar_arrive(r.empty_of(n + 1));
        if (i == 0) marks.mark(0);
    }
    marks.mark(1);
    st.store(a, sp, t.arg[2]);
}

// Warp g merges query head g's splits in rounds of 32: lane l holds split 32r + l's weight
// exp(m_s - m) (one load of every split's (max, sum) per round, not a dependent load per split),
// then every lane adds all the round's weighted partials for its dims 4l..4l+3.
// Marks: the splits' (max, sum) loaded; their outputs summed.
__device__ void run_attn_combine(const MkStepArgs& a, const MkTask& t, PhaseMarks& marks) {
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
    marks.mark(0);
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
    marks.mark(1);
    bf16* out = ptr<bf16>(a.attn_out) + (size_t)b * a.heads * kHeadDim + (kvh * group + g) * kHeadDim + d0;
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __float2bfloat16(acc[i] / l);
}

}  // namespace mk
