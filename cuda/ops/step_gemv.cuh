// The GEMV task: 16 * groups output rows of one weight matrix for the whole batch, with the
// matrix's epilogue (RoPE and the paged K/V write for QKV, silu·up for gate/up pairs, ...).
#pragma once
#include "gemv.cuh"
#include "step_common.cuh"

namespace mk {

// Shared memory of a GEMV task.
struct GemvSmem {
    float partial[kWarps][4][32];
    float out[4][16][8];  // [group][row][batch]
    int has_row[8];       // expert tiles: which batch rows routed to the slot's expert
};

// What a task multiplies: up to 4 row groups, each 16 rows of some matrix with k columns.
struct GemvPlan {
    const bf16* rows[4];  // first row of each group
    int valid[4];         // rows of the group that exist (the rest read row 0 and are dropped)
    int groups;
    int k;
    const bf16* act;      // [batch, k]
};

// Fills has_row[b] for an expert tile's slot (visible after the next barrier).
__device__ __forceinline__ void load_slot_rows(const MkStepArgs& a, int slot, int* has_row) {
    if (threadIdx.x < a.batch) {
        const int32_t* ts = ptr<int32_t>(a.topk_slot) + threadIdx.x * a.top_k;
        bool has = false;
        for (int i = 0; i < a.top_k; ++i) has |= ld_i32(ts + i) == slot;
        has_row[threadIdx.x] = has;
    }
}

__device__ GemvPlan gemv_plan(const MkStepArgs& a, const MkTask& t) {
    const uint64_t* lw = ptr<uint64_t>(a.layer_weights) + (size_t)t.layer * MK_LW_COUNT;
    const int matrix = t.arg[0], r0 = t.arg[1], slot = t.arg[3];
    GemvPlan p{};
    p.groups = t.arg[2];
    const int qw = a.heads * a.head_dim, kvw = a.kv_heads * a.head_dim;
    auto rows_of = [&](uint64_t w, int k, int first, int n) {
        for (int g = 0; g < p.groups; ++g) {
            p.rows[g] = ptr<const bf16>(w) + (size_t)(first + 16 * g) * k;
            p.valid[g] = max(0, min(16, n - (first + 16 * g)));
        }
        p.k = k;
    };
    switch (matrix) {
        case MK_MAT_QKV: {
            p.act = ptr<const bf16>(a.h);
            if (r0 < qw) rows_of(lw[MK_LW_Q], a.hidden, r0, qw);
            else if (r0 < qw + kvw) rows_of(lw[MK_LW_K], a.hidden, r0 - qw, kvw);
            else rows_of(lw[MK_LW_V], a.hidden, r0 - qw - kvw, kvw);
            break;
        }
        case MK_MAT_O:
            p.act = ptr<const bf16>(a.attn_out);
            rows_of(lw[MK_LW_O], qw, r0, a.hidden);
            break;
        case MK_MAT_ROUTER:
            p.act = ptr<const bf16>(a.h);
            rows_of(lw[MK_LW_ROUTER], a.hidden, r0, a.experts);
            break;
        case MK_MAT_DENSE_GATE_UP:
        case MK_MAT_EXPERT_GATE_UP: {
            uint64_t gate = lw[MK_LW_GATE], up = lw[MK_LW_UP];
            int ffn = a.dense_ffn;
            if (matrix == MK_MAT_EXPERT_GATE_UP) {
                const int e = ld_i32(ptr<int32_t>(a.slot_expert) + slot);
                const uint64_t* ew = ptr<uint64_t>(a.expert_weights) + ((size_t)t.layer * a.experts + e) * 3;
                gate = ew[0], up = ew[1], ffn = a.expert_ffn;
            }
            p.act = ptr<const bf16>(a.h);
            p.groups = 2;  // group 0: 16 gate rows, group 1: the matching 16 up rows
            p.rows[0] = ptr<const bf16>(gate) + (size_t)r0 * a.hidden;
            p.rows[1] = ptr<const bf16>(up) + (size_t)r0 * a.hidden;
            p.valid[0] = p.valid[1] = min(16, ffn - r0);
            p.k = a.hidden;
            break;
        }
        case MK_MAT_DENSE_DOWN:
            p.act = ptr<const bf16>(a.dense_act);
            rows_of(lw[MK_LW_DOWN], a.dense_ffn, r0, a.hidden);
            break;
        case MK_MAT_EXPERT_DOWN: {
            const int e = ld_i32(ptr<int32_t>(a.slot_expert) + slot);
            const uint64_t* ew = ptr<uint64_t>(a.expert_weights) + ((size_t)t.layer * a.experts + e) * 3;
            p.act = ptr<const bf16>(a.expert_act) + (size_t)slot * a.batch * a.expert_ffn;
            rows_of(ew[2], a.expert_ffn, r0, a.hidden);
            break;
        }
        case MK_MAT_LM_HEAD:
            p.act = ptr<const bf16>(a.h);
            rows_of(a.embed, a.hidden, r0, a.vocab);
            break;
    }
    return p;
}

// out[g][row][b] = sum_k act[b][k] * rows[g][row][k] (fp32), for b < batch (<= 8).
__device__ void gemv_compute(const GemvPlan& p, int batch, GemvSmem& s) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int per_group = kWarps / p.groups;
    const int g = warp / per_group, slice = warp % per_group;
    const int chunks = p.k / 32;
    const int k_begin = 32 * (slice * chunks / per_group), k_end = 32 * ((slice + 1) * chunks / per_group);
    float acc[1][4] = {};
    if (g < p.groups && p.valid[g] > 0)
        gemv_warp_rows16<1, 4>(p.rows[g], p.k, p.act, p.k, batch, 0, k_begin, k_end, acc, p.valid[g]);
#pragma unroll
    for (int i = 0; i < 4; ++i) s.partial[warp][i][lane] = acc[0][i];
    __syncthreads();
    for (int idx = threadIdx.x; idx < p.groups * 128; idx += kThreads) {
        const int grp = idx / 128, i = (idx / 32) % 4, l = idx % 32;
        float sum = 0.f;
        for (int w = grp * per_group; w < (grp + 1) * per_group; ++w) sum += s.partial[w][i][l];
        const int row = l / 4 + (i >= 2 ? 8 : 0), b = 2 * (l % 4) + (i & 1);
        s.out[grp][row][b] = sum;
    }
    __syncthreads();
}

__device__ void gemv_epilogue(const MkStepArgs& a, const MkTask& t, const GemvPlan& p, GemvSmem& s) {
    const int matrix = t.arg[0], r0 = t.arg[1], slot = t.arg[3];
    const int qw = a.heads * a.head_dim, kvw = a.kv_heads * a.head_dim;
    const int n = p.groups * 16;
    for (int idx = threadIdx.x; idx < n * a.batch; idx += kThreads) {
        const int row = idx / a.batch, b = idx % a.batch;
        const int grp = row / 16, r = row % 16;
        if (r >= p.valid[grp]) continue;
        const float v = round_bf16(s.out[grp][r][b]);
        const int out_row = r0 + row;
        switch (matrix) {
            case MK_MAT_O: ptr<float>(a.y_attn)[b * a.hidden + out_row] = v; break;
            case MK_MAT_ROUTER: ptr<float>(a.router)[b * a.experts + out_row] = v; break;
            case MK_MAT_DENSE_DOWN: ptr<float>(a.ffn_out)[b * a.hidden + out_row] = v; break;
            case MK_MAT_EXPERT_DOWN:
                if (s.has_row[b])
                    ptr<float>(a.expert_out)[((size_t)slot * a.batch + b) * a.hidden + out_row] = v;
                break;
            case MK_MAT_LM_HEAD: ptr<float>(a.logits)[(size_t)b * a.vocab + out_row] = v * a.logit_scale; break;
            case MK_MAT_DENSE_GATE_UP:
            case MK_MAT_EXPERT_GATE_UP: {
                if (grp != 0) break;  // one thread per (feature, row) does both halves
                const float gate = v, up = round_bf16(s.out[1][r][b]);
                const bf16 act = __float2bfloat16(gate / (1.f + __expf(-gate)) * up);
                if (matrix == MK_MAT_DENSE_GATE_UP) {
                    ptr<bf16>(a.dense_act)[b * a.dense_ffn + out_row] = act;
                } else if (s.has_row[b]) {
                    ptr<bf16>(a.expert_act)[((size_t)slot * a.batch + b) * a.expert_ffn + out_row] = act;
                }
                break;
            }
            case MK_MAT_QKV: break;  // below: RoPE pairs rows
        }
    }
    if (matrix != MK_MAT_QKV) return;
    // QKV: rows come in (even, odd) RoPE pairs; one thread per (pair, batch row).
    const bool rope = ptr<int32_t>(a.layer_rope)[t.layer] != 0;
    for (int idx = threadIdx.x; idx < 8 * a.batch; idx += kThreads) {
        const int pair = idx / a.batch, b = idx % a.batch;
        float ye = round_bf16(s.out[0][2 * pair][b]), yo = round_bf16(s.out[0][2 * pair + 1][b]);
        const int pos = ld_i32(ptr<int32_t>(a.positions) + b);
        const int region_row = r0 < qw ? r0 : (r0 < qw + kvw ? r0 - qw : r0 - qw - kvw);
        const int dim = region_row % a.head_dim + 2 * pair;
        const bool is_v = r0 >= qw + kvw;
        if (rope && !is_v) {
            // Angles in double, tables rounded to bf16: the reference model's RoPE.
            const double inv_freq = pow((double)a.rope_theta, -(double)dim / (double)a.head_dim);
            const double angle = (double)pos * inv_freq;
            const float c = round_bf16((float)cos(angle)), sn = round_bf16((float)sin(angle));
            const float e2 = ye * c - yo * sn, o2 = yo * c + ye * sn;
            ye = e2, yo = o2;
        }
        if (r0 < qw) {
            float* q = ptr<float>(a.q) + (size_t)b * qw + r0 + 2 * pair;
            q[0] = ye, q[1] = yo;
        } else {
            const int head = region_row / a.head_dim;
            const int block = ld_i32(ptr<int32_t>(a.block_tables) + ((size_t)t.layer * a.batch + b) * a.max_pages + pos / 64);
            bf16* pool = ptr<bf16>(is_v ? a.v_pool : a.k_pool);
            bf16* dst = pool + (((size_t)block * 64 + pos % 64) * a.kv_heads + head) * a.head_dim + dim;
            dst[0] = __float2bfloat16(ye), dst[1] = __float2bfloat16(yo);
        }
    }
}

__device__ __forceinline__ void prefetch_l2(const void* p, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p), "r"(bytes) : "memory");
}

// Asks L2 for the weight rows of GEMV task `t` (one thread calls it). Expert tiles are skipped:
// which expert a slot holds is only known once the layer's top-k task has run. Rows are
// contiguous per group and 16-byte multiples (k is a multiple of 32).
__device__ void prefetch_gemv_weights(const MkStepArgs& a, const MkTask& t) {
    if (t.op != MK_OP_GEMV || t.arg[0] == MK_MAT_EXPERT_GATE_UP || t.arg[0] == MK_MAT_EXPERT_DOWN) return;
    const GemvPlan p = gemv_plan(a, t);
    for (int g = 0; g < p.groups; ++g)
        if (p.valid[g] > 0) prefetch_l2(p.rows[g], (uint32_t)(p.valid[g] * p.k * sizeof(bf16)));
}

__device__ void run_gemv(const MkStepArgs& a, const MkTask& t, GemvSmem& s) {
    if (t.arg[0] == MK_MAT_EXPERT_GATE_UP || t.arg[0] == MK_MAT_EXPERT_DOWN) {
        if (t.arg[3] >= ld_i32(ptr<int32_t>(a.slot_count))) return;  // an unused MoE slot
    }
    const GemvPlan p = gemv_plan(a, t);
    if (t.arg[0] == MK_MAT_EXPERT_GATE_UP || t.arg[0] == MK_MAT_EXPERT_DOWN) load_slot_rows(a, t.arg[3], s.has_row);
    gemv_compute(p, a.batch, s);  // its barriers publish has_row
    gemv_epilogue(a, t, p, s);
}

}  // namespace mk
