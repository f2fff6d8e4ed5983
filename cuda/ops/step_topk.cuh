// The top-k task: the router's choices for every row and the step's expert slots.
#pragma once
#include "step_common.cuh"
#include "step_routing.cuh"

namespace mk {

// The top-k task: every row's choices (one warp per row: warp_choose), their sigmoid scores, and
// the slots: the distinct chosen experts in ascending order. Without local routing this task is
// on every MoE layer's critical path. Marks: the choices made (the logits' loads included); the
// slots numbered.
template <int kPer>
__device__ void topk_rows(const MkStepArgs& a, const MkTask& t, int* chosen, int* slot_of) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    uint32_t used = 0;  // (the slots are numbered from slot_of)
    for (int b = warp; b < a.batch; b += kWarps)
        warp_choose<kPer, 1>(a, b, used, [&](int row, int k, int id, uint32_t best) {
            if (lane != 0) return;
            chosen[row * kMaxTopK + k] = id;
            ptr<float>(a.topk_score)[row * a.top_k + k] = 1.f / (1.f + expf(-topk_logit(best)));
            ptr<int32_t>(a.routing_log)[((size_t)t.layer * a.batch + row) * a.top_k + k] = id;
            slot_of[id] = 0;
        });
}

__device__ void run_topk(const MkStepArgs& a, const MkTask& t, int* chosen /* [batch * kMaxTopK] */,
                         int* slot_of /* [experts] */, PhaseMarks& marks) {
    for (int e = threadIdx.x; e < a.experts; e += kThreads) slot_of[e] = -1;
    compute_sync();
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (a.experts <= 32 * kFewExpertsPerLane) topk_rows<kFewExpertsPerLane>(a, t, chosen, slot_of);
    else topk_rows<kExpertsPerLane>(a, t, chosen, slot_of);
    compute_sync();
    marks.mark(0);
    if (warp == 0) {
        // Slots in ascending expert order: a ballot per 32 experts, ranks by prefix popcount.
        int count = 0;
        for (int e0 = 0; e0 < a.experts; e0 += 32) {
            const int e = e0 + lane;
            const bool used = e < a.experts && slot_of[e] == 0;
            const unsigned mask = __ballot_sync(0xffffffffu, used);
            if (used) {
                const int slot = count + __popc(mask & ((1u << lane) - 1u));
                ptr<int32_t>(a.slot_expert)[slot] = e;
                slot_of[e] = slot;
            }
            count += __popc(mask);
        }
        if (lane == 0) ptr<int32_t>(a.slot_count)[0] = count;
    }
    compute_sync();
    marks.mark(1);
    for (int i = threadIdx.x; i < a.batch * a.top_k; i += kThreads)
        ptr<int32_t>(a.topk_slot)[i] = slot_of[chosen[(i / a.top_k) * kMaxTopK + i % a.top_k]];
}

}  // namespace mk
