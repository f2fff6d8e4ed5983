//! Property test of the whole loop: random arrivals, prompt families sharing prefixes (so the
//! prefix cache attaches), greedy and seeded requests, some under a grammar, cancellations, batch sizes and arenas
//! from the smallest that can serve the context upwards (so preemption happens), speculative
//! decoding on and off. Every step is
//! checked against the scheduler's invariants; at the end every block is free, every request
//! ended exactly once, and every uncancelled stream equals the request's solo run.

use proptest::prelude::*;

use super::mock::MockModel;
use super::tests::{budgeted_core, mock_grammars, run};
use crate::grammar::{ConstraintSpec, Grammars};
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
    /// Under a grammar (`GRAMMARS`: letters only, or digits and a-c), or free.
    grammar: Option<u8>,
}

fn spec() -> impl Strategy<Value = Spec> {
    let grammar = proptest::option::weighted(0.3, 0..2u8);
    (0..12usize, 0..3u32, 0..20usize, 1..8usize, 1..30usize, any::<bool>(), any::<bool>(), grammar).prop_map(
        |(arrival, family, shared, own, max_tokens, seeded, ignore_eos, grammar)| Spec {
            arrival,
            family,
            shared,
            own,
            max_tokens,
            seeded,
            ignore_eos,
            grammar,
        },
    )
}

const GRAMMARS: [&str; 2] = ["[a-u]*", "[0-9a-c]*"];

fn request(id: u64, s: &Spec, grammars: &Grammars) -> Request {
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
    let constraint = s.grammar.map(|g| grammars.compile(&ConstraintSpec::Regex(GRAMMARS[g as usize].into())).unwrap());
    Request { constraint, ..Request::new(id, prompt, params) }
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
        // 0: off; 1: on over a backend that cannot queue (so: synchronous steps); 2: on, steps queued as on a device.
        launch_ahead in 0u8..3,
        // With queueing: the backend refuses every step after this many (a batch that stops
        // being queueable, mid-run).
        queue_limit in proptest::option::of(0usize..30),
        // Layer-sliced prefill within this budget while a stream decodes (cancellations and
        // preemptions then drop sliced calls half done).
        sliced_budget in proptest::option::of(1usize..40),
        // ... except a lone chunk of up to this many tokens, which runs whole.
        whole_chunk in 0usize..16,
        // With queueing: rows under a grammar are queued too, their masks delivered late.
        late_masks in any::<bool>(),
        // Speculative decoding's most draft tokens (0: off) and the rows a step may take, over a
        // model whose text repeats itself (drafts accepted) or not (drafts mostly rejected).
        max_draft in prop::sample::select(vec![0usize, 0, 1, 3, 8]),
        step_rows in 1usize..20,
        repetitive in any::<bool>(),
    ) {
        let model = if repetitive { MockModel::repetitive() } else { MockModel::small() };
        let grammars = mock_grammars(&model);
        let probe = KvManager::new(model.kv_config(1)).unwrap();
        let blocks = probe.prefill_blocks_needed(MAX_CONTEXT, chunk) + spare;
        let mut c = budgeted_core(&model, blocks, max_batch, chunk, sliced_budget, MAX_CONTEXT);
        c.layer_slices = sliced_budget.map(|_| model.sliding.len());
        c.whole_chunk_tokens = whole_chunk;
        c.sched.config_mut().max_draft = max_draft;
        c.sched.config_mut().step_rows = step_rows;
        c.launch_ahead = launch_ahead > 0;
        c.backend.queueing = launch_ahead == 2;
        c.backend.queue_limit = queue_limit;
        c.backend.late_masks = late_masks;
        let arrivals: Vec<_> =
            specs.iter().enumerate().map(|(i, s)| (s.arrival, request(i as u64, s, &grammars))).collect();
        let out = run(&mut c, &arrivals, &cancels);
        prop_assert_eq!(out.finish.len(), arrivals.len());
        let cancelled: Vec<u64> = cancels.iter().map(|c| c.1).collect();
        for (_, r) in &arrivals {
            let (solo, reason) = model.solo_request(r.clone(), 1234, MAX_CONTEXT);
            let got = out.tokens.get(&r.id).cloned().unwrap_or_default();
            if out.finish[&r.id] == FinishReason::Cancelled {
                prop_assert!(cancelled.contains(&r.id));
                prop_assert!(solo.starts_with(&got), "request {} cancelled off its solo stream", r.id);
            } else {
                prop_assert_eq!(&got, &solo, "request {} ({:?})", r.id, out.errors.get(&r.id));
                prop_assert_eq!(out.finish[&r.id], reason);
            }
        }
    }

    /// The prefill budget (the engine's `prefill_chunk`) shared by every prompt of an iteration:
    /// no prefill call ever carries more prompt tokens than the budget, and while long prompts are
    /// admitted (in chunks, several iterations each) every stream that has started gets a token
    /// in every iteration until it ends, with or without a smaller budget while streams decode
    /// (`decode_prefill_budget`), which calls made while a stream decodes never exceed, in tokens
    /// through the whole model (a layer-sliced call: tokens × its layers ≤ the budget × all
    /// layers). Blocks are ample, so nothing is preempted.
    #[test]
    fn prefill_stays_within_its_budget_and_never_stalls_a_decoding_stream(
        long in proptest::collection::vec((0..10usize, 20..44usize), 1..5),
        short in proptest::collection::vec((0..10usize, 1..6usize, 2..20usize), 1..6),
        budget in 1usize..24,
        decode_budget in proptest::option::of(1usize..24),
        // 0: off; 1: on over a backend that cannot queue (so: synchronous steps); 2: on, steps queued as on a device.
        launch_ahead in 0u8..3,
        sliced in proptest::bool::ANY,
    ) {
        let model = MockModel::small();
        let layers = model.sliding.len();
        let mut arrivals = Vec::new();
        let greedy = |n: usize| SamplingParams::greedy(n).with_ignore_eos();
        for (i, &(at, len)) in long.iter().enumerate() {
            let prompt: Vec<u32> = (0..len as u32).map(|t| 1 + (t * 7 + i as u32) % 31).collect();
            arrivals.push((at, Request::new(i as u64, prompt, greedy(MAX_CONTEXT - len))));
        }
        for (i, &(at, len, n)) in short.iter().enumerate() {
            let id = (long.len() + i) as u64;
            let prompt: Vec<u32> = (0..len as u32).map(|t| 1 + (t * 3 + id as u32) % 31).collect();
            arrivals.push((at, Request::new(id, prompt, greedy(n))));
        }
        let probe = KvManager::new(model.kv_config(1)).unwrap();
        let blocks = arrivals.len() * probe.prefill_blocks_needed(MAX_CONTEXT, budget);
        let mut c = budgeted_core(&model, blocks, arrivals.len(), budget, decode_budget, MAX_CONTEXT);
        c.launch_ahead = launch_ahead > 0;
        c.backend.queueing = launch_ahead == 2;
        c.layer_slices = sliced.then_some(layers);
        let out = run(&mut c, &arrivals, &[]);
        let b = &c.backend;
        prop_assert!(b.prefill_tokens.iter().all(|&t| t <= budget), "{:?}", b.prefill_tokens);
        if let Some(small) = decode_budget {
            // A call made while streams decode: one whose iteration also delivers a token to a
            // stream that had one before.
            let work = b.prefill_tokens.iter().zip(&b.prefill_layers).map(|(t, l)| t * l);
            let decoding = b.prefill_decoding.iter().zip(work);
            prop_assert!(decoding.filter(|(d, _)| **d).all(|(_, w)| w <= small.min(budget) * layers),
                "{:?} {:?} {:?}", b.prefill_tokens, b.prefill_layers, b.prefill_decoding);
        }
        if !sliced {
            prop_assert!(b.prefill_layers.iter().all(|&l| l == layers));
        }
        for (_, r) in &arrivals {
            let first = out.per_iteration.iter().position(|m| m.contains_key(&r.id)).unwrap();
            let last = out.per_iteration.iter().rposition(|m| m.contains_key(&r.id)).unwrap();
            // The first iteration brings the prefill's token and the step's (or only the first).
            prop_assert!(out.per_iteration[first + 1..=last].iter().all(|m| m.get(&r.id) == Some(&1)),
                "request {} skipped an iteration", r.id);
            prop_assert_eq!(out.tokens[&r.id].len(), r.params.max_tokens);
        }
    }
}
