// The decode megakernel: one launch runs a whole decode step of the batch. Each block (one per
// SM) walks its host-built task list (rust/graph) in order: wait on the task's counters, run it,
// signal. Ops live in ops/; this file is only the persistent loop and the dispatch.
#include "abi.h"
#include "ops/step_attention.cuh"
#include "ops/step_common.cuh"
#include "ops/step_gemv.cuh"
#include "ops/step_misc.cuh"

namespace mk {

union StepSmem {
    GemvSmem gemv;
    AttnSmem attn;
    struct {
        float row[8192];  // one fp32 residual row (hidden <= 8192)
        float scratch[kWarps];
        int slots[8];
        float scores[8];
    } norm;
    struct {
        float logits[8 * 512];
        int chosen[64];
        int slot_of[512];
    } topk;
    struct {
        float score[kThreads];
        int id[kThreads];
    } sample;
};

static_assert(sizeof(StepSmem) <= MK_STEP_SMEM_BYTES, "raise MK_STEP_SMEM_BYTES");
static_assert(kThreads == MK_STEP_THREADS, "block size is part of the ABI");

}  // namespace mk

extern "C" __global__ void __launch_bounds__(mk::kThreads, 1) mk_decode_step(const MkStepArgs a) {
    using namespace mk;
    extern __shared__ __align__(16) unsigned char smem_raw[];
    StepSmem& sm = *reinterpret_cast<StepSmem*>(smem_raw);
    uint32_t* counters = ptr<uint32_t>(a.counters) + (size_t)a.parity * a.num_counters;
    // The other set serves the next step: zero it now (the previous step, its last user, has
    // finished before this launch began; the next one starts after this one ends).
    uint32_t* next = ptr<uint32_t>(a.counters) + (size_t)(1 - a.parity) * a.num_counters;
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < a.num_counters; i += gridDim.x * kThreads) next[i] = 0;

    const MkTask* list = ptr<const MkTask>(a.tasks) + (size_t)blockIdx.x * a.per_sm;
    const bool prefetch = (a.flags & MK_STEP_PREFETCH_L2) != 0;
    MkTraceEntry* trace = a.trace ? ptr<MkTraceEntry>(a.trace) + (size_t)blockIdx.x * a.per_sm : nullptr;
    if (prefetch && threadIdx.x == 0 && a.per_sm > 0) prefetch_gemv_weights(a, list[0]);
    for (int i = 0; i < a.per_sm; ++i) {
        const MkTask t = list[i];
        if (t.op == MK_OP_NOP) break;  // lists are NOP-padded at the end only
        // The next task's weights stream into L2 while this one waits and runs.
        if (prefetch && threadIdx.x == 0 && i + 1 < a.per_sm) prefetch_gemv_weights(a, list[i + 1]);
        uint64_t start_ns = 0;
        long long c0 = 0, c1 = 0;
        if (trace && threadIdx.x == 0) start_ns = global_ns(), c0 = clock64();
        wait_for(t, counters);
        if (trace && threadIdx.x == 0) c1 = clock64();
        switch (t.op) {
            case MK_OP_EMBED: run_embed(a, t, sm.norm.row, sm.norm.scratch); break;
            case MK_OP_GEMV: run_gemv(a, t, sm.gemv); break;
            case MK_OP_ATTN_SPLIT: run_attn_split(a, t, sm.attn); break;
            case MK_OP_ATTN_COMBINE: run_attn_combine(a, t); break;
            case MK_OP_TOPK: run_topk(a, t, sm.topk.logits, sm.topk.chosen, sm.topk.slot_of); break;
            case MK_OP_RESIDUAL_NORM:
                run_residual_norm(a, t, sm.norm.row, sm.norm.scratch, sm.norm.slots, sm.norm.scores);
                break;
            case MK_OP_SAMPLE_PART: run_sample_part(a, t, sm.sample.score, sm.sample.id); break;
            case MK_OP_SAMPLE_FINAL: run_sample_final(a, t); break;
            default: break;
        }
        signal_done(t, counters);
        if (trace && threadIdx.x == 0) trace[i] = MkTraceEntry{start_ns, (uint32_t)(c1 - c0), (uint32_t)(clock64() - c1)};
    }
}

