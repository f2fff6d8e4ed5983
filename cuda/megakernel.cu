// The decode megakernel: one launch runs a whole decode step of the batch. Each block (one per
// SM) walks its host-built task list (rust/graph) in order: wait on the task's counters, run it,
// signal. Ops live in ops/; this file is only the persistent loop and the dispatch.
#include "abi.h"
#include "ops/step_attention.cuh"
#include "ops/step_common.cuh"
#include "ops/step_embed.cuh"
#include "ops/step_gemv.cuh"
#include "ops/step_norm.cuh"
#include "ops/step_producer.cuh"
#include "ops/step_sample.cuh"
#include "ops/step_stream.cuh"
#include "ops/step_topk.cuh"

namespace mk {

// The ops' shared memory besides the GEMV's and attention's, whose sizes depend on the batch.
union StepSmem {
    struct {
        float row[MK_STEP_MAX_K];  // one fp32 residual row (hidden <= MK_STEP_MAX_K, checked by the host)
        float scratch[kWarps];
        int slots[MK_STEP_MAX_TOP_K];  // a row's top-k choices sorted by slot
        float scores[MK_STEP_MAX_TOP_K];
    } norm;
    struct {
        int chosen[MK_IMAGE_ROWS * MK_STEP_MAX_TOP_K];
        int slot_of[MK_STEP_MAX_EXPERTS];
    } topk;
    struct {
        float score[kThreads];
        int id[kThreads];
    } sample;
};

// Dynamic shared memory: the ring's barriers and tags, the done word, the list window and the
// producer's routing of MoE layers (BlockRouting[2]), then
// the ops' union (StepSmem or the GEMV's, sized for the launch's batch, with the attention's scratch
// past the GEMV's activations: attn_offset), then as many ring stages
// as fit: 8 of 24 KB at batch 1 and 2, 7 at 4, 5 at 8.
constexpr int kMaxRingStages = 32;
__host__ __device__ constexpr size_t align_up(size_t n, size_t to) { return (n + to - 1) / to * to; }
constexpr size_t kBarrierOffset = 0;
constexpr size_t kTagOffset = kBarrierOffset + 2 * kMaxRingStages * sizeof(uint64_t);
constexpr size_t kDoneOffset = kTagOffset + kMaxRingStages * sizeof(int);  // the tasks done (signal_done)
constexpr size_t kListOffset = align_up(kDoneOffset + sizeof(uint32_t), 16);
constexpr size_t kRoutingOffset = align_up(kListOffset + kListBatch * sizeof(MkTask), 16);  // BlockRouting[2]
constexpr size_t kUnionOffset = align_up(kRoutingOffset + 2 * sizeof(BlockRouting), 128);
// The ring's stages start at a multiple of 1024 bytes (the 128-byte swizzle of the KV boxes needs
// it; kStageBytes is a multiple of 1024, and so is the dynamic shared memory's address, checked).
constexpr size_t kStageAlign = 1024;
static_assert(kStageBytes % kStageAlign == 0, "every stage must start at a multiple of 1024 bytes");

// The attention's scratch sits past the GEMV's activation rows, so a GEMV task after a split or
// combine (a gate/up tile after QKV's, same h) finds its activations still there instead of
// loading them again (docs/PERF.md, tuning decisions); no launch's ring loses a stage to it.
__host__ __device__ constexpr size_t attn_offset(int batch) { return GemvSmem::act_bytes(batch); }
__host__ __device__ constexpr size_t union_bytes(int batch) {
    const size_t ops = sizeof(StepSmem) > GemvSmem::bytes(batch) ? sizeof(StepSmem) : GemvSmem::bytes(batch);
    const size_t attn_end = attn_offset(batch) + sizeof(AttnScratch);
    return align_up(attn_end > ops ? attn_end : ops, 128);
}
__host__ __device__ constexpr size_t stages_offset(int batch) {
    return align_up(kUnionOffset + union_bytes(batch), kStageAlign);
}
__host__ __device__ constexpr int ring_stages(int batch) {
    const int fit = (int)((MK_STEP_SMEM_BYTES - stages_offset(batch)) / kStageBytes);
    return fit < kMaxRingStages ? fit : kMaxRingStages;
}
static_assert(ring_stages(MK_IMAGE_ROWS) >= 4, "the weight ring needs at least 4 stages at every batch");
static_assert(kBlockThreads == MK_STEP_THREADS, "block size is part of the ABI");

}  // namespace mk

// Rows this image takes (cuda/abi.h): the host reads it at load and launches the narrowest image
// that holds a step's rows.
extern "C" __device__ const int mk_image_rows = MK_IMAGE_ROWS;

extern "C" __global__ void __launch_bounds__(mk::kBlockThreads, 1) mk_decode_step(const MkStepArgs a) {
    using namespace mk;
    extern __shared__ __align__(1024) unsigned char smem_raw[];
    unsigned char* ops = smem_raw + kUnionOffset;
    StepSmem& sm = *reinterpret_cast<StepSmem*>(ops);
    AttnScratch& attn = *reinterpret_cast<AttnScratch*>(ops + attn_offset(a.batch));
    uint64_t* barriers = reinterpret_cast<uint64_t*>(smem_raw + kBarrierOffset);
    int* tags = reinterpret_cast<int*>(smem_raw + kTagOffset);
    // A ledger build's rows follow the trace's [gridDim.x][per_sm] entries (cuda/abi.h).
    uint64_t* ledger = MK_STREAM_LEDGER && a.trace ? ptr<uint64_t>(a.trace) + 4 * ((size_t)gridDim.x * a.per_sm +
                                                                                   (size_t)blockIdx.x * MK_LEDGER_STAGES)
                                                   : nullptr;
    const Ring ring{smem_raw + stages_offset(a.batch), barriers, barriers + kMaxRingStages, tags, ring_stages(a.batch),
                    ledger};
    if (smem_addr(smem_raw) % kStageAlign != 0) __trap();  // a launch error, not wrong results
    uint32_t* done = reinterpret_cast<uint32_t*>(smem_raw + kDoneOffset);
    BlockRouting* routing = reinterpret_cast<BlockRouting*>(smem_raw + kRoutingOffset);
    if (threadIdx.x == 0) ring_init(ring), *done = 0;
    __syncthreads();  // the last barrier the producer and signal warps join

    uint32_t* counters = ptr<uint32_t>(a.counters) + (size_t)a.parity * a.num_counters;
    const MkTask* list = ptr<const MkTask>(a.tasks) + (size_t)blockIdx.x * a.per_sm;
    if (threadIdx.x / 32 == kProducerWarp) {
        stream_weights(a, list, counters, ring, reinterpret_cast<MkTask*>(smem_raw + kListOffset), routing);
        return;
    }
    if (threadIdx.x / 32 == kSignalWarp) return send_signals(a, list, counters, done);
    // The other set serves the next step: zero it now (the previous step, its last user, has
    // finished before this launch began; the next one starts after this one ends).
    uint32_t* next = ptr<uint32_t>(a.counters) + (size_t)(1 - a.parity) * a.num_counters;
    for (int i = blockIdx.x * kThreads + threadIdx.x; i < a.num_counters; i += gridDim.x * kThreads) next[i] = 0;

    uint32_t stage = 0;     // the ring stage the next GEMV task or split starts at (the producer's order)
    uint64_t act_key = 0;   // what the GEMV activation buffer holds (stage_activations)
    GemvSmem gemv(ops, a.batch);
    MkTraceEntry* trace = a.trace ? ptr<MkTraceEntry>(a.trace) + (size_t)blockIdx.x * a.per_sm : nullptr;
    MkTask upcoming = list[0];  // per_sm > 0 (checked by the host)
    for (int i = 0; i < a.per_sm; ++i) {
        const MkTask t = upcoming;
        if (t.op == MK_OP_NOP) break;  // lists are NOP-padded at the end only
        if (i + 1 < a.per_sm) upcoming = list[i + 1];  // in flight while this task waits and runs
        uint64_t start_ns = 0;
        long long c0 = 0, c1 = 0;
        if (trace && threadIdx.x == 0) start_ns = global_ns(), c0 = clock64();
        // A split's position and page table (its pages come through the ring) load while it waits.
        const SplitPages split = t.op == MK_OP_ATTN_SPLIT ? SplitPages(a, t) : SplitPages();
        wait_for(t, counters, t.op != MK_OP_RESIDUAL_NORM);  // a norm waits for its FFN itself
        if (trace && threadIdx.x == 0) c1 = clock64();
        PhaseMarks marks;
        switch (t.op) {
            case MK_OP_EMBED: run_embed(a, t, sm.norm.row, sm.norm.scratch); break;
            case MK_OP_GEMV: run_gemv(a, t, gemv, ring, stage, act_key, routing, marks); break;
            case MK_OP_EXPERT_CLAIM: run_expert_claim(a, t, gemv, ring, stage, act_key, routing, marks); break;
            case MK_OP_ATTN_SPLIT: run_attn_split(a, t, split, attn, ring, stage, marks); break;
            case MK_OP_ATTN_COMBINE: run_attn_combine(a, t, marks); break;
            case MK_OP_TOPK: run_topk(a, t, sm.topk.chosen, sm.topk.slot_of, marks); break;
            case MK_OP_RESIDUAL_NORM:
                run_residual_norm(a, t, counters, sm.norm.row, sm.norm.scratch, sm.norm.slots, sm.norm.scores, marks);
                break;
            case MK_OP_SAMPLE_PART: run_sample_part(a, t, sm.sample.score, sm.sample.id); break;
            case MK_OP_SAMPLE_FINAL: run_sample_final(a, t); break;
            default: break;
        }
        const bool attention = t.op == MK_OP_ATTN_SPLIT || t.op == MK_OP_ATTN_COMBINE;
        if (t.op != MK_OP_GEMV && t.op != MK_OP_EXPERT_CLAIM && !attention) act_key = 0;  // shared memory
        signal_done(i, done);
        if (trace && threadIdx.x == 0) {  // the producer writes the entry's other fields
            trace[i].start_ns = start_ns;
            trace[i].wait_cycles = (uint32_t)(c1 - c0);
            trace[i].run_cycles = (uint32_t)(clock64() - c1);
            if (MK_TRACE_MARKS && marks.at[0] != 0) {  // (the producer leaves a marked task's fields alone)
                trace[i].ring_wait_cycles = (uint32_t)(marks.at[0] - c1);
                trace[i].topk_wait_cycles = MK_TRACE_MARKED | (marks.at[1] != 0 ? (uint32_t)(marks.at[1] - c1) : 0u);
            }
        }
    }
}

