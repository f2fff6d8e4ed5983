// The one calling convention shared by the CUDA kernels and the Rust host code.
//
// Rust mirrors every struct here with #[repr(C)] (rust/abi.rs); a Rust test reads the
// sizes and offsets nvcc actually compiled (from the embedded abi_probe cubin) and compares.
// Only fixed-width fields; device pointers travel as uint64_t so the layout is the same on
// host and device. Append-only: never reorder or retype an existing field.
#pragma once
#include <stdint.h>

#define MK_ABI_VERSION 16

// ---- The decode megakernel's task graph (docs/MEGAKERNEL.md) ------------------------------------
// A step is a list of tasks per SM, built by the host (rust/graph). Each block runs its list in
// order; a task first waits until up to two counters reach their targets (acquire), runs, then
// adds 1 to its signal counter (release). Counters come in two sets; step s uses set s % 2 and
// zeroes the other for step s + 1, so no launch is spent resetting them.
#define MK_TASK_WORDS 16
// Tokens per KV page (block): the paged cache's layout [blocks][MK_PAGE_SIZE][kv_heads][head_dim].
#define MK_PAGE_SIZE 64
#define MK_NO_COUNTER (-1)

typedef struct MkTask {
    int32_t op;            // MkOp
    int32_t layer;
    int32_t wait0, target0;  // counter index (MK_NO_COUNTER: none) and the value to reach
    int32_t wait1, target1;
    int32_t signal;        // counter to add 1 to when done, or MK_NO_COUNTER
    int32_t arg[9];        // op-specific, see MkOp
} MkTask;

typedef enum MkOp {
    MK_OP_NOP = 0,
    // arg0 = row b. x[b] = embed[token[b]]; h[b] = bf16(rmsnorm(x[b]) * gamma_0); row b of the
    // step's RoPE table (MkStepArgs.rope).
    MK_OP_EMBED = 1,
    // arg0 = MkMatrix, arg1 = first output row, arg2 = row groups of 16 (1 to MK_GEMV_MAX_GROUPS;
    // gate/up matrices: groups of 16 features, at most half as many, each streaming its gate and
    // its up rows; QKV tasks stay inside one of Q, K and V), arg3 = MoE slot (expert matrices
    // only), arg5 (expert matrices only: MK_ARG_ROUTERS) = the layer's router tasks or 0.
    // y = act · Wᵀ with the matrix's epilogue.
    MK_OP_GEMV = 2,
    // arg0 = b, arg1 = kv head, arg2 = split s, arg3 = sliding window (0: full attention),
    // arg4 = the row's splits (the host's only), arg5 = keys per split (chunk). Partial
    // softmax(q kᵀ) v of the kv head's query group over keys [lo, hi) of a row writing at pos:
    // lo = start + s * chunk with start = max(0, pos + 1 - window) (0 without one), hi =
    // min(lo + chunk, pos + 1). The words do not change while the row's split count holds.
    MK_OP_ATTN_SPLIT = 3,
    // arg0 = b, arg1 = kv head, arg2 = number of splits. Merges the partials into attn_out.
    MK_OP_ATTN_COMBINE = 4,
    // Sigmoid top-k of every row's router logits; builds the layer's active-expert slots. Exactly
    // one per MoE layer; the residual norms wait for its counter to reach 1, and so does the
    // weight producer before streaming the layer's expert tiles unless they name the router
    // tasks (MK_ARG_ROUTERS).
    MK_OP_TOPK = 5,
    // arg0 = b. x[b] += attn + ffn; h[b] = bf16(rmsnorm(x[b]) * gamma_{layer+1}) (final norm
    // after the last layer).
    MK_OP_RESIDUAL_NORM = 6,
    // arg0 = b, arg1 = part, arg2 = first vocab id, arg3 = end. Best (score, id) of the slice.
    MK_OP_SAMPLE_PART = 7,
    // arg0 = b, arg1 = parts. Reduces the parts and writes the sampled token.
    MK_OP_SAMPLE_FINAL = 8,
    // A MoE layer's expert tiles of one matrix, claimed from the layer's queue by whichever block
    // is free: arg0 = MK_MAT_EXPERT_GATE_UP or MK_MAT_EXPERT_DOWN, arg1 = row groups of 16 per
    // tile (gate/up: features), arg2 = tiles per slot (arg3, arg4: the queue's most tiles and its
    // claimers, for the host's cost model only), arg5 = MK_ARG_ROUTERS. Tile i is slot i / arg2, rows (i % arg2)
    // * 16 * arg1 ..; the queue holds slot_count * arg2 tiles. The block's weight producer claims
    // (atomic add on the layer's MK_CTR_UP_CLAIM / MK_CTR_DOWN_CLAIM) as it streams; one task per
    // block and matrix, signalled once when the queue is empty and its own tiles are done.
    MK_OP_EXPERT_CLAIM = 9,
} MkOp;

// The word of an expert task (GEMV of an expert matrix, or claim) that says where its block's
// weight producer learns the layer's routing: > 0, the number of the layer's router tasks (it
// chooses the experts itself once they have all signalled MK_CTR_ROUTER: local routing); 0, from
// the top-k task once it has run.
#define MK_ARG_ROUTERS 5

typedef enum MkMatrix {
    MK_MAT_QKV = 0,          // q|k|v rows; RoPE where the layer uses it, K/V into the paged cache
    MK_MAT_O = 1,            // attn_out · Woᵀ -> y_attn
    MK_MAT_ROUTER = 2,       // h · Wgateᵀ -> router logits (fp32)
    MK_MAT_DENSE_GATE_UP = 3,  // 16 * arg2 features: gate and up rows -> silu(g)·u -> dense_act
    MK_MAT_DENSE_DOWN = 4,   // dense_act · Wdownᵀ -> ffn_out
    MK_MAT_EXPERT_GATE_UP = 5,  // the same for the expert in MoE slot arg3 -> expert_act[slot]
    MK_MAT_EXPERT_DOWN = 6,  // expert_act[slot] · Wdownᵀ -> expert_out[slot]
    MK_MAT_LM_HEAD = 7,      // h · embedᵀ -> logits (fp32)
} MkMatrix;

// Per-layer counters (index = layer * MK_COUNTERS_PER_LAYER + MkCounter). "Layer" L (one past
// the last) holds H_READY = final norm done, and reuses QKV's and ATTN_SPLIT's slots for the
// logits and the sampling parts.
#define MK_COUNTERS_PER_LAYER 11
typedef enum MkCounter {
    MK_CTR_H_READY = 0,   // h of this layer is ready (embed or the previous layer's norms)
    MK_CTR_QKV = 1,
    MK_CTR_ATTN_SPLIT = 2,
    MK_CTR_ATTN = 3,      // attn_out complete
    MK_CTR_O = 4,
    MK_CTR_ROUTER = 5,    // router logits complete (dense layer: unused)
    MK_CTR_TOPK = 6,
    MK_CTR_FFN_UP = 7,    // dense or expert gate/up tiles
    MK_CTR_FFN_DOWN = 8,  // dense or expert down tiles
    MK_CTR_UP_CLAIM = 9,  // the next expert gate/up tile to claim (MK_OP_EXPERT_CLAIM); not waited on
    MK_CTR_DOWN_CLAIM = 10,  // the next expert down tile to claim
    MK_CTR_LOGITS = 1,    // in "layer" L
    MK_CTR_SAMPLE = 2,    // in "layer" L
} MkCounter;

// Per-layer weight pointers (uint64 device addresses, nn.Linear layout [out, in], bf16), in
// this order: MK_LW_COUNT entries per layer. Missing ones (router of a dense layer) are 0.
typedef enum MkLayerWeight {
    MK_LW_NORM = 0,   // input_layernorm [hidden]
    MK_LW_Q = 1,
    MK_LW_K = 2,
    MK_LW_V = 3,
    MK_LW_O = 4,
    MK_LW_ROUTER = 5,
    MK_LW_GATE = 6,   // dense FFN
    MK_LW_UP = 7,
    MK_LW_DOWN = 8,
    MK_LW_COUNT = 9,
} MkLayerWeight;

// Dynamic shared memory every block of mk_decode_step is launched with (all a Hopper block may
// have: the ops' union, then a ring of weight stages filling the rest), and its threads per
// block: 8 compute warps, the weight producer warp and the signal warp.
#define MK_STEP_SMEM_BYTES (227 * 1024)
#define MK_STEP_THREADS 320
// The longest reduction (k) of any GEMV task, and rows. build.rs compiles megakernel.cu twice: a
// narrow image for launches of 1-8 rows (one n-tile; the activation buffer in shared memory holds
// [rows][MK_STEP_MAX_K]) and a wide one for 9-16 (two n-tiles, a long reduction's activations
// staged in passes of the same buffer size; docs/MEGAKERNEL.md, "Batch size"). MK_IMAGE_ROWS is
// the rows of the image being compiled (the wide one gets -DMK_IMAGE_ROWS=MK_WIDE_ROWS), and
// `mk_image_rows` tells the host which image is which; MK_STEP_MAX_ROWS is the most rows of one
// launch. The swizzled-weights variant has no wide image (its 16-row loop spills registers).
#define MK_STEP_MAX_K 4096
#define MK_NARROW_ROWS 8
#define MK_WIDE_ROWS 16
#ifndef MK_IMAGE_ROWS
#define MK_IMAGE_ROWS MK_NARROW_ROWS
#endif
// The most 16-row weight groups one GEMV task multiplies (128 output rows).
#define MK_GEMV_MAX_GROUPS 8
// The geometry the kernel's tasks are built for: the attention's head size and query heads per KV
// head, the router's top-k and experts (mk.megakernel.support refuses models outside them).
#define MK_STEP_HEAD_DIM 128
#define MK_STEP_MAX_GROUP 8
#define MK_STEP_MAX_TOP_K 8
#define MK_STEP_MAX_EXPERTS 512

// Everything one launch of the decode megakernel needs. Pointers are device addresses; the
// buffers are described in python/mk/megakernel/buffers.py (StepBuffers).
typedef struct MkStepArgs {
    uint64_t tasks;         // MkTask [gridDim.x][per_sm]
    uint64_t counters;      // uint32 [2][num_counters]
    uint64_t layer_weights; // uint64 [layers][MK_LW_COUNT]
    uint64_t expert_weights;  // uint64 [layers][experts][3]: gate, up, down
    uint64_t layer_window;  // int32 [layers]: window in keys, 0 = full attention
    uint64_t layer_rope;    // int32 [layers]: 1 where RoPE applies
    uint64_t embed;         // bf16 [vocab, hidden], also the LM head
    uint64_t final_norm;    // bf16 [hidden]
    uint64_t k_pool, v_pool;  // bf16 [blocks, 64, kv_heads, head_dim]
    uint64_t tokens, positions, block_tables;
    uint64_t x, h, q, attn_o, attn_ml, attn_out, y_attn, router;
    uint64_t topk_slot, topk_score, slot_expert, slot_count;
    uint64_t dense_act, expert_act, ffn_out, expert_out;  // expert_out: bf16 [slots][batch][hidden]
    uint64_t logits, sample_score, sample_id, sampled;
    int32_t per_sm, num_counters, parity, batch;
    int32_t layers, hidden, heads, kv_heads;
    int32_t head_dim, experts, top_k, expert_ffn;
    int32_t dense_ffn, vocab, max_pages, max_splits;
    int32_t slots, sample_parts, flags, mask_epoch;  // flags: none defined, must be 0; mask_epoch: see mask_ready
    float eps, logit_scale, rope_theta, reserved2;
    uint64_t routing_log;   // int32 [layers][batch][top_k]: every layer's chosen experts (tests, debugging)
    uint64_t residual_log;  // fp32 [layers][batch][hidden]: x after every layer, or 0 (off)
    uint64_t trace;         // MkTraceEntry [gridDim.x][per_sm]: when each task ran, or 0 (off)
    // Bulk-tensor-copy descriptors (CUtensorMap, 128 bytes each, encoded by the host with boxes of
    // MK_STAGE_ROWS x min(k, MK_STAGE_COLS)) of the same matrices as the pointer tables above.
    uint64_t layer_maps;    // [layers][MK_LW_COUNT] (entries without a matrix are zero)
    uint64_t expert_maps;   // [layers][experts][3]: gate, up, down
    uint64_t embed_map;     // the LM head (embed)
    uint64_t rope;          // fp32 [batch][head_dim / 2][2]: (cos, sin) at each row's position (EMBED writes it)
    // [2] CUtensorMaps of k_pool and v_pool as [blocks * MK_PAGE_SIZE rows][kv_heads * head_dim]
    // bf16, boxes of MK_PAGE_SIZE rows x MK_KV_BOX_COLS columns with 128-byte swizzle: the weight
    // producer copies a split's pages with them (one page of one KV head is two boxes).
    uint64_t kv_maps;
    uint64_t row_samples;   // MkRowSample [batch]: how each row's token is drawn, or 0 (every row greedy)
    // uint32 [batch][ceil(vocab / 32)]: the tokens row b may take (bit t % 32 of word t / 32), read
    // for the rows whose MkRowSample.masked is 1 (a grammar's mask); 0 when no row is masked.
    uint64_t row_masks;
    // uint32 in host-mapped memory, or 0: the masks are in row_masks when the launch starts. Else
    // they come while it runs (a step queued before the host knows them): a masked row's sample
    // tasks wait until this word equals mask_epoch (written by the host after the masks) and then
    // read row_masks, which is host-mapped memory too.
    uint64_t mask_ready;
} MkStepArgs;

// How the sample tasks pick row b's token: inv_temperature 0 takes the largest logit (ties to the
// lowest id); > 0 the largest key(logit) * inv_temperature + Gumbel noise of Philox4x32-10 at
// (seed, index, token id), as rust/sampling defines it bit for bit.
typedef struct MkRowSample {
    float inv_temperature;
    uint32_t seed_lo, seed_hi;
    uint32_t index;  // the request's generation step
    uint32_t masked;  // 1: only the tokens of MkStepArgs.row_masks[b] (the others never win)
} MkRowSample;

// A build variant (`MK_WEIGHT_SWIZZLE=1 make wheel`: build.rs passes it to nvcc and to the Rust
// side, which must agree): weight boxes of 64 columns (128 bytes) copied with the 128-byte swizzle,
// so that the compute warps' 16-byte loads of rows g and g + 1 do not share banks (dense rows of
// 512 bytes do: every weight load takes twice the wavefronts). Every k must then be a multiple of 64.
#ifndef MK_WEIGHT_SWIZZLE
#define MK_WEIGHT_SWIZZLE 0
#endif
#if MK_WEIGHT_SWIZZLE
#define MK_STEP_MAX_ROWS MK_NARROW_ROWS
#if MK_IMAGE_ROWS > MK_NARROW_ROWS
#error "the swizzled-weights variant has no wide image: its 16-row loop spills registers"
#endif
#else
#define MK_STEP_MAX_ROWS MK_WIDE_ROWS
#endif
// One box of a weight stage: a tile of MK_STAGE_ROWS weight rows by MK_STAGE_COLS columns (fewer
// where k is shorter). A stage is MK_STAGE_BOXES boxes side by side along k (24 KB). In the
// swizzled variant the host's tensor map of a matrix whose k is whole boxes describes them as one
// box of a 3-D view ([k / box][rows][box]): one bulk tensor copy a stage (rust/gpu/tensor_map.rs);
// the default build copies each box. (MK_STAGE_BOXES stays a tuning knob of the default build,
// -DMK_STAGE_BOXES=N for a kernel loaded from a path; the swizzled variant's host maps fix it.)
#define MK_STAGE_ROWS 16
#if MK_WEIGHT_SWIZZLE
#define MK_STAGE_COLS 64
#ifndef MK_STAGE_BOXES
#define MK_STAGE_BOXES 12
#endif
#if MK_STAGE_BOXES != 12
#error "the swizzled variant's host maps bring 12 boxes a stage (rust/abi.rs STAGE_BOXES)"
#endif
#else
#define MK_STAGE_COLS 256
#ifndef MK_STAGE_BOXES
#define MK_STAGE_BOXES 3
#endif
#endif
#define MK_TENSOR_MAP_BYTES 128
// Columns of a KV tensor map's box (128 bytes: the widest box the 128-byte swizzle takes).
#define MK_KV_BOX_COLS 64

// One executed task, written when MkStepArgs.trace is set: by thread 0 of its block, and for the
// tasks whose bytes were streamed (GEMV, expert-claim and attention split tasks), by the weight
// producer (fields stream_ns on; 0 otherwise, except the marks of a -DMK_TRACE_MARKS=1 build).
typedef struct MkTraceEntry {
    uint64_t start_ns;     // %globaltimer when the block reached the task (before its wait)
    uint32_t wait_cycles;  // clock64 cycles spent waiting on its counters (a norm: the first only)
    uint32_t run_cycles;   // cycles from the end of the wait to its "done" (the signal warp then publishes it)
    uint64_t stream_ns;    // %globaltimer when the producer issued the task's first weight copy
    // A streamed task: the cycles the producer waited for free ring stages for its copies, and for
    // the layer's top-k before them (expert tiles). A kernel built with -DMK_TRACE_MARKS=1 (a
    // diagnostic build): for a task whose op marks two points (PhaseMarks: the top-k, norm and
    // combine tasks, the attention split), the cycles from the end of its wait to each, the
    // second or'ed with MK_TRACE_MARKED (and 0 where it marks only one); for the first task the
    // producer walks after waiting for a top-k, the second word counts from the top-k seen done.
    uint32_t ring_wait_cycles;
    uint32_t topk_wait_cycles;
} MkTraceEntry;
// Bit 31 of MkTraceEntry.topk_wait_cycles: the two words hold a task's marks (a marks build).
#define MK_TRACE_MARKED 0x80000000u
// A kernel built with -DMK_STREAM_LEDGER=1 (a diagnostic build) also writes, past the trace's
// [gridDim.x][per_sm] entries (in memory the host must provide with every trace), each block's first MK_LEDGER_STAGES ring stages as rows of four
// uint64 words (the size of an MkTraceEntry): [0] %globaltimer when the producer issued the stage's
// copies, [1] when compute thread 0 first found it full, [2] its bytes (low half) and kind (high
// half: 0 weights, 1 KV page, 2 a claim queue's end marker), [3] the index of its task in the
// block's list (low half) and the compute warps that had to wait for it (bit 32 + warp). 0 rows
// past the block's last stage.
#define MK_LEDGER_STAGES 8192
