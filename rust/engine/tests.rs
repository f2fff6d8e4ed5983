//! The loop end to end over the mock model: every request's stream equals its solo run whatever
//! the batch size, arrival pattern, arena size or neighbours; blocks all come back.

use std::collections::HashMap;
use std::time::Duration;

use super::mock::{MockBackend, MockModel};
use super::*;
use crate::sched::{FinishReason, Request, SamplingParams, SchedConfig, Scheduler};

pub(crate) fn core(
    model: &MockModel,
    blocks: usize,
    max_batch: usize,
    chunk: usize,
    max_context: usize,
) -> Core<MockBackend> {
    budgeted_core(model, blocks, max_batch, chunk, None, max_context)
}

/// `core` with a prefill budget of its own while some sequence decodes.
pub(crate) fn budgeted_core(
    model: &MockModel,
    blocks: usize,
    max_batch: usize,
    chunk: usize,
    decode_prefill_budget: Option<usize>,
    max_context: usize,
) -> Core<MockBackend> {
    let cfg = SchedConfig {
        max_batch,
        prefill_chunk: chunk,
        decode_prefill_budget,
        max_context,
        vocab_size: model.vocab as usize,
        eos_token_id: model.eos,
        ..SchedConfig::new(max_batch, max_context, 0)
    };
    let sched = Scheduler::new(cfg, model.kv_config(blocks)).unwrap();
    let mut core = Core::new(sched, MockBackend::new(model.clone(), blocks));
    core.check_invariants = true;
    core
}

#[derive(Debug, Default)]
pub(crate) struct Outcome {
    pub tokens: HashMap<u64, Vec<u32>>,
    pub finish: HashMap<u64, FinishReason>,
    pub errors: HashMap<u64, String>,
    /// Tokens each request received per iteration (for stall checks).
    pub per_iteration: Vec<HashMap<u64, usize>>,
    pub cached: HashMap<u64, usize>,
    /// Seconds each request waited before its first admission.
    pub queued: HashMap<u64, f64>,
}

impl Outcome {
    fn absorb(&mut self, events: &mut Vec<Event>) {
        let mut this = HashMap::new();
        for e in events.drain(..) {
            assert!(!self.finish.contains_key(&e.id), "event after the end of request {}", e.id);
            if let Some(t) = e.token {
                self.tokens.entry(e.id).or_default().push(t);
                *this.entry(e.id).or_default() += 1;
            }
            if let Some(c) = e.cached_tokens {
                assert!(self.cached.insert(e.id, c).is_none(), "cached_tokens reported twice");
            }
            if let Some(q) = e.queue_seconds {
                assert!(q >= 0.0 && e.cached_tokens.is_some(), "the queue time comes with the first token");
                assert!(self.queued.insert(e.id, q).is_none(), "queue time reported twice");
            }
            if let Some(f) = e.finish {
                self.finish.insert(e.id, f);
            }
            if let Some(msg) = e.error {
                self.errors.insert(e.id, msg);
            }
        }
        self.per_iteration.push(this);
    }
}

/// Runs `core` until idle; request `r` is submitted before iteration `at`, and `cancels` are
/// applied before their iteration.
pub(crate) fn run(core: &mut Core<MockBackend>, arrivals: &[(usize, Request)], cancels: &[(usize, u64)]) -> Outcome {
    let mut out = Outcome::default();
    let mut events = Vec::new();
    let last = arrivals.iter().map(|a| a.0).chain(cancels.iter().map(|c| c.0)).max().unwrap_or(0);
    let mut it = 0;
    while it <= last || core.busy() {
        for (_, req) in arrivals.iter().filter(|a| a.0 == it) {
            core.sched.submit(req.clone(), 1234).unwrap();
        }
        for &(_, id) in cancels.iter().filter(|c| c.0 == it) {
            core.sched.cancel(id, &mut events);
        }
        core.step(&mut events);
        out.absorb(&mut events);
        it += 1;
        assert!(it < 100_000, "the loop does not terminate");
    }
    let kv = core.sched.kv();
    assert_eq!(kv.free_blocks(), kv.total_blocks(), "blocks leaked");
    assert_eq!(kv.stats().sequences, 0);
    out
}

fn req(id: u64, prompt_len: usize, params: SamplingParams) -> Request {
    let prompt = (0..prompt_len as u32).map(|i| 1 + (i * 7 + id as u32 * 3) % 31).collect();
    Request::new(id, prompt, params)
}

fn assert_solo(model: &MockModel, arrivals: &[(usize, Request)], out: &Outcome, max_context: usize) {
    for (_, r) in arrivals {
        let (tokens, finish) = model.solo(&r.prompt, &r.params, 1234, max_context);
        assert_eq!(out.tokens.get(&r.id), Some(&tokens), "request {} tokens", r.id);
        assert_eq!(out.finish.get(&r.id), Some(&finish), "request {} finish", r.id);
    }
}

fn mixed_workload(n: u64) -> Vec<(usize, Request)> {
    (0..n)
        .map(|i| {
            let params = if i % 3 == 0 {
                SamplingParams {
                    max_tokens: 5 + i as usize % 13,
                    seed: Some(i * 11),
                    temperature: 0.8,
                    ..Default::default()
                }
            } else {
                SamplingParams { ignore_eos: i % 2 == 0, ..SamplingParams::greedy(3 + (i as usize * 5) % 17) }
            };
            (i as usize * 2 % 7, req(i, 1 + (i as usize * 13) % 40, params))
        })
        .collect()
}

#[test]
fn staggered_arrivals_match_solo_runs_at_every_batch_size() {
    let model = MockModel::small();
    let arrivals = mixed_workload(12);
    for max_batch in [1, 3, 8] {
        let mut c = core(&model, 400, max_batch, 16, 80);
        let out = run(&mut c, &arrivals, &[]);
        assert_solo(&model, &arrivals, &out, 80);
        assert_eq!(out.queued.len(), arrivals.len(), "every request reports its queue time once");
        assert!(c.backend.max_rows <= max_batch);
        assert_eq!(c.sched.stats().preemptions, 0);
    }
    // Batch 8 really batched.
    let mut c = core(&model, 400, 8, 16, 80);
    run(&mut c, &arrivals, &[]);
    assert!(c.backend.max_rows >= 4, "max rows {}", c.backend.max_rows);
}

#[test]
fn a_tiny_arena_preempts_yet_outputs_are_unchanged() {
    let model = MockModel::small();
    let arrivals: Vec<_> =
        (0..8).map(|i| (0, req(i, 6 + i as usize, SamplingParams::greedy(30).with_ignore_eos()))).collect();
    // A 64-token sequence holds 16 + 2·4 = 24 blocks decoding and 16 + 2·7 = 30 while
    // prefilling in 16-token chunks; 40 blocks hold one, never eight. With launch-ahead, steps
    // whose blocks run out fall back to synchronous ones (which preempt).
    for (launch_ahead, queueing) in [(false, false), (true, false), (true, true)] {
        let mut c = core(&model, 40, 8, 16, 64);
        c.launch_ahead = launch_ahead;
        c.backend.queueing = queueing;
        let out = run(&mut c, &arrivals, &[]);
        assert_solo(&model, &arrivals, &out, 64);
        let stats = c.sched.stats();
        assert!(stats.preemptions > 0, "no preemption happened");
        // Recomputation shows up as extra prefill, never as extra tokens.
        assert_eq!(stats.generated_tokens, 8 * 30);
        assert!(stats.prefill_tokens > stats.prompt_tokens);
        assert_eq!(c.metrics.queued_steps > 0, queueing, "steps queue only where the backend queues");
    }
}

#[test]
fn preemption_waits_for_a_departure_before_readmitting() {
    let model = MockModel::small();
    // A 40-token sequence holds 10 pages on the full layer and at most 4 on each sliding one:
    // 18 blocks. Two need 36; the arena has 30 (the least that prefills 40 tokens alone).
    let arrivals = vec![
        (0, req(1, 4, SamplingParams::greedy(36).with_ignore_eos())),
        (0, req(2, 4, SamplingParams::greedy(36).with_ignore_eos())),
    ];
    let mut c = core(&model, 30, 2, 64, 40);
    let out = run(&mut c, &arrivals, &[]);
    assert_solo(&model, &arrivals, &out, 40);
    assert_eq!(c.sched.stats().preemptions, 1);
    // Request 2 was paused once and got no token again until request 1 had ended.
    let it = &out.per_iteration;
    let last1 = it.iter().rposition(|m| m.contains_key(&1)).unwrap();
    let first2 = it.iter().position(|m| m.contains_key(&2)).unwrap();
    let pause = first2 + it[first2..].iter().position(|m| !m.contains_key(&2)).unwrap();
    assert!(pause < last1);
    assert!(it[pause..=last1].iter().all(|m| !m.contains_key(&2)));
    assert!(it[last1 + 1..].iter().any(|m| m.contains_key(&2)));
}

#[test]
fn long_prefill_is_chunked_and_decoding_streams_keep_flowing() {
    let model = MockModel::small();
    let arrivals = vec![
        (0, req(1, 5, SamplingParams::greedy(40).with_ignore_eos())),
        (3, req(2, 200, SamplingParams::greedy(4).with_ignore_eos())),
    ];
    let mut c = core(&model, 600, 4, 16, 256);
    let out = run(&mut c, &arrivals, &[]);
    assert_solo(&model, &arrivals, &out, 256);
    // Request 1 gets one token per iteration after its first (which comes with the prefill's
    // token) to its last, while request 2's 200-token prompt goes through in 13 chunks of at
    // most 16 tokens.
    let first = out.per_iteration.iter().position(|m| m.contains_key(&1)).unwrap();
    let last = out.per_iteration.iter().rposition(|m| m.contains_key(&1)).unwrap();
    assert_eq!(out.per_iteration[first].get(&1), Some(&2));
    assert!(out.per_iteration[first + 1..=last].iter().all(|m| m.get(&1) == Some(&1)));
    assert!(c.backend.prefill_calls >= 13);
}

#[test]
fn prompts_arriving_together_share_one_prefill_call() {
    let model = MockModel::small();
    // Four 10-token prompts and a 100-token one at once, a chunk of 64: the first iteration prefills
    // the four and the first 24 tokens of the long one in one call.
    let mut arrivals: Vec<(usize, Request)> =
        (1..=4).map(|id| (0, req(id, 10, SamplingParams::greedy(6).with_ignore_eos()))).collect();
    arrivals.push((0, req(5, 100, SamplingParams::greedy(6).with_ignore_eos())));
    let mut c = core(&model, 600, 8, 64, 256);
    let out = run(&mut c, &arrivals, &[]);
    assert_solo(&model, &arrivals, &out, 256);
    // 40 + 24 tokens, then 64 and 12 of the long prompt's remaining 76.
    assert_eq!(c.backend.prefill_batches, vec![5, 1, 1]);
    assert_eq!(c.backend.prefill_calls, 7);
}

#[test]
fn prefix_cache_hit_skips_the_cached_prefill() {
    let model = MockModel::small();
    let a = req(1, 30, SamplingParams::greedy(5));
    let b = Request { id: 2, ..a.clone() };
    let mut c = core(&model, 200, 4, 64, 64);
    let first = run(&mut c, &[(0, a.clone())], &[]);
    let before = c.sched.stats().prefill_tokens;
    let second = run(&mut c, &[(0, b.clone())], &[]);
    let prefilled = c.sched.stats().prefill_tokens - before;
    assert_eq!(first.tokens[&1], second.tokens[&2]);
    // 30 tokens in pages of 4: 7 full pages before the last token's page.
    assert_eq!(second.cached[&2], 28);
    assert_eq!(first.cached[&1], 0);
    assert_eq!(prefilled, 30 - 28);
    // A longer prompt sharing the prefix reuses it too.
    let mut longer = req(3, 30, SamplingParams::greedy(5));
    longer.prompt = [a.prompt.clone(), vec![9; 9]].concat();
    let third = run(&mut c, &[(0, longer.clone())], &[]);
    assert_eq!(third.cached[&3], 28);
    assert_solo(&model, &[(0, longer)], &third, 64);
}

#[test]
fn cancellation_frees_blocks_in_the_same_iteration() {
    let model = MockModel::small();
    let mut c = core(&model, 200, 4, 64, 64);
    let mut events = Vec::new();
    c.sched.submit(req(1, 10, SamplingParams::greedy(50).with_ignore_eos()), 0).unwrap();
    c.sched.submit(req(2, 10, SamplingParams::greedy(50).with_ignore_eos()), 0).unwrap();
    for _ in 0..5 {
        c.step(&mut events);
    }
    let held = c.sched.kv().total_blocks() - c.sched.kv().free_blocks();
    assert!(c.sched.cancel(1, &mut events));
    assert!(!c.sched.cancel(99, &mut events));
    let now = c.sched.kv().total_blocks() - c.sched.kv().free_blocks();
    assert!(now < held && c.sched.kv().stats().sequences == 1);
    assert_eq!(events.last().unwrap(), &Event::ended(1, FinishReason::Cancelled, None));
    // A waiting request cancels too.
    c.sched.submit(req(3, 10, SamplingParams::greedy(5)), 0).unwrap();
    assert!(c.sched.cancel(3, &mut events));
    assert_eq!(c.sched.waiting(), 0);
    let mut out = Outcome::default();
    out.absorb(&mut events);
    c.sched.cancel(2, &mut events);
    c.sched.check().unwrap();
    assert_eq!(c.sched.kv().free_blocks(), c.sched.kv().total_blocks());
}

#[test]
fn a_failed_packed_prefill_is_retried_chunk_by_chunk() {
    let model = MockModel::small();
    let mut c = core(&model, 200, 4, 64, 64);
    c.backend.fail_packed_request = Some(2);
    let arrivals: Vec<_> = (1..=3).map(|i| (0, req(i, 8, SamplingParams::greedy(6).with_ignore_eos()))).collect();
    let out = run(&mut c, &arrivals, &[]);
    // The packed call of the three failed; alone, every chunk went through.
    assert!(c.backend.prefill_batches.starts_with(&[3, 1, 1, 1]), "{:?}", c.backend.prefill_batches);
    assert!(out.errors.is_empty(), "{:?}", out.errors);
    assert_solo(&model, &arrivals, &out, 64);
    // A request that also fails alone ends with an error; its neighbours do not.
    c.backend.fail_request = Some(5);
    c.backend.fail_packed_request = Some(5);
    let arrivals: Vec<_> = (4..=6).map(|i| (0, req(i, 8, SamplingParams::greedy(6).with_ignore_eos()))).collect();
    let out = run(&mut c, &arrivals, &[]);
    assert_eq!(out.finish[&5], FinishReason::Error);
    assert_solo(&model, &[arrivals[0].clone(), arrivals[2].clone()], &out, 64);
}

#[test]
fn backend_failures_end_only_the_requests_they_touch() {
    let model = MockModel::small();
    let mut c = core(&model, 200, 4, 64, 64);
    c.backend.fail_request = Some(2);
    let arrivals: Vec<_> = (1..=3).map(|i| (0, req(i, 8, SamplingParams::greedy(6).with_ignore_eos()))).collect();
    let out = run(&mut c, &arrivals, &[]);
    assert_eq!(out.finish[&2], FinishReason::Error);
    assert!(out.errors[&2].contains("injected"));
    assert_solo(&model, &[arrivals[0].clone(), arrivals[2].clone()], &out, 64);
    // A failed decode step fails its rows; the engine then serves new requests normally.
    c.backend.fail_request = None;
    c.backend.fail_decode_call = Some(c.backend.decode_calls + 1);
    let arrivals: Vec<_> = (4..=5).map(|i| (0, req(i, 8, SamplingParams::greedy(6).with_ignore_eos()))).collect();
    let out = run(&mut c, &arrivals, &[]);
    assert!(arrivals.iter().all(|(_, r)| out.finish[&r.id] == FinishReason::Error));
    let later = [(0, req(6, 9, SamplingParams::greedy(4)))];
    let out = run(&mut c, &later, &[]);
    assert_solo(&model, &later, &out, 64);
}

#[test]
fn a_failed_queued_step_fails_its_rows_and_the_step_queued_behind_it() {
    let model = MockModel::small();
    let mut c = core(&model, 200, 4, 64, 64);
    c.launch_ahead = true;
    c.backend.queueing = true;
    let arrivals: Vec<_> = (1..=2).map(|i| (0, req(i, 8, SamplingParams::greedy(12).with_ignore_eos()))).collect();
    let mut events = Vec::new();
    for (_, r) in &arrivals {
        c.sched.submit(r.clone(), 1234).unwrap();
    }
    c.step(&mut events); // prefill (a token each), then step 0 queued
    c.backend.fail_decode_call = Some(c.backend.decode_calls + 1); // step 2 fails, step 3 follows it
    let mut first = Outcome::default();
    first.absorb(&mut events);
    let out = run(&mut c, &[], &[]);
    for (_, r) in &arrivals {
        assert_eq!(out.finish[&r.id], FinishReason::Error);
        // The prefill's token and those of steps 0 and 1, as the request alone has them.
        let mut got = first.tokens[&r.id].clone();
        got.extend(out.tokens.get(&r.id).cloned().unwrap_or_default());
        let (solo, _) = model.solo(&r.prompt, &r.params, 1234, 64);
        assert_eq!(got, solo[..3], "request {}", r.id);
    }
    assert_eq!(c.sched.stats().generated_tokens, 2 * 3, "a token of a failed step was counted");
    // The engine then serves new requests normally, still queueing.
    let later = [(0, req(6, 9, SamplingParams::greedy(6).with_ignore_eos()))];
    let queued = c.backend.queued_steps;
    let out = run(&mut c, &later, &[]);
    assert_solo(&model, &later, &out, 64);
    assert!(c.backend.queued_steps > queued);
}

#[test]
fn seeded_requests_ignore_their_neighbours() {
    let model = MockModel::small();
    let seeded = req(1, 12, SamplingParams { max_tokens: 20, seed: Some(77), ignore_eos: true, ..Default::default() });
    let mut alone = core(&model, 300, 8, 64, 64);
    let solo = run(&mut alone, &[(0, seeded.clone())], &[]);
    let crowd: Vec<_> =
        std::iter::once((2, seeded.clone()))
            .chain((2..8).map(|i| {
                (i as usize % 3, req(i, 3 + i as usize, SamplingParams { max_tokens: 9, ..Default::default() }))
            }))
            .collect();
    let mut busy = core(&model, 300, 8, 64, 64);
    let out = run(&mut busy, &crowd, &[]);
    assert_eq!(out.tokens[&1], solo.tokens[&1]);
    // A different seed changes the stream.
    let other = Request { params: SamplingParams { seed: Some(78), ..seeded.params.clone() }, ..seeded.clone() };
    let mut c = core(&model, 300, 8, 64, 64);
    assert_ne!(run(&mut c, &[(0, other)], &[]).tokens[&1], solo.tokens[&1]);
}

#[test]
fn engine_config_and_submission_errors() {
    let model = MockModel::small();
    let cfg = |blocks| EngineConfig {
        sched: SchedConfig { prefill_chunk: 64, ..SchedConfig::new(4, 64, 32) },
        kv: model.kv_config(blocks),
        max_waiting: 2,
        check_invariants: true,
        launch_ahead: false,
        sliced_prefill: false,
        whole_chunk_tokens: 0,
    };
    // 64 tokens need 16 pages on the full layer + 2 × 4 on sliding ones... with a 64-token chunk
    // the sliding transient is the whole chunk: 48 blocks.
    let err = Engine::start(cfg(20), NoopBackend::new(1)).err().unwrap();
    assert!(matches!(err, EngineError::Config(_)), "{err}");
    let engine = Engine::start(cfg(200), MockBackend::new(model.clone(), 200)).unwrap();
    let too_long = req(1, 60, SamplingParams::greedy(10));
    assert!(matches!(engine.submit(too_long), Err(EngineError::Rejected(SubmitError::TooLong { .. }))));
    let bad = Request { prompt: vec![40], ..req(1, 1, SamplingParams::greedy(1)) };
    assert!(matches!(engine.submit(bad), Err(EngineError::Rejected(SubmitError::BadToken { .. }))));
    let empty = req(1, 0, SamplingParams::greedy(1));
    assert!(matches!(engine.submit(empty), Err(EngineError::Rejected(SubmitError::EmptyPrompt))));
    engine.shutdown();
    assert!(matches!(engine.submit(req(1, 3, SamplingParams::greedy(1))), Err(EngineError::Closed)));
    assert!(!engine.is_running());
}

#[test]
fn the_loop_thread_serves_concurrent_clients() {
    let model = MockModel::small();
    let config = EngineConfig {
        sched: SchedConfig { prefill_chunk: 16, eos_token_id: model.eos, ..SchedConfig::new(8, 80, 32) },
        kv: model.kv_config(300),
        max_waiting: 100,
        check_invariants: true,
        launch_ahead: true,
        sliced_prefill: false,
        whole_chunk_tokens: 0,
    };
    let engine = std::sync::Arc::new(Engine::start(config, MockBackend::new(model.clone(), 300)).unwrap());
    let arrivals = mixed_workload(24);
    let submitters: Vec<_> = (0..3)
        .map(|k| {
            let (engine, mine) = (engine.clone(), arrivals.iter().skip(k).step_by(3).cloned().collect::<Vec<_>>());
            std::thread::spawn(move || {
                for (_, r) in mine {
                    engine.submit(r).unwrap();
                    std::thread::sleep(Duration::from_micros(300));
                }
            })
        })
        .collect();
    for s in submitters {
        s.join().unwrap();
    }
    let ids: Vec<u64> = arrivals.iter().map(|(_, r)| r.id).collect();
    let out = collect(&engine, &ids);
    assert_solo(&model, &arrivals, &out, 80);
    let stats = engine.stats();
    assert_eq!((stats.sched.running, stats.sched.waiting), (0, 0));
    assert_eq!(stats.kv.free_blocks, stats.kv.total_blocks);
    assert!(stats.metrics.decode_steps > 0 && stats.metrics.host_ns > 0);
    assert_eq!(stats.metrics.launch.launches, stats.metrics.decode_steps, "the backend's launch times reach the stats");
    // Cancel a long request mid-stream: it ends `cancelled` and gives its blocks back. (If this
    // thread was descheduled for the request's whole life, its first batch already holds the
    // finish: then there is nothing left to cancel.)
    engine.submit(req(100, 5, SamplingParams::greedy(70).with_ignore_eos())).unwrap();
    let first = engine.next_events(Duration::from_secs(10)).unwrap();
    assert!(first.iter().any(|e| e.id == 100));
    let mut end = first.iter().find_map(|e| e.finish);
    let finished_first = end.is_some();
    engine.cancel(100);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while end.is_none() {
        assert!(std::time::Instant::now() < deadline, "request 100 never finished after its cancel");
        for e in engine.next_events(Duration::from_millis(100)).unwrap_or_default() {
            end = end.or(e.finish);
        }
    }
    let expected = if finished_first { FinishReason::Length } else { FinishReason::Cancelled };
    assert_eq!(end, Some(expected));
    engine.shutdown();
    assert_eq!(engine.stats().kv.free_blocks, engine.stats().kv.total_blocks);
    assert!(engine.next_events(Duration::from_millis(10)).is_none());
}

fn threaded_engine(model: &MockModel, launch_ahead: bool) -> Engine {
    let config = EngineConfig {
        sched: SchedConfig { prefill_chunk: 64, eos_token_id: model.eos, ..SchedConfig::new(8, 80, 32) },
        kv: model.kv_config(300),
        max_waiting: 100,
        check_invariants: true,
        launch_ahead,
        sliced_prefill: false,
        whole_chunk_tokens: 0,
    };
    Engine::start(config, MockBackend::new(model.clone(), 300)).unwrap()
}

/// Events until every one of `ids` has finished (10 s without an event fails).
fn collect(engine: &Engine, ids: &[u64]) -> Outcome {
    let mut out = Outcome::default();
    while !ids.iter().all(|id| out.finish.contains_key(id)) {
        let mut batch = engine.next_events(Duration::from_secs(10)).expect("engine alive");
        assert!(!batch.is_empty(), "no events for 10 s");
        out.absorb(&mut batch);
    }
    out
}

#[test]
fn requests_submitted_under_a_hold_start_together() {
    let model = MockModel::small();
    for launch_ahead in [false, true] {
        let engine = threaded_engine(&model, launch_ahead);
        let steps = 12;
        let arrivals: Vec<_> = (0..4)
            .map(|i| (0, req(i, 5 + 3 * i as usize, SamplingParams::greedy(steps + 1).with_ignore_eos())))
            .collect();
        engine.hold();
        engine.hold(); // holds nest
        for (_, r) in &arrivals {
            engine.submit(r.clone()).unwrap();
            // Without the hold the loop would have run each request alone by now.
            std::thread::sleep(Duration::from_millis(20));
        }
        engine.release();
        std::thread::sleep(Duration::from_millis(20));
        let s = engine.stats();
        assert_eq!((s.sched.running, s.sched.waiting, s.metrics.prefill_chunks), (0, 0, 0), "admitted under a hold");
        engine.release();
        let out = collect(&engine, &[0, 1, 2, 3]);
        assert_solo(&model, &arrivals, &out, 80);
        // One prefill iteration took every prompt, then every decode step had all four rows.
        let m = engine.stats().metrics;
        assert_eq!((m.decode_steps, m.decode_rows), (steps as u64, 4 * steps as u64), "launch-ahead {launch_ahead}");
        engine.shutdown();
    }
}

#[test]
fn a_cancel_under_a_hold_ends_its_request_at_once() {
    let model = MockModel::small();
    let engine = threaded_engine(&model, true);
    engine.hold();
    for i in 0..3 {
        engine.submit(req(i, 6, SamplingParams::greedy(10).with_ignore_eos())).unwrap();
    }
    engine.cancel(1);
    let out = collect(&engine, &[1]);
    assert_eq!(out.finish.get(&1), Some(&FinishReason::Cancelled));
    assert!(out.tokens.is_empty(), "the others are still held");
    engine.cancel_all();
    let out = collect(&engine, &[0, 2]);
    assert!(out.finish.values().all(|&f| f == FinishReason::Cancelled), "{:?}", out.finish);
    // Submissions after the cancel-all wait for the release.
    engine.submit(req(7, 6, SamplingParams::greedy(10).with_ignore_eos())).unwrap();
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(engine.stats().sched.waiting + engine.stats().sched.running, 0);
    engine.release();
    let out = collect(&engine, &[7]);
    assert_eq!((out.finish.get(&7), out.tokens[&7].len()), (Some(&FinishReason::Length), 10));
    engine.shutdown();
    assert_eq!(engine.stats().kv.free_blocks, engine.stats().kv.total_blocks);
}

#[test]
fn shutdown_cancels_everything_in_flight() {
    let model = MockModel::small();
    let config = EngineConfig {
        sched: SchedConfig { prefill_chunk: 16, ..SchedConfig::new(2, 80, 32) },
        kv: model.kv_config(300),
        max_waiting: 100,
        check_invariants: false,
        launch_ahead: false,
        sliced_prefill: false,
        whole_chunk_tokens: 0,
    };
    let engine = Engine::start(config, MockBackend::new(model, 300)).unwrap();
    for i in 0..6 {
        engine.submit(req(i, 5, SamplingParams::greedy(70).with_ignore_eos())).unwrap();
    }
    engine.shutdown();
    let mut out = Outcome::default();
    while let Some(mut batch) = engine.next_events(Duration::from_secs(5)) {
        out.absorb(&mut batch);
    }
    assert_eq!(out.finish.len(), 6);
    assert!(out.finish.values().all(|&f| f == FinishReason::Cancelled));
}

#[test]
fn queue_limit_counts_only_unadmitted_requests() {
    let model = MockModel::small();
    let config = EngineConfig {
        sched: SchedConfig { prefill_chunk: 16, ..SchedConfig::new(1, 80, 32) },
        kv: model.kv_config(300),
        max_waiting: 2,
        check_invariants: false,
        launch_ahead: false,
        sliced_prefill: false,
        whole_chunk_tokens: 0,
    };
    let engine = Engine::start(config, NoopBackend::new(5)).unwrap();
    let mut accepted = 0;
    for i in 0..50 {
        match engine.submit(req(i, 5, SamplingParams::greedy(60))) {
            Ok(()) => accepted += 1,
            Err(EngineError::QueueFull(n)) => assert!(n >= 2),
            Err(e) => panic!("{e}"),
        }
    }
    // One running plus two waiting at most at any instant, and never fewer than two accepted.
    assert!((2..50).contains(&accepted), "{accepted}");
}

/// The mock's tokens as text for grammars: 1..=10 are the digits, 11..=31 the letters a..u; EOS 0.
pub(crate) fn mock_grammars(model: &MockModel) -> crate::grammar::Grammars {
    let mut words = vec![b"\xff<eos>".to_vec()];
    words.extend((b'0'..=b'9').chain(b'a'..=b'u').map(|b| vec![b]));
    crate::grammar::Grammars::from_token_bytes(words, model.vocab as usize, 0).unwrap()
}

fn text(tokens: &[u32]) -> String {
    tokens
        .iter()
        .filter(|&&t| t != 0)
        .map(|&t| if t <= 10 { (b'0' + t as u8 - 1) as char } else { (b'a' + t as u8 - 11) as char })
        .collect()
}

/// Request `id` (`req`'s prompt of 5 + id tokens) under the regular expression `rx`.
fn constrained_req(grammars: &crate::grammar::Grammars, id: u64, rx: &str, params: SamplingParams) -> Request {
    let spec = crate::grammar::ConstraintSpec::Regex(rx.into());
    Request { constraint: Some(grammars.compile(&spec).unwrap()), ..req(id, 5 + id as usize, params) }
}

/// `core` launching ahead over a mock backend that queues steps, rows under a grammar too (their
/// masks delivered late).
fn late_masks_core(model: &MockModel, blocks: usize, max_batch: usize, chunk: usize) -> Core<MockBackend> {
    let mut c = core(model, blocks, max_batch, chunk, 64);
    c.launch_ahead = true;
    c.backend.queueing = true;
    c.backend.late_masks = true;
    c
}

#[test]
fn constrained_requests_follow_their_grammar_beside_free_ones() {
    let model = MockModel::small();
    let grammars = mock_grammars(&model);
    let constrained = |id: u64, rx: &str, params: SamplingParams| constrained_req(&grammars, id, rx, params);
    let seeded = SamplingParams { seed: Some(5), temperature: 0.9, ..SamplingParams::greedy(20) };
    let arrivals = vec![
        (0, constrained(1, "[0-9]{2}[a-c]", SamplingParams::greedy(20))),
        (0, req(2, 9, SamplingParams::greedy(12))),
        (1, constrained(3, "(ab|cd)+e", seeded.clone())),
        (2, constrained(4, "[a-u]*", SamplingParams { ignore_eos: true, ..SamplingParams::greedy(6) })),
    ];
    // (batch, launch-ahead, a backend that queues steps with late masks): without late masks rows
    // under a grammar step synchronously; with them they queue, their masks computed once the
    // tokens before have landed (QueuedDecoder::deliver_masks).
    for (max_batch, ahead, late) in
        [(1, false, false), (4, false, false), (4, true, false), (4, true, true), (1, true, true)]
    {
        let mut c = core(&model, 64, max_batch, 4, 64);
        c.launch_ahead = ahead;
        c.backend.queueing = late;
        c.backend.late_masks = late;
        let out = run(&mut c, &arrivals, &[]);
        if late {
            assert!(c.backend.masks_delivered > 5 && c.metrics.queued_steps >= c.backend.masks_delivered as u64);
        }
        for (_, r) in &arrivals {
            let (want, finish) = model.solo_request(r.clone(), 1234, 64);
            assert_eq!(out.tokens[&r.id], want, "request {} at batch {max_batch}", r.id);
            assert_eq!(out.finish[&r.id], finish, "request {}", r.id);
        }
        let t1 = text(&out.tokens[&1]);
        assert!(t1.len() == 3 && t1[..2].chars().all(|c| c.is_ascii_digit()) && "abc".contains(&t1[2..]), "{t1}");
        assert_eq!(out.finish[&1], FinishReason::Stop); // the grammar's end stops it
        let t3 = text(&out.tokens[&3]);
        assert!(t3.ends_with('e') && t3[..t3.len() - 1].len() % 2 == 0, "{t3}");
        let t4 = text(&out.tokens[&4]);
        assert!(t4.chars().all(|c| c.is_ascii_lowercase()) && out.tokens[&4].len() <= 6, "{t4}");
    }
}

#[test]
fn a_prefix_constraint_holds_only_the_first_tokens_and_is_dropped_once_covered() {
    // Token healing's grammar: the output must begin with "ab"; after that the request samples as
    // one without a grammar (the mock's own tokens), in every launch mode, and no more masks are made.
    let model = MockModel::small();
    let grammars = mock_grammars(&model);
    let prefixed = |id: u64, text: &str, params: SamplingParams| {
        let spec = crate::grammar::ConstraintSpec::Prefix(text.into());
        Request { constraint: Some(grammars.compile(&spec).unwrap()), ..req(id, 5 + id as usize, params) }
    };
    let seeded = SamplingParams { seed: Some(9), temperature: 0.9, ..SamplingParams::greedy(16) };
    let arrivals = vec![
        (0, prefixed(1, "ab", SamplingParams::greedy(16))),
        (0, req(2, 9, SamplingParams::greedy(12))),
        (1, prefixed(3, "q7", seeded)),
    ];
    for (max_batch, ahead, late) in [(1, false, false), (4, false, false), (4, true, false), (4, true, true)] {
        let mut c = core(&model, 64, max_batch, 4, 64);
        c.launch_ahead = ahead;
        c.backend.queueing = late;
        c.backend.late_masks = late;
        let out = run(&mut c, &arrivals, &[]);
        for (_, r) in &arrivals {
            let (want, finish) = model.solo_request(r.clone(), 1234, 64);
            assert_eq!(out.tokens[&r.id], want, "request {} at batch {max_batch}", r.id);
            assert_eq!(out.finish[&r.id], finish, "request {}", r.id);
        }
        assert!(text(&out.tokens[&1]).starts_with("ab") && text(&out.tokens[&3]).starts_with("q7"));
        assert!(out.tokens[&1].len() > 2, "the request went on past its prefix");
        // One mask a prefix token at most (the first comes with the prefill, the second may have
        // been planned before the first landed).
        assert!(c.backend.masks_delivered <= 4, "{} masks delivered", c.backend.masks_delivered);
    }
}

#[test]
fn launch_ahead_changes_no_stream_finish_or_count() {
    let model = MockModel::small();
    let arrivals = mixed_workload(12);
    let cancels = [(6, 3), (9, 7)];
    for (max_batch, queueing) in [(1, false), (3, false), (8, false), (1, true), (3, true), (8, true)] {
        let mut sync = core(&model, 400, max_batch, 16, 80);
        let want = run(&mut sync, &arrivals, &cancels);
        let mut ahead = core(&model, 400, max_batch, 16, 80);
        ahead.launch_ahead = true;
        ahead.backend.queueing = queueing;
        let got = run(&mut ahead, &arrivals, &cancels);
        assert_eq!(ahead.backend.queued_steps > 0, queueing, "steps were queued only where the backend queues");
        for (_, r) in &arrivals {
            let (solo, reason) = model.solo(&r.prompt, &r.params, 1234, 80);
            let tokens = got.tokens.get(&r.id).cloned().unwrap_or_default();
            if got.finish[&r.id] == FinishReason::Cancelled {
                assert!(solo.starts_with(&tokens), "request {} cancelled off its solo stream", r.id);
            } else {
                assert_eq!((&tokens, got.finish[&r.id]), (&solo, reason), "request {} at batch {max_batch}", r.id);
                assert_eq!(want.tokens.get(&r.id), Some(&tokens));
            }
        }
        let (s, a) = (sync.sched.stats(), ahead.sched.stats());
        let emitted: usize = got.tokens.values().map(Vec::len).sum();
        assert_eq!(a.generated_tokens as usize, emitted, "a dropped token was counted");
        assert_eq!((a.finished, a.prompt_tokens), (s.finished, s.prompt_tokens));
        assert_eq!(got.queued.len(), want.queued.len(), "every admitted request reports its queue time once");
    }
}

/// `request` with a stop id that its stream (alone, seed 1234) first samples at token k + 1,
/// k >= 2; returns it and k.
fn stopping_early(model: &MockModel, request: Request) -> (Request, usize) {
    let (stream, _) = model.solo(&request.prompt, &request.params, 1234, 64);
    let k = (2..stream.len()).find(|&k| !stream[..k].contains(&stream[k])).unwrap();
    let params = SamplingParams { stop_token_ids: vec![stream[k]], ..request.params.clone() };
    (Request { params, ..request }, k)
}

#[test]
fn launch_ahead_lands_a_step_one_iteration_later_and_drops_the_token_after_a_stop() {
    let model = MockModel::small();
    let request = |params: &SamplingParams| req(1, 6, params.clone());
    let greedy = SamplingParams::greedy(8).with_ignore_eos();
    let (stopping, k) = stopping_early(&model, request(&greedy));
    let stop = stopping.params;
    // max_tokens: one step per token after the prefill's, none wasted (the last is known ahead);
    // a stop: the step launched behind the stopping token's is wasted and its token dropped.
    for (params, steps) in [(SamplingParams { max_tokens: 5, ..greedy.clone() }, 4), (stop, k + 1)] {
        let mut c = core(&model, 200, 4, 64, 64);
        c.launch_ahead = true;
        c.backend.queueing = true;
        let mut events = Vec::new();
        c.sched.submit(request(&params), 1234).unwrap();
        c.step(&mut events); // the prefill's token; the first decode step launched, not landed
        assert_eq!((events.len(), c.backend.decode_calls), (1, 1));
        c.step(&mut events); // the second launched, the first landed
        assert_eq!((events.len(), c.backend.decode_calls), (2, 2));
        let mut out = Outcome::default();
        out.absorb(&mut events);
        let rest = run(&mut c, &[], &[]);
        let mut got = out.tokens[&1].clone();
        got.extend(rest.tokens.get(&1).cloned().unwrap_or_default());
        let (solo, reason) = model.solo(&request(&params).prompt, &params, 1234, 64);
        assert_eq!((got, rest.finish[&1]), (solo, reason));
        assert_eq!(c.backend.decode_calls, steps);
        assert_eq!(c.sched.stats().generated_tokens as usize, out.tokens[&1].len() + rest.tokens[&1].len());
        assert!(!c.busy());
    }
}

#[test]
fn launch_ahead_runs_a_step_the_backend_cannot_queue_at_once() {
    // Iteration by iteration, launch-ahead over a backend that cannot queue emits what synchronous
    // steps emit: no token waits an iteration to be handed over.
    let model = MockModel::small();
    let params = SamplingParams::greedy(7).with_ignore_eos();
    let (mut sync, mut ahead) = (core(&model, 200, 4, 64, 64), core(&model, 200, 4, 64, 64));
    ahead.launch_ahead = true;
    for c in [&mut sync, &mut ahead] {
        c.sched.submit(req(1, 6, params.clone()), 1234).unwrap();
        c.sched.submit(req(2, 9, params.clone()), 1234).unwrap();
    }
    let (mut want, mut got) = (Vec::new(), Vec::new());
    while sync.busy() || ahead.busy() {
        sync.step(&mut want);
        ahead.step(&mut got);
        let tokens = |events: &[Event]| events.iter().map(|e| (e.id, e.token, e.finish)).collect::<Vec<_>>();
        assert_eq!(tokens(&got), tokens(&want));
    }
    assert_eq!(ahead.backend.decode_calls, sync.backend.decode_calls);
}

#[test]
fn a_queued_step_followed_by_one_that_cannot_be_queued_gives_the_same_streams() {
    // Step n + 1 planned behind a queued step n but refused by the backend runs at once and
    // lands right after step n, rows that stop at step n included (their entries dropped).
    let model = MockModel::small();
    let greedy = SamplingParams::greedy(9).with_ignore_eos();
    let (stopping, _) = stopping_early(&model, req(1, 6, greedy.clone()));
    let requests = [stopping, req(2, 9, greedy.clone()), req(3, 4, greedy.clone())];
    for limit in 1..6 {
        let mut c = core(&model, 200, 4, 64, 64);
        c.launch_ahead = true;
        c.backend.queueing = true;
        c.backend.queue_limit = Some(limit);
        let out = run(&mut c, &requests.iter().map(|r| (0, r.clone())).collect::<Vec<_>>(), &[]);
        for r in &requests {
            let (solo, reason) = model.solo(&r.prompt, &r.params, 1234, 64);
            assert_eq!((&out.tokens[&r.id], out.finish[&r.id]), (&solo, reason), "limit {limit}, request {}", r.id);
        }
        assert_eq!(c.backend.queued_steps, limit);
        assert!(!c.busy());
        // The iteration that found the step refused handed over two of request 2's tokens: the
        // queued step's and the refused one's (an iteration late, it would be one each time).
        assert!(out.per_iteration.iter().any(|m| m.get(&2) == Some(&2)), "limit {limit}: {:?}", out.per_iteration);
    }
}

#[test]
fn a_request_resubmitted_under_its_id_while_a_step_is_in_flight_gets_none_of_its_tokens() {
    let model = MockModel::small();
    let (stopping, _) = stopping_early(&model, req(1, 6, SamplingParams::greedy(8).with_ignore_eos()));
    let mut c = core(&model, 200, 4, 64, 64);
    c.launch_ahead = true;
    c.backend.queueing = true;
    let mut events = Vec::new();
    c.sched.submit(stopping, 1234).unwrap();
    while !events.iter().any(|e: &Event| e.finish.is_some()) {
        c.step(&mut events);
    }
    assert!(c.busy(), "the step launched behind the stopping token is still in flight");
    // The same id again, into the row just freed, before that step lands.
    let again = req(1, 9, SamplingParams::greedy(5).with_ignore_eos());
    let out = run(&mut c, &[(0, again.clone())], &[]);
    let (solo, reason) = model.solo(&again.prompt, &again.params, 1234, 64);
    assert_eq!((&out.tokens[&1], out.finish[&1]), (&solo, reason));
}

/// A stream of 40 tokens from iteration 0, and a 30-token prompt (5 tokens) arriving at iteration 3.
fn stream_and_long_prompt() -> [(usize, Request); 2] {
    [
        (0, req(1, 3, SamplingParams::greedy(40).with_ignore_eos())),
        (3, req(2, 30, SamplingParams::greedy(5).with_ignore_eos())),
    ]
}

/// A long prompt admitted while a stream decodes, with layer-sliced prefill: its chunks are whole
/// (the prefill chunk, not the decode budget), each call runs a slice of the layers whose work
/// (tokens × layers) stays within the budget, the stream gets a token every iteration, and both
/// give their solo outputs.
#[test]
fn a_sliced_prefill_keeps_its_chunks_and_the_stream_its_pace() {
    let model = MockModel::small();
    let layers = model.sliding.len();
    let (chunk, budget) = (12, 4);
    let arrivals = stream_and_long_prompt();
    let mut c = budgeted_core(&model, 200, 2, chunk, Some(budget), 64);
    c.layer_slices = Some(layers);
    let out = run(&mut c, &arrivals, &[]);
    assert_solo(&model, &arrivals, &out, 64);
    let b = &c.backend;
    let sliced: Vec<_> = b.prefill_layers.iter().zip(&b.prefill_tokens).filter(|(&l, _)| l < layers).collect();
    // The 30 prompt tokens go in chunks of 12, 12 and 6: slices of one layer (12 × 1 ≤ 4 × 3) for
    // the first two, of two layers and one for the last (6 × 2 ≤ 4 × 3).
    let expect = [(1, 12), (1, 12), (1, 12), (1, 12), (1, 12), (1, 12), (2, 6), (1, 6)];
    let got: Vec<(usize, usize)> = sliced.iter().map(|(&l, &t)| (l, t)).collect();
    assert_eq!(got, expect, "{:?} {:?}", b.prefill_layers, b.prefill_tokens);
    assert_eq!(c.metrics.prefill_slices, expect.len() as u64);
    let first = out.per_iteration.iter().position(|m| m.contains_key(&1)).unwrap();
    let last = out.per_iteration.iter().rposition(|m| m.contains_key(&1)).unwrap();
    assert!(out.per_iteration[first + 1..=last].iter().all(|m| m.get(&1) == Some(&1)), "the stream skipped a step");
}

/// A call of one chunk within `whole_chunk_tokens` runs the whole model though a stream decodes
/// (on a GPU: one graph replay instead of slices of the eager path); a larger chunk, or two
/// chunks together, are sliced as before. The outputs are the solo ones either way.
#[test]
fn a_lone_chunk_within_whole_chunk_tokens_is_not_sliced() {
    let model = MockModel::small();
    let layers = model.sliding.len();
    let streaming = (0, req(1, 3, SamplingParams::greedy(40).with_ignore_eos()));
    let lone = (3, req(2, 8, SamplingParams::greedy(5).with_ignore_eos()));
    let (a, b) = (
        (3, req(3, 5, SamplingParams::greedy(5).with_ignore_eos())),
        (3, req(4, 3, SamplingParams::greedy(5).with_ignore_eos())),
    );
    // (whole_chunk_tokens, arrivals, the prefill calls' (tokens, layers))
    let cases = [
        (8, vec![streaming.clone(), lone.clone()], vec![(3, layers), (8, layers)]),
        (7, vec![streaming.clone(), lone], vec![(3, layers), (8, 1), (8, 1), (8, 1)]),
        (8, vec![streaming, a, b], vec![(3, layers), (8, 1), (8, 1), (8, 1)]),
    ];
    for (whole, arrivals, expect) in cases {
        let mut c = budgeted_core(&model, 200, 3, 12, Some(4), 64);
        c.layer_slices = Some(layers);
        c.whole_chunk_tokens = whole;
        let out = run(&mut c, &arrivals, &[]);
        assert_solo(&model, &arrivals, &out, 64);
        let b = &c.backend;
        let calls: Vec<(usize, usize)> =
            b.prefill_tokens.iter().copied().zip(b.prefill_layers.iter().copied()).collect();
        assert_eq!(calls, expect, "whole_chunk_tokens {whole}, {} prompts", arrivals.len() - 1);
    }
}

/// With launch-ahead, a slice in the middle of a sliced call is issued while the step queued
/// before it is still in flight (a device runs the two back to back, the host landing the step
/// after issuing the slice); the first slice (its pages just mapped) and the last (its results)
/// land it first. The outputs stay the solo ones, with and without launch-ahead.
#[test]
fn a_mid_slice_is_issued_behind_the_step_in_flight() {
    let model = MockModel::small();
    let layers = model.sliding.len();
    let arrivals = stream_and_long_prompt();
    for ahead in [false, true] {
        let mut c = budgeted_core(&model, 200, 2, 12, Some(4), 64);
        c.layer_slices = Some(layers);
        c.launch_ahead = ahead;
        c.backend.queueing = ahead;
        let out = run(&mut c, &arrivals, &[]);
        assert_solo(&model, &arrivals, &out, 64);
        let b = &c.backend;
        // The stream's own prompt (whole), then the slices of the chunks of 12, 12 and 6 tokens
        // (as in a_sliced_prefill_keeps_its_chunks_and_the_stream_its_pace): first, middle and
        // last slice of each 12, first and last of the 6.
        assert_eq!(b.prefill_layers, [layers, 1, 1, 1, 1, 1, 1, 2, 1], "launch-ahead {ahead}");
        let mid = [false, false, true, false, false, true, false, false, false];
        let expect: Vec<bool> = mid.iter().map(|&m| m && ahead).collect();
        assert_eq!(b.prefill_behind_queued, expect, "launch-ahead {ahead}");
    }
}

/// A sliced call whose sequence is cancelled half way is dropped (nothing more is written for it,
/// its blocks come back); one whose packed neighbour leaves is planned again from its start and
/// still gives its solo output.
#[test]
fn a_sliced_prefill_whose_sequence_leaves_is_dropped() {
    let model = MockModel::small();
    let layers = model.sliding.len();
    let streaming = (0, req(1, 3, SamplingParams::greedy(30).with_ignore_eos()));
    let cancelled = (3, req(2, 10, SamplingParams::greedy(5).with_ignore_eos()));
    let neighbour = (3, req(3, 9, SamplingParams::greedy(5).with_ignore_eos()));
    let arrivals = [streaming.clone(), cancelled, neighbour.clone()];
    let mut c = budgeted_core(&model, 200, 3, 24, Some(4), 64);
    c.layer_slices = Some(layers);
    // Submitted before iteration 3 and planned there; cancelled before iteration 4 (its first slice ran).
    let out = run(&mut c, &arrivals, &[(4, 2)]);
    assert_eq!(out.finish[&2], FinishReason::Cancelled);
    assert!(!out.tokens.contains_key(&2));
    assert_solo(&model, &[streaming, neighbour], &out, 64);
    let b = &c.backend;
    // After the stream's own prompt, a call of 12 tokens (all 10 of the cancelled prompt, 2 of its
    // neighbour's) ran one slice; the neighbour then went alone: the 2 positions that call had
    // mapped (whole, within the budget), then its other 7 in slices.
    let calls: Vec<(usize, usize)> = b.prefill_tokens.iter().copied().zip(b.prefill_layers.iter().copied()).collect();
    assert_eq!(calls, [(3, layers), (12, 1), (2, layers), (7, 1), (7, 1), (7, 1)]);
}

/// A sliced call of two prompts fails in a slice (the backend fails one of them): the call is
/// dropped and its chunks go again one call each, so only the prompt at fault ends with an error.
#[test]
fn a_failed_sliced_call_ends_only_its_own_request() {
    let model = MockModel::small();
    let streaming = (0, req(1, 3, SamplingParams::greedy(30).with_ignore_eos()));
    let bad = (3, req(2, 6, SamplingParams::greedy(5).with_ignore_eos()));
    let good = (3, req(3, 5, SamplingParams::greedy(5).with_ignore_eos()));
    let mut c = budgeted_core(&model, 200, 3, 24, Some(4), 64);
    c.layer_slices = Some(model.sliding.len());
    c.backend.fail_request = Some(2);
    let out = run(&mut c, &[streaming.clone(), bad, good.clone()], &[]);
    assert_eq!(out.finish[&2], FinishReason::Error);
    assert_solo(&model, &[streaming, good], &out, 64);
    let b = &c.backend;
    assert_eq!(b.prefill_batches[1], 2, "the two prompts were packed: {:?}", b.prefill_batches);
    assert!(b.prefill_batches[2..].iter().all(|&n| n == 1), "{:?}", b.prefill_batches);
}

/// A sliced call's survivor mapped far past its progress (its chunk was planned in full when the
/// call was dropped): its next chunk is exactly those positions, so no grow releases the sliding
/// pages that chunk writes and reads (a grow releases relative to the mapped end).
#[test]
fn a_dropped_calls_survivor_keeps_the_pages_its_chunk_needs() {
    let model = MockModel::small(); // window 10, pages of 4
    let streaming = (0, req(1, 3, SamplingParams::greedy(40).with_ignore_eos()));
    let short = (3, req(2, 1, SamplingParams::greedy(5).with_ignore_eos()));
    let long = (3, req(3, 40, SamplingParams::greedy(5).with_ignore_eos()));
    let mut c = budgeted_core(&model, 300, 3, 24, Some(8), 64);
    c.layer_slices = Some(model.sliding.len());
    let out = run(&mut c, &[streaming.clone(), short, long.clone()], &[(4, 2)]);
    assert_eq!(out.finish[&2], FinishReason::Cancelled);
    assert_solo(&model, &[streaming, long], &out, 64);
    let b = &c.backend;
    assert_eq!(b.prefill_tokens[1..3], [24, 23], "{:?}", b.prefill_tokens);
}

/// When the last decoding stream ends in the middle of a sliced call, the call's other layers run
/// at once in the next iteration, and later chunks are whole calls again.
#[test]
fn a_sliced_call_finishes_at_once_when_nothing_decodes() {
    let model = MockModel::small();
    let layers = model.sliding.len();
    // The stream's tokens: 2 in iteration 0 (its prefill's and a step's), then one an iteration.
    let streaming = (0, req(1, 3, SamplingParams::greedy(4).with_ignore_eos()));
    let admitted = (2, req(2, 30, SamplingParams::greedy(4).with_ignore_eos()));
    let mut c = budgeted_core(&model, 200, 2, 12, Some(4), 64);
    c.layer_slices = Some(layers);
    let out = run(&mut c, &[streaming.clone(), admitted.clone()], &[]);
    assert_solo(&model, &[streaming, admitted], &out, 64);
    let b = &c.backend;
    let calls: Vec<(usize, usize)> = b.prefill_tokens.iter().copied().zip(b.prefill_layers.iter().copied()).collect();
    // The stream's prompt; the first 12-token chunk: one layer while the stream decodes, the other
    // two at once after it ended; then whole chunks of 12 and 6.
    assert_eq!(calls, [(3, layers), (12, 1), (12, layers - 1), (12, layers), (6, layers)]);
}

/// With late masks, a request under a grammar cancelled while its step is queued: the step's masks
/// come without it (that row's token is dropped), and the others keep their solo streams.
#[test]
fn late_masks_survive_a_cancel_while_the_step_is_queued() {
    let model = MockModel::small();
    let grammars = mock_grammars(&model);
    let constrained =
        |id: u64, rx: &str, n: usize| constrained_req(&grammars, id, rx, SamplingParams::greedy(n).with_ignore_eos());
    let arrivals = vec![(0, constrained(1, "[a-u]*", 30)), (0, constrained(2, "[0-9a-c]*", 12))];
    let mut c = late_masks_core(&model, 64, 4, 8);
    let out = run(&mut c, &arrivals, &[(6, 1)]);
    assert_eq!(out.finish[&1], FinishReason::Cancelled);
    let (want, finish) = model.solo_request(arrivals[1].1.clone(), 1234, 64);
    assert_eq!((&out.tokens[&2], out.finish[&2]), (&want, finish));
    let (solo1, _) = model.solo_request(arrivals[0].1.clone(), 1234, 64);
    assert!(solo1.starts_with(&out.tokens[&1]), "the cancelled stream kept to its solo tokens");
    assert!(c.backend.masks_delivered >= 5, "{}", c.backend.masks_delivered);
}

/// With late masks, a step whose masks could not be delivered fails its rows when it lands, and
/// is still collected in its turn: a request that comes later gets its solo stream.
#[test]
fn a_failed_mask_delivery_fails_its_step_and_nothing_after() {
    let model = MockModel::small();
    let grammars = mock_grammars(&model);
    let constrained = |id: u64| constrained_req(&grammars, id, "[a-u]*", SamplingParams::greedy(20).with_ignore_eos());
    let later = (30, req(3, 7, SamplingParams::greedy(10).with_ignore_eos()));
    let arrivals = vec![(0, constrained(1)), (0, constrained(2)), later.clone()];
    let mut c = late_masks_core(&model, 64, 4, 8);
    c.backend.fail_masks_call = Some(2);
    let out = run(&mut c, &arrivals, &[]);
    assert_eq!((out.finish[&1], out.finish[&2]), (FinishReason::Error, FinishReason::Error));
    assert_solo(&model, &[later], &out, 64);
}

#[test]
fn speculative_decoding_gives_the_solo_streams_in_fewer_steps() {
    let model = MockModel::repetitive();
    let arrivals: Vec<_> = (0..10u64)
        .map(|i| {
            let params = SamplingParams { ignore_eos: true, ..SamplingParams::greedy(100 + i as usize * 7) };
            let params = match i % 4 {
                0 => SamplingParams { temperature: 0.7, seed: Some(i), ..params },
                _ => params,
            };
            (i as usize % 5, req(i, 2 + i as usize * 3, params))
        })
        .collect();
    for (max_batch, launch_ahead, queueing) in [(1, false, false), (4, false, false), (4, true, true), (8, true, false)]
    {
        let mut plain = core(&model, 2000, max_batch, 16, 200);
        plain.launch_ahead = launch_ahead;
        plain.backend.queueing = queueing;
        let want = run(&mut plain, &arrivals, &[]);
        let mut spec = core(&model, 2000, max_batch, 16, 200);
        spec.sched.config_mut().max_draft = crate::speculative::length::MAX_DRAFT;
        spec.launch_ahead = launch_ahead;
        spec.backend.queueing = queueing;
        let got = run(&mut spec, &arrivals, &[]);
        assert_solo(&model, &arrivals, &got, 200);
        assert_eq!(got.tokens, want.tokens);
        let s = spec.sched.stats();
        assert!(s.draft_tokens > 0 && s.accepted_tokens > 0, "{s:?}");
        let emitted: usize = got.tokens.values().map(Vec::len).sum();
        assert_eq!(s.generated_tokens as usize, emitted);
        assert!(
            spec.metrics.decode_steps * 3 < plain.metrics.decode_steps * 2,
            "{} steps with drafts, {} without (batch {max_batch})",
            spec.metrics.decode_steps,
            plain.metrics.decode_steps
        );
        assert!(spec.backend.max_rows <= crate::abi::STEP_MAX_ROWS);
    }
}

#[test]
fn a_sequence_drafts_from_another_live_sequences_text() {
    // The model's text rarely repeats itself, so a sequence alone has few drafts accepted; a
    // second request of the same prompt, started later, finds its every step in the first one's
    // output and drafts it whole.
    let model = MockModel::small();
    let params = SamplingParams::greedy(60).with_ignore_eos();
    let prompt: Vec<u32> = (0..9u32).map(|i| 1 + (i * 11) % 29).collect();
    let first = Request::new(1, prompt.clone(), params.clone());
    let second = Request::new(2, prompt, params);
    let accepted = |arrivals: &[(usize, Request)]| {
        let mut c = core(&model, 400, 4, 16, 200);
        c.sched.config_mut().max_draft = crate::speculative::length::MAX_DRAFT;
        let out = run(&mut c, arrivals, &[]);
        assert_solo(&model, arrivals, &out, 200);
        c.sched.stats().accepted_tokens
    };
    let alone = accepted(&[(0, first.clone())]) + accepted(&[(0, second.clone())]);
    let together = accepted(&[(0, first), (30, second)]);
    assert!(together >= alone + 20, "{together} draft tokens accepted together, {alone} alone");
}

#[test]
fn drafts_stop_at_a_stop_token_and_fill_only_the_rows_the_batch_leaves() {
    let model = MockModel::repetitive();
    let greedy = SamplingParams::greedy(40).with_ignore_eos();
    let (stopping, k) = stopping_early(&model, req(1, 12, greedy.clone()));
    for step_rows in [1, 2, 5] {
        let mut c = core(&model, 200, 4, 64, 64);
        c.sched.config_mut().max_draft = 8;
        c.sched.config_mut().step_rows = step_rows;
        let arrivals = [(0, stopping.clone()), (0, req(2, 9, greedy.clone())), (1, req(3, 7, greedy.clone()))];
        let out = run(&mut c, &arrivals, &[]);
        assert_solo(&model, &arrivals, &out, 64);
        assert_eq!(out.tokens[&1].len(), k + 1, "the stream ends at its stop token");
        assert!(c.backend.max_rows <= step_rows.max(3), "{} rows with {step_rows} allowed", c.backend.max_rows);
        assert_eq!(c.sched.stats().draft_tokens > 0, step_rows > 3);
    }
}

#[test]
fn drafts_under_a_grammar_keep_to_it_and_give_the_solo_streams() {
    // A repetitive text under a grammar that lets most of it through: drafts are taken, cut where
    // the grammar would refuse a token, and each verification row samples under the mask of the
    // grammar advanced by the draft before it.
    let model = MockModel::repetitive();
    let grammars = mock_grammars(&model);
    let long = |n: usize| SamplingParams { ignore_eos: true, ..SamplingParams::greedy(n) };
    let arrivals = vec![
        (0, constrained_req(&grammars, 1, "[a-u]*", long(90))),
        (0, constrained_req(&grammars, 2, "[0-9a-m]*", long(70))),
        (1, req(3, 9, long(80))),
        (2, constrained_req(&grammars, 4, "([a-f][0-9])*", long(60))),
    ];
    for (ahead, late) in [(false, false), (true, true)] {
        let mut c = core(&model, 400, 4, 4, 200);
        c.sched.config_mut().max_draft = crate::speculative::length::MAX_DRAFT;
        c.launch_ahead = ahead;
        c.backend.queueing = late;
        c.backend.late_masks = late;
        let out = run(&mut c, &arrivals, &[]);
        for (_, r) in &arrivals {
            let (want, finish) = model.solo_request(r.clone(), 1234, 200);
            assert_eq!(out.tokens[&r.id], want, "request {}", r.id);
            assert_eq!(out.finish[&r.id], finish, "request {}", r.id);
        }
        assert!(text(&out.tokens[&1]).chars().all(|c| c.is_ascii_lowercase()));
        let s = c.sched.stats();
        assert!(s.accepted_tokens > 20, "{s:?}");
    }
    // Under a grammar alone (no free request beside them), drafts are verified and accepted too.
    let mut c = core(&model, 400, 4, 4, 200);
    c.sched.config_mut().max_draft = crate::speculative::length::MAX_DRAFT;
    let constrained: Vec<_> = arrivals.iter().filter(|(_, r)| r.constraint.is_some()).cloned().collect();
    let out = run(&mut c, &constrained, &[]);
    for (_, r) in &constrained {
        assert_eq!(out.tokens[&r.id], model.solo_request(r.clone(), 1234, 200).0, "request {}", r.id);
    }
    let s = c.sched.stats();
    assert!(s.accepted_tokens > 20, "{s:?}");
}
