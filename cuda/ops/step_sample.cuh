// The sample tasks: each row's token, greedy or Gumbel-max, as rust/sampling draws it.
#pragma once
#include "step_common.cuh"

namespace mk {

// A row is sampled greedily (argmax, ties to the lowest id) or, where MkStepArgs.row_samples gives
// it a temperature, by Gumbel-max: argmax of key(logit) / T + g, g = -ln(-ln u) with u from
// Philox4x32-10 of (seed, index, token id). This is rust/sampling's definition bit for bit
// (philox.rs): every float operation below is one explicitly rounded IEEE operation in the host's
// order (no contraction into fma), and the logarithm is that module's own, not logf.
__device__ __forceinline__ uint32_t philox_token_bits(uint64_t seed, uint32_t index, uint32_t id) {
    uint32_t c0 = id, c1 = index, c2 = 0u, c3 = 0u, k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#pragma unroll
    for (int round = 0; round < 10; ++round) {
        if (round > 0) k0 += 0x9E3779B9u, k1 += 0xBB67AE85u;
        const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0, c1 = lo1, c2 = n2, c3 = lo0;
    }
    return c0;
}

// philox::ln: x = m 2^e, m in [sqrt(1/2), sqrt(2)), ln m = 2 atanh(s) by its series to s^9.
__device__ __forceinline__ float sampling_ln(float x) {
    const uint32_t bits = __float_as_uint(x);
    int e = (int)((bits >> 23) & 0xffu) - 127;
    float m = __uint_as_float((bits & 0x007fffffu) | 0x3f800000u);
    if (m > __uint_as_float(0x3fb504f3u)) m = __fmul_rn(m, 0.5f), e += 1;  // sqrt(2) in f32
    const float f = __fsub_rn(m, 1.0f);
    const float s = __fdiv_rn(f, __fadd_rn(m, 1.0f));
    const float z = __fmul_rn(s, s);
    // 2/3, 2/5, 2/7, 2/9 rounded to f32 (the host's constant quotients).
    const float c3 = __uint_as_float(0x3f2aaaabu), c5 = __uint_as_float(0x3ecccccdu);
    const float c7 = __uint_as_float(0x3e924925u), c9 = __uint_as_float(0x3e638e39u);
    const float series =
        __fmul_rn(z, __fadd_rn(c3, __fmul_rn(z, __fadd_rn(c5, __fmul_rn(z, __fadd_rn(c7, __fmul_rn(z, c9)))))));
    const float ln2 = __uint_as_float(0x3f317218u);
    return __fadd_rn(__fmul_rn((float)e, ln2), __fadd_rn(__fmul_rn(2.0f, s), __fmul_rn(s, series)));
}

__device__ __forceinline__ float gumbel_of_bits(uint32_t bits) {
    const float u = __fmul_rn(__fadd_rn((float)(bits >> 9), 0.5f), 1.0f / 8388608.0f);  // exact
    return -sampling_ln(-sampling_ln(u));
}

// At least any noise: the largest uniform's, plus the host's margin (philox::gumbel_bound).
__device__ __forceinline__ float gumbel_bound() { return gumbel_of_bits(0xffffffffu) + 1e-3f; }

// The host's key(): NaN never wins, +inf counts as the largest finite value.
__device__ __forceinline__ float logit_key(float x) { return isnan(x) ? -INFINITY : fminf(x, __uint_as_float(0x7f7fffffu)); }

// Row b's rule: inv_t > 0 draws with Gumbel noise, 0 is greedy (and so is every row without a table).
__device__ __forceinline__ MkRowSample row_sample(const MkStepArgs& a, int b) {
    if (a.row_samples == 0) return MkRowSample{0.f, 0u, 0u, 0u, 0u};
    return ptr<const MkRowSample>(a.row_samples)[b];
}

// The best (score, lowest id) of a vocabulary slice, then over the slices; the score is the logit
// (greedy) or key(logit) * inv_t + noise. An id whose scaled key cannot reach the thread's best
// even with the largest noise is passed over without a draw (it can neither win nor tie). A
// masked row's ids outside its mask count as -inf logits, as the host sampler makes them.
__device__ void run_sample_part(const MkStepArgs& a, const MkTask& t, float* sv, int* si) {
    const int b = t.arg[0], part = t.arg[1], lo = t.arg[2], hi = t.arg[3];
    const MkRowSample rule = row_sample(a, b);
    const bool draw = rule.inv_temperature > 0.f;
    // Written by the host before the launch: read through the read-only path. Or, for a step
    // queued before the host knew its masks (mask_ready), while it runs: wait for them (thread 0;
    // the barrier extends what it saw to the block), then read them uncached. Masks that never
    // come leave the row without a token (the host fails it), not the context trapped.
    const bool late = rule.masked && a.mask_ready != 0;
    bool gave_up = false;
    if (late) {
        if (threadIdx.x == 0) {
            const uint32_t* ready = ptr<const uint32_t>(a.mask_ready);
            const uint64_t start = global_ns();
            while (load_acquire_sys(ready) != (uint32_t)a.mask_epoch && !gave_up) {
                __nanosleep(256);
                gave_up = global_ns() - start > kWaitLimitNs;
            }
            si[0] = gave_up;
        }
        compute_sync();
        gave_up = si[0] != 0;
        compute_sync();  // (si is written again below)
    }
    const uint32_t* mask =
        rule.masked ? ptr<const uint32_t>(a.row_masks) + (size_t)b * ((a.vocab + 31) / 32) : nullptr;
    const uint64_t seed = ((uint64_t)rule.seed_hi << 32) | rule.seed_lo;
    const float bound = draw ? gumbel_bound() : 0.f;
    float best = -INFINITY;
    int id = hi;
    // kSampleBatch loads in flight before the compares (one latency per batch, not per value;
    // docs/PERF.md, tuning decisions).
    constexpr int kSampleBatch = 8;
    const float* row = ptr<float>(a.logits) + (size_t)b * a.vocab;
    for (int i0 = lo + threadIdx.x; i0 < hi && !gave_up; i0 += kSampleBatch * kThreads) {
        float v[kSampleBatch];
#pragma unroll
        for (int j = 0; j < kSampleBatch; ++j) {
            const int i = i0 + j * kThreads;
            v[j] = i < hi ? ld_f32(row + i) : -INFINITY;
            if (mask != nullptr && i < hi) {
                const uint32_t word = late ? __ldcv(mask + i / 32) : __ldg(mask + i / 32);
                if (((word >> (i % 32)) & 1u) == 0) v[j] = -INFINITY;
            }
        }
#pragma unroll
        for (int j = 0; j < kSampleBatch; ++j) {
            float score = v[j];
            if (draw) {
                const float scaled = __fmul_rn(logit_key(v[j]), rule.inv_temperature);
                if (__fadd_rn(scaled, bound) < best) continue;
                score = __fadd_rn(scaled, gumbel_of_bits(philox_token_bits(seed, rule.index, (uint32_t)(i0 + j * kThreads))));
            }
            if (score > best) best = score, id = i0 + j * kThreads;  // ascending i per thread: keeps the lowest id on ties
        }
    }
    sv[threadIdx.x] = best, si[threadIdx.x] = id;
    compute_sync();
    if (threadIdx.x == 0) {
        for (int i = 1; i < kThreads; ++i)
            if (sv[i] > best || (sv[i] == best && si[i] < id)) best = sv[i], id = si[i];
        ptr<float>(a.sample_score)[b * a.sample_parts + part] = best;
        ptr<int32_t>(a.sample_id)[b * a.sample_parts + part] = id;
    }
}

// A part without any finite score names no token: a row without one gets `vocab` (the host
// refuses it), not the first part's end.
__device__ void run_sample_final(const MkStepArgs& a, const MkTask& t) {
    if (threadIdx.x != 0) return;
    const int b = t.arg[0], parts = t.arg[1];
    float best = -INFINITY;
    int id = a.vocab;
    for (int p = 0; p < parts; ++p) {
        const float v = ld_f32(ptr<float>(a.sample_score) + b * a.sample_parts + p);
        const int i = ld_i32(ptr<int32_t>(a.sample_id) + b * a.sample_parts + p);
        if (v == -INFINITY) continue;
        if (v > best || (v == best && i < id)) best = v, id = i;
    }
    ptr<int32_t>(a.sampled)[b] = id;
}

}  // namespace mk
