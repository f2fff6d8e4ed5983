//! Scheduler policies in isolation, driven by hand with a fixed "sampled" token (no backend):
//! admission order and limits, block accounting at admission, the preemption hold, submission
//! errors. End-to-end behaviour over a model lives in `engine::tests`.

use super::*;
use crate::sampling::Sampled;

/// 2 layers (full, sliding), pages of 4 tokens, window 8; vocabulary 50.
fn sched(max_batch: usize, chunk: usize, max_context: usize, blocks: usize) -> Scheduler {
    let cfg = SchedConfig {
        max_batch,
        prefill_chunk: chunk,
        decode_prefill_budget: None,
        max_context,
        vocab_size: 50,
        eos_token_id: Some(0),
        ..SchedConfig::new(max_batch, max_context, 50)
    };
    let kv = KvConfig { sliding: vec![false, true], window: 8, page_size: 4, num_blocks: blocks, salt: vec![] };
    Scheduler::new(cfg, kv).unwrap()
}

fn submit(s: &mut Scheduler, id: u64, len: usize, max_tokens: usize) {
    let prompt = (0..len as u32).map(|i| 1 + (i + id as u32) % 40).collect();
    s.submit(Request::new(id, prompt, SamplingParams::greedy(max_tokens)), 0).unwrap();
}

/// One iteration with every sampled token = 7; returns the events.
fn step(s: &mut Scheduler) -> Vec<Event> {
    let mut out = Vec::new();
    s.admit();
    let mut chunks = Vec::new();
    s.plan_prefill(s.config().prefill_chunk, &mut chunks, &mut out);
    let rows: Vec<usize> = chunks.iter().map(|c| c.row).collect();
    assert!(rows.iter().all(|r| rows.iter().filter(|x| *x == r).count() == 1), "a row planned twice");
    for c in &chunks {
        s.prefill_done(c, Some(&Sampled::token(7)), &mut out);
    }
    let mut batch = DecodeBatch::default();
    s.plan_decode(&mut batch, &mut out);
    let sampled = vec![Sampled::token(7); batch.len()];
    s.decoded(&batch, &sampled, &mut out);
    s.check().unwrap();
    out
}

fn live_ids(s: &Scheduler) -> Vec<u64> {
    let mut ids: Vec<u64> = (0..s.config().max_batch).filter_map(|r| s.seq(r).map(|q| q.id)).collect();
    ids.sort_unstable();
    ids
}

#[test]
fn config_must_let_one_full_context_prefill_alone() {
    let cfg = SchedConfig::new(4, 64, 50);
    let kv = |n| KvConfig { sliding: vec![false, true], window: 8, page_size: 4, num_blocks: n, salt: vec![] };
    // 64 tokens: 16 pages on the full layer; in 512-token chunks the sliding layer holds all 16.
    assert!(matches!(Scheduler::new(cfg.clone(), kv(31)), Err(SchedError::Config(_))));
    assert!(Scheduler::new(cfg.clone(), kv(32)).is_ok());
    assert!(matches!(Scheduler::new(SchedConfig { max_batch: 0, ..cfg.clone() }, kv(32)), Err(SchedError::Config(_))));
    let no_budget = SchedConfig { decode_prefill_budget: Some(0), ..cfg };
    assert!(matches!(Scheduler::new(no_budget, kv(32)), Err(SchedError::Config(_))));
}

#[test]
fn the_prefill_budget_shrinks_while_a_sequence_decodes() {
    let mut s = sched(4, 16, 64, 200);
    s.cfg.decode_prefill_budget = Some(4);
    submit(&mut s, 0, 5, 10);
    assert_eq!(s.prefill_budget(), 16, "nothing decodes yet");
    step(&mut s); // request 0 prefilled (5 <= 16 tokens) and decoding
    submit(&mut s, 1, 30, 2);
    s.admit();
    assert_eq!(s.prefill_budget(), 4, "request 0 decodes");
    let (mut chunks, mut out) = (Vec::new(), Vec::new());
    s.plan_prefill(s.prefill_budget(), &mut chunks, &mut out);
    assert_eq!(chunks.iter().map(|c| c.end - c.start).sum::<usize>(), 4);
    s.cfg.decode_prefill_budget = Some(100);
    assert_eq!(s.prefill_budget(), 16, "never more than prefill_chunk");
}

#[test]
fn admission_is_fifo_and_bounded_by_rows() {
    let mut s = sched(2, 64, 64, 200);
    for id in 0..4 {
        submit(&mut s, id, 5, 3);
    }
    assert_eq!(s.admit(), 2);
    assert_eq!(live_ids(&s), vec![0, 1]);
    assert_eq!((s.live(), s.waiting(), s.take_dequeued()), (2, 2, 2));
    // Each ends after 3 tokens; the queue moves up in order.
    let mut finished = Vec::new();
    while s.busy() {
        finished.extend(step(&mut s).into_iter().filter(|e| e.finish.is_some()).map(|e| e.id));
    }
    assert_eq!(finished, vec![0, 1, 2, 3]);
    assert_eq!(s.kv().free_blocks(), s.kv().total_blocks());
    let st = s.stats();
    assert_eq!((st.prompt_tokens, st.prefill_tokens, st.generated_tokens, st.finished), (20, 20, 12, 4));
}

#[test]
fn the_head_of_the_queue_is_never_skipped() {
    // 36 blocks; after one step request 0 (31 tokens) holds 8 + 3 = 11 and promises 2 more;
    // request 1 needs 13 + 13 = 26 to prefill 50 tokens in one chunk: it must wait, and the tiny
    // request 2 behind it waits too.
    let mut s = sched(4, 64, 64, 36);
    submit(&mut s, 0, 30, 30);
    step(&mut s);
    submit(&mut s, 1, 50, 10);
    submit(&mut s, 2, 2, 2);
    let need = s.kv().prefill_blocks_needed(50, 64);
    assert!(need + 2 > s.kv().free_blocks(), "need {need}, free {}", s.kv().free_blocks());
    assert_eq!(s.admit(), 0);
    assert_eq!(live_ids(&s), vec![0]);
    while s.busy() {
        step(&mut s);
    }
    assert_eq!(s.kv().free_blocks(), 36);
}

#[test]
fn outstanding_prefills_count_at_admission() {
    // Two 40-token prompts in 8-token chunks: each needs 10 + 5 = 15 blocks at peak; 24 blocks
    // cannot promise both, so the second waits for the first's prefill to be paid for.
    let mut s = sched(4, 8, 48, 24);
    submit(&mut s, 0, 40, 2);
    submit(&mut s, 1, 40, 2);
    assert_eq!(s.admit(), 1);
    let mut iterations = 0;
    while s.live() < 2 && s.busy() {
        step(&mut s);
        iterations += 1;
    }
    assert!(iterations >= 2);
    while s.busy() {
        step(&mut s);
    }
    assert_eq!(s.stats().preemptions, 0);
}

#[test]
fn a_preemption_holds_admission_until_someone_leaves() {
    // Two sequences growing to 40 tokens need 10 + 3 = 13 blocks each; 20 blocks fit one.
    let mut s = sched(3, 8, 44, 20);
    submit(&mut s, 0, 4, 36);
    submit(&mut s, 1, 4, 36);
    let mut preempted_at = None;
    for i in 0..200 {
        step(&mut s);
        if s.stats().preemptions > 0 && preempted_at.is_none() {
            preempted_at = Some(i);
            // The youngest went back to the head of the queue with its tokens kept.
            assert_eq!(live_ids(&s), vec![0]);
            assert_eq!(s.waiting(), 1);
            assert!(s.waiting.front().unwrap().tokens.len() > 4);
            submit(&mut s, 2, 2, 1);
        }
        if preempted_at.is_some() && s.seq(0).is_some_and(|q| q.id == 0) {
            // While request 0 lives, nothing is admitted, not even the tiny request 2.
            assert_eq!(live_ids(&s), vec![0]);
        }
        if !s.busy() {
            break;
        }
    }
    assert!(preempted_at.is_some());
    assert!(!s.busy());
    assert_eq!(s.stats().preemptions, 1);
    assert_eq!(s.stats().generated_tokens, 36 + 36 + 1);
}

#[test]
fn submission_errors() {
    let mut s = sched(2, 64, 20, 100);
    let r = |id, prompt: Vec<u32>, max_tokens| Request::new(id, prompt, SamplingParams::greedy(max_tokens));
    assert_eq!(s.submit(r(1, vec![], 1), 0), Err(SubmitError::EmptyPrompt));
    assert_eq!(s.submit(r(1, vec![50], 1), 0), Err(SubmitError::BadToken { token: 50, vocab: 50 }));
    assert_eq!(
        s.submit(r(1, vec![1; 15], 6), 0),
        Err(SubmitError::TooLong { prompt: 15, max_tokens: 6, max_context: 20 })
    );
    assert!(matches!(s.submit(r(1, vec![1], 0), 0), Err(SubmitError::Params(_))));
    s.submit(r(1, vec![1; 15], 5), 0).unwrap();
    assert_eq!(s.submit(r(1, vec![1], 1), 0), Err(SubmitError::Duplicate(1)));
    s.admit();
    assert_eq!(s.submit(r(1, vec![1], 1), 0), Err(SubmitError::Duplicate(1)));
}

#[test]
fn unseeded_requests_take_the_engine_seed_and_seeded_keep_theirs() {
    let mut s = sched(2, 64, 20, 100);
    let p = SamplingParams { seed: Some(5), ..SamplingParams::default() };
    s.submit(Request::new(1, vec![1], p), 99).unwrap();
    s.submit(Request::new(2, vec![1], SamplingParams::default()), 99).unwrap();
    let seeds: Vec<u64> = s.waiting.iter().map(|q| q.seed).collect();
    assert_eq!(seeds, vec![5, 99]);
}
