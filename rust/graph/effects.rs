//! What each task reads and writes, as regions of the step's buffers: the contract the CUDA
//! kernel and the CPU interpreter both implement, and what the static checker reasons about.
//! Weights are constant during a step and not modelled.

use super::task::{Matrix, MkTask, Op, ARG_ROUTERS};
use super::{split_keys, ModelDims, StepGraph};

/// The step's activation and cache buffers. Each is a set of rows of elements; `row` and the
/// element range [lo, hi) of a `Region` index them as the comments say.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buf {
    /// Input token of row b (host-written).
    Token,
    /// RoPE (cos, sin) table of row b's position [b][head_dim / 2] (the embedding task's).
    Rope,
    /// fp32 residual [b][hidden].
    X,
    /// bf16 normed input of the current layer [b][hidden].
    H,
    /// fp32 post-RoPE queries [b][q_width].
    Q,
    /// Paged K / V of a layer for row b, flattened as position * kv_width + column.
    KCache(u16),
    VCache(u16),
    /// Attention partials of (b, kv head): row = b * kv_heads + kvh, element = split.
    AttnPart,
    /// bf16 attention output [b][q_width].
    AttnOut,
    /// fp32 O-projection output [b][hidden].
    YAttn,
    /// fp32 router logits [b][experts].
    Router,
    /// The current layer's routing: top-k per row and the active-expert slots (one row).
    Routing,
    /// bf16 gate·up activations: dense [b][dense_ffn]; experts row = slot * batch + b.
    DenseAct,
    ExpertAct,
    /// fp32 FFN down outputs: dense [b][hidden]; experts row = slot * batch + b.
    FfnOut,
    ExpertOut,
    /// fp32 logits [b][vocab].
    Logits,
    /// Sampling partials of row b: element = part.
    SamplePart,
    /// The sampled token of row b.
    Sampled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Region {
    pub buf: Buf,
    pub row: usize,
    pub lo: usize,
    pub hi: usize,
}

#[derive(Debug, Default, Clone)]
pub struct Effects {
    pub reads: Vec<Region>,
    pub writes: Vec<Region>,
}

fn r(buf: Buf, row: usize, lo: usize, hi: usize) -> Region {
    Region { buf, row, lo, hi }
}

/// Regions that exist before the step starts: input tokens and the KV of earlier positions.
pub fn external_inputs(dims: &ModelDims, graph: &StepGraph) -> Vec<Region> {
    let mut out = Vec::new();
    let kvw = dims.kv_width();
    for (b, &pos) in graph.positions.iter().enumerate() {
        out.push(r(Buf::Token, b, 0, 1));
        for l in 0..dims.layers() {
            if pos > 0 {
                out.push(r(Buf::KCache(l as u16), b, 0, pos * kvw));
                out.push(r(Buf::VCache(l as u16), b, 0, pos * kvw));
            }
        }
    }
    out
}

/// The reads and writes of one task of `graph`.
pub fn effects(t: &MkTask, dims: &ModelDims, graph: &StepGraph) -> Effects {
    let batch = graph.positions.len();
    let rows = 0..batch;
    let (d, kvw, hd) = (dims.hidden, dims.kv_width(), dims.head_dim);
    let l = t.layer as usize;
    let a = |i: usize| t.arg[i] as usize;
    let mut e = Effects::default();
    match t.op() {
        Op::Nop => {}
        Op::Embed => {
            e.reads.push(r(Buf::Token, a(0), 0, 1));
            e.writes.extend([r(Buf::X, a(0), 0, d), r(Buf::H, a(0), 0, d), r(Buf::Rope, a(0), 0, hd / 2)]);
        }
        Op::Gemv => gemv_effects(t, dims, &graph.positions, &mut e),
        // Whichever tiles the queue hands it: as far as order goes, any of the matrix's outputs
        // for every slot (the checker knows the claimers of one queue never share a tile).
        Op::ExpertClaim => {
            let (m, slots) = (Matrix::from_i32(t.arg[0]).expect("valid matrix"), graph.slots);
            let slot_rows = |buf: Buf, hi: usize| (0..slots * batch).map(move |row| r(buf, row, 0, hi));
            e.reads.extend(routing_reads(t, dims, batch));
            if m == Matrix::ExpertGateUp {
                e.reads.extend(rows.map(|b| r(Buf::H, b, 0, d)));
                e.writes.extend(slot_rows(Buf::ExpertAct, dims.expert_ffn));
            } else {
                e.reads.extend(slot_rows(Buf::ExpertAct, dims.expert_ffn));
                e.writes.extend(slot_rows(Buf::ExpertOut, d));
            }
        }
        Op::AttnSplit => {
            let (b, kvh, split) = (a(0), a(1), a(2));
            let (lo, hi) = split_keys(t, graph.positions[b]);
            let group_cols = dims.group() * hd;
            e.reads.push(r(Buf::Q, b, kvh * group_cols, (kvh + 1) * group_cols));
            for cache in [Buf::KCache(l as u16), Buf::VCache(l as u16)] {
                e.reads.push(r(cache, b, lo * kvw + kvh * hd, (hi - 1) * kvw + (kvh + 1) * hd));
            }
            e.writes.push(r(Buf::AttnPart, b * dims.kv_heads + kvh, split, split + 1));
        }
        Op::AttnCombine => {
            let (b, kvh, splits) = (a(0), a(1), a(2));
            let group_cols = dims.group() * hd;
            e.reads.push(r(Buf::AttnPart, b * dims.kv_heads + kvh, 0, splits));
            e.writes.push(r(Buf::AttnOut, b, kvh * group_cols, (kvh + 1) * group_cols));
        }
        Op::TopK => {
            e.reads.extend(rows.map(|b| r(Buf::Router, b, 0, dims.experts)));
            e.writes.push(r(Buf::Routing, 0, 0, 1));
        }
        Op::ResidualNorm => {
            let b = a(0);
            e.reads.extend([r(Buf::X, b, 0, d), r(Buf::YAttn, b, 0, d)]);
            if dims.moe[l] {
                e.reads.push(r(Buf::Routing, 0, 0, 1));
                e.reads.extend((0..graph.slots).map(|s| r(Buf::ExpertOut, s * batch + b, 0, d)));
            } else {
                e.reads.push(r(Buf::FfnOut, b, 0, d));
            }
            e.writes.extend([r(Buf::X, b, 0, d), r(Buf::H, b, 0, d)]);
        }
        Op::SamplePart => {
            let (b, part, lo, hi) = (a(0), a(1), a(2), a(3));
            e.reads.extend([r(Buf::Logits, b, lo, hi), r(Buf::Token, b, 0, 1)]);
            e.writes.push(r(Buf::SamplePart, b, part, part + 1));
        }
        Op::SampleFinal => {
            e.reads.push(r(Buf::SamplePart, a(0), 0, a(1)));
            e.writes.push(r(Buf::Sampled, a(0), 0, 1));
        }
    }
    e
}

/// What an expert task learns its slots from: the top-k task's routing, or with local routing
/// (`ARG_ROUTERS`) the router's logits, from which its block's producer chooses the experts (it
/// copies the top-k's routing instead only after that task's counter says it has run).
fn routing_reads(t: &MkTask, dims: &ModelDims, batch: usize) -> Vec<Region> {
    if t.arg[ARG_ROUTERS] > 0 {
        (0..batch).map(|b| r(Buf::Router, b, 0, dims.experts)).collect()
    } else {
        vec![r(Buf::Routing, 0, 0, 1)]
    }
}

fn gemv_effects(t: &MkTask, dims: &ModelDims, positions: &[usize], e: &mut Effects) {
    let batch = positions.len();
    let (d, qw, kvw) = (dims.hidden, dims.q_width(), dims.kv_width());
    let l = t.layer as usize;
    let m = Matrix::from_i32(t.arg[0]).expect("valid matrix");
    let r0 = t.arg[1] as usize;
    let n_rows = 16 * t.arg[2] as usize;
    let slot = t.arg[3] as usize;
    let all = |buf: Buf, lo: usize, hi: usize| (0..batch).map(move |b| r(buf, b, lo, hi));
    let slot_rows = |buf: Buf, lo: usize, hi: usize| (0..batch).map(move |b| r(buf, slot * batch + b, lo, hi));
    match m {
        Matrix::Qkv => {
            e.reads.extend(all(Buf::H, 0, d));
            e.reads.extend(all(Buf::Rope, 0, dims.head_dim / 2));
            // A task stays within Q, K or V; its last rows may run past the end of that one.
            if r0 < qw {
                e.writes.extend(all(Buf::Q, r0, (r0 + n_rows).min(qw)));
            } else {
                let (cache, base) =
                    if r0 < qw + kvw { (Buf::KCache(l as u16), qw) } else { (Buf::VCache(l as u16), qw + kvw) };
                let r1 = (r0 + n_rows).min(base + kvw);
                // Each row writes the current token's K or V at its own position.
                e.writes.extend(
                    positions.iter().enumerate().map(|(b, &p)| r(cache, b, p * kvw + r0 - base, p * kvw + r1 - base)),
                );
            }
        }
        Matrix::O => {
            e.reads.extend(all(Buf::AttnOut, 0, qw));
            e.writes.extend(all(Buf::YAttn, r0, (r0 + n_rows).min(d)));
        }
        Matrix::Router => {
            e.reads.extend(all(Buf::H, 0, d));
            e.writes.extend(all(Buf::Router, r0, (r0 + n_rows).min(dims.experts)));
        }
        Matrix::DenseGateUp => {
            e.reads.extend(all(Buf::H, 0, d));
            e.writes.extend(all(Buf::DenseAct, r0, (r0 + n_rows).min(dims.dense_ffn)));
        }
        Matrix::DenseDown => {
            e.reads.extend(all(Buf::DenseAct, 0, dims.dense_ffn));
            e.writes.extend(all(Buf::FfnOut, r0, (r0 + n_rows).min(d)));
        }
        Matrix::ExpertGateUp => {
            e.reads.extend(routing_reads(t, dims, batch));
            e.reads.extend(all(Buf::H, 0, d));
            e.writes.extend(slot_rows(Buf::ExpertAct, r0, (r0 + n_rows).min(dims.expert_ffn)));
        }
        Matrix::ExpertDown => {
            e.reads.extend(routing_reads(t, dims, batch));
            e.reads.extend(slot_rows(Buf::ExpertAct, 0, dims.expert_ffn));
            e.writes.extend(slot_rows(Buf::ExpertOut, r0, (r0 + n_rows).min(d)));
        }
        Matrix::LmHead => {
            e.reads.extend(all(Buf::H, 0, d));
            e.writes.extend(all(Buf::Logits, r0, (r0 + n_rows).min(dims.vocab)));
        }
    }
}
