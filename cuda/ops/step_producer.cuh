// The producer warp: its walk over the block's task list (every GEMV task's weight stages and
// every attention split's pages, in the order the compute warps consume them) and its loop of
// bulk tensor copies into the ring (step_stream.cuh).
#pragma once
#include "step_attention.cuh"
#include "step_common.cuh"
#include "step_gemv.cuh"
#include "step_routing.cuh"
#include "step_stream.cuh"

namespace mk {

// The producer warp's walk: every stage of every GEMV task of the block's list, and every page of
// every attention split, K then V, in list order: the stage sequence gemv_compute
// and run_attn_split consume. Lane 0 walks; the list is read kListBatch tasks at a time into
// a window of shared memory (loads in flight together instead of one task's latency per task).
constexpr int kListBatch = 32;

struct StageWalk {
    const MkTask* list;
    int per_sm;
    MkTask* window;  // [kListBatch]: tasks [base, base + kListBatch) of the list (past its end: unread)
    BlockRouting* routing;  // [2]: the block's routing of MoE layers, by layer parity
    int base = -kListBatch;
    int j = -1;  // the task whose stages are being walked, -1 before the first
    GemvShape s{};
    GemvMaps maps{};
    int g = 0, c = 0, box = 0, kc = 0, depth = 0;  // depth: stage_depth(s.k)
    int pass = kMaxK;  // a wide launch: the columns of one activation pass (act_cols)
    // The split being walked (kv): its pages, the next page and which of K (0) and V (1), and the
    // pool blocks of that page and the one after (loaded a stage ahead of its use).
    bool kv = false;
    SplitPages split{};
    int page = 0, which = 0, block = 0, block_next = 0;
    int slots_layer = -1, slots = 0;  // the layer whose used-slot count `slots` is
    long long topk_seen = 0;  // a marks build: the clock when the walk learned the last routing
    bool end = false;
    // The expert queue being claimed (MK_OP_EXPERT_CLAIM): the claim task, its head counter and
    // its tiles; `tag` is what the stage next() returned carries.
    bool claiming = false;
    MkTask claim{};
    uint32_t* queue_head = nullptr;
    int queue_tiles = 0, tag = kNoTag;

    __device__ const MkTask& task(int i) {
        if (i >= base + kListBatch) {
            // Asynchronous 16-byte copies: the window's loads are in flight together without
            // holding registers. The list does not change during the step (.ca: through L1).
            base = i - i % kListBatch;
            const int count = min(kListBatch, per_sm - base);
            for (int q = 0; q < count * (int)(sizeof(MkTask) / 16); ++q)
                asm volatile("cp.async.ca.shared.global [%0], [%1], 16;" ::"r"(smem_addr(window) + 16 * q),
                             "l"(reinterpret_cast<const uint4*>(list + base) + q)
                             : "memory");
            asm volatile("cp.async.wait_all;" ::: "memory");
        }
        return window[i - base];
    }

    // Starts walking the stages of GEMV task (or claimed tile) t; false if it has none.
    __device__ bool start(const MkStepArgs& a, const MkTask& t) {
        s = gemv_shape(a, t), maps = gemv_maps(a, t, routing), kv = false;
        box = box_cols(s.k), kc = box * kStageBoxes, depth = stage_depth(s.k), g = 0, c = 0;
        if constexpr (kWideBatch) pass = act_cols(a.batch);
        while (g < s.groups && s.group_valid(g) <= 0) ++g;
        return g < s.groups;
    }

    // The used-slot count of expert task t's layer: the first expert task of a layer has the
    // producer warp learn the layer's routing (route_layer: the top-k task's, or chosen here from
    // the router's logits where the task names the layer's router tasks and the top-k has not
    // run), which the walk waits for.
    __device__ int routed_slots(const MkStepArgs& a, const uint32_t* counters, const MkTask& t) {
        if (t.layer != slots_layer) {
            const int layer = t.layer;
            producer_warp_route(RoutingArgs(a), counters, routing, layer, t.arg[MK_ARG_ROUTERS]);
            if (MK_TRACE_MARKS) topk_seen = clock64();
            slots = shared_load(&routing[layer & 1].count), slots_layer = layer;
        }
        return slots;
    }

    // Moves to the next run of stages: the next tile of the queue being claimed, or the next GEMV
    // task with weights or split in the list (a claim task opens its queue). kMarker: the queue
    // being claimed is empty, or an expert task's slot is unused (the walk then reports one
    // marker stage, which the compute warps take for "no stages").
    enum Next { kEnd, kStages, kMarker, kKv };
    __device__ Next advance(const MkStepArgs& a, uint32_t* counters) {
        for (;;) {
            if (claiming) {
                const int i = (int)atomicAdd(queue_head, 1u);
                if (i >= queue_tiles) return claiming = false, kMarker;
                tag = i;
                if (start(a, claimed_tile(claim, i))) return kStages;
                continue;
            }
            if (++j >= per_sm) return kEnd;
            const MkTask& t = task(j);
            if (t.op == MK_OP_NOP) return kEnd;  // lists are NOP-padded at the end only
            if (t.op == MK_OP_EXPERT_CLAIM) {
                claim = t, claiming = true;
                queue_tiles = routed_slots(a, counters, t) * t.arg[2];
                const int head = t.arg[0] == MK_MAT_EXPERT_GATE_UP ? MK_CTR_UP_CLAIM : MK_CTR_DOWN_CLAIM;
                queue_head = counters + t.layer * MK_COUNTERS_PER_LAYER + head;
                continue;
            }
            if (t.op == MK_OP_ATTN_SPLIT) {
                split = SplitPages(a, t), kv = true, page = 0, which = 0;
                if (split.pages <= 0) continue;
                block = split.table[split.first_page / kPage];  // the host's table: no .cg needed
                return kKv;
            }
            if (t.op != MK_OP_GEMV) continue;
            if (is_expert(t) && t.arg[3] >= routed_slots(a, counters, t)) return kMarker;
            if (start(a, t)) return kStages;
        }
    }

    // The next stage: a weight stage (kStages) or a split page's K or V (kKv): its tensor map,
    // first column and row and boxes, and `tag` (Ring::tag); kEnd at the end of the list, kMarker
    // for a queue's end marker (no copies).
    __device__ Next next(const MkStepArgs& a, uint32_t* counters, const void*& map, int& col, int& row, int& boxes) {
        tag = kNoTag;
        if (end) return kEnd;
        if (j < 0 || (kv ? page >= split.pages : g >= s.groups)) {
            const Next n = advance(a, counters);
            if (n == kEnd) end = true;
            if (n == kEnd || n == kMarker) return tag = kQueueEnd, n;
        }
        if (kv) {
            map = ptr<const unsigned char>(a.kv_maps) + which * MK_TENSOR_MAP_BYTES;
            col = split.kvh * kHeadDim, row = block * kPage, boxes = 2;
            if (which == 0 && page + 1 < split.pages) block_next = split.table[split.first_page / kPage + page + 1];
            if (++which == 2) which = 0, ++page, block = block_next;
            return kKv;
        }
        map = maps.of(s, g), col = c, row = s.group_first(g);
        int end = s.k;
        if constexpr (kWideBatch) end = min(s.k, (c / pass + 1) * pass);  // a stage stays inside a pass
        boxes = min(kStageBoxes, (end - c + box - 1) / box);
        c += kc;
        if constexpr (kWideBatch) c = min(c, end);
        if (c >= s.k) {
            c = 0;
            do ++g;
            while (g < s.groups && s.group_valid(g) <= 0);
        }
        return kStages;
    }
};

static_assert(kStageBytes >= 2 * kKvBoxBytes, "a ring stage holds a KV page's two boxes");

// Whether a streamed task's trace words hold its consumer's marks, not the producer's waits.
__device__ __forceinline__ bool consumer_marks(bool split) { return MK_TRACE_MARKS && (split || MK_GEMV_MARKS); }

// A diagnostic build (-DMK_NO_COPY=1; its outputs are garbage): no stage is copied, each is full
// as soon as its slot is free, so that the step's time is what the compute warps and the
// dependencies alone allow (is a step bound by HBM or by its consumers?).
#ifndef MK_NO_COPY
#define MK_NO_COPY 0
#endif

// The producer warp's loop (lane 0): as soon as a ring slot is free, one bulk tensor copy per box
// of a weight stage (the swizzled variant: one 3-D copy a stage), or the two of a split page's K
// or V. (Prefetching the stages beyond the ring
// into L2 while it waits was slower, and so was the whole warp copying a split's pages with
// cp.async: docs/PERF.md, "Measured and not kept".)
__device__ void stream_weights(const MkStepArgs& a, const MkTask* list, uint32_t* counters, const Ring& r,
                               MkTask* window, BlockRouting* routing) {
    if (threadIdx.x % 32 != 0) {  // the other lanes help lane 0 learn each MoE layer's routing
        const RoutingArgs args(a);
        while (producer_warp_route(args, counters, routing, 0, 0) >= 0) {
        }
        return;
    }
    const uint64_t policy = evict_first_policy();
    StageWalk copy{list, a.per_sm, window, routing};
    uint32_t n = 0;  // stages issued
    // The trace's producer fields of the task being streamed (`traced`).
    MkTraceEntry* trace = a.trace ? ptr<MkTraceEntry>(a.trace) + (size_t)blockIdx.x * a.per_sm : nullptr;
    int traced = -1;
    // A marks build: a split's two words (every task's, with MK_GEMV_MARKS) hold its marks,
    // written by the consumer.
    bool traced_kv = false;
    uint32_t ring_wait = 0;
    const void* map;
    int col, row, boxes;
    for (;; ++n) {
        const long long t0 = trace ? clock64() : 0;
        const StageWalk::Next kind = copy.next(a, counters, map, col, row, boxes);
        if (kind == StageWalk::kEnd) break;
        const bool first = trace && copy.j != traced;
        if (first) {
            if (traced >= 0 && !consumer_marks(traced_kv)) trace[traced].ring_wait_cycles = ring_wait;
            // A marks build: the first task walked after a top-k wait records the cycles from
            // the top-k seen to its first stage known (the slot loads), not the whole wait.
            long long from = t0;
            if (MK_TRACE_MARKS && copy.topk_seen != 0) from = copy.topk_seen, copy.topk_seen = 0;
            if (!consumer_marks(copy.kv)) trace[copy.j].topk_wait_cycles = (uint32_t)(clock64() - from);
            traced = copy.j, traced_kv = copy.kv, ring_wait = 0;
        }
        if (n >= (uint32_t)r.count && !mbar_test_wait(r.empty_of(n), r.parity(n) ^ 1u)) {
            const long long w0 = trace ? clock64() : 0;
            mbar_wait(r.empty_of(n), r.parity(n) ^ 1u);
            if (trace) ring_wait += (uint32_t)(clock64() - w0);
        }
        r.set_tag(n, copy.tag);  // published by the arrival below
        uint64_t* full = r.full_of(n);
        if (kind == StageWalk::kMarker) {
            r.record_issue(n, 0, 2, copy.j);
            mbar_arrive(full);  // no bytes: the phase completes at once
        } else if (MK_NO_COPY) {
            mbar_arrive(full);  // a diagnostic build: the stage as it is, at once
        } else if (kind == StageWalk::kKv) {
            r.record_issue(n, 2 * kKvBoxBytes, 1, copy.j);
            mbar_arrive_expect_tx(full, (uint32_t)(2 * kKvBoxBytes));
            for (int h = 0; h < 2; ++h)
                tensor_copy_2d(r.stage(n) + h * kKvBoxBytes, map, col + h * kKvBoxCols, row, full, policy);
        } else if (copy.depth > 0) {
            // One copy of the stage's boxes (3-D map, the swizzled variant, which has no wide
            // image): whole boxes count, those past k and rows past the matrix's end too (the copy
            // zero-fills them; a ledger's bytes count them as well).
            const uint32_t bytes = copy.depth * kStageRows * copy.box * 2;
            r.record_issue(n, bytes, 0, copy.j);
            mbar_arrive_expect_tx(full, bytes);
            tensor_copy_3d(r.stage(n), map, col / copy.box, row, full, policy);
        } else {
            const int box = copy.box;
            // Whole boxes count, rows past the matrix's end too (the copy zero-fills them).
            r.record_issue(n, boxes * kStageRows * box * 2, 0, copy.j);
            mbar_arrive_expect_tx(full, (uint32_t)(boxes * kStageRows * box * 2));
            for (int b = 0; b < boxes; ++b)
                tensor_copy_2d(r.stage(n) + b * kStageRows * box * 2, map, col + b * box, row, full, policy);
        }
        if (first) trace[copy.j].stream_ns = global_ns();
    }
    if (traced >= 0 && !consumer_marks(traced_kv)) trace[traced].ring_wait_cycles = ring_wait;
    producer_warp_route(RoutingArgs(a), counters, routing, -1, 0);  // releases the other lanes
}

}  // namespace mk
