// The embedding task: row b's token embedding, the step's RoPE table for the row, and the first
// layer's norm.
#pragma once
#include "step_common.cuh"
#include "step_norm.cuh"

namespace mk {

// Row b's RoPE table for the step: (cos, sin) of position * theta^(-2i / head_dim) for pair i,
// the angle in double and both rounded to bf16 (the reference model's tables). The QKV tasks
// of every layer read it.
__device__ void fill_rope_row(const MkStepArgs& a, int b) {
    const int pos = ld_i32(ptr<int32_t>(a.positions) + b);
    for (int i = threadIdx.x; i < a.head_dim / 2; i += kThreads) {
        const double inv_freq = pow((double)a.rope_theta, -(double)(2 * i) / (double)a.head_dim);
        const double angle = (double)pos * inv_freq;
        ptr<float2>(a.rope)[(size_t)b * (a.head_dim / 2) + i] =
            make_float2(round_bf16((float)cos(angle)), round_bf16((float)sin(angle)));
    }
}

__device__ void run_embed(const MkStepArgs& a, const MkTask& t, float* v, float* scratch) {
    const int b = t.arg[0];
    fill_rope_row(a, b);
    // A step queued behind one whose row had no finite logit reads that step's token `vocab` (the
    // host fails the row): clamped so the read stays inside the table.
    const int token = min(max(ld_i32(ptr<int32_t>(a.tokens) + b), 0), a.vocab - 1);
    const bf16* row = ptr<const bf16>(a.embed) + (size_t)token * a.hidden;
    for (int i0 = kVec * threadIdx.x; i0 < a.hidden; i0 += kVec * kThreads) {
        float e[kVec];
        load8_bf16(row + i0, e);
#pragma unroll
        for (int j = 0; j < kVec; ++j) v[i0 + j] = e[j];
    }
    compute_sync();
    store_normed(a, b, v, norm_weight(a, 0), scratch);
}

}  // namespace mk
