// The GEMV task: 16 * groups output rows of one weight matrix for the whole batch, with the
// matrix's epilogue (RoPE and the paged K/V write for QKV, silu·up for gate/up pairs, ...).
#pragma once
#include "step_attention.cuh"
#include "step_common.cuh"
#include "step_routing.cuh"
#include "step_stream.cuh"

namespace mk {

constexpr int kMaxBatch = MK_IMAGE_ROWS;
constexpr int kMaxK = MK_STEP_MAX_K;
// Bytes per activation row in shared memory: 64 mod 128, so the 8 threads of a quarter-warp
// reading rows g and g + 1 at one column hit 32 distinct banks.
__host__ __device__ constexpr int act_pitch(int k) { return (2 * k + 127) / 128 * 128 + 64; }

constexpr int kMaxGroups = MK_GEMV_MAX_GROUPS;

// Batch columns of one tensor-core product (m16n8k16's N). A launch of more rows (the wide image,
// MK_IMAGE_ROWS 16) multiplies each weight fragment with two n-tiles of activations
// (gemv_compute_wide).
constexpr int kTileN = 8;
constexpr bool kWideBatch = kMaxBatch > kTileN;
static_assert(kMaxBatch <= 2 * kTileN, "a GEMV multiplies at most two n-tiles");
static_assert(kMaxBatch * 16 <= kThreads, "a group's reduction takes one thread per (row, column)");

// Activation columns one GEMV holds in shared memory at a time: all of k up to kTileN rows (the
// buffer is [rows][kMaxK]); past that, whole boxes that keep the buffer [kTileN][kMaxK]'s size,
// and a longer reduction (O, the dense down projection) goes in passes of that many columns.
__host__ __device__ constexpr int act_cols(int batch) {
    return !kWideBatch || batch <= kTileN ? kMaxK : kMaxK * kTileN / batch / kBoxCols * kBoxCols;
}

// Groups whose per-warp partial sums shared memory holds at once: every group of a task up to
// kTileN rows (reduced at the task's end); past that two, each group reduced as soon as it is done.
__host__ __device__ constexpr int partial_groups(int batch) {
    return !kWideBatch || batch <= kTileN ? kMaxGroups : 2;
}

// Columns of a GEMV task's outputs in shared memory: one n-tile's, or two in a wide launch.
__host__ __device__ constexpr int out_cols(int batch) { return kWideBatch && batch > kTileN ? 2 * kTileN : kTileN; }

// Shared memory of a GEMV task (outside the weight ring), sized by the launch's batch so that a
// small batch leaves the ring more stages: the activations [batch][act_pitch(k)], the per-warp
// partial sums [group][warp][batch][16] (only the batch's columns of each mma tile), the
// outputs [group][16 rows][out_cols(batch)] and an expert tile's routed rows.
struct GemvSmem {
    unsigned char* act;
    float* partial;
    float* out_base;
    int* has_row;  // [kMaxBatch]: which batch rows routed to an expert tile's slot
    int cols;      // out_cols(batch)

    __host__ __device__ static constexpr size_t act_bytes(int batch) {
        return (size_t)batch * act_pitch(act_cols(batch));
    }
    __host__ __device__ static constexpr size_t partial_bytes(int batch) {
        return (size_t)partial_groups(batch) * kWarps * batch * 16 * sizeof(float);
    }
    __host__ __device__ static constexpr size_t out_bytes(int batch) {
        return (size_t)kMaxGroups * 16 * out_cols(batch) * sizeof(float);
    }
    __host__ __device__ static constexpr size_t bytes(int batch) {
        return act_bytes(batch) + partial_bytes(batch) + out_bytes(batch) + kMaxBatch * sizeof(int);
    }
    __device__ GemvSmem(unsigned char* base, int batch)
        : act(base), partial(reinterpret_cast<float*>(base + act_bytes(batch))),
          out_base(reinterpret_cast<float*>(base + act_bytes(batch) + partial_bytes(batch))),
          has_row(reinterpret_cast<int*>(base + act_bytes(batch) + partial_bytes(batch) + out_bytes(batch))),
          cols(out_cols(batch)) {}
    // Output (row, column b) of group grp.
    __device__ float& out(int grp, int row, int b) const {
        if constexpr (kWideBatch) return out_base[(grp * 16 + row) * cols + b];
        else return reinterpret_cast<float(*)[16][kTileN]>(out_base)[grp][row][b];
    }
};

// What a task multiplies, from its words and the step's dimensions alone (no loads): `groups`
// weight groups of 16 rows of one matrix with `rows` rows of k columns. Gate/up tasks are
// `paired`: group 2j holds the gate rows of features first + 16j.., group 2j + 1 the same up rows.
struct GemvShape {
    int groups;
    int k;
    int first;  // the first row of group 0 within its matrix (QKV: within Q, K or V)
    int rows;
    bool paired;
    const bf16* act;  // [batch, k]

    __device__ int group_first(int g) const { return first + 16 * (paired ? g / 2 : g); }
    // Rows of group g that exist (the copy zero-fills the rest; they are dropped).
    __device__ int group_valid(int g) const { return max(0, min(16, rows - group_first(g))); }
};

__device__ GemvShape gemv_shape(const MkStepArgs& a, const MkTask& t) {
    const int matrix = t.arg[0], r0 = t.arg[1], slot = t.arg[3];
    const int qw = a.heads * a.head_dim, kvw = a.kv_heads * a.head_dim;
    GemvShape s{t.arg[2], a.hidden, r0, 0, false, ptr<const bf16>(a.h)};
    switch (matrix) {
        case MK_MAT_QKV:
            if (r0 < qw) s.rows = qw;
            else if (r0 < qw + kvw) s.first = r0 - qw, s.rows = kvw;
            else s.first = r0 - qw - kvw, s.rows = kvw;
            break;
        case MK_MAT_O: s.k = qw, s.rows = a.hidden, s.act = ptr<const bf16>(a.attn_out); break;
        case MK_MAT_ROUTER: s.rows = a.experts; break;
        case MK_MAT_DENSE_GATE_UP:
        case MK_MAT_EXPERT_GATE_UP:
            s.groups = 2 * t.arg[2], s.paired = true;
            s.rows = matrix == MK_MAT_DENSE_GATE_UP ? a.dense_ffn : a.expert_ffn;
            break;
        case MK_MAT_DENSE_DOWN: s.k = a.dense_ffn, s.rows = a.hidden, s.act = ptr<const bf16>(a.dense_act); break;
        case MK_MAT_EXPERT_DOWN:
            s.k = a.expert_ffn, s.rows = a.hidden;
            s.act = ptr<const bf16>(a.expert_act) + (size_t)slot * a.batch * a.expert_ffn;
            break;
        case MK_MAT_LM_HEAD: s.rows = a.vocab; break;
    }
    return s;
}

// The bulk-copy descriptors (CUtensorMap) of the matrix a task streams: maps[0] its matrix (a
// gate/up task's gate), maps[1] a gate/up task's up. Expert matrices need the expert in the
// task's slot, from the block's routing of the layer (the producer's own: StageWalk::routed_slots).
struct GemvMaps {
    const void* map[2];
    __device__ const void* of(const GemvShape& s, int g) const { return s.paired && g % 2 ? map[1] : map[0]; }
};

__device__ GemvMaps gemv_maps(const MkStepArgs& a, const MkTask& t, const BlockRouting* routing) {
    const int matrix = t.arg[0], r0 = t.arg[1];
    const int qw = a.heads * a.head_dim, kvw = a.kv_heads * a.head_dim;
    const unsigned char* lmaps = ptr<unsigned char>(a.layer_maps) + (size_t)t.layer * MK_LW_COUNT * MK_TENSOR_MAP_BYTES;
    auto layer_map = [&](int which) -> const void* { return lmaps + (size_t)which * MK_TENSOR_MAP_BYTES; };
    auto expert_map = [&](int which) -> const void* {
        const int e = shared_load(&routing[t.layer & 1].expert[t.arg[3]]);
        return ptr<unsigned char>(a.expert_maps) + (((size_t)t.layer * a.experts + e) * 3 + which) * MK_TENSOR_MAP_BYTES;
    };
    switch (matrix) {
        case MK_MAT_QKV: return {{layer_map(r0 < qw ? MK_LW_Q : (r0 < qw + kvw ? MK_LW_K : MK_LW_V)), nullptr}};
        case MK_MAT_O: return {{layer_map(MK_LW_O), nullptr}};
        case MK_MAT_ROUTER: return {{layer_map(MK_LW_ROUTER), nullptr}};
        case MK_MAT_DENSE_GATE_UP: return {{layer_map(MK_LW_GATE), layer_map(MK_LW_UP)}};
        case MK_MAT_DENSE_DOWN: return {{layer_map(MK_LW_DOWN), nullptr}};
        case MK_MAT_EXPERT_GATE_UP: {
            const void* gate = expert_map(0);
            return {{gate, static_cast<const unsigned char*>(gate) + MK_TENSOR_MAP_BYTES}};
        }
        case MK_MAT_EXPERT_DOWN: return {{expert_map(2), nullptr}};
        default: return {{ptr<const void>(a.embed_map), nullptr}};  // MK_MAT_LM_HEAD
    }
}

__device__ __forceinline__ bool is_expert(const MkTask& t) {
    return t.arg[0] == MK_MAT_EXPERT_GATE_UP || t.arg[0] == MK_MAT_EXPERT_DOWN;
}

// Tile i of a claim task's queue as the GEMV task it is (the producer and the compute warps both
// build it from here): slot i / tiles, rows (i % tiles) * 16 * groups on.
__device__ __forceinline__ MkTask claimed_tile(const MkTask& claim, int i) {
    const int groups = claim.arg[1], tiles = claim.arg[2];
    MkTask t = claim;
    t.op = MK_OP_GEMV;
    t.arg[1] = (i % tiles) * 16 * groups, t.arg[2] = groups, t.arg[3] = i / tiles;
    t.arg[4] = 0;  // the claim task's words past arg3 mean nothing to a GEMV task
    return t;
}

// The pitch of a task's activation rows in shared memory: every column of k, or a wide launch's
// pass of act_cols(batch).
__device__ __forceinline__ int task_act_pitch(const GemvShape& p, int batch) {
    return act_pitch(kWideBatch ? min(p.k, act_cols(batch)) : p.k);
}

// Starts copying the task's activations [batch][k] into shared memory (in a wide launch columns
// [c0, c0 + act_cols(batch)) of them), unless the previous GEMV task of this block already did:
// `key` names what the buffer holds (the source address of its first column and the layer;
// activation buffers are rewritten only after every reader of the layer has finished), 0 when
// another op has reused the memory. The copies are asynchronous, so the loads an expert tile
// still has to make go out with them; finish_activations waits for them.
__device__ __forceinline__ uint64_t act_key_of(const GemvShape& p, int layer, int c0) {
    return reinterpret_cast<uint64_t>(p.act + c0) ^ ((uint64_t)layer << 56);
}

__device__ bool start_activations(const GemvShape& p, int batch, int layer, GemvSmem& s, uint64_t& key, int c0 = 0) {
    const uint64_t want = act_key_of(p, layer, c0);
    if (key == want) return false;
    int cols = p.k;
    if constexpr (kWideBatch) cols = min(p.k - c0, act_cols(batch));
    const int vecs = cols / 8, pitch = task_act_pitch(p, batch);
    for (int i = threadIdx.x; i < batch * vecs; i += kThreads) {
        const int b = i / vecs, v = i % vecs;
        cp_async16(s.act + b * pitch + 16 * v, p.act + (size_t)b * p.k + c0 + 8 * v);
    }
    key = want;  // true once every thread has waited for its copies (the next barrier)
    return true;
}

__device__ __forceinline__ void finish_activations(bool started) {
    if (!started) return;
    cp_async_wait_all();
    compute_sync();
}

// An expert tile's routed rows as a bit mask (bit b: batch row b), from has_row once it is visible.
__device__ __forceinline__ unsigned routed_mask(const int* has_row, int batch) {
    const int lane = threadIdx.x % 32;
    return __ballot_sync(0xffffffffu, lane < batch && has_row[lane]);
}

// The batch row of column `col` of a routed tile: the mask's (col + 1)th set bit.
__device__ __forceinline__ int routed_row(unsigned routed, int col) { return __fns(routed, 0, col + 1); }

// out[g][row][b] = sum_k act[b][k] * rows[g][row][k] (fp32), for b < batch (<= 8), from the
// ring's stages. Warp w takes 32-column chunks w, w + 8, ... of each stage: thread (g = lane / 4,
// t = lane % 4) reads 16 bytes of weight rows g and g + 8 and of activation row g at column
// 8t of the chunk. The weights are the 16-row A operand and the batch the 8 columns of B ("swap
// AB": every weight byte is read once whatever the batch; columns past the batch read row
// batch - 1 again and are dropped), and the k index inside each 32-wide chunk is permuted the same
// way for A and B, so each thread fills its fragments from one 16-byte load per row; the dot
// products do not depend on the order of k. With a `routed` mask (a wide launch's expert tile of at
// most kTileN routed rows, batch of them), column b is the mask's (b + 1)th set bit, not row b.
__device__ void gemv_compute(const GemvShape& p, GemvSmem& s, const Ring& r, uint32_t& n, int batch,
                             unsigned routed = 0) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    // The weight row (of 0-7; + 8 for the fragment's second half) behind the fragment's row gi:
    // gi itself, or with swizzled boxes 0, 4, 1, 5, ... so that the two rows of a quarter-warp
    // sit 4 apart and their swizzled 16-byte units in opposite halves of the banks.
    const int wrow = MK_WEIGHT_SWIZZLE ? (gi & 1) * 4 + gi / 2 : gi;
    const int box = box_cols(p.k), kc = box * kStageBoxes, pitch = act_pitch(p.k);
    const int box_chunks = box / 32, box_bytes = kStageRows * box * 2;
    const int act_b = routed ? routed_row(routed, min(gi, batch - 1)) : min(gi, batch - 1);
    const unsigned char* act_row = s.act + act_b * pitch + 16 * ti;
    for (int g = 0; g < p.groups; ++g) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f}, acc2[4] = {0.f, 0.f, 0.f, 0.f};
        if (p.group_valid(g) > 0) {
            for (int c = 0; c < p.k; c += kc, ++n) {
                r.wait_full(n);
                const unsigned char* st = r.stage(n) + gi * 2 * box + 16 * ti;
                const int chunks = min(kc, p.k - c) / 32;  // the last stage may run past k
                if (box == kBoxCols) {
                    // Full boxes (every real matrix): shifts for the chunk's box instead of
                    // divisions, and a chunk's two products into two accumulators (half the
                    // dependent chain; docs/PERF.md, tuning decisions).
                    constexpr int kBoxChunks = kBoxCols / 32, kBoxBytes = kStageRows * kBoxCols * 2;
                    for (int ch = warp; ch < chunks; ch += kWarps) {
                        const unsigned char* w;
                        if constexpr (MK_WEIGHT_SWIZZLE) {  // (row gi + 8 is 1 KB on: the same swizzle)
                            w = r.stage(n) + (ch / kBoxChunks) * kBoxBytes + swizzled_unit(wrow, (ch % kBoxChunks) * 4 + ti);
                        } else {
                            w = st + (ch / kBoxChunks) * kBoxBytes + 64 * (ch % kBoxChunks);
                        }
                        const uint4 wa = *reinterpret_cast<const uint4*>(w);
                        const uint4 wb = *reinterpret_cast<const uint4*>(w + 16 * kBoxCols);
                        const uint4 x = *reinterpret_cast<const uint4*>(act_row + 2 * c + 64 * ch);
                        mma_16816(acc, wa.x, wb.x, wa.y, wb.y, x.x, x.y);
                        mma_16816(acc2, wa.z, wb.z, wa.w, wb.w, x.z, x.w);
                    }
                } else {  // (short rows: dense boxes only, MK_WEIGHT_SWIZZLE needs k % 64 == 0)
                    for (int ch = warp; ch < chunks; ch += kWarps) {
                        const unsigned char* w = st + (ch / box_chunks) * box_bytes + 64 * (ch % box_chunks);
                        const uint4 wa = *reinterpret_cast<const uint4*>(w);
                        const uint4 wb = *reinterpret_cast<const uint4*>(w + 16 * box);
                        const uint4 x = *reinterpret_cast<const uint4*>(act_row + 2 * c + 64 * ch);
                        mma_16816(acc, wa.x, wb.x, wa.y, wb.y, x.x, x.y);
                        mma_16816(acc, wa.z, wb.z, wa.w, wb.w, x.z, x.w);
                    }
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(r.empty_of(n));
            }
        }
        // acc[i] is (row wrow + 8 (i >= 2), column 2 ti + (i & 1)) of the group's 16 x 8 tile
        // (row gi for short boxes, read dense).
        float* part = s.partial + (size_t)(g * kWarps + warp) * batch * 16;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int b = 2 * ti + (i & 1);
            if (b < batch) part[b * 16 + (box == kBoxCols ? wrow : gi) + (i >= 2 ? 8 : 0)] = acc[i] + acc2[i];
        }
    }
    compute_sync();
    // One (group, column, row) sum per thread and group: batch * 16 <= 128 < kThreads.
    for (int grp = 0; grp < p.groups; ++grp) {
        const int b = threadIdx.x / 16, row = threadIdx.x % 16;
        if (b >= batch) break;
        const float* part = s.partial + (size_t)grp * kWarps * batch * 16 + threadIdx.x;
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) sum += part[w * batch * 16];
        s.out(grp, row, b) = sum;
    }
    compute_sync();
}

// gemv_compute for 9-16 rows (a wide launch): each weight fragment multiplies two n-tiles, the
// activation rows gi and gi + 8 (the second tile's columns past the batch read row batch - 1 and
// are dropped); a reduction longer than act_cols(batch) stages its activations again between
// passes (the producer's stages never straddle one: StageWalk::next); and each group is reduced as
// soon as its stages are done, its partial sums double-buffered by group parity (partial_groups).
__device__ void gemv_compute_wide(const GemvShape& p, GemvSmem& s, const Ring& r, uint32_t& n, int batch, int layer,
                                  uint64_t& act_key) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, gi = lane / 4, ti = lane % 4;
    const int wrow = MK_WEIGHT_SWIZZLE ? (gi & 1) * 4 + gi / 2 : gi;  // as in gemv_compute
    const int box = box_cols(p.k), kc = box * kStageBoxes, pass = act_cols(batch), pitch = task_act_pitch(p, batch);
    const int box_chunks = box / 32, box_bytes = kStageRows * box * 2;
    const bool swizzled = MK_WEIGHT_SWIZZLE && box == kBoxCols;  // (short rows: dense boxes)
    const unsigned char* act0 = s.act + gi * pitch + 16 * ti;
    const int act1 = (min(gi + kTileN, batch - 1) - gi) * pitch;  // the second tile's row, from act0
    for (int g = 0; g < p.groups; ++g) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f}, acc1[4] = {0.f, 0.f, 0.f, 0.f};  // n-tiles 0 and 1
        for (int c0 = 0; p.group_valid(g) > 0 && c0 < p.k; c0 += pass) {
            if (act_key != act_key_of(p, layer, c0)) {  // (run_gemv staged the task's first pass)
                compute_sync();  // every warp is done with the columns the buffer holds
                finish_activations(start_activations(p, batch, layer, s, act_key, c0));
            }
            const int c1 = min(p.k, c0 + pass);
            for (int c = c0; c < c1; c += kc, ++n) {
                r.wait_full(n);
                const int chunks = min(kc, c1 - c) / 32;
                for (int ch = warp; ch < chunks; ch += kWarps) {
                    // Weight rows wrow and wrow + 8 (16 box columns on) of the chunk, and the two
                    // tiles' activations at the same columns.
                    constexpr int kBoxChunks = kBoxCols / 32, kBoxBytes = kStageRows * kBoxCols * 2;
                    const unsigned char* w =
                        swizzled ? r.stage(n) + (ch / kBoxChunks) * kBoxBytes + swizzled_unit(wrow, (ch % kBoxChunks) * 4 + ti)
                                 : r.stage(n) + (ch / box_chunks) * box_bytes + gi * 2 * box + 16 * ti + 64 * (ch % box_chunks);
                    const uint4 wa = *reinterpret_cast<const uint4*>(w);
                    const uint4 wb = *reinterpret_cast<const uint4*>(w + 16 * box);
                    const int col = 2 * (c - c0) + 64 * ch;
                    const uint4 x = *reinterpret_cast<const uint4*>(act0 + col);
                    const uint4 y = *reinterpret_cast<const uint4*>(act0 + col + act1);
                    mma_16816(acc, wa.x, wb.x, wa.y, wb.y, x.x, x.y);
                    mma_16816(acc, wa.z, wb.z, wa.w, wb.w, x.z, x.w);
                    mma_16816(acc1, wa.x, wb.x, wa.y, wb.y, y.x, y.y);
                    mma_16816(acc1, wa.z, wb.z, wa.w, wb.w, y.z, y.w);
                }
                __syncwarp();
                if (lane == 0) mbar_arrive(r.empty_of(n));
            }
        }
        // acc[i] is (row, column 2 ti + (i & 1)) of the group's first 16 x 8 tile, acc1[i] the same
        // of the second (columns + 8), row as in gemv_compute.
        float* part = s.partial + (size_t)((g % 2) * kWarps + warp) * batch * 16;
        const int row0 = swizzled ? wrow : gi;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int b = 2 * ti + (i & 1), row = row0 + (i >= 2 ? 8 : 0);
            part[b * 16 + row] = acc[i];  // b < 8 < batch
            if (b + kTileN < batch) part[(b + kTileN) * 16 + row] = acc1[i];
        }
        compute_sync();
        // One (column, row) sum per thread: batch * 16 <= kThreads.
        if ((int)threadIdx.x < batch * 16) {
            const float* mine = s.partial + (size_t)(g % 2) * kWarps * batch * 16 + threadIdx.x;
            float sum = 0.f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) sum += mine[w * batch * 16];
            s.out(g, threadIdx.x % 16, threadIdx.x / 16) = sum;
        }
    }
    compute_sync();
}

// A variant to measure (-DMK_QKV_EARLY_SLOT=1, off by default): a K or V task loads each row's
// cache row (its position, then that position's page: two dependent loads) into shared memory
// before its stages instead of in its epilogue, one L2 round trip fewer between the task's last
// stage and the attention splits that wait for it. Measured no faster (docs/PERF.md, "Measured
// and not kept"), so it stays off.
#ifndef MK_QKV_EARLY_SLOT
#define MK_QKV_EARLY_SLOT 0
#endif

// Row b's row of the paged K/V pools for this step's token (block * page + offset).
__device__ __forceinline__ size_t kv_cache_row(const MkStepArgs& a, int layer, int b) {
    const int pos = ld_i32(ptr<int32_t>(a.positions) + b);
    const int block = ld_i32(ptr<int32_t>(a.block_tables) + ((size_t)layer * a.batch + b) * a.max_pages + pos / MK_PAGE_SIZE);
    return (size_t)block * MK_PAGE_SIZE + pos % MK_PAGE_SIZE;
}

// (MK_QKV_EARLY_SLOT) Whether task t is a QKV task of K or V rows.
__device__ __forceinline__ bool writes_kv(const MkStepArgs& a, const MkTask& t) {
    return t.arg[0] == MK_MAT_QKV && t.arg[1] >= a.heads * a.head_dim;
}

// QKV: the group's rows come in (even, odd) RoPE pairs; one thread per (pair, batch row). RoPE
// reads the step's (cos, sin) table, which the embedding tasks fill.
__device__ void qkv_epilogue(const MkStepArgs& a, const MkTask& t, const GemvShape& p, const GemvSmem& s) {
    const int qw = a.heads * a.head_dim, kvw = a.kv_heads * a.head_dim, r0 = t.arg[1];
    const bool is_q = r0 < qw, is_v = r0 >= qw + kvw;
    const bool rope = !is_v && ptr<int32_t>(a.layer_rope)[t.layer] != 0;
    for (int idx = threadIdx.x; idx < p.groups * 8 * a.batch; idx += kThreads) {
        const int pair = idx / a.batch, b = idx % a.batch, grp = pair / 8;
        const int row = p.first + 2 * pair;  // within Q, K or V
        if (row >= p.rows) continue;
        float ye = round_bf16(s.out(grp, 2 * (pair % 8), b)), yo = round_bf16(s.out(grp, 2 * (pair % 8) + 1, b));
        const int dim = row % a.head_dim;
#if !MK_QKV_EARLY_SLOT
        const int pos = ld_i32(ptr<int32_t>(a.positions) + b);
#endif
        if (rope) {
            const float2 cs = __ldcg(ptr<const float2>(a.rope) + (size_t)b * (a.head_dim / 2) + dim / 2);
            const float e2 = ye * cs.x - yo * cs.y, o2 = yo * cs.x + ye * cs.y;
            ye = e2, yo = o2;
        }
        if (is_q) {
            float* q = ptr<float>(a.q) + (size_t)b * qw + row;
            q[0] = ye, q[1] = yo;
        } else {
            const int head = row / a.head_dim;
            bf16* pool = ptr<bf16>(is_v ? a.v_pool : a.k_pool);
#if MK_QKV_EARLY_SLOT
            const size_t cache_row = (size_t)s.has_row[b];  // (run_gemv: loaded before the stages)
#else
            const int block = ld_i32(ptr<int32_t>(a.block_tables) + ((size_t)t.layer * a.batch + b) * a.max_pages + pos / MK_PAGE_SIZE);
            const size_t cache_row = (size_t)block * MK_PAGE_SIZE + pos % MK_PAGE_SIZE;
#endif
            bf16* dst = pool + (cache_row * a.kv_heads + head) * a.head_dim + dim;
            dst[0] = __float2bfloat16(ye), dst[1] = __float2bfloat16(yo);
        }
    }
}

// `routed`: the outputs' columns are an expert tile's routed rows alone (gemv_compute's `routed`).
__device__ void gemv_epilogue(const MkStepArgs& a, const MkTask& t, const GemvShape& p, GemvSmem& s,
                              unsigned routed = 0) {
    const int matrix = t.arg[0], r0 = t.arg[1], slot = t.arg[3];
    if (matrix == MK_MAT_QKV) return qkv_epilogue(a, t, p, s);
    const int n = p.groups * 16, cols = routed ? __popc(routed) : a.batch;
    for (int idx = threadIdx.x; idx < n * cols; idx += kThreads) {
        const int row = idx / cols, col = idx % cols;
        const int b = routed ? routed_row(routed, col) : col;
        const int grp = row / 16, r = row % 16;
        if (r >= p.group_valid(grp)) continue;
        const float v = round_bf16(s.out(grp, r, col));
        const int out_row = r0 + row;
        switch (matrix) {
            case MK_MAT_O: ptr<float>(a.y_attn)[b * a.hidden + out_row] = v; break;
            case MK_MAT_ROUTER: ptr<float>(a.router)[b * a.experts + out_row] = v; break;
            case MK_MAT_DENSE_DOWN: ptr<float>(a.ffn_out)[b * a.hidden + out_row] = v; break;
            case MK_MAT_EXPERT_DOWN:
                if (s.has_row[b])  // (v is a bf16 value: exact)
                    ptr<bf16>(a.expert_out)[((size_t)slot * a.batch + b) * a.hidden + out_row] = __float2bfloat16(v);
                break;
            case MK_MAT_LM_HEAD: ptr<float>(a.logits)[(size_t)b * a.vocab + out_row] = v * a.logit_scale; break;
            case MK_MAT_DENSE_GATE_UP:
            case MK_MAT_EXPERT_GATE_UP: {
                if (grp % 2 != 0) break;  // one thread per (feature, row) does both halves
                const float gate = v, up = round_bf16(s.out(grp + 1, r, col));
                const bf16 act = __float2bfloat16(gate / (1.f + __expf(-gate)) * up);
                const int feature = p.group_first(grp) + r;
                if (matrix == MK_MAT_DENSE_GATE_UP) {
                    ptr<bf16>(a.dense_act)[b * a.dense_ffn + feature] = act;
                } else if (s.has_row[b]) {
                    ptr<bf16>(a.expert_act)[((size_t)slot * a.batch + b) * a.expert_ffn + feature] = act;
                }
                break;
            }
        }
    }
}

// The compute warps pass over a marker stage (no bytes: an expert queue's end, an unused slot).
__device__ __forceinline__ void release_marker(const Ring& r, uint32_t& n) {
    __syncwarp();
    if (threadIdx.x % 32 == 0) mbar_arrive(r.empty_of(n));
    ++n;
}

// Marks (MK_GEMV_MARKS): the activations in shared memory; every stage multiplied and reduced.
// An expert task learns its rows from the block's routing once its first stage is full (the
// producer learned the routing before it issued that stage); a marker there means the batch did
// not fill its slot.
__device__ void run_gemv(const MkStepArgs& a, const MkTask& t, GemvSmem& s, const Ring& r, uint32_t& n,
                         uint64_t& act_key, const BlockRouting* routing, PhaseMarks& marks) {
    const GemvShape p = gemv_shape(a, t);
    const bool started = start_activations(p, a.batch, t.layer, s, act_key);
    if (is_expert(t)) {
        r.wait_full(n);
        if (r.tag_of(n) == kQueueEnd) {
            release_marker(r, n);
            if (started) cp_async_wait_all();  // the buffer is complete before the next task's barrier
            return;
        }
        load_slot_rows(a, routing[t.layer & 1], t.arg[3], s.has_row);
    }
#if MK_QKV_EARLY_SLOT
    // Each row's cache row, published to the epilogue by gemv_compute's barriers (has_row is an
    // expert tile's only otherwise).
    if (writes_kv(a, t) && (int)threadIdx.x < a.batch) s.has_row[threadIdx.x] = (int)kv_cache_row(a, t.layer, threadIdx.x);
#endif
    finish_activations(started);
    // A wide launch's expert tile of at most kTileN routed rows (most of them: 16 rows route ~1.6
    // to an expert) runs the 8-row loop on those rows alone, where their partial sums fit.
    unsigned routed = 0;
    // (One pass: then the rows were staged at act_pitch(p.k), the pitch gemv_compute reads.)
    if (kWideBatch && a.batch > kTileN && is_expert(t) && p.k <= act_cols(a.batch)) {
        if (!started) compute_sync();  // has_row, for every thread
        const unsigned mask = routed_mask(s.has_row, a.batch);
        const int m = __popc(mask);
        const bool fits = (size_t)p.groups * kWarps * m * 16 * sizeof(float) <= GemvSmem::partial_bytes(a.batch);
        if (m <= kTileN && fits) routed = mask;
    }
    if (MK_GEMV_MARKS) marks.mark(0);
    // One call of gemv_compute for both cases: a second inlined copy would lengthen the wide image's
    // code for nothing (neither form was slower at batch 1: docs/PERF.md, tuning decisions).
    if (kWideBatch && a.batch > kTileN && !routed) gemv_compute_wide(p, s, r, n, a.batch, t.layer, act_key);
    else gemv_compute(p, s, r, n, routed ? __popc(routed) : a.batch, routed);  // their barriers publish has_row
    if (MK_GEMV_MARKS) marks.mark(1);
    gemv_epilogue(a, t, p, s, routed);
}

// A claim task: the tiles the block's producer claimed from the queue, in the order it streamed
// them (each first stage's tag says which), up to the queue's end marker. Marks: the first tile's.
__device__ void run_expert_claim(const MkStepArgs& a, const MkTask& t, GemvSmem& s, const Ring& r, uint32_t& n,
                                 uint64_t& act_key, const BlockRouting* routing, PhaseMarks& marks) {
    for (;;) {
        r.wait_full(n);
        const int tile = r.tag_of(n);
        if (tile == kQueueEnd) return release_marker(r, n);
        run_gemv(a, claimed_tile(t, tile), s, r, n, act_key, routing, marks);
        compute_sync();  // the epilogue's reads of the tile's shared memory are done
    }
}

}  // namespace mk
