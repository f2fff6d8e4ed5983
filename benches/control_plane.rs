//! Host overhead of the control plane per decode step, with a backend that computes nothing (it
//! only copies the page-table rows that changed, as a GPU backend uploads them).
//!
//! North Mini Code geometry (49 layers, every 4th full, 4096-token window, 64-token pages),
//! 32K context. Scenarios:
//! - `steady`: B long requests (4000-token prompts) decoding; pages are crossed and sliding pages
//!   released as in real decode. Each `Core::step` is timed alone (scheduling, block tables, dense
//!   page-table patching, sampling bookkeeping, events).
//! - `churn`: batch 64 of short requests (512-token prompts sharing a 448-token prefix, 64 new
//!   tokens) with the queue always full: admission, prefix attach/publish, release every step.
//! - `thread`: the real loop thread at batch 64 with a consumer thread taking the events.
//!
//! `cargo bench --bench control_plane` prints a table and writes JSON to `$MK_BENCH_JSON`
//! (default `target/control_plane.json`).

use std::time::{Duration, Instant};

use mk::engine::{Core, Engine, EngineConfig, NoopBackend};
use mk::kv::KvConfig;
use mk::sched::{Event, Request, SamplingParams, SchedConfig, Scheduler};

const CONTEXT: usize = 32768;

fn config(max_batch: usize, num_blocks: usize) -> (SchedConfig, KvConfig) {
    let sched = SchedConfig {
        max_batch,
        prefill_chunk: 2048,
        decode_prefill_budget: None,
        max_context: CONTEXT,
        vocab_size: 262_144,
        eos_token_id: Some(255_001),
        ..SchedConfig::new(max_batch, CONTEXT, 262_144)
    };
    (sched, KvConfig::periodic(49, 4, 4096, num_blocks, b"bench"))
}

fn request(id: u64, prompt_len: usize, shared: usize, max_tokens: usize) -> Request {
    let prompt = (0..prompt_len as u64)
        .map(|i| {
            if (i as usize) < shared {
                (i * 7919 % 250_000) as u32
            } else {
                ((i + id * 1_000_003) * 104_729 % 250_000) as u32
            }
        })
        .collect();
    Request::new(id, prompt, SamplingParams { ignore_eos: true, ..SamplingParams::greedy(max_tokens) })
}

struct Row {
    scenario: &'static str,
    batch: usize,
    steps: u64,
    mean_us: f64,
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    steps_per_s: f64,
}

fn summarize(scenario: &'static str, batch: usize, mut samples: Vec<f64>) -> Row {
    samples.sort_by(f64::total_cmp);
    let n = samples.len();
    let mean = samples.iter().sum::<f64>() / n as f64;
    let at = |q: f64| samples[((n as f64 - 1.0) * q) as usize];
    Row {
        scenario,
        batch,
        steps: n as u64,
        mean_us: mean,
        p50_us: at(0.5),
        p99_us: at(0.99),
        max_us: samples[n - 1],
        steps_per_s: 1e6 / mean,
    }
}

/// Times `steps` decode iterations of `batch` long requests after they are all decoding.
fn steady(batch: usize, steps: usize) -> Row {
    let (sched, kv) = config(batch, batch * 9000 + 4000);
    let mut core = Core::new(Scheduler::new(sched, kv).unwrap(), NoopBackend::new(17));
    for id in 0..batch as u64 {
        core.sched.submit(request(id, 4000, 0, 28_000), id).unwrap();
    }
    // Warm up until every row has been decoding, without prefill, for a few steps.
    let (mut events, mut settled) = (Vec::new(), 0);
    while settled < 8 {
        let chunks = core.metrics.prefill_chunks;
        core.step(&mut events);
        settled = if events.len() == batch && core.metrics.prefill_chunks == chunks { settled + 1 } else { 0 };
        events.clear();
    }
    let mut samples = Vec::with_capacity(steps);
    for _ in 0..steps {
        let t = Instant::now();
        core.step(&mut events);
        samples.push(t.elapsed().as_secs_f64() * 1e6);
        assert_eq!(events.len(), batch, "every row decodes every step");
        events.clear();
    }
    summarize("steady", batch, samples)
}

/// Batch 64 of short requests with staggered lengths and the queue kept full, so requests end
/// and join every few steps.
fn churn(steps: usize) -> Row {
    let batch = 64;
    let (sched, kv) = config(batch, 64 * 2000);
    let mut core = Core::new(Scheduler::new(sched, kv).unwrap(), NoopBackend::new(17));
    let mut next = 0u64;
    let mut events: Vec<Event> = Vec::new();
    let mut samples = Vec::with_capacity(steps);
    for i in 0..steps + 500 {
        while core.sched.waiting() < 64 {
            core.sched.submit(request(next, 512, 448, 32 + (next as usize * 37) % 96), next).unwrap();
            next += 1;
        }
        let t = Instant::now();
        core.step(&mut events);
        if i >= 500 {
            samples.push(t.elapsed().as_secs_f64() * 1e6);
        }
        events.clear();
    }
    summarize("churn", batch, samples)
}

/// The loop thread at batch 64, events drained by another thread: wall time of `steps` steps.
fn thread(steps: u64) -> (Row, f64) {
    let batch = 64;
    let (sched, kv) = config(batch, batch * 9000 + 4000);
    let engine = std::sync::Arc::new(
        Engine::start(
            EngineConfig {
                sched,
                kv,
                max_waiting: 1024,
                check_invariants: false,
                launch_ahead: false,
                sliced_prefill: false,
                whole_chunk_tokens: 0,
            },
            NoopBackend::new(17),
        )
        .unwrap(),
    );
    let consumer = {
        let engine = engine.clone();
        std::thread::spawn(move || {
            let mut n = 0u64;
            while let Some(batch) = engine.next_events(Duration::from_millis(100)) {
                n += batch.len() as u64;
            }
            n
        })
    };
    for id in 0..batch as u64 {
        engine.submit(request(id, 4000, 0, 28_000)).unwrap();
    }
    while engine.stats().metrics.decode_rows < (batch * 64) as u64 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let (s0, t0) = (engine.stats().metrics, Instant::now());
    let mut s1 = s0;
    while s1.decode_steps < s0.decode_steps + steps {
        std::thread::sleep(Duration::from_millis(1));
        s1 = engine.stats().metrics;
    }
    let wall = t0.elapsed().as_secs_f64();
    assert_eq!(engine.stats().sched.running, batch, "requests must outlast the measurement");
    engine.shutdown();
    assert!(consumer.join().unwrap() > 0);
    let steps = s1.decode_steps - s0.decode_steps;
    let host_us = (s1.host_ns - s0.host_ns) as f64 / 1e3 / steps as f64;
    let row = Row {
        scenario: "thread",
        batch,
        steps,
        mean_us: wall * 1e6 / steps as f64,
        p50_us: f64::NAN,
        p99_us: f64::NAN,
        max_us: s1.max_host_ns as f64 / 1e3,
        steps_per_s: steps as f64 / wall,
    };
    (row, host_us)
}

fn main() {
    let mut rows = vec![steady(1, 20_000), steady(8, 20_000), steady(64, 10_000), churn(5_000)];
    let (thread_row, thread_host_us) = thread(15_000);
    rows.push(thread_row);

    println!("\ncontrol plane, no-op backend, NMC geometry, 32K context (µs per decode step)");
    println!(
        "{:>9} {:>6} {:>7} {:>9} {:>9} {:>9} {:>9} {:>10}",
        "scenario", "batch", "steps", "mean", "p50", "p99", "max", "steps/s"
    );
    for r in &rows {
        println!(
            "{:>9} {:>6} {:>7} {:>9.2} {:>9.2} {:>9.2} {:>9.1} {:>10.0}",
            r.scenario, r.batch, r.steps, r.mean_us, r.p50_us, r.p99_us, r.max_us, r.steps_per_s
        );
    }
    println!("thread: mean is wall time per step; the loop's own host time is {thread_host_us:.2} µs per step");

    let num = |x: f64| if x.is_finite() { format!("{x:.3}") } else { "null".into() };
    let body: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"scenario\": \"{}\", \"batch\": {}, \"steps\": {}, \"mean_us\": {}, \"p50_us\": {}, \"p99_us\": {}, \"max_us\": {}, \"steps_per_s\": {}}}",
                r.scenario, r.batch, r.steps, num(r.mean_us), num(r.p50_us), num(r.p99_us), num(r.max_us), num(r.steps_per_s)
            )
        })
        .collect();
    let json = format!(
        "{{\n  \"benchmark\": \"control_plane\",\n  \"geometry\": \"nmc-49-layers\",\n  \"context\": {CONTEXT},\n  \"thread_host_us_per_step\": {},\n  \"rows\": [\n{}\n  ]\n}}\n",
        num(thread_host_us),
        body.join(",\n")
    );
    let path = std::env::var("MK_BENCH_JSON").unwrap_or_else(|_| "target/control_plane.json".into());
    std::fs::write(&path, json).unwrap();
    println!("wrote {path}");
}
