// Runs ON the GPU machine (scripts/device-check.sh --sanitize): does compute-sanitizer's racecheck
// see an mbarrier hand-off of a plain shared-memory value? The megakernel's weight producer
// writes each ring stage's tag with a plain store after waiting for the stage's "empty" phase
// and before arriving on its "full" barrier; the compute warps read it after waiting on "full"
// and arrive on "empty" afterwards (cuda/ops/step_producer.cuh, step_gemv.cuh). This kernel does exactly that with
// one producer warp and two consumer warps over a 4-slot ring, and checks every value arrived.
// A racecheck hazard here means the tool does not model the hand-off; none means it does, and a
// hazard in the megakernel would then be real. It reports hazards: racecheck models barriers
// only, so the megakernel hands such values over with atomics (Ring::tag_of, st_release_cta),
// which it does not report.
#include <cstdio>
#include <cstdint>

constexpr int kSlots = 4, kConsumers = 2, kRounds = 64;

__device__ __forceinline__ uint32_t smem(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void init(uint64_t* b, uint32_t n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void arrive(uint64_t* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(b)) : "memory");
}
__device__ __forceinline__ void wait(uint64_t* b, uint32_t parity) {
    uint32_t done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(smem(b)), "r"(parity)
                     : "memory");
}

__global__ void handoff(int* errors) {
    __shared__ uint64_t full[kSlots], empty[kSlots];
    __shared__ int tag[kSlots];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (threadIdx.x == 0) {
        for (int i = 0; i < kSlots; ++i) init(full + i, 1), init(empty + i, kConsumers);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    for (int n = 0; n < kRounds; ++n) {
        const int s = n % kSlots;
        const uint32_t parity = (n / kSlots) & 1u;
        if (warp == 0) {
            if (lane == 0) {
                if (n >= kSlots) wait(empty + s, parity ^ 1u);
                tag[s] = n;  // the plain store the megakernel's producer makes
                arrive(full + s);
            }
        } else {
            wait(full + s, parity);
            if (tag[s] != n) atomicAdd(errors, 1);
            __syncwarp();
            if (lane == 0) arrive(empty + s);
        }
    }
}

int main() {
    int* errors;
    cudaMalloc(&errors, sizeof(int));
    cudaMemset(errors, 0, sizeof(int));
    handoff<<<1, 32 * (1 + kConsumers)>>>(errors);
    int host = -1;
    const cudaError_t e = cudaMemcpy(&host, errors, sizeof(int), cudaMemcpyDeviceToHost);
    printf("mbarrier hand-off probe: %s, %d wrong values\n", cudaGetErrorString(e), host);
    return e == cudaSuccess && host == 0 ? 0 : 1;
}
