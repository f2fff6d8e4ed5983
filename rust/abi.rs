//! Rust mirror of `cuda/abi.h`. Field order, types and padding must match the header exactly;
//! the test below checks them against the layout nvcc compiled (cuda/abi_probe.cu).

/// Declares a `#[repr(C)]` mirror of a cuda/abi.h struct and its field layout (name, offset,
/// type), so the ABI test and the Python packer both read the one Rust definition.
macro_rules! abi_struct {
    ($(#[$meta:meta])* $name:ident { $($field:ident: $ty:ident),* $(,)? }) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy, Default, PartialEq)]
        pub struct $name {
            $(pub $field: $ty,)*
        }

        impl $name {
            pub fn layout() -> Vec<(&'static str, usize, &'static str)> {
                vec![$((stringify!($field), std::mem::offset_of!($name, $field), stringify!($ty)),)*]
            }
        }
    };
}

abi_struct! {
    /// See `MkStepArgs` in cuda/abi.h: everything one decode-step launch needs.
    MkStepArgs {
        tasks: u64,
        counters: u64,
        layer_weights: u64,
        expert_weights: u64,
        layer_window: u64,
        layer_rope: u64,
        embed: u64,
        final_norm: u64,
        k_pool: u64,
        v_pool: u64,
        tokens: u64,
        positions: u64,
        block_tables: u64,
        x: u64,
        h: u64,
        q: u64,
        attn_o: u64,
        attn_ml: u64,
        attn_out: u64,
        y_attn: u64,
        router: u64,
        topk_slot: u64,
        topk_score: u64,
        slot_expert: u64,
        slot_count: u64,
        dense_act: u64,
        expert_act: u64,
        ffn_out: u64,
        expert_out: u64,
        logits: u64,
        sample_score: u64,
        sample_id: u64,
        sampled: u64,
        per_sm: i32,
        num_counters: i32,
        parity: i32,
        batch: i32,
        layers: i32,
        hidden: i32,
        heads: i32,
        kv_heads: i32,
        head_dim: i32,
        experts: i32,
        top_k: i32,
        expert_ffn: i32,
        dense_ffn: i32,
        vocab: i32,
        max_pages: i32,
        max_splits: i32,
        slots: i32,
        sample_parts: i32,
        flags: i32,
        mask_epoch: i32,
        eps: f32,
        logit_scale: f32,
        rope_theta: f32,
        reserved2: f32,
        routing_log: u64,
        residual_log: u64,
        trace: u64,
        layer_maps: u64,
        expert_maps: u64,
        embed_map: u64,
        rope: u64,
        kv_maps: u64,
        row_samples: u64,
        row_masks: u64,
        mask_ready: u64,
    }
}

abi_struct! {
    /// See `MkRowSample` in cuda/abi.h: how the kernel draws one row's token (inv_temperature 0:
    /// greedy; else Gumbel-max with `crate::sampling::philox`'s noise at (seed, index)), and
    /// whether only the tokens of the row's mask may win (`masked` 1).
    MkRowSample {
        inv_temperature: f32,
        seed_lo: u32,
        seed_hi: u32,
        index: u32,
        masked: u32,
    }
}

impl MkRowSample {
    /// Gumbel-max at temperature 1 / inv_temperature, seeded, at generation step `index`.
    pub fn draw(inv_temperature: f32, seed: u64, index: u32) -> Self {
        Self { inv_temperature, seed_lo: seed as u32, seed_hi: (seed >> 32) as u32, index, masked: 0 }
    }

    /// The same draw among the tokens of the row's mask only.
    pub fn with_mask(self) -> Self {
        Self { masked: 1, ..self }
    }

    pub fn is_greedy(&self) -> bool {
        self.inv_temperature <= 0.0
    }

    /// Greedy over every token: the kernel's default, which needs no entry uploaded.
    pub fn is_plain_greedy(&self) -> bool {
        self.is_greedy() && self.masked == 0
    }
}

// SAFETY: plain-old-data with the C layout of MkRowSample (checked against nvcc); all zeros is
// a greedy row.
unsafe impl cudarc::driver::DeviceRepr for MkRowSample {}
unsafe impl cudarc::driver::ValidAsZeroBits for MkRowSample {}

impl MkStepArgs {
    /// The longest reduction of any GEMV task of the step (hidden, the query width, either FFN
    /// width), which `STEP_MAX_K` bounds.
    pub fn longest_reduction(&self) -> usize {
        let widths = [self.hidden, self.heads * self.head_dim, self.dense_ffn, self.expert_ffn];
        widths.into_iter().max().unwrap_or(0).max(0) as usize
    }
}

// SAFETY: plain-old-data with the C layout of MkStepArgs, passed by value to mk_decode_step.
unsafe impl cudarc::driver::DeviceRepr for MkStepArgs {}

/// `MK_STEP_SMEM_BYTES` and `MK_STEP_THREADS`: how mk_decode_step is launched.
pub const STEP_SMEM_BYTES: u32 = 227 * 1024;
pub const STEP_THREADS: u32 = 320;
/// `MK_STEP_MAX_K`: the longest GEMV reduction. `MK_NARROW_ROWS` and `MK_WIDE_ROWS`: the rows of
/// the two megakernel images (build.rs), and `MK_STEP_MAX_ROWS` the most rows of one launch (the
/// wide image's; the narrow one's in the swizzled variant, which has no wide image).
pub const STEP_MAX_K: usize = 4096;
pub const NARROW_ROWS: usize = 8;
pub const WIDE_ROWS: usize = 16;
pub const STEP_MAX_ROWS: usize = if WEIGHT_SWIZZLE { NARROW_ROWS } else { WIDE_ROWS };
/// `MK_GEMV_MAX_GROUPS`: the most 16-row weight groups of one GEMV task.
pub const GEMV_MAX_GROUPS: usize = 8;
/// `MK_STEP_HEAD_DIM`, `MK_STEP_MAX_GROUP`, `MK_STEP_MAX_TOP_K`, `MK_STEP_MAX_EXPERTS`: the
/// geometry the kernel's tasks are built for.
pub const STEP_HEAD_DIM: usize = 128;
pub const STEP_MAX_GROUP: usize = 8;
pub const STEP_MAX_TOP_K: usize = 8;
pub const STEP_MAX_EXPERTS: usize = 512;
/// `MK_WEIGHT_SWIZZLE`: the build variant whose weight boxes are 64 columns, 128-byte swizzled
/// (`MK_WEIGHT_SWIZZLE=1` when building; build.rs).
pub const WEIGHT_SWIZZLE: bool = cfg!(mk_weight_swizzle);
/// `MK_STAGE_ROWS` x `MK_STAGE_COLS`: the box of the weight tensor maps (a ring stage holds
/// several side by side), and `MK_TENSOR_MAP_BYTES`, the size of one encoded map.
pub const STAGE_ROWS: u32 = 16;
pub const STAGE_COLS: u32 = if WEIGHT_SWIZZLE { 64 } else { 256 };
/// `MK_STAGE_BOXES`: the boxes of one ring stage, side by side along k (one copy of a 3-D box
/// where k is whole boxes: tensor_map.rs).
pub const STAGE_BOXES: u32 = if WEIGHT_SWIZZLE { 12 } else { 3 };
pub const TENSOR_MAP_BYTES: usize = 128;
/// `MK_KV_BOX_COLS`: the columns of a KV tensor map's box (`MkStepArgs.kv_maps`); its rows are a page.
pub const KV_BOX_COLS: u32 = 64;
/// `MK_LW_COUNT`: entries per layer of the weight tables (`MkStepArgs.layer_weights`, `layer_maps`),
/// and their names in `MkLayerWeight` order (`MK_LW_<name>` is the index).
pub const LAYER_WEIGHT_COUNT: usize = 9;
pub const LAYER_WEIGHTS: [&str; LAYER_WEIGHT_COUNT] = ["NORM", "Q", "K", "V", "O", "ROUTER", "GATE", "UP", "DOWN"];

/// `sizeof(MkTraceEntry)`: u64 start_ns, u32 wait_cycles, u32 run_cycles, u64 stream_ns,
/// u32 ring_wait_cycles, u32 topk_wait_cycles.
pub const TRACE_ENTRY_BYTES: usize = 32;
/// `MK_TRACE_MARKED`: bit 31 of an entry's top-k wait word, set where the two words hold a task's
/// marks (a `-DMK_TRACE_MARKS=1` kernel).
pub const TRACE_MARKED: u32 = 0x8000_0000;
/// `MK_LEDGER_STAGES`: the ring stages per block a `-DMK_STREAM_LEDGER=1` kernel records, in rows
/// of `TRACE_ENTRY_BYTES` past the trace's entries.
pub const LEDGER_STAGES: usize = 8192;

/// Must equal `MK_ABI_VERSION` in cuda/abi.h.
pub const ABI_VERSION: u64 = 16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_reduction_is_the_widest_gemv_input() {
        let real = MkStepArgs {
            hidden: 2048,
            heads: 32,
            head_dim: 128,
            dense_ffn: 3072,
            expert_ffn: 768,
            ..Default::default()
        };
        assert_eq!(real.longest_reduction(), 4096); // O's input: 32 heads x 128
        let wide_ffn = MkStepArgs { dense_ffn: 8192, ..real };
        assert_eq!(wide_ffn.longest_reduction(), 8192);
        assert!(wide_ffn.longest_reduction() > STEP_MAX_K);
    }
}
