// Weight streaming for the decode megakernel's GEMV tasks: a producer warp walks the block's task
// list ahead of the compute warps and copies every GEMV task's weight tiles with the bulk tensor
// copy engine (cp.async.bulk.tensor) into a ring of shared-memory stages, each guarded by a "full"
// mbarrier (bytes landed) and an "empty" one (every compute warp is done with it). Weights never
// change, so a task's tiles are in flight while earlier tasks still wait on their inputs; only
// expert tiles wait, for the layer's top-k task that says which expert a slot holds.
//
// Producer and consumers walk the same stage sequence: for each GEMV task with weights, for each
// 16-row group with rows, for each chunk of kc columns, one stage (stream_weights in
// step_producer.cuh, gemv_compute in step_gemv.cuh).
#pragma once
#include "step_common.cuh"

namespace mk {

constexpr int kStageRows = MK_STAGE_ROWS;
constexpr int kBoxCols = MK_STAGE_COLS;  // weight columns per box of a stage (bf16)
// Boxes per stage, side by side along k (cuda/abi.h: the host's tensor maps describe them): more
// boxes make fewer, larger stages (longer runs of each weight row per stage); 3 measured fastest
// (docs/PERF.md, tuning decisions), and 4 leave fewer than 4 stages (the swizzled variant's 12
// boxes of 64 columns make the same 24 KB stages).
constexpr int kStageBoxes = MK_STAGE_BOXES;
// A stage is kStageBoxes [kStageRows][box] tiles: dense rows, where rows g and g + 1 read at one
// column by a quarter-warp share banks (2-way), or 128-byte rows in the 128-byte swizzle
// (MK_WEIGHT_SWIZZLE: swizzled_unit).
constexpr int kStageBytes = kStageBoxes * kStageRows * kBoxCols * 2;

// Columns per box for a reduction length k (a multiple of 32): the box of the host's tensor
// maps (rust/gpu/tensor_map.rs stage_cols), min(k, MK_STAGE_COLS). Where the stage's columns do
// not divide k the last stage runs past the matrix: boxes past k are not copied (a 3-D copy
// zero-fills them), a box that straddles k is zero-filled, and the compute skips those columns.
__device__ __forceinline__ int box_cols(int k) { return min(k, kBoxCols); }

// The boxes one copy brings of a matrix of reduction length k. The swizzled variant's stages are
// 12 boxes of 64 columns: as 12 copies its steps were much slower than the default's (the copy
// engine's cost per copy), as one copy of a 3-D box equal (docs/PERF.md, tuning decisions). So
// there, where k is whole boxes, the host's map is 3-D and a stage one copy of this many boxes
// (rust/gpu/tensor_map.rs stage_depth; the last stage of a row zero-fills those past k). 0: a 2-D
// map, a copy per box (the default's 3 copies a stage: one 3-D copy measured no faster).
__device__ __forceinline__ int stage_depth(int k) {
    const int box = box_cols(k);
    return MK_WEIGHT_SWIZZLE && k % box == 0 ? min(kStageBoxes, k / box) : 0;
}

// With MK_WEIGHT_SWIZZLE: the byte offset inside one box of a weight stage of row r's 16-byte unit
// u (columns 8u to 8u + 7): 128-byte rows, unit u stored at unit u ^ (r % 8) (the 128-byte swizzle).
// Rows r and r + 4 of one quarter-warp then read opposite halves of the banks (gemv_compute).
__device__ __forceinline__ int swizzled_unit(int r, int u) { return r * 128 + 16 * (u ^ (r & 7)); }

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without registers, read at L2 (.cg: another SM may have written them
// in this launch); cp_async_wait_all waits for the thread's copies.
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_addr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

// Makes the initialised barriers visible to the copy engine (the async proxy).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
                 : "memory");
}

// Whether the phase of parity %2 of the barrier at %1 has completed, into %0: mbarrier.<op>, where
// try_wait may suspend the thread a while first and test_wait answers at once.
#define MK_MBAR_PHASE_DONE(op)                                                               \
    "{\n\t.reg .pred p;\n\tmbarrier." op ".parity.shared::cta.b64 p, [%1], %2;\n\t" \
    "selp.u32 %0, 1, 0, p;\n\t}"

__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile(MK_MBAR_PHASE_DONE("try_wait") : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}

__device__ __forceinline__ bool mbar_test_wait(uint64_t* bar, uint32_t parity) {
    uint32_t done;
    asm volatile(MK_MBAR_PHASE_DONE("test_wait") : "=r"(done) : "r"(smem_addr(bar)), "r"(parity) : "memory");
    return done != 0;
}

// Waits for the phase of parity `parity` to complete; traps (a launch error, not a hung GPU) if
// it never does.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
    if (mbar_try_wait(bar, parity)) return;
    const uint64_t start = global_ns();
    while (!mbar_try_wait(bar, parity))
        if (global_ns() - start > kWaitLimitNs) __trap();
}

__device__ __forceinline__ uint64_t evict_first_policy() {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    return policy;
}

// Copies the [kStageRows][box cols] tile at (column c0, row r0) of the matrix `map` describes
// into shared memory, counted on `bar`'s transaction count.
__device__ __forceinline__ void tensor_copy_2d(void* dst, const void* map, int c0, int r0, uint64_t* bar,
                                               uint64_t policy) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(smem_addr(dst)),
        "l"(map), "r"(c0), "r"(r0), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
}

// Copies the stage at (column block c0 / box, row r0) of a matrix of whole boxes, whose map is the
// 3-D view [k / box][rows][box] with boxes [stage_depth(k)][kStageRows][box] (rust/gpu/tensor_map.rs):
// the stage's boxes in one copy, those past k zero-filled (and counted on `bar`).
__device__ __forceinline__ void tensor_copy_3d(void* dst, const void* map, int block, int r0, uint64_t* bar,
                                               uint64_t policy) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(smem_addr(dst)),
        "l"(map), "r"(0), "r"(r0), "r"(block), "r"(smem_addr(bar)), "l"(policy)
        : "memory");
}

// The ring of stages and its barriers, carved out of the block's dynamic shared memory.
struct Ring {
    unsigned char* stages;  // [stages][kStageBytes]
    uint64_t* full;         // [stages], 1 arrival (the producer) + the stage's bytes
    uint64_t* empty;        // [stages], kWarps arrivals (one per compute warp)
    // [stages]: what an expert queue's stage is (written before the stage's arrival, so the
    // compute warps read it once the stage is full): the claimed tile's index at its first
    // stage, kQueueEnd for the marker that ends a claim task's tiles, kNoTag otherwise.
    int* tag;
    int count;       // stages (set for the launch's batch: not a compile-time constant)
    uint32_t magic;  // ceil(2^32 / count): n / count = umulhi(n, magic), exact for n < 2^27
#if MK_STREAM_LEDGER
    uint64_t* ledger;  // a ledger build with a trace: this block's ledger rows (cuda/abi.h), else null
#endif

    __device__ Ring(unsigned char* stages, uint64_t* full, uint64_t* empty, int* tag, int count,
                    [[maybe_unused]] uint64_t* ledger_rows = nullptr)
        : stages(stages), full(full), empty(empty), tag(tag), count(count), magic(0xffffffffu / count + 1) {
#if MK_STREAM_LEDGER
        ledger = ledger_rows;
#endif
    }
    // The n-th stage's use of the ring: which round and which slot (a multiply, not a division).
    __device__ uint32_t round(uint32_t n) const { return __umulhi(n, magic); }
    __device__ uint32_t slot(uint32_t n) const { return n - round(n) * count; }

    __device__ unsigned char* stage(uint32_t n) const { return stages + (size_t)slot(n) * kStageBytes; }
    __device__ uint64_t* full_of(uint32_t n) const { return full + slot(n); }
    __device__ uint64_t* empty_of(uint32_t n) const { return empty + slot(n); }
    // Atomic accesses: ordered by the stage's mbarriers alone, which racecheck does not see (its
    // probe, scripts/racecheck_probe.cu, reports a plain value handed over that way), and it
    // does not report atomics.
    __device__ int tag_of(uint32_t n) const { return atomicAdd(tag + slot(n), 0); }
    __device__ void set_tag(uint32_t n, int value) const { atomicExch(tag + slot(n), value); }
    // Parity of the n-th use's phase of its slot.
    __device__ uint32_t parity(uint32_t n) const { return round(n) & 1u; }

    // The compute warps wait until the n-th stage is full; a ledger build records when thread 0
    // first found it so (an expert task's first stage is waited on twice) and which warps had to
    // wait for it.
    __device__ void wait_full(uint32_t n) const {
#if MK_STREAM_LEDGER
        if (ledger != nullptr && threadIdx.x % 32 == 0 && n < MK_LEDGER_STAGES) {
            uint64_t* row = ledger + 4 * (size_t)n;
            if (!mbar_test_wait(full_of(n), parity(n))) {
                mbar_wait(full_of(n), parity(n));
                atomicOr(reinterpret_cast<unsigned long long*>(row + 3), 1ull << (32 + threadIdx.x / 32));
            }
            if (threadIdx.x == 0 && row[1] == 0) row[1] = global_ns();
            return;
        }
#endif
        mbar_wait(full_of(n), parity(n));
    }
    // The producer is issuing the n-th stage (a ledger build): its bytes, kind and task.
    __device__ void record_issue([[maybe_unused]] uint32_t n, [[maybe_unused]] uint32_t bytes,
                                 [[maybe_unused]] uint32_t kind, [[maybe_unused]] int task) const {
#if MK_STREAM_LEDGER
        if (ledger == nullptr || n >= MK_LEDGER_STAGES) return;
        uint64_t* row = ledger + 4 * (size_t)n;
        row[0] = global_ns(), row[2] = bytes | (uint64_t)kind << 32;
        // An OR: compute warps that began to wait before the issue have set their bits already
        // (a plain store lost them: every family read "never waited").
        atomicOr(reinterpret_cast<unsigned long long*>(row + 3), (unsigned long long)task);
#endif
    }
};

constexpr int kNoTag = -2;
constexpr int kQueueEnd = -1;

// One thread initialises the barriers before the block splits into roles.
__device__ __forceinline__ void ring_init(const Ring& r) {
    for (int i = 0; i < r.count; ++i) {
        mbar_init(r.full + i, 1);
        mbar_init(r.empty + i, kWarps);
    }
    mbar_init_fence();
}

}  // namespace mk
