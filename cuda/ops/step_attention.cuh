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
constexpr int kKvPitch = kHeadDim + 8;  // bf16 per smem row: 272 bytes, so 8 rows hit 8 distinct bank groups
constexpr int kOPitch = kHeadDim + 8;   // floats per row of a warp's partial output (2-way banks at most)
constexpr int kWarpKeys = kPage / kWarps;  // keys of each page one warp owns
static_assert(kWarpKeys == 8, "warp w owns keys 8w..8w+7 of every page (one n8 tile of S)");

// One split streams its pages through a kKvStages-deep cp.async pipeline. Warp w owns keys
// 8w..8w+7 of every page: it copies their K and V rows, computes their scores for the whole query
// group (the 16-row A operand of mma.m16n8k16: heads 0..7, rows 8..15 zero) and adds P V for them
// into its own output (mma.m16n8k8, whose A fragment is exactly S's accumulator), with its own
// running max and sum. The warps never wait for each other until the end, where their partial
// outputs are merged once through shared memory (in the space of the K stages).
struct AttnSmem {
    bf16 k[kKvStages][kPage][kKvPitch];
    bf16 v[kKvStages][kPage][kKvPitch];
    float m[kWarps][kMaxGroup];  // each warp's running max and sum per head, for the merge
    float l[kWarps][kMaxGroup];

    // The warps' partial outputs [warp][head][dim] once the pages are done (over the K stages).
    __device__ float* warp_out(int w, int head) { return reinterpret_cast<float*>(&k[0][0][0]) + (w * kMaxGroup + head) * kOPitch; }
};
static_assert(sizeof(AttnSmem::k) >= sizeof(float) * kWarps * kMaxGroup * kOPitch, "the merge fits the K stages");

__device__ __forceinline__ uint32_t lds32(const void* p) { return *reinterpret_cast<const uint32_t*>(p); }

__device__ __forceinline__ void ldmatrix_x4_trans(const void* p, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(smem_addr(p)));
}

// d[0..1] += A · B for the rows 0..7 of A (mma.sync m16n8k8, bf16 in, fp32 accumulate): rows 8..15
// of A are zero, so their outputs are dropped.
__device__ __forceinline__ void mma_1688_top(float (&d)[2], uint32_t a0, uint32_t b0) {
    float unused0, unused1;
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%7,%7};"
        : "+f"(d[0]), "+f"(d[1]), "=f"(unused0), "=f"(unused1)
        : "r"(a0), "r"(0u), "r"(b0), "f"(0.f));
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

    // The calling warp copies its keys of page i into stage i % kKvStages (one cp.async group a
    // thread, empty past the end): rows outside [lo, hi) are zeroed (they may hold anything, and
    // 0 * NaN would poison P V).
    __device__ void issue(const MkStepArgs& a, AttnSmem& sm, int i) const {
        if (i < pages) {
            const int start = first_page + i * kPage, st = i % kKvStages, lane = threadIdx.x % 32;
            const int key0 = (threadIdx.x / 32) * kWarpKeys;
            const size_t block = (size_t)ld_i32(table + start / kPage);
            constexpr int kVecs = kHeadDim / 8;  // 16-byte pieces of a row
            for (int c = lane; c < 2 * kWarpKeys * kVecs; c += 32) {
                const int which = c / (kWarpKeys * kVecs), row = key0 + (c / kVecs) % kWarpKeys, col = c % kVecs;
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
    const int key0 = warp * kWarpKeys;
    while (issued < kKvStages - 1) sp.issue(a, sm, issued++);

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

    // Head g over this warp's keys: the running max (the same in the quad's four lanes), this
    // lane's share of the sum, and O[head g][dims 8j + 2tq, + 1] in o[j].
    float m_run = -INFINITY, l_part = 0.f;
    float o[kHeadDim / 8][2] = {};
    for (int i = 0; i < sp.pages; ++i) {
        cp_async_wait_pending<kKvStages - 2>();  // this thread's copies of page i have landed
        __syncwarp();                            // the warp's have; it is done with page i - 1
        sp.issue(a, sm, i + kKvStages - 1);
        const int st = i % kKvStages, start = sp.first_page + i * kPage;

        // S for keys key0 + 2tq, + 1 of head g.
        float sc[4] = {0.f, 0.f, 0.f, 0.f};
        const bf16* krow = &sm.k[st][key0 + g][0];
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks)
            mma_16816(sc, qa[ks][0], 0u, qa[ks][1], 0u, lds32(krow + 16 * ks + 2 * tq), lds32(krow + 16 * ks + 8 + 2 * tq));
        const int key = start + key0 + 2 * tq;
        const bool ok0 = key >= lo && key < hi, ok1 = key + 1 >= lo && key + 1 < hi;
        const float s0 = ok0 ? sc[0] * inv_sqrt : -INFINITY, s1 = ok1 ? sc[1] * inv_sqrt : -INFINITY;
        float mx = fmaxf(s0, s1);
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float m_new = fmaxf(m_run, mx);
        if (m_new == -INFINITY) continue;  // none of the warp's keys so far is in range
        const float factor = __expf(m_run - m_new);
        const float p0 = ok0 ? __expf(s0 - m_new) : 0.f, p1 = ok1 ? __expf(s1 - m_new) : 0.f;
        l_part = l_part * factor + p0 + p1;
        m_run = m_new;

        // O += P V: P's accumulator layout (head g, keys 2tq, 2tq + 1) is the m16n8k8 A fragment,
        // and ldmatrix.trans of the warp's 8 V rows gives the B fragments of 4 dim tiles at once.
        const uint32_t pa = pack_bf16(p0, p1);
        const bf16* vrow = &sm.v[st][key0 + lane % 8][8 * (lane / 8)];
#pragma unroll
        for (int j4 = 0; j4 < kHeadDim / 32; ++j4) {
            uint32_t v[4];
            ldmatrix_x4_trans(vrow + 32 * j4, v[0], v[1], v[2], v[3]);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                float(&oj)[2] = o[4 * j4 + q];
                oj[0] *= factor, oj[1] *= factor;
                mma_1688_top(oj, pa, v[q]);
            }
        }
    }

    // Merge the warps: O = sum_w exp(m_w - M) O_w, l likewise, M the largest m_w (finite: the
    // split has a key in range).
    l_part += __shfl_xor_sync(0xffffffffu, l_part, 1);
    l_part += __shfl_xor_sync(0xffffffffu, l_part, 2);
    cp_async_wait_all();
    compute_sync();  // every warp is done with the stages the merge overwrites
    if (tq == 0) sm.m[warp][g] = m_run, sm.l[warp][g] = l_part;
    float* mine = sm.warp_out(warp, g) + 2 * tq;
#pragma unroll
    for (int j = 0; j < kHeadDim / 8; ++j) *reinterpret_cast<float2*>(mine + 8 * j) = make_float2(o[j][0], o[j][1]);
    compute_sync();
    const int head = threadIdx.x / 32, d0 = 4 * lane;  // kWarps == kMaxGroup heads, 32 x 4 dims
    if (head < group) {
        float m_max = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) m_max = fmaxf(m_max, sm.m[w][head]);
        float l_sum = 0.f, acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float mw = sm.m[w][head];
            if (mw == -INFINITY) continue;  // the warp had no key in range
            const float scale = __expf(mw - m_max);
            l_sum += scale * sm.l[w][head];
            const float4 ow = *reinterpret_cast<const float4*>(sm.warp_out(w, head) + d0);
            acc[0] += scale * ow.x, acc[1] += scale * ow.y, acc[2] += scale * ow.z, acc[3] += scale * ow.w;
        }
        const size_t slot = ((size_t)b * a.kv_heads + kvh) * a.max_splits + split;
        float* out = ptr<float>(a.attn_o) + (slot * group + head) * kHeadDim + d0;
        *reinterpret_cast<float4*>(out) = make_float4(acc[0], acc[1], acc[2], acc[3]);
        if (lane == 0) {
            float* ml = ptr<float>(a.attn_ml) + (slot * group + head) * 2;
            ml[0] = m_max, ml[1] = l_sum;
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
