//! Host time of sampling one row of the real model's logits (262,144 entries) with the shared
//! sampler (rust/sampling): what a row costs that the megakernel does not sample itself (seeded or
//! temperature sampling, top-k/top-p, logprobs, grammars), per row and per step of 8 such rows.
//!
//! Two fixed pseudo-random rows (`rows`): one shaped like a language model's, one adversarially flat. `cargo bench --bench sampling` prints a table and writes JSON to
//! `$MK_BENCH_JSON` (default `target/sampling.json`).

use std::time::Instant;

use mk::sampling::{SampleSpec, Sampler};

const VOCAB: usize = 262_144;
const ROWS: usize = 8;
const REPEATS: usize = 20;

/// xorshift noise in [0, 1) (deterministic, no dependencies).
fn noise(state: &mut u64) -> f32 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    (*state >> 40) as f32 / (1u64 << 24) as f32
}

/// Two deterministic rows. "lm-like": a language model's shape, a bulk around 0 (a sum of
/// uniforms, spread ~2.5) under a few dozen logits of 12-20 and one of 22. "flat": every logit
/// within 16 of the top, so Gumbel noise could lift any of them to the top (nothing can be skipped).
fn rows() -> [(&'static str, Vec<f32>); 2] {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let lm = (0..VOCAB)
        .map(|i| match i {
            1234 => 22.0,
            _ if i % 4099 == 0 => 12.0 + 8.0 * noise(&mut state),
            _ => 2.5 * ((0..4).map(|_| noise(&mut state)).sum::<f32>() - 2.0) * 1.7,
        })
        .collect();
    let flat = (0..VOCAB)
        .map(|i| if i % 4099 == 0 { 8.0 + 4.0 * noise(&mut state) } else { -4.0 + 6.0 * noise(&mut state) })
        .collect();
    [("lm-like", lm), ("flat", flat)]
}

fn main() {
    let sampled = |temperature: f32, top_p: f32, top_k: u32, logprobs: Option<u32>| SampleSpec {
        temperature,
        top_p,
        top_k,
        seed: 1234,
        index: 0,
        logprobs,
    };
    let cases = [
        ("greedy", SampleSpec::greedy(0)),
        ("greedy, logprobs 0", SampleSpec { logprobs: Some(0), ..SampleSpec::greedy(0) }),
        ("temperature 1.0", sampled(1.0, 1.0, 0, None)),
        ("temperature 0.7, top_p 0.95", sampled(0.7, 0.95, 0, None)),
        ("temperature 0.7, top_k 50", sampled(0.7, 1.0, 50, None)),
        ("temperature 1.0, logprobs 5", sampled(1.0, 1.0, 0, Some(5))),
    ];
    let mut sampler = Sampler::new();
    let mut out = Vec::new();
    println!("{:>8} {:>30} {:>12} {:>12} {:>16}", "row", "spec", "row p50 µs", "row max µs", "8-row step ms");
    for (row_name, row) in rows() {
        for (name, spec) in cases {
            let mut times = Vec::with_capacity(REPEATS);
            for r in 0..REPEATS {
                let spec = SampleSpec { index: r as u32, ..spec };
                let t = Instant::now();
                let got = sampler.sample_allowed(&row, &spec, None).expect("a finite row");
                times.push(t.elapsed().as_secs_f64() * 1e6);
                std::hint::black_box(got);
            }
            times.sort_by(f64::total_cmp);
            let (p50, max) = (times[REPEATS / 2], times[REPEATS - 1]);
            let step_ms = p50 * ROWS as f64 / 1e3;
            println!("{row_name:>8} {name:>30} {p50:>12.0} {max:>12.0} {step_ms:>16.2}");
            out.push(format!(
                "{{\"row\": \"{row_name}\", \"spec\": \"{name}\", \"row_p50_us\": {p50:.1}, \"row_max_us\": {max:.1}, \"step_ms_8_rows\": {step_ms:.3}}}"
            ));
        }
    }
    let path = std::env::var("MK_BENCH_JSON").unwrap_or_else(|_| "target/sampling.json".into());
    let json = format!("{{\"bench\": \"sampling\", \"vocab\": {VOCAB}, \"rows\": [{}]}}\n", out.join(", "));
    std::fs::write(&path, json).expect("write the JSON");
    println!("wrote {path}");
}
