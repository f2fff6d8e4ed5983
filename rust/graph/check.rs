//! Static checker of a step graph, no GPU needed. It proves, for the graph as built:
//! - every wait's target equals the number of tasks that signal that counter;
//! - the happens-before relation (per-SM program order plus counter edges) has no cycle, so
//!   the step cannot deadlock with all blocks resident;
//! - every region a task reads was written by a task it transitively waits on, or exists
//!   before the step (input tokens, earlier positions' KV);
//! - no two tasks that are not ordered write the same element (except the claim tasks of one
//!   expert queue, which split its tiles at run time), and no task reads an element that an
//!   unordered task writes.

use std::collections::HashMap;

use super::effects::{effects, external_inputs, Buf, Region};
use super::task::{counter, Counter, Op};
use super::{ModelDims, StepGraph};

#[derive(Debug, Clone, PartialEq)]
pub enum Violation {
    TargetMismatch { task: usize, counter: i32, target: i32, producers: i32 },
    Deadlock { stuck: usize },
    UncoveredRead { task: usize, region: Region },
    UnorderedWrites { first: usize, second: usize, region: Region },
    Race { reader: usize, writer: usize, region: Region },
}

/// (buffer, row) -> every write to it as (lo, hi, task).
type WriteIndex = HashMap<(Buf, usize), Vec<(usize, usize, usize)>>;

/// Returns every violation found (empty when the graph is sound), at most `limit` of them.
pub fn check(dims: &ModelDims, graph: &StepGraph, limit: usize) -> Vec<Violation> {
    let mut out = Vec::new();
    let n = graph.order.len();
    let producers = producers_of(graph);
    for (i, t) in graph.order.iter().enumerate() {
        for (c, target) in t.waits_on() {
            let have = producers.get(&c).map_or(0, |p| p.len() as i32);
            if have != target {
                out.push(Violation::TargetMismatch { task: i, counter: c, target, producers: have });
            }
        }
    }
    let Some(hb) = HappensBefore::new(graph, &producers) else {
        out.push(Violation::Deadlock { stuck: n });
        return out;
    };
    let fx: Vec<_> = graph.order.iter().map(|t| effects(t, dims, graph)).collect();
    let mut writes: WriteIndex = HashMap::new();
    for (i, e) in fx.iter().enumerate() {
        for w in &e.writes {
            writes.entry((w.buf, w.row)).or_default().push((w.lo, w.hi, i));
        }
    }
    let mut external: HashMap<(Buf, usize), Vec<(usize, usize)>> = HashMap::new();
    for reg in external_inputs(dims, graph) {
        external.entry((reg.buf, reg.row)).or_default().push((reg.lo, reg.hi));
    }

    for (i, e) in fx.iter().enumerate() {
        for rd in &e.reads {
            let key = (rd.buf, rd.row);
            let mut cover: Vec<(usize, usize)> = external.get(&key).cloned().unwrap_or_default();
            for &(lo, hi, w) in writes.get(&key).map_or(&[][..], |v| &v[..]) {
                if w == i || hi <= rd.lo || lo >= rd.hi {
                    continue;
                }
                if hb.before(w, i) {
                    cover.push((lo, hi));
                } else if !hb.before(i, w) {
                    out.push(Violation::Race { reader: i, writer: w, region: *rd });
                }
            }
            if !covers(&mut cover, rd.lo, rd.hi) {
                out.push(Violation::UncoveredRead { task: i, region: *rd });
            }
        }
    }
    for ((buf, row), list) in &mut writes {
        list.sort();
        for (a, &(lo_a, hi_a, ta)) in list.iter().enumerate() {
            for &(lo_b, hi_b, tb) in &list[a + 1..] {
                if lo_b >= hi_a {
                    break;
                }
                if ta != tb && !hb.before(ta, tb) && !hb.before(tb, ta) && !same_queue(graph, ta, tb) {
                    let region = Region { buf: *buf, row: *row, lo: lo_a.max(lo_b), hi: hi_a.min(hi_b) };
                    out.push(Violation::UnorderedWrites { first: ta, second: tb, region });
                }
            }
        }
    }
    out.truncate(limit);
    out
}

/// Claim tasks of one queue (layer and matrix): each tile goes to exactly one of them (the
/// kernel's atomic claim), so their writes never meet although the checker cannot order them.
fn same_queue(graph: &StepGraph, a: usize, b: usize) -> bool {
    let (ta, tb) = (&graph.order[a], &graph.order[b]);
    ta.op() == Op::ExpertClaim && tb.op() == Op::ExpertClaim && ta.layer == tb.layer && ta.arg[0] == tb.arg[0]
}

fn producers_of(graph: &StepGraph) -> HashMap<i32, Vec<usize>> {
    let mut p: HashMap<i32, Vec<usize>> = HashMap::new();
    for (i, t) in graph.order.iter().enumerate() {
        if t.signal >= 0 {
            p.entry(t.signal).or_default().push(i);
        }
    }
    p
}

/// Whether [lo, hi) lies inside the union of `parts`.
fn covers(parts: &mut [(usize, usize)], lo: usize, hi: usize) -> bool {
    parts.sort();
    let mut reached = lo;
    for &(a, b) in parts.iter() {
        if a > reached {
            break;
        }
        reached = reached.max(b);
        if reached >= hi {
            return true;
        }
    }
    reached >= hi
}

/// Transitive happens-before over tasks, with one virtual node per counter so that a wait on
/// a counter with many producers costs one bitset union.
struct HappensBefore {
    words: usize,
    ancestors: Vec<Vec<u64>>,
}

impl HappensBefore {
    fn new(graph: &StepGraph, producers: &HashMap<i32, Vec<usize>>) -> Option<HappensBefore> {
        let n = graph.order.len();
        let counters: Vec<i32> = producers.keys().copied().collect();
        let counter_node: HashMap<i32, usize> = counters.iter().enumerate().map(|(k, &c)| (c, n + k)).collect();
        let nodes = n + counters.len();
        let mut preds: Vec<Vec<usize>> = vec![Vec::new(); nodes];
        for list in &graph.per_sm {
            for w in list.windows(2) {
                preds[w[1]].push(w[0]);
            }
        }
        for (i, t) in graph.order.iter().enumerate() {
            // A MoE layer's residual norm also waits for the layer's top-k inside the kernel
            // (run_residual_norm: the combine's routing), beyond its two counters.
            let topk = (t.op() == Op::ResidualNorm).then(|| counter(t.layer as usize, Counter::TopK));
            for c in t.waits_on().map(|(c, _)| c).chain(topk) {
                if let Some(&node) = counter_node.get(&c) {
                    preds[i].push(node);
                }
            }
        }
        for (c, ps) in producers {
            preds[counter_node[c]].extend(ps);
        }
        let order = topological(&preds)?;
        let words = n.div_ceil(64);
        let mut ancestors = vec![vec![0u64; words]; nodes];
        for v in order {
            let mut acc = vec![0u64; words];
            for &p in &preds[v] {
                for (a, b) in acc.iter_mut().zip(&ancestors[p]) {
                    *a |= b;
                }
                if p < n {
                    acc[p / 64] |= 1 << (p % 64);
                }
            }
            ancestors[v] = acc;
        }
        ancestors.truncate(n);
        Some(HappensBefore { words, ancestors })
    }

    /// a happens before b.
    fn before(&self, a: usize, b: usize) -> bool {
        debug_assert!(a / 64 < self.words);
        self.ancestors[b][a / 64] >> (a % 64) & 1 == 1
    }
}

/// Kahn's algorithm; None when there is a cycle.
fn topological(preds: &[Vec<usize>]) -> Option<Vec<usize>> {
    let n = preds.len();
    let mut succs = vec![Vec::new(); n];
    let mut indegree = vec![0usize; n];
    for (v, ps) in preds.iter().enumerate() {
        indegree[v] = ps.len();
        for &p in ps {
            succs[p].push(v);
        }
    }
    let mut ready: Vec<usize> = (0..n).filter(|&v| indegree[v] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(v) = ready.pop() {
        order.push(v);
        for &s in &succs[v] {
            indegree[s] -= 1;
            if indegree[s] == 0 {
                ready.push(s);
            }
        }
    }
    (order.len() == n).then_some(order)
}

#[cfg(test)]
mod tests {
    use super::super::task::{Counter, Op, NO_COUNTER};
    use super::super::tests::{gpu_test, tiny};
    use super::super::{build_step, BuildOptions};
    use super::*;

    fn sound(dims: &ModelDims, positions: &[usize], opts: &BuildOptions) {
        let g = build_step(dims, positions, opts).unwrap();
        let v = check(dims, &g, 5);
        assert!(v.is_empty(), "positions {positions:?}: {v:?}");
    }

    #[test]
    fn tiny_graphs_are_sound_across_batches_pages_and_windows() {
        let opts = BuildOptions { num_sms: 5, attn_chunk: 64, ..Default::default() };
        for positions in [vec![0], vec![63], vec![64, 95, 96], vec![5, 130, 300, 1, 64, 97, 200, 511]] {
            sound(&tiny(), &positions, &opts);
        }
    }

    #[test]
    fn gpu_test_graphs_are_sound() {
        let opts = BuildOptions::default();
        sound(&gpu_test(), &[8191], &opts);
        sound(&gpu_test(), &[0, 4095, 4096, 9000], &opts);
        sound(&gpu_test(), &[100, 200, 300, 400, 500, 600, 700, 5000], &opts);
    }

    fn broken(mutate: impl Fn(&mut StepGraph)) -> Vec<Violation> {
        let dims = tiny();
        let mut g = build_step(&dims, &[130, 300], &BuildOptions { num_sms: 4, ..Default::default() }).unwrap();
        mutate(&mut g);
        check(&dims, &g, 10_000)
    }

    #[test]
    fn a_missing_edge_is_caught() {
        // The norm of layer 2 forgets to wait for the experts' down projections.
        let v = broken(|g| {
            let t = g.order.iter_mut().find(|t| t.op() == Op::ResidualNorm && t.layer == 2).unwrap();
            assert_eq!(t.wait1, super::super::task::counter(2, Counter::FfnDown));
            t.wait1 = NO_COUNTER;
        });
        // ExpertOut is reused across layers, so the norm would read layer 1's values: a race
        // with layer 2's writers (and uncovered wherever nothing earlier wrote).
        let stale = |x: &Violation| match x {
            Violation::Race { region, .. } | Violation::UncoveredRead { region, .. } => region.buf == Buf::ExpertOut,
            _ => false,
        };
        assert!(v.iter().any(stale), "{:?}", &v[..v.len().min(5)]);
    }

    #[test]
    fn a_wrong_target_is_caught() {
        let v = broken(|g| g.order.iter_mut().find(|t| t.op() == Op::AttnCombine).unwrap().target0 -= 1);
        assert!(v.iter().any(|x| matches!(x, Violation::TargetMismatch { .. })));
    }

    #[test]
    fn a_split_that_does_not_wait_for_the_current_token_is_caught() {
        let v = broken(|g| {
            let last = g.order.iter().rposition(|t| t.op() == Op::AttnSplit && t.layer == 0 && t.arg[0] == 0).unwrap();
            g.order[last].wait0 = super::super::task::NO_COUNTER; // its keys end at the token this step's QKV writes
        });
        assert!(v.iter().any(|x| matches!(x, Violation::UncoveredRead { region, .. } if region.buf == Buf::KCache(0))));
    }

    #[test]
    fn a_wait_on_later_work_is_a_deadlock() {
        // The embedding of row 0 waits for the final sampling: a cycle through program order.
        let v = broken(|g| {
            let sample = super::super::task::sample_counter(5);
            let producers = g.order.iter().filter(|t| t.signal == sample).count() as i32;
            let t = &mut g.order[0];
            t.wait0 = sample;
            t.target0 = producers;
        });
        assert!(v.iter().any(|x| matches!(x, Violation::Deadlock { .. })));
    }

    #[test]
    fn two_unordered_writers_are_caught() {
        // Two QKV tiles write the same query rows and nothing orders them.
        let v = broken(|g| {
            let idx: Vec<usize> = g
                .order
                .iter()
                .enumerate()
                .filter(|(_, t)| t.op() == Op::Gemv && t.arg[0] == 0 && t.layer == 1)
                .map(|(i, _)| i)
                .take(2)
                .collect();
            let r0 = g.order[idx[0]].arg[1];
            g.order[idx[1]].arg[1] = r0;
        });
        assert!(v.iter().any(|x| matches!(x, Violation::UnorderedWrites { .. })));
    }
}
