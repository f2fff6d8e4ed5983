// Shared helpers of the decode megakernel's tasks: typed views of MkStepArgs, loads of data other
// SMs wrote during the step, block reductions, and the dependency counters.
#pragma once
#include <cuda_bf16.h>
#include <stdint.h>

#include "../abi.h"

namespace mk {

using bf16 = __nv_bfloat16;
// The compute warps run the tasks; one more warp, the producer, streams weight tiles into the
// shared-memory ring ahead of them (step_stream.cuh), and another, the signal warp, publishes
// the finished tasks' counters (send_signals). Ops see only the kThreads compute threads.
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kProducerWarp = kWarps;
constexpr int kSignalWarp = kWarps + 1;
constexpr int kBlockThreads = kThreads + 64;

// A barrier of the compute warps only (named barrier 1): the producer never joins it.
__device__ __forceinline__ void compute_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory"); }

template <typename T>
__device__ __forceinline__ T* ptr(uint64_t address) {
    return reinterpret_cast<T*>(address);
}

// Activations are produced by other SMs within the launch: read them at L2, never from a
// possibly stale L1 line.
__device__ __forceinline__ float ld_f32(const float* p) { return __ldcg(p); }
__device__ __forceinline__ int ld_i32(const int32_t* p) { return __ldcg(p); }
__device__ __forceinline__ float ld_bf16(const bf16* p) {
    unsigned short raw = __ldcg(reinterpret_cast<const unsigned short*>(p));
    return __bfloat162float(__ushort_as_bfloat16(raw));
}

// 16 bytes of activations at L2 (.cg): another SM may have written them in this launch.
__device__ __forceinline__ uint4 ld_activations(const void* p) {
    uint4 r;
    asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

// d += A · B on the tensor cores (mma.sync m16n8k16, bf16 in, fp32 accumulate): the register
// fragments of the PTX ISA's layout for row-major A and column-major B.
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The value a bf16 matmul output holds: what the reference model computes in bf16 mode.
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16(v)); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; `scratch` holds kWarps floats and may be reused after the call.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    compute_sync();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += scratch[w];
    compute_sync();
    return total;
}

// ---- dependency counters -------------------------------------------------------------------
__device__ __forceinline__ uint32_t load_acquire(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

// A word the host writes into mapped memory while the kernel runs (MkStepArgs.mask_ready).
__device__ __forceinline__ uint32_t load_acquire_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ uint64_t global_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
    return t;
}

#ifndef MK_TRACE_MARKS
#define MK_TRACE_MARKS 0
#endif
// A diagnostic build that also records every weight copy's times (abi.h: the stream ledger).
#ifndef MK_STREAM_LEDGER
#define MK_STREAM_LEDGER 0
#endif
// With MK_TRACE_MARKS, the GEMV and expert-claim tasks mark too (their first tile's activations in
// shared memory; its stages multiplied and reduced), in place of their producer's waits.
#ifndef MK_GEMV_MARKS
#define MK_GEMV_MARKS 0
#endif
// Two points inside a task, for the trace of a diagnostic build (-DMK_TRACE_MARKS=1): thread 0's
// clock the first time it reaches mark k, written to the task's trace entry as cycles since its
// wait ended (MkTraceEntry), where the producer's waits are otherwise. Compiles to nothing
// otherwise.
struct PhaseMarks {
    long long at[2] = {0, 0};
    __device__ __forceinline__ void mark(int k) {
        if (MK_TRACE_MARKS && threadIdx.x == 0 && at[k] == 0) at[k] = clock64();
    }
};

// A counter that never reaches its target means a broken graph: trap (the host then sees a
// launch error) instead of hanging the GPU.
constexpr uint64_t kWaitLimitNs = 2000000000ull;

__device__ __forceinline__ void spin_until(const uint32_t* c, uint32_t target) {
    if (load_acquire(c) >= target) return;
    const uint64_t start = global_ns();
    while (load_acquire(c) < target) {
        __nanosleep(32);
        if (global_ns() - start > kWaitLimitNs) __trap();
    }
}

// Thread 0 spins until every counter the task names reaches its target; the barrier then
// extends the acquire to the whole block.
__device__ __forceinline__ void wait_for(const MkTask& t, const uint32_t* counters, bool second = true) {
    if (threadIdx.x == 0) {
        if (t.wait0 >= 0) spin_until(counters + t.wait0, (uint32_t)t.target0);
        if (second && t.wait1 >= 0) spin_until(counters + t.wait1, (uint32_t)t.target1);
    }
    compute_sync();
}

// A shared-memory word handed between warps of the block (release / acquire at block scope), by
// atomics: racecheck reports plain accesses ordered by anything but a barrier, and the atomics
// cost next to nothing (docs/PERF.md, tuning decisions).
__device__ __forceinline__ void st_release_cta(uint32_t* p, uint32_t v) {
    asm volatile("atom.release.cta.shared.exch.b32 _, [%0], %1;" ::"r"((uint32_t)__cvta_generic_to_shared(p)), "r"(v)
                 : "memory");
}
__device__ __forceinline__ uint32_t ld_acquire_cta(uint32_t* p) {
    uint32_t v;
    asm volatile("atom.acquire.cta.shared.or.b32 %0, [%1], 0;" : "=r"(v) : "r"((uint32_t)__cvta_generic_to_shared(p)) : "memory");
    return v;
}

// Task i of the block's list is done: after the barrier every thread's writes of the task are
// done, and thread 0 says so to the signal warp (`done` = tasks finished), which publishes the
// task's counter. The compute warps go on to the next task without waiting for the gpu-scope
// release, a part of every task's time otherwise (docs/PERF.md, tuning decisions: MK_STEP_THREADS).
__device__ __forceinline__ void signal_done(int i, uint32_t* done) {
    compute_sync();
    if (threadIdx.x == 0) st_release_cta(done, (uint32_t)i + 1);
}

// The signal warp's loop (lane 0): as each task of the list is done, in list order, a release add
// of 1 to its counter. The release is cumulative: it orders every write the block made before
// the task's `done` store (the compute warps' barrier, then the store and this lane's acquire),
// and pairs with the waiters' ld.acquire.
__device__ void send_signals(const MkStepArgs& a, const MkTask* list, uint32_t* counters, uint32_t* done) {
    if (threadIdx.x % 32 != 0) return;
    int op = list[0].op, signal = list[0].signal;  // per_sm > 0 (checked by the host)
    for (int i = 0; i < a.per_sm && op != MK_OP_NOP; ++i) {
        const int this_signal = signal;
        if (i + 1 < a.per_sm) op = list[i + 1].op, signal = list[i + 1].signal;  // in flight while task i runs
        if (ld_acquire_cta(done) <= (uint32_t)i) {
            const uint64_t start = global_ns();
            while (ld_acquire_cta(done) <= (uint32_t)i)
                if (global_ns() - start > kWaitLimitNs) __trap();
        }
        if (this_signal >= 0)
            asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(counters + this_signal) : "memory");
    }
}

}  // namespace mk
