//! Property test of the whole loop: random arrivals, prompt families sharing prefixes (so the
//! prefix cache attaches), greedy and seeded requests, cancellations, batch sizes and arenas
//! from the smallest that can serve the context upwards (so preemption happens). Every step is
//! checked against the scheduler's invariants; at the end every block is free, every request
//! ended exactly once, and every uncancelled stream equals the request's solo run.

use proptest::prelude::*;

use super::mock::MockModel;
use super::tests::{core, run};
use crate::kv::KvManager;
use crate::sched::{FinishReason, Request, SamplingParams};

const MAX_CONTEXT: usize = 48;

#[derive(Debug, Clone)]
struct Spec {
    arrival: usize,
    family: u32,
    shared: usize,
    own: usize,
    max_tokens: usize,
    seeded: bool,
    ignore_eos: bool,
}

fn spec() -> impl Strategy<Value = Spec> {
    (0..12usize, 0..3u32, 0..20usize, 1..8usize, 1..30usize, any::<bool>(), any::<bool>()).prop_map(
        |(arrival, family, shared, own, max_tokens, seeded, ignore_eos)| Spec {
            arrival,
            family,
            shared,
            own,
            max_tokens,
            seeded,
            ignore_eos,
        },
    )
}

fn request(id: u64, s: &Spec) -> Request {
    let shared = (0..s.shared as u32).map(|i| 1 + (i * 5 + s.family * 11) % 31);
    let own = (0..s.own as u32).map(|i| 1 + (i * 3 + id as u32 * 7) % 31);
    let mut prompt: Vec<u32> = shared.chain(own).collect();
    prompt.truncate(MAX_CONTEXT - s.max_tokens.min(MAX_CONTEXT - 1));
    let params = SamplingParams {
        max_tokens: s.max_tokens,
        temperature: if s.seeded { 0.9 } else { 0.0 },
        seed: s.seeded.then_some(id * 31 + 7),
        ignore_eos: s.ignore_eos,
        ..Default::default()
    };
    Request::new(id, prompt, params)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn any_workload_streams_its_solo_output(
        specs in proptest::collection::vec(spec(), 1..12),
        max_batch in 1usize..8,
        chunk in 1usize..40,
        spare in 0usize..12,
        cancels in proptest::collection::vec((0..30usize, 0..12u64), 0..3),
    ) {
        let model = MockModel::small();
        let probe = KvManager::new(model.kv_config(1)).unwrap();
        let blocks = probe.prefill_blocks_needed(MAX_CONTEXT, chunk) + spare;
        let mut c = core(&model, blocks, max_batch, chunk, MAX_CONTEXT);
        let arrivals: Vec<_> = specs.iter().enumerate().map(|(i, s)| (s.arrival, request(i as u64, s))).collect();
        let out = run(&mut c, &arrivals, &cancels);
        prop_assert_eq!(out.finish.len(), arrivals.len());
        let cancelled: Vec<u64> = cancels.iter().map(|c| c.1).collect();
        for (_, r) in &arrivals {
            let (solo, reason) = model.solo(&r.prompt, &r.params, 1234, MAX_CONTEXT);
            let got = out.tokens.get(&r.id).cloned().unwrap_or_default();
            if out.finish[&r.id] == FinishReason::Cancelled {
                prop_assert!(cancelled.contains(&r.id));
                prop_assert!(solo.starts_with(&got), "request {} cancelled off its solo stream", r.id);
            } else {
                prop_assert_eq!(&got, &solo, "request {}", r.id);
                prop_assert_eq!(out.finish[&r.id], reason);
            }
        }
    }
}
