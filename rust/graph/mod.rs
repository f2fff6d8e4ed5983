//! One decode step of the whole model as a task graph for the megakernel (docs/MEGAKERNEL.md).
//!
//! The builder lists every task of the step in one global order in which each task's
//! producers come first, fills in counter targets (= the number of producers), and deals the
//! list round-robin onto the SMs. Because every SM's list is a subsequence of that order, a
//! block can only wait on tasks that are earlier in it, so the step cannot deadlock.
//! `check` proves this and the data flow of any graph without a GPU.

pub mod cache;
pub mod check;
pub mod deal;
pub mod effects;
pub mod task;

pub use deal::Dealing;

use crate::abi::GEMV_MAX_GROUPS;
use crate::kv::PAGE_SIZE;

use task::{counter, logits_counter, num_counters, sample_counter, Counter, Matrix, MkTask, Op, ARG_ROUTERS};

/// The model dimensions the graph depends on (from `ModelConfig`).
#[derive(Debug, Clone, PartialEq)]
pub struct ModelDims {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub experts: usize,
    pub top_k: usize,
    pub expert_ffn: usize,
    pub dense_ffn: usize,
    pub vocab: usize,
    /// Per layer: the sliding window (keys incl. the current token), or None for full attention.
    pub window: Vec<Option<usize>>,
    /// Per layer: whether the FFN is a mixture of experts (else dense).
    pub moe: Vec<bool>,
}

impl ModelDims {
    pub fn layers(&self) -> usize {
        self.window.len()
    }
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    pub fn qkv_rows(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }
    /// MoE slots per layer: one per distinct expert the batch can select.
    pub fn slots(&self, batch: usize) -> usize {
        self.experts.min(batch * self.top_k)
    }
}

/// The default `BuildOptions::qkv_groups`: 48 rows, so that one layer's 5,120 QKV rows make about
/// one task per SM (docs/PERF.md, tuning decisions).
pub const QKV_GROUPS: usize = 3;
/// The default `BuildOptions::row_groups`: 128-row expert down and LM-head tiles (docs/PERF.md,
/// tuning decisions).
pub const ROW_GROUPS: usize = 8;
/// The default `BuildOptions::sample_parts`: vocabulary slices per row for greedy sampling.
pub const SAMPLE_PARTS: usize = 16;

/// Knobs of the task decomposition.
#[derive(Debug, Clone)]
pub struct BuildOptions {
    pub num_sms: usize,
    /// Keys per attention split (a multiple of 64, the page size), or 0: sized per row so that
    /// one layer's splits about fill the SMs (at least 2 pages each).
    pub attn_chunk: usize,
    /// Row groups of 16 per GEMV task for expert down projections and the LM head (1 to
    /// `GEMV_MAX_GROUPS`). O and the dense down projection, with their long rows, always take 1.
    pub row_groups: usize,
    /// Row groups of 16 per QKV task, inside each of Q, K and V (1 to `GEMV_MAX_GROUPS`).
    pub qkv_groups: usize,
    /// Features (groups of 16) per gate/up task, each streaming its gate and its up rows (1 to
    /// `GEMV_MAX_GROUPS / 2`), or 0: sized per step (`gate_up_groups`).
    pub gate_up_groups: usize,
    /// Vocabulary slices per row for sampling.
    pub sample_parts: usize,
    /// How the global order is dealt onto the SMs.
    pub dealing: Dealing,
    /// A MoE layer's attention tasks come right after the router and top-k, before the expert
    /// gate/up tiles (which wait on the top-k), instead of after them: the attention chain's inputs
    /// are ready first, so every block starts on it instead of waiting for the routing (faster at
    /// every batch: docs/PERF.md, tuning decisions).
    pub attention_first: bool,
    /// A MoE layer's expert tiles are claimed at run time from a queue per matrix by whichever
    /// block is free (`Op::ExpertClaim`, one task per SM and matrix), instead of dealt with the
    /// rest as one task per (slot, tile), which leaves the SMs that got one more tile (or fewer
    /// unused slots) finishing last. None: from `EXPERT_QUEUE_MIN_BATCH` rows on.
    pub expert_queue: Option<bool>,
    /// Every block's weight producer chooses a MoE layer's experts itself from the router's logits
    /// where the top-k task has not run yet (the expert tasks name the layer's router tasks:
    /// `ARG_ROUTERS`), and the gate/up tiles wait on the router instead of the top-k task, which
    /// still runs for the combine: the expert weights can start streaming a task and a counter
    /// hop sooner. None: for batches up to `LOCAL_ROUTING_MAX_BATCH` rows.
    pub local_routing: Option<bool>,
}

/// The largest batch that routes on every block by default. Local routing starts the expert
/// stream sooner at batch 1; from batch 2 a block's producer reaches the expert tiles only after
/// the top-k has run there, and choosing again costs more than copying the top-k's choice
/// (docs/PERF.md, tuning decisions).
pub const LOCAL_ROUTING_MAX_BATCH: usize = 1;

/// The smallest batch whose expert tiles are claimed from queues by default. The queues are
/// faster from batch 2 on but slower at batch 1, where the blocks that are free first take a
/// second tile while most are still in their attention split, and the layer's last gate/up tile
/// ends later than with one per SM (docs/PERF.md, tuning decisions).
pub const EXPERT_QUEUE_MIN_BATCH: usize = 2;

impl Default for BuildOptions {
    fn default() -> Self {
        BuildOptions {
            num_sms: 132,
            attn_chunk: 0,
            row_groups: ROW_GROUPS,
            qkv_groups: QKV_GROUPS,
            gate_up_groups: 0,
            sample_parts: SAMPLE_PARTS,
            dealing: Dealing::RoundRobin,
            attention_first: true,
            expert_queue: None,
            local_routing: None,
        }
    }
}

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum GraphError {
    #[error("a decode step needs at least one row")]
    EmptyBatch,
    #[error("{0}")]
    Dims(String),
}

/// A built step: the global order (for checkers and the CPU interpreter) and the per-SM lists.
#[derive(Debug, Clone)]
pub struct StepGraph {
    pub order: Vec<MkTask>,
    /// `per_sm[s]` holds indices into `order`, in execution order.
    pub per_sm: Vec<Vec<usize>>,
    pub num_counters: usize,
    pub slots: usize,
    pub max_splits: usize,
    /// Write position of each row (its context is position + 1 tokens).
    pub positions: Vec<usize>,
}

impl StepGraph {
    /// Per-SM task words padded with NOPs to the longest list: [num_sms][max_len].
    pub fn padded(&self) -> (Vec<MkTask>, usize) {
        let len = self.per_sm.iter().map(Vec::len).max().unwrap_or(0);
        let mut out = vec![MkTask::new(Op::Nop, 0, &[]); self.per_sm.len() * len];
        for (s, list) in self.per_sm.iter().enumerate() {
            for (i, &t) in list.iter().enumerate() {
                out[s * len + i] = self.order[t];
            }
        }
        (out, len)
    }
}

/// Builds the step for rows writing at `positions` (one per sequence in the batch).
pub fn build_step(dims: &ModelDims, positions: &[usize], opts: &BuildOptions) -> Result<StepGraph, GraphError> {
    validate(dims, opts)?;
    if positions.is_empty() {
        return Err(GraphError::EmptyBatch);
    }
    let mut b = Builder { dims, opts, batch: positions.len(), order: Vec::new(), max_splits: 1 };
    b.embed();
    for layer in 0..dims.layers() {
        b.layer(layer, positions);
    }
    b.head();
    let num_counters = num_counters(dims.layers());
    set_targets(&mut b.order, num_counters);
    let per_sm = deal::deal(&b.order, dims, opts.num_sms, opts.dealing, num_counters);
    Ok(StepGraph {
        order: b.order,
        per_sm,
        num_counters,
        slots: dims.slots(positions.len()),
        max_splits: b.max_splits,
        positions: positions.to_vec(),
    })
}

fn validate(g: &ModelDims, o: &BuildOptions) -> Result<(), GraphError> {
    validate_dims(g)?;
    let bad = |m: String| Err(GraphError::Dims(m));
    if o.num_sms == 0 || o.attn_chunk % PAGE_SIZE != 0 {
        return bad(format!("num_sms > 0 and attn_chunk a multiple of {PAGE_SIZE} (0: automatic)"));
    }
    let groups = [("row_groups", o.row_groups, GEMV_MAX_GROUPS), ("qkv_groups", o.qkv_groups, GEMV_MAX_GROUPS)];
    for (name, v, max) in groups {
        if !(1..=max).contains(&v) {
            return bad(format!("{name} must be in 1..={max}, got {v}"));
        }
    }
    if o.gate_up_groups > GEMV_MAX_GROUPS / 2 {
        return bad(format!("gate_up_groups must be in 0..={} (0: automatic)", GEMV_MAX_GROUPS / 2));
    }
    Ok(())
}

/// The shapes every task of a step needs (whatever the build options): GEMV widths in whole
/// 32-column chunks, vocabulary slices of 16, whole query groups.
pub fn validate_dims(g: &ModelDims) -> Result<(), GraphError> {
    let bad = |m: String| Err(GraphError::Dims(m));
    if g.layers() == 0 || g.moe.len() != g.layers() {
        return bad("window and moe must list every layer".into());
    }
    for (name, v) in [("hidden", g.hidden), ("q width", g.q_width()), ("kv width", g.kv_width())] {
        if v % 32 != 0 {
            return bad(format!("{name} ({v}) must be a multiple of 32"));
        }
    }
    if g.head_dim % 16 != 0 || g.heads % g.kv_heads != 0 {
        return bad("head_dim must be a multiple of 16 and kv heads must divide heads".into());
    }
    if g.expert_ffn % 32 != 0 || g.dense_ffn % 32 != 0 || g.vocab % 16 != 0 {
        return bad("FFN widths must be multiples of 32 and the vocabulary of 16".into());
    }
    Ok(())
}

struct Builder<'a> {
    dims: &'a ModelDims,
    opts: &'a BuildOptions,
    batch: usize,
    order: Vec<MkTask>,
    max_splits: usize,
}

impl Builder<'_> {
    fn push(&mut self, t: MkTask) {
        self.order.push(t);
    }

    /// GEMV tasks covering the `rows` output rows of matrix `m`, 16 * `groups` rows each.
    fn gemv(&mut self, layer: usize, tile: (Matrix, usize, usize, i32), wait: &[i32], signal: i32) {
        self.gemv_from(layer, 0, tile, wait, signal);
    }

    /// The same for rows numbered from `base` (QKV: K and V rows follow Q's).
    fn gemv_from(
        &mut self,
        layer: usize,
        base: usize,
        (m, rows, groups, slot): (Matrix, usize, usize, i32),
        wait: &[i32],
        signal: i32,
    ) {
        for r0 in (base..base + rows).step_by(16 * groups) {
            let mut t = MkTask::new(Op::Gemv, layer, &[m as i32, r0 as i32, groups as i32, slot]).signals(signal);
            for &c in wait {
                t = t.waits(c);
            }
            self.push(t);
        }
    }

    fn embed(&mut self) {
        for b in 0..self.batch {
            self.push(MkTask::new(Op::Embed, 0, &[b as i32]).signals(counter(0, Counter::HReady)));
        }
    }

    fn layer(&mut self, l: usize, positions: &[usize]) {
        let g = self.dims;
        let rg = self.opts.row_groups;
        let h_ready = counter(l, Counter::HReady);
        // QKV first: attention is the longest chain of the layer. Tasks stay within Q, K or V.
        for (base, rows) in [(0, g.q_width()), (g.q_width(), g.kv_width()), (g.q_width() + g.kv_width(), g.kv_width())]
        {
            let tile = (Matrix::Qkv, rows, self.opts.qkv_groups, -1);
            self.gemv_from(l, base, tile, &[h_ready], counter(l, Counter::Qkv));
        }
        // The FFN's first half reads the same h (parallel block): the router's weights stream
        // while attention waits on QKV. The expert tiles wait on the top-k, or with local routing
        // on the router (they then name its tasks: `routers`, else 0); with attention_first the
        // blocks run attention (whose inputs come sooner) before them.
        let mut routers = 0;
        if g.moe[l] {
            let first_router = self.order.len();
            let router = counter(l, Counter::Router);
            self.gemv(l, (Matrix::Router, g.experts, 1, -1), &[h_ready], router);
            if self.opts.local_routing.unwrap_or(self.batch <= LOCAL_ROUTING_MAX_BATCH) {
                routers = self.order.len() - first_router;
            }
            self.push(MkTask::new(Op::TopK, l, &[]).waits(router).signals(counter(l, Counter::TopK)));
            if self.opts.attention_first {
                self.attention(l, positions);
            }
            let groups = gate_up_groups(self.opts, g.expert_ffn, g.slots(self.batch));
            let tile = (Matrix::ExpertGateUp, g.expert_ffn, groups);
            let routed = if routers > 0 { router } else { counter(l, Counter::TopK) };
            self.experts(l, tile, routers, routed, counter(l, Counter::FfnUp));
        } else {
            self.gemv(
                l,
                (Matrix::DenseGateUp, g.dense_ffn, gate_up_groups(self.opts, g.dense_ffn, 1), -1),
                &[h_ready],
                counter(l, Counter::FfnUp),
            );
        }
        if !(g.moe[l] && self.opts.attention_first) {
            self.attention(l, positions);
        }
        // O and the dense down projection have long rows (4096, 3072): 16-row tasks keep each
        // task short and spread them over more SMs.
        self.gemv(l, (Matrix::O, g.hidden, 1, -1), &[counter(l, Counter::Attn)], counter(l, Counter::O));
        let (up_done, down_done) = (counter(l, Counter::FfnUp), counter(l, Counter::FfnDown));
        if g.moe[l] {
            self.experts(l, (Matrix::ExpertDown, g.hidden, rg), routers, up_done, down_done);
        } else {
            self.gemv(l, (Matrix::DenseDown, g.hidden, 1, -1), &[up_done], down_done);
        }
        for b in 0..self.batch {
            self.push(
                MkTask::new(Op::ResidualNorm, l, &[b as i32])
                    .waits(counter(l, Counter::O))
                    .waits(counter(l, Counter::FfnDown))
                    .signals(counter(l + 1, Counter::HReady)),
            );
        }
    }

    /// A MoE layer's tiles of expert matrix `m` (`rows` rows per expert, 16 * `groups` per tile)
    /// for every slot: claim tasks, one per SM (`expert_queue`), or one task per (slot, tile).
    /// `routers`: the layer's router tasks with local routing, else 0 (`ARG_ROUTERS`).
    fn experts(&mut self, l: usize, (m, rows, groups): (Matrix, usize, usize), routers: usize, wait: i32, signal: i32) {
        let slots = self.dims.slots(self.batch);
        let start = self.order.len();
        if !self.opts.expert_queue.unwrap_or(self.batch >= EXPERT_QUEUE_MIN_BATCH) {
            for s in 0..slots {
                self.gemv(l, (m, rows, groups, s as i32), &[wait], signal);
            }
        } else {
            let tiles = rows.div_ceil(16 * groups);
            let claimers = self.opts.num_sms;
            // arg3 and arg4 (the queue's most tiles, the claimers) are for the cost model only.
            let args = [m as i32, groups as i32, tiles as i32, (slots * tiles) as i32, claimers as i32];
            for _ in 0..claimers {
                self.push(MkTask::new(Op::ExpertClaim, l, &args).waits(wait).signals(signal));
            }
        }
        for t in &mut self.order[start..] {
            t.arg[ARG_ROUTERS] = routers as i32;
        }
    }

    fn attention(&mut self, l: usize, positions: &[usize]) {
        let g = self.dims;
        let mut combines = Vec::new();
        for (b, &pos) in positions.iter().enumerate() {
            let keys = KeyRange::of(g, self.opts, positions.len(), l, pos);
            let splits = keys.splits;
            self.max_splits = self.max_splits.max(splits);
            let window = g.window[l].unwrap_or(0); // 0: full attention (split_keys)
            for kvh in 0..g.kv_heads {
                for s in 0..splits {
                    let args = [b as i32, kvh as i32, s as i32, window as i32, splits as i32, keys.chunk as i32];
                    self.push(
                        MkTask::new(Op::AttnSplit, l, &args)
                            .waits(counter(l, Counter::Qkv))
                            .signals(counter(l, Counter::AttnSplit)),
                    );
                }
                combines.push(
                    MkTask::new(Op::AttnCombine, l, &[b as i32, kvh as i32, splits as i32])
                        .waits(counter(l, Counter::AttnSplit))
                        .signals(counter(l, Counter::Attn)),
                );
            }
        }
        for t in combines {
            self.push(t);
        }
    }

    fn head(&mut self) {
        let g = self.dims;
        let l = g.layers();
        self.gemv(
            l,
            (Matrix::LmHead, g.vocab, self.opts.row_groups, -1),
            &[counter(l, Counter::HReady)],
            logits_counter(l),
        );
        let parts = self.opts.sample_parts.min(g.vocab / 16).max(1);
        for b in 0..self.batch {
            for p in 0..parts {
                let lo = g.vocab * p / parts;
                let hi = g.vocab * (p + 1) / parts;
                let args = [b as i32, p as i32, lo as i32, hi as i32];
                self.push(MkTask::new(Op::SamplePart, l, &args).waits(logits_counter(l)).signals(sample_counter(l)));
            }
        }
        for b in 0..self.batch {
            self.push(MkTask::new(Op::SampleFinal, l, &[b as i32, parts as i32]).waits(sample_counter(l)));
        }
    }
}

/// Features (groups of 16) per gate/up task over `slots` matrices of `ffn` features: the option,
/// or where it is 0 the size whose worst case (every slot in use, tasks dealt evenly) leaves each
/// SM the fewest feature rows, ties to the larger size (fewer tasks, fewer fixed costs). Batch 1
/// on the real model gets 48-feature tasks (128 for 132 SMs), batch 4 and more 64-feature ones.
pub fn gate_up_groups(opts: &BuildOptions, ffn: usize, slots: usize) -> usize {
    if opts.gate_up_groups > 0 {
        return opts.gate_up_groups;
    }
    let per_sm = |g: usize| (slots * ffn.div_ceil(16 * g)).div_ceil(opts.num_sms) * g;
    (1..=GEMV_MAX_GROUPS / 2).rev().min_by_key(|&g| per_sm(g)).expect("a non-empty range")
}

/// The keys one row attends to in one layer, cut into splits (the attention tasks' ranges).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyRange {
    pub start: usize,
    pub end: usize,
    pub chunk: usize,
    pub splits: usize,
}

impl KeyRange {
    /// Row writing at `pos` in layer `l` of a `batch`-row step. Automatic chunks (attn_chunk 0):
    /// about num_sms splits per layer in all, at least two pages each.
    pub fn of(g: &ModelDims, opts: &BuildOptions, batch: usize, l: usize, pos: usize) -> KeyRange {
        let per_row = (opts.num_sms / (batch * g.kv_heads)).max(1);
        KeyRange::cut(pos, g.window[l], |keys| match opts.attn_chunk {
            0 => keys.div_ceil(per_row).div_ceil(PAGE_SIZE).max(2) * PAGE_SIZE,
            c => c,
        })
    }

    /// The keys of a row writing at `pos` under `window` (keys incl. the current one; None: all),
    /// in splits of `chunk(number of keys)` keys.
    fn cut(pos: usize, window: Option<usize>, chunk: impl FnOnce(usize) -> usize) -> KeyRange {
        let end = pos + 1;
        let start = window.map_or(0, |w| end.saturating_sub(w));
        let chunk = chunk(end - start);
        KeyRange { start, end, chunk, splits: (end - start).div_ceil(chunk) }
    }

    /// Keys [lo, hi) of split `s`.
    pub fn split(&self, s: usize) -> (usize, usize) {
        let lo = self.start + s * self.chunk;
        (lo, (lo + self.chunk).min(self.end))
    }
}

/// Keys [lo, hi) of attention split task `t` (`Op::AttnSplit`: row, KV head, split, window or 0,
/// splits, chunk) for its row writing at `pos`. The kernel computes the same from the step's
/// positions, so a split's words stay the same from one step to the next while the row's split
/// count and chunk hold.
pub fn split_keys(t: &MkTask, pos: usize) -> (usize, usize) {
    let window = (t.arg[3] > 0).then_some(t.arg[3] as usize);
    KeyRange::cut(pos, window, |_| t.arg[5] as usize).split(t.arg[2] as usize)
}

/// Every wait targets the number of tasks that signal its counter.
fn set_targets(order: &mut [MkTask], num_counters: usize) {
    let mut producers = vec![0i32; num_counters];
    for t in order.iter() {
        if t.signal >= 0 {
            producers[t.signal as usize] += 1;
        }
    }
    for t in order.iter_mut() {
        if t.wait0 >= 0 {
            t.target0 = producers[t.wait0 as usize];
        }
        if t.wait1 >= 0 {
            t.target1 = producers[t.wait1 as usize];
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The tiny CPU geometry of mk.config (5 layers, window 96).
    pub fn tiny() -> ModelDims {
        ModelDims {
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            experts: 8,
            top_k: 2,
            expert_ffn: 32,
            dense_ffn: 96,
            vocab: 512,
            window: (0..5).map(|i| if i % 4 == 0 { None } else { Some(96) }).collect(),
            moe: (0..5).map(|i| i >= 1).collect(),
        }
    }

    /// The GPU test geometry: real widths, 5 layers, 32 experts.
    pub fn gpu_test() -> ModelDims {
        ModelDims {
            hidden: 2048,
            heads: 32,
            kv_heads: 4,
            head_dim: 128,
            experts: 32,
            top_k: 8,
            expert_ffn: 768,
            dense_ffn: 3072,
            vocab: 32768,
            window: (0..5).map(|i| if i % 4 == 0 { None } else { Some(4096) }).collect(),
            moe: (0..5).map(|i| i >= 1).collect(),
        }
    }

    #[test]
    fn targets_count_producers_and_lists_follow_the_order() {
        let g = build_step(&tiny(), &[5, 130, 300], &BuildOptions { num_sms: 7, ..Default::default() }).unwrap();
        let g3 = 16 * QKV_GROUPS;
        let qkv_tiles = tiny().q_width().div_ceil(g3) + 2 * tiny().kv_width().div_ceil(g3);
        let first_attn = g.order.iter().find(|t| t.op() == Op::AttnSplit).unwrap();
        assert_eq!(first_attn.target0, qkv_tiles as i32);
        for list in &g.per_sm {
            assert!(list.windows(2).all(|w| w[0] < w[1]));
        }
        assert_eq!(g.per_sm.iter().map(Vec::len).sum::<usize>(), g.order.len());
    }

    #[test]
    fn a_norm_waits_for_the_o_projection_first_and_the_ffn_second() {
        // The kernel reads x, y_attn and the routing after the first wait (and the layer's top-k)
        // alone, before it waits for the FFN (cuda/ops/step_norm.cuh run_residual_norm): the
        // checker sees both waits as one, so the order of the two is pinned here.
        let dims = gpu_test();
        for batch in [1, 4] {
            let g = build_step(&dims, &vec![300; batch], &BuildOptions::default()).unwrap();
            let norms: Vec<_> = g.order.iter().filter(|t| t.op() == Op::ResidualNorm).collect();
            assert_eq!(norms.len(), batch * dims.layers());
            for t in norms {
                let l = t.layer as usize;
                assert_eq!((t.wait0, t.wait1), (counter(l, Counter::O), counter(l, Counter::FfnDown)));
            }
        }
    }

    #[test]
    fn attention_first_moves_moe_attention_ahead_of_the_expert_tiles_and_stays_sound() {
        let dims = gpu_test();
        for attention_first in [false, true] {
            let opts = BuildOptions { attention_first, ..Default::default() };
            let g = build_step(&dims, &[4095, 9000], &opts).unwrap();
            assert_eq!(check::check(&dims, &g, 5), vec![]);
            for l in 0..dims.layers() {
                let at = |op: Op, m: Option<Matrix>| {
                    g.order
                        .iter()
                        .position(|t| t.layer == l as i32 && t.op() == op && m.is_none_or(|m| t.arg[0] == m as i32))
                };
                let (attn, up) = (at(Op::AttnSplit, None), at(Op::ExpertClaim, Some(Matrix::ExpertGateUp)));
                if let Some(up) = up {
                    assert_eq!(attn.unwrap() < up, attention_first, "layer {l}");
                } else {
                    assert!(!dims.moe[l]);
                }
            }
        }
    }

    #[test]
    fn attention_splits_follow_live_length_and_window() {
        let dims = tiny();
        let opts = BuildOptions { attn_chunk: 64, ..Default::default() };
        let g = build_step(&dims, &[300], &opts).unwrap();
        let splits = |layer: i32| {
            g.order.iter().filter(|t| t.op() == Op::AttnSplit && t.layer == layer && t.arg[1] == 0).count()
        };
        assert_eq!(splits(0), 301usize.div_ceil(64)); // full attention: all 301 keys
        assert_eq!(splits(1), 2); // window 96: keys 205..301
        let first = g.order.iter().find(|t| t.op() == Op::AttnSplit && t.layer == 1).unwrap();
        assert_eq!(split_keys(first, 300), (205, 269));
        let last = g.order.iter().rfind(|t| t.op() == Op::AttnSplit && t.layer == 1).unwrap();
        assert_eq!(split_keys(last, 300), (269, 301));
    }

    #[test]
    fn split_keys_tile_each_rows_keys_as_key_range_does() {
        // What the kernel computes from a task's words and the row's position: the splits of a
        // (layer, row, KV head) are KeyRange's, in order, and cover its keys exactly once.
        let dims = gpu_test();
        for (positions, chunk) in
            [(vec![5000, 70], 64), (vec![8191], 0), (vec![4095, 4096, 4097, 0], 0), (vec![100, 200], 128)]
        {
            let opts = BuildOptions { attn_chunk: chunk, ..Default::default() };
            let g = build_step(&dims, &positions, &opts).unwrap();
            for l in 0..dims.layers() {
                for (b, &pos) in positions.iter().enumerate() {
                    let keys = KeyRange::of(&dims, &opts, positions.len(), l, pos);
                    for kvh in 0..dims.kv_heads as i32 {
                        let got: Vec<_> = g
                            .order
                            .iter()
                            .filter(|t| {
                                t.op() == Op::AttnSplit
                                    && t.layer == l as i32
                                    && t.arg[0] == b as i32
                                    && t.arg[1] == kvh
                            })
                            .map(|t| split_keys(t, pos))
                            .collect();
                        let want: Vec<_> = (0..keys.splits).map(|s| keys.split(s)).collect();
                        assert_eq!(got, want, "layer {l} row {b} at {pos}");
                        assert_eq!((got[0].0, got.last().unwrap().1), (keys.start, pos + 1));
                        assert!(got.windows(2).all(|w| w[0].1 == w[1].0 && w[0].0 < w[0].1));
                    }
                }
            }
        }
    }

    #[test]
    fn automatic_chunks_spread_one_layer_over_the_sms() {
        let dims = gpu_test();
        let g = build_step(&dims, &[8191], &BuildOptions::default()).unwrap();
        let splits = g.order.iter().filter(|t| t.op() == Op::AttnSplit && t.layer == 0).count();
        assert!((100..=132).contains(&splits), "{splits} splits for 132 SMs");
        let keys = |t: &MkTask, positions: &[usize]| split_keys(t, positions[t.arg[0] as usize]);
        let chunk = |t: &MkTask, positions: &[usize]| {
            let (lo, hi) = keys(t, positions);
            hi - lo
        };
        assert!(g.order.iter().filter(|t| t.op() == Op::AttnSplit).all(|t| (1..=256).contains(&chunk(t, &[8191]))));
        // Short contexts still get at least two pages per split (but the last).
        let positions = [100, 200];
        let g = build_step(&dims, &positions, &BuildOptions::default()).unwrap();
        for t in g.order.iter().filter(|t| t.op() == Op::AttnSplit) {
            assert!(chunk(t, &positions) == 128 || keys(t, &positions).1 == positions[t.arg[0] as usize] + 1, "{t:?}");
        }
    }

    #[test]
    fn gate_up_tasks_cover_gate_up_groups_of_16_features() {
        let dims = gpu_test();
        let opts = BuildOptions { expert_queue: Some(false), ..Default::default() };
        let g = build_step(&dims, &[100, 200], &opts).unwrap();
        let gate_up: Vec<&MkTask> =
            g.order.iter().filter(|t| t.op() == Op::Gemv && t.arg[0] == Matrix::ExpertGateUp as i32).collect();
        let groups = gate_up_groups(&BuildOptions::default(), dims.expert_ffn, dims.slots(2));
        assert_eq!(groups, 3); // 16 slots x 16 tasks of 48 features: 2 per SM, 96 rows each
        let per_layer = dims.slots(2) * dims.expert_ffn / (16 * groups);
        assert_eq!(gate_up.len(), per_layer * (dims.layers() - 1));
        assert!(gate_up.iter().all(|t| t.arg[2] == groups as i32 && t.arg[1] % 48 == 0));
        assert!(check::check(&dims, &g, 10).is_empty());
    }

    #[test]
    fn expert_queues_get_one_claim_task_per_sm_and_matrix_and_stay_sound() {
        let dims = gpu_test();
        for positions in [vec![5000], vec![100, 7000, 64, 4159, 9, 300, 2000]] {
            let opts = BuildOptions {
                num_sms: 20,
                expert_queue: Some(true),
                local_routing: Some(false),
                ..Default::default()
            };
            let g = build_step(&dims, &positions, &opts).unwrap();
            assert_eq!(check::check(&dims, &g, 5), vec![]);
            let slots = dims.slots(positions.len());
            let gate_up = gate_up_groups(&opts, dims.expert_ffn, slots);
            for l in (0..dims.layers()).filter(|&l| dims.moe[l]) {
                let claims = |m: Matrix| -> Vec<usize> {
                    (0..g.order.len())
                        .filter(|&i| g.order[i].layer == l as i32 && g.order[i].op() == Op::ExpertClaim)
                        .filter(|&i| g.order[i].arg[0] == m as i32)
                        .collect()
                };
                let (up, down) = (claims(Matrix::ExpertGateUp), claims(Matrix::ExpertDown));
                assert_eq!((up.len(), down.len()), (20, 20));
                let up_tiles = dims.expert_ffn / (16 * gate_up);
                let down_tiles = dims.hidden / (16 * ROW_GROUPS);
                for (list, groups, tiles, wait, signal) in [
                    (&up, gate_up, up_tiles, Counter::TopK, Counter::FfnUp),
                    (&down, ROW_GROUPS, down_tiles, Counter::FfnUp, Counter::FfnDown),
                ] {
                    for &i in list {
                        let t = &g.order[i];
                        assert_eq!(&t.arg[1..5], &[groups as i32, tiles as i32, (slots * tiles) as i32, 20]);
                        assert_eq!((t.wait0, t.signal), (counter(l, wait), counter(l, signal)));
                    }
                    // Round-robin deals one claimer of each queue to every SM.
                    let mut sms: Vec<usize> =
                        list.iter().map(|&i| g.per_sm.iter().position(|s| s.contains(&i)).unwrap()).collect();
                    sms.sort();
                    assert_eq!(sms, (0..20).collect::<Vec<_>>());
                }
                // Down claimers wait for every gate/up claimer; norms for every down claimer.
                assert_eq!(g.order[down[0]].target0, 20);
                let norm = g.order.iter().find(|t| t.layer == l as i32 && t.op() == Op::ResidualNorm).unwrap();
                assert_eq!((norm.wait1, norm.target1), (counter(l, Counter::FfnDown), 20));
                assert!(!g.order.iter().any(|t| t.layer == l as i32 && t.op() == Op::Gemv && t.arg[0] >= 5));
            }
            let static_tiles =
                build_step(&dims, &positions, &BuildOptions { expert_queue: Some(false), ..opts }).unwrap();
            assert_eq!(check::check(&dims, &static_tiles, 5), vec![]);
        }
    }

    #[test]
    fn local_routing_names_the_router_tasks_and_stays_sound() {
        let dims = gpu_test();
        // The default's 132 SMs at batch 1 (one task per slot and tile), queues on fewer SMs.
        let cases = [(vec![5000], false, 132), (vec![5000], true, 20), (vec![100, 7000, 64, 4159], true, 20)];
        for (positions, queue, num_sms) in cases {
            let opts =
                BuildOptions { num_sms, expert_queue: Some(queue), local_routing: Some(true), ..Default::default() };
            let g = build_step(&dims, &positions, &opts).unwrap();
            assert_eq!(check::check(&dims, &g, 5), vec![]);
            for l in (0..dims.layers()).filter(|&l| dims.moe[l]) {
                let of_layer = |t: &&MkTask| t.layer == l as i32;
                let is_router = |t: &&MkTask| t.op() == Op::Gemv && t.arg[0] == Matrix::Router as i32;
                let routers = g.order.iter().filter(of_layer).filter(is_router).count() as i32;
                assert_eq!(routers, dims.experts.div_ceil(16) as i32);
                let experts: Vec<&MkTask> = g
                    .order
                    .iter()
                    .filter(of_layer)
                    .filter(|t| {
                        t.op() == Op::ExpertClaim || (t.op() == Op::Gemv && t.arg[0] >= Matrix::ExpertGateUp as i32)
                    })
                    .filter(|t| t.arg[0] != Matrix::LmHead as i32)
                    .collect();
                assert!(!experts.is_empty());
                for t in experts {
                    assert_eq!(t.arg[ARG_ROUTERS], routers, "{t:?}");
                    if t.arg[0] == Matrix::ExpertGateUp as i32 {
                        assert_eq!((t.wait0, t.target0), (counter(l, Counter::Router), routers));
                    }
                }
            }
            // Without it the words stay 0 and the gate/up tiles wait for the top-k.
            let global = build_step(&dims, &positions, &BuildOptions { local_routing: Some(false), ..opts }).unwrap();
            assert!(global.order.iter().all(|t| t.op() == Op::AttnSplit || t.arg[ARG_ROUTERS] == 0));
            assert_eq!(check::check(&dims, &global, 5), vec![]);
        }
    }

    #[test]
    fn local_routing_is_the_default_for_one_row() {
        let dims = gpu_test();
        let local = |positions: &[usize]| {
            let g = build_step(&dims, positions, &BuildOptions::default()).unwrap();
            g.order.iter().any(|t| t.op() != Op::AttnSplit && t.arg[ARG_ROUTERS] > 0)
        };
        assert_eq!(LOCAL_ROUTING_MAX_BATCH, 1);
        assert!(local(&[100]));
        assert!(!local(&[100, 200]));
    }

    #[test]
    fn expert_queues_are_the_default_from_two_rows_on() {
        let dims = gpu_test();
        let claims = |positions: &[usize]| {
            let g = build_step(&dims, positions, &BuildOptions::default()).unwrap();
            g.order.iter().filter(|t| t.op() == Op::ExpertClaim).count()
        };
        assert_eq!(EXPERT_QUEUE_MIN_BATCH, 2);
        assert_eq!(claims(&[100]), 0);
        assert_eq!(claims(&[100, 200]), 2 * 132 * dims.moe.iter().filter(|&&m| m).count());
    }

    #[test]
    fn automatic_gate_up_tasks_fit_the_batch() {
        let opts = BuildOptions::default();
        let real_ffn = 768;
        // Batch 1: 8 slots; 48-feature tasks make 128 tasks, one per SM.
        assert_eq!(gate_up_groups(&opts, real_ffn, 8), 3);
        // Batch 4 and 8: 32 and 64 slots; every size gives the same rows per SM, the largest wins.
        assert_eq!(gate_up_groups(&opts, real_ffn, 32), 4);
        assert_eq!(gate_up_groups(&opts, real_ffn, 64), 4);
        assert_eq!(gate_up_groups(&BuildOptions { gate_up_groups: 1, ..opts }, real_ffn, 8), 1);
    }

    #[test]
    fn bad_options_are_refused() {
        let opts = BuildOptions { attn_chunk: 100, ..Default::default() };
        assert!(build_step(&tiny(), &[1], &BuildOptions { row_groups: 9, ..Default::default() }).is_err());
        assert!(build_step(&tiny(), &[1], &BuildOptions { row_groups: 0, ..Default::default() }).is_err());
        assert!(build_step(&tiny(), &[1], &BuildOptions { row_groups: 3, ..Default::default() }).is_ok());
        assert!(build_step(&tiny(), &[1], &BuildOptions { gate_up_groups: 5, ..Default::default() }).is_err());
        assert!(build_step(&tiny(), &[1], &BuildOptions { qkv_groups: 9, ..Default::default() }).is_err());
        assert!(matches!(build_step(&tiny(), &[1], &opts), Err(GraphError::Dims(_))));
        assert_eq!(build_step(&tiny(), &[], &BuildOptions::default()).unwrap_err(), GraphError::EmptyBatch);
    }
}
