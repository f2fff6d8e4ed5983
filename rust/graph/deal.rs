//! Dealing a step's global task order onto the SMs, and a timing model to compare dealings.
//!
//! Any dealing that gives each SM a subsequence of the global order is deadlock-free (a block
//! only waits on tasks earlier in that order). Round-robin ignores how long tasks take and when
//! their inputs are ready, so a block can sit waiting on a task whose inputs are far off while
//! ready work queues behind it. `Balanced` is list scheduling under a rough cost model: in
//! global order, each task goes to the SM that (in the model) frees up first.
//!
//! The model: a GEMV or attention task costs a fixed overhead plus the bytes it streams at one
//! SM's share of HBM bandwidth; other tasks a fixed time. It only has to rank choices, not
//! predict microseconds; `benches/graph_build.rs` prints the modelled step time of both dealings
//! and the GPU trace (`mk.megakernel.trace`) says how far off it is.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::task::{Matrix, MkTask, Op};
use super::ModelDims;

/// How the global order is dealt onto the SMs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Dealing {
    /// Task i to SM i mod num_sms.
    #[default]
    RoundRobin,
    /// Each task, in order, to the SM the cost model frees first.
    Balanced,
}

impl Dealing {
    pub fn parse(name: &str) -> Option<Dealing> {
        match name {
            "round_robin" => Some(Dealing::RoundRobin),
            "balanced" => Some(Dealing::Balanced),
            _ => None,
        }
    }
}

/// Fixed cost of a task (barriers, counter handshake, first loads), ns.
const TASK_NS: f64 = 2000.0;
/// Bytes per ns one SM streams when all stream at once (the card's copy rate over its SMs, less
/// what traced GEMV tasks lose; docs/PERF.md, tuning decisions).
const SM_BYTES_PER_NS: f64 = 28.0;
/// The same for attention's paged KV (traced splits stream slower than GEMV tasks).
const SM_KV_BYTES_PER_NS: f64 = 20.0;
/// The small tasks on the critical path (norm, top-k, combine): a few dependent loads each.
const SMALL_TASK_NS: f64 = 4500.0;

/// Modelled duration of task `t` in ns.
pub fn cost_ns(t: &MkTask, g: &ModelDims) -> f64 {
    let streamed = |bytes: usize| TASK_NS + bytes as f64 / SM_BYTES_PER_NS;
    match t.op() {
        Op::Gemv => {
            let rows = 16 * t.arg[2].max(1) as usize;
            let k = match Matrix::from_i32(t.arg[0]).expect("valid matrix") {
                Matrix::O => g.q_width(),
                Matrix::DenseDown => g.dense_ffn,
                Matrix::ExpertDown => g.expert_ffn,
                Matrix::DenseGateUp | Matrix::ExpertGateUp => 2 * g.hidden, // gate and up rows
                _ => g.hidden,
            };
            streamed(rows * k * 2)
        }
        // The row's split size (arg5), not this split's range: a step patched from the previous
        // one (graph::cache) must deal the same way, and only the last split's range moves.
        Op::AttnSplit => TASK_NS + (t.arg[5].max(0) as usize * g.head_dim * 4) as f64 / SM_KV_BYTES_PER_NS,
        // A claimer's share of the queue, every slot in use: tiles of 16 * arg1 rows (gate/up:
        // features, each a gate and an up row) of k columns, arg3 tiles over arg4 claimers.
        Op::ExpertClaim => {
            let (rows, k) = match Matrix::from_i32(t.arg[0]).expect("valid matrix") {
                Matrix::ExpertGateUp => (32 * t.arg[1] as usize, g.hidden),
                _ => (16 * t.arg[1] as usize, g.expert_ffn),
            };
            let tiles = (t.arg[3].max(0) as usize).div_ceil(t.arg[4].max(1) as usize);
            TASK_NS * tiles.max(1) as f64 + (tiles * rows * k * 2) as f64 / SM_BYTES_PER_NS
        }
        Op::ResidualNorm | Op::Embed | Op::TopK | Op::AttnCombine => SMALL_TASK_NS,
        Op::SamplePart | Op::SampleFinal | Op::Nop => TASK_NS,
    }
}

/// Per-SM lists of indices into `order` (each ascending).
pub fn deal(order: &[MkTask], g: &ModelDims, num_sms: usize, dealing: Dealing, num_counters: usize) -> Vec<Vec<usize>> {
    let mut per_sm = vec![Vec::new(); num_sms];
    match dealing {
        Dealing::RoundRobin => {
            for i in 0..order.len() {
                per_sm[i % num_sms].push(i);
            }
        }
        Dealing::Balanced => {
            let mut timing = Timing::new(num_counters, num_sms);
            // (time the SM frees, SM): the earliest first, ties to the lowest index. Times are
            // non-negative, so their bit patterns order like the numbers.
            let mut heap: BinaryHeap<Reverse<(u64, usize)>> = (0..num_sms).map(|s| Reverse((0, s))).collect();
            for (i, t) in order.iter().enumerate() {
                let Reverse((_, sm)) = heap.pop().expect("num_sms > 0");
                timing.run(t, sm, cost_ns(t, g));
                heap.push(Reverse((timing.free[sm].to_bits(), sm)));
                per_sm[sm].push(i);
            }
        }
    }
    per_sm
}

/// The modelled step: when it ends and how busy the SMs were.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Modelled {
    pub makespan_ns: f64,
    /// Task time over (SMs × makespan).
    pub busy: f64,
}

/// Runs the model over a dealt graph. Every SM list is a subsequence of the order and producers
/// precede consumers, so one pass in global order sees each task after all it depends on.
pub fn model(order: &[MkTask], per_sm: &[Vec<usize>], g: &ModelDims, num_counters: usize) -> Modelled {
    let mut sm_of = vec![0; order.len()];
    for (s, list) in per_sm.iter().enumerate() {
        for &i in list {
            sm_of[i] = s;
        }
    }
    let mut timing = Timing::new(num_counters, per_sm.len());
    let mut work = 0.0;
    for (i, t) in order.iter().enumerate() {
        let cost = cost_ns(t, g);
        timing.run(t, sm_of[i], cost);
        work += cost;
    }
    let makespan = timing.free.iter().cloned().fold(0.0, f64::max);
    Modelled { makespan_ns: makespan, busy: work / (per_sm.len() as f64 * makespan.max(1.0)) }
}

/// SM clocks and counter completion times of the model.
struct Timing {
    free: Vec<f64>,
    /// Latest end among the producers of each counter seen so far.
    done: Vec<f64>,
}

impl Timing {
    fn new(num_counters: usize, num_sms: usize) -> Self {
        Timing { free: vec![0.0; num_sms], done: vec![0.0; num_counters] }
    }

    fn run(&mut self, t: &MkTask, sm: usize, cost: f64) {
        let ready = t.waits_on().map(|(c, _)| self.done[c as usize]).fold(0.0, f64::max);
        let end = self.free[sm].max(ready) + cost;
        self.free[sm] = end;
        if t.signal >= 0 {
            let d = &mut self.done[t.signal as usize];
            *d = d.max(end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{gpu_test, tiny};
    use super::super::{build_step, check, BuildOptions};
    use super::*;

    #[test]
    fn balanced_lists_are_ordered_complete_and_sound() {
        for (dims, positions, sms) in [(tiny(), vec![5, 130, 300], 7), (gpu_test(), vec![0, 4095, 4096, 9000], 132)] {
            let opts = BuildOptions { num_sms: sms, dealing: Dealing::Balanced, ..Default::default() };
            let g = build_step(&dims, &positions, &opts).unwrap();
            assert!(g.per_sm.iter().all(|l| l.windows(2).all(|w| w[0] < w[1])));
            let mut all: Vec<usize> = g.per_sm.iter().flatten().copied().collect();
            all.sort_unstable();
            assert_eq!(all, (0..g.order.len()).collect::<Vec<_>>());
            assert_eq!(check::check(&dims, &g, 5), vec![]);
        }
    }

    #[test]
    fn the_model_waits_for_producers_and_balanced_is_no_slower_in_it() {
        let dims = gpu_test();
        for positions in [vec![8191], vec![100, 200, 300, 400, 500, 600, 700, 5000]] {
            let rr = build_step(&dims, &positions, &BuildOptions::default()).unwrap();
            let bal = build_step(&dims, &positions, &BuildOptions { dealing: Dealing::Balanced, ..Default::default() })
                .unwrap();
            let m_rr = model(&rr.order, &rr.per_sm, &dims, rr.num_counters);
            let m_bal = model(&bal.order, &bal.per_sm, &dims, bal.num_counters);
            assert!(m_bal.makespan_ns <= m_rr.makespan_ns * 1.001, "{m_bal:?} vs {m_rr:?}");
            // At least the chain of layers: every layer's QKV, attention, O and norm in series.
            assert!(m_rr.makespan_ns > dims.layers() as f64 * 4.0 * TASK_NS);
            assert!(m_bal.busy > 0.0 && m_bal.busy <= 1.0);
        }
    }

    #[test]
    fn costs_follow_streamed_bytes() {
        let g = gpu_test();
        let qkv = MkTask::new(Op::Gemv, 0, &[Matrix::Qkv as i32, 0, 1, -1]);
        let lm = MkTask::new(Op::Gemv, 5, &[Matrix::LmHead as i32, 0, 4, -1]);
        assert!((cost_ns(&lm, &g) - TASK_NS) > 3.9 * (cost_ns(&qkv, &g) - TASK_NS));
        let short = MkTask::new(Op::AttnSplit, 0, &[0, 0, 0, 0, 64, 128]);
        let long = MkTask::new(Op::AttnSplit, 0, &[0, 0, 0, 0, 64, 256]);
        assert!(cost_ns(&long, &g) > cost_ns(&short, &g));
        assert_eq!(Dealing::parse("balanced"), Some(Dealing::Balanced));
        assert_eq!(Dealing::parse("rr"), None);
    }
}
