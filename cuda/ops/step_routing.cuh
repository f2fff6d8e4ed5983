// A MoE layer's routing: each row's top-k experts by router logit, and the slots (the distinct
// chosen experts in ascending order). The top-k task computes it for the whole GPU (the residual
// norm's combine reads that); with local routing every block's weight producer warp also chooses
// the experts itself from the logits, so that its expert tiles start streaming without waiting
// for the top-k task and its counter (BlockRouting).
#pragma once
#include "step_common.cuh"

namespace mk {

constexpr int kMaxTopK = MK_STEP_MAX_TOP_K;
// The most slots a step fills: every row's choices distinct.
constexpr int kMaxSlots = MK_IMAGE_ROWS * MK_STEP_MAX_TOP_K;

// A router logit (a bf16 value held in fp32: its low 16 bits are zero) and its expert as one
// integer that orders like (logit, -expert): the larger logit wins, ties go to the lower expert.
__device__ __forceinline__ uint32_t topk_key(float logit, int expert) {
    const uint32_t u = __float_as_uint(logit);
    const uint32_t ordered = (u & 0x80000000u) ? ~u : (u | 0x80000000u);  // monotonic in the float
    return (ordered & 0xffff0000u) | (uint32_t)(0xffff - expert);
}

__device__ __forceinline__ float topk_logit(uint32_t key) {
    const uint32_t ordered = key & 0xffff0000u;
    return __uint_as_float((ordered & 0x80000000u) ? (ordered & 0x7fffffffu) : ~ordered & 0xffff0000u);
}

// Experts per lane of a selecting warp: 4 cover the model's 128, 16 the most the ABI allows.
constexpr int kFewExpertsPerLane = 4;
constexpr int kExpertsPerLane = MK_STEP_MAX_EXPERTS / 32;

// What routing reads of the step's arguments (MkStepArgs' fields of the same names), by value: the
// producer warp's routing is not inlined, and through a reference to the kernel's parameters it
// would load every field again after each atomic, which made a layer's routing many times slower.
struct RoutingArgs {
    uint64_t router, slot_count, slot_expert, topk_slot;
    int batch, experts, top_k;
    __device__ explicit RoutingArgs(const MkStepArgs& a)
        : router(a.router), slot_count(a.slot_count), slot_expert(a.slot_expert), topk_slot(a.topk_slot),
          batch(a.batch), experts(a.experts), top_k(a.top_k) {}
};

// One warp chooses the top-k of rows [row0, row0 + kRows) (those below the batch): lane l holds
// experts l, l + 32, ... of each row as keys in registers, and each choice is one redux.sync max
// per row, the rows' reductions independent (in flight together). For every choice,
// chose(b, k, expert, key) runs on every lane; `used` gains bit j where the lane's expert
// l + 32 j was chosen by one of the rows. Args: MkStepArgs or RoutingArgs.
template <int kPer, int kRows, typename Args, typename Chose>
__device__ __forceinline__ void warp_choose(const Args& a, int row0, uint32_t& used, Chose chose) {
    const int lane = threadIdx.x % 32;
    uint32_t keys[kRows][kPer];
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
        for (int j = 0; j < kPer; ++j) {
            const int b = row0 + r, e = lane + 32 * j;
            keys[r][j] = b < a.batch && e < a.experts ? topk_key(ld_f32(ptr<float>(a.router) + b * a.experts + e), e) : 0u;
        }
    for (int k = 0; k < a.top_k; ++k) {
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
            uint32_t mine = 0;
#pragma unroll
            for (int j = 0; j < kPer; ++j) mine = max(mine, keys[r][j]);
            const uint32_t best = __reduce_max_sync(0xffffffffu, mine);
            if (row0 + r >= a.batch) continue;  // a padding row (uniform: no divergence)
#pragma unroll
            for (int j = 0; j < kPer; ++j)
                if (keys[r][j] == best) keys[r][j] = 0, used |= 1u << j;  // keys are distinct: one expert each
            chose(row0 + r, k, 0xffff - (int)(best & 0xffffu), best);
        }
    }
}

// A layer's routing as one block's weight producer knows it, for that block's expert tiles (two
// buffers, by layer parity: a layer's routing is written only after every reader of the one two
// layers back has finished, as the router waits for that layer's FFN). Written by the producer
// warp before the first stage that needs it and read by the compute warps after that stage's
// full barrier: atomic accesses only, which racecheck accepts across mbarriers (Ring::tag_of).
struct BlockRouting {
    int count;             // slots used
    int expert[kMaxSlots];  // slot -> expert
    int slot[kMaxSlots];    // [row][k] -> slot (row * top_k + k)
};

__device__ __forceinline__ int shared_load(const int* p) { return atomicAdd(const_cast<int*>(p), 0); }

// The producer warp's own choice of the layer's experts, as the top-k task makes it.
template <int kPer>
__device__ void choose_experts(const RoutingArgs& a, BlockRouting& out) {
    const int lane = threadIdx.x % 32;
    uint32_t used = 0;
    auto chose = [&](int b, int k, int expert, uint32_t) {
        if (lane == 0) atomicExch(&out.slot[b * a.top_k + k], expert);  // the expert, its slot below
    };
    // Few keys a lane: every row's keys in registers at once, their choices interleaved.
    if constexpr (kPer == kFewExpertsPerLane) {
        if (a.batch > 1) {
            // (at most kChooseRows rows' keys in registers at once: a wide launch takes 16 rows)
            constexpr int kChooseRows = MK_IMAGE_ROWS < 8 ? MK_IMAGE_ROWS : 8;
            if constexpr (kChooseRows == MK_IMAGE_ROWS) {
                warp_choose<kPer, kChooseRows>(a, 0, used, chose);
            } else {
                for (int row0 = 0; row0 < a.batch; row0 += kChooseRows) warp_choose<kPer, kChooseRows>(a, row0, used, chose);
            }
        } else {
            warp_choose<kPer, 1>(a, 0, used, chose);
        }
    } else {
        for (int b = 0; b < a.batch; ++b) warp_choose<kPer, 1>(a, b, used, chose);
    }
    // Slots in ascending expert order (expert l + 32 j: j major): before[j] slots precede the
    // lane group j, and inside it the lanes below.
    uint32_t mask[kPer];
    int before[kPer], count = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
        mask[j] = __ballot_sync(0xffffffffu, (used >> j) & 1u);
        before[j] = count, count += __popc(mask[j]);
        if ((used >> j) & 1u) atomicExch(&out.expert[before[j] + __popc(mask[j] & ((1u << lane) - 1u))], lane + 32 * j);
    }
    __syncwarp();
    for (int i = lane; i < a.batch * a.top_k; i += 32) {
        const int expert = shared_load(&out.slot[i]), l = expert % 32, group = expert / 32;
        int slot = 0;
#pragma unroll
        for (int j = 0; j < kPer; ++j)
            if (j == group) slot = before[j] + __popc(mask[j] & ((1u << l) - 1u));
        atomicExch(&out.slot[i], slot);
    }
    if (lane == 0) atomicExch(&out.count, count);
}

// Every lane of the producer warp: layer `layer`'s routing into `out`: the top-k task's, copied
// once it has run, or with routers > 0 where that task has not run yet, chosen here once the
// layer's `routers` router tasks have signalled (the same choices; copying is quicker where the
// top-k is already done, as it is when the ring held the warp back until then).
__device__ void route_layer(const RoutingArgs& a, const uint32_t* counters, int layer, int routers,
                            BlockRouting& out) {
    const int lane = threadIdx.x % 32;
    const uint32_t* c = counters + layer * MK_COUNTERS_PER_LAYER;
    bool choose = false;
    if (lane == 0) {
        choose = routers > 0 && load_acquire(c + MK_CTR_TOPK) < 1;
        spin_until(choose ? c + MK_CTR_ROUTER : c + MK_CTR_TOPK, choose ? routers : 1);
    }
    choose = __shfl_sync(0xffffffffu, choose, 0);
    __syncwarp();  // extends lane 0's acquire to the warp
    if (choose) {
        if (a.experts <= 32 * kFewExpertsPerLane) choose_experts<kFewExpertsPerLane>(a, out);
        else choose_experts<kExpertsPerLane>(a, out);
    } else {
        const int count = ld_i32(ptr<int32_t>(a.slot_count));
        for (int i = lane; i < count; i += 32) atomicExch(&out.expert[i], ld_i32(ptr<int32_t>(a.slot_expert) + i));
        for (int i = lane; i < a.batch * a.top_k; i += 32) atomicExch(&out.slot[i], ld_i32(ptr<int32_t>(a.topk_slot) + i));
        if (lane == 0) atomicExch(&out.count, count);
    }
    __syncwarp();  // lane 0 reads what the others wrote
}

// The producer warp's rendezvous: lane 0 asks for a layer's routing (layer >= 0) or releases the
// other lanes (layer < 0), which wait here between requests. Not inlined, so that every lane runs
// the same warp-synchronous instructions whichever call site it came from.
__device__ __noinline__ int producer_warp_route(const RoutingArgs a, const uint32_t* counters, BlockRouting* routing,
                                                int layer, int routers) {
    layer = __shfl_sync(0xffffffffu, layer, 0);
    routers = __shfl_sync(0xffffffffu, routers, 0);
    if (layer >= 0) route_layer(a, counters, layer, routers, routing[layer & 1]);
    return layer;
}

// Fills has_row[b] for an expert tile's slot from the block's routing (visible after the next
// barrier).
__device__ __forceinline__ void load_slot_rows(const MkStepArgs& a, const BlockRouting& route, int slot,
                                               int* has_row) {
    if (threadIdx.x < a.batch) {
        bool has = false;
        for (int i = 0; i < a.top_k; ++i) has |= shared_load(&route.slot[threadIdx.x * a.top_k + i]) == slot;
        has_row[threadIdx.x] = has;
    }
}

}  // namespace mk
