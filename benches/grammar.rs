//! Host time of grammar-constrained decoding (rust/grammar): compiling a constraint, and per step
//! computing a row's allowed-token mask and committing its token, at batch 8 over a vocabulary
//! of the real model's size (262,144 tokens).
//!
//! The real tokenizer is not in the repository, so the vocabulary is a stand-in with the same
//! size and shape: the 256 byte tokens, then the most frequent 2- to 12-byte substrings of this
//! repository's Rust and Python sources (code-like multi-byte tokens), then EOS. Each of the 8 rows
//! follows its own JSON document, token by token (greedy longest-match tokenization), under a
//! tool-call-like JSON schema, `json_object`, or a regex. A step's masks are timed twice: one
//! row after another, and all together as the engine computes them (`grammar::allowed_all`, one
//! thread a row).
//!
//! `cargo bench --bench grammar` prints a table and writes JSON to `$MK_BENCH_JSON` (default
//! `target/grammar.json`).

use std::collections::HashMap;
use std::path::Path;
use std::time::Instant;

use mk::grammar::{allowed_all, ConstraintSpec, Grammars, TokenMask};

const VOCAB: usize = 262_144;
const ROWS: usize = 8;
const MAX_TOKEN_BYTES: usize = 12;

fn sources(dir: &Path, out: &mut Vec<u8>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    let mut paths: Vec<_> = entries.flatten().map(|e| e.path()).collect();
    paths.sort();
    for p in paths {
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs" || e == "py") {
            out.extend(std::fs::read(&p).unwrap_or_default());
        }
    }
}

/// 256 byte tokens, the most frequent substrings of `text`, EOS last.
fn vocabulary(text: &[u8]) -> Vec<Vec<u8>> {
    let mut counts: HashMap<&[u8], u32> = HashMap::new();
    for i in 0..text.len() {
        for n in 2..=MAX_TOKEN_BYTES.min(text.len() - i) {
            *counts.entry(&text[i..i + n]).or_default() += 1;
        }
    }
    let mut ranked: Vec<(&[u8], u32)> = counts.into_iter().collect();
    ranked.sort_unstable_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let mut words: Vec<Vec<u8>> = (0..=255u8).map(|b| vec![b]).collect();
    words.extend(ranked.into_iter().take(VOCAB - 257).map(|(w, _)| w.to_vec()));
    words.push(b"\xff<eos>".to_vec());
    words
}

/// Greedy longest-match tokenization (every byte is a token, so it always succeeds).
fn tokenize(text: &[u8], ids: &HashMap<&[u8], u32>) -> Vec<u32> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        let n = (1..=MAX_TOKEN_BYTES.min(text.len() - i)).rev().find(|&n| ids.contains_key(&text[i..i + n])).unwrap();
        out.push(ids[&text[i..i + n]]);
        i += n;
    }
    out
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut text = Vec::new();
    sources(&root.join("rust"), &mut text);
    sources(&root.join("python"), &mut text);
    let t = Instant::now();
    let words = vocabulary(&text);
    let eos = (words.len() - 1) as u32;
    let ids: HashMap<&[u8], u32> = words.iter().enumerate().map(|(i, w)| (&w[..], i as u32)).collect();
    let grammars = Grammars::from_token_bytes(words.clone(), VOCAB, eos).expect("the vocabulary loads");
    let vocab_s = t.elapsed().as_secs_f64();

    let schema = r#"{"type":"object","properties":{"name":{"type":"string"},"arguments":{"type":"object",
        "properties":{"path":{"type":"string"},"line":{"type":"integer"},"recursive":{"type":"boolean"},
        "patterns":{"type":"array","items":{"type":"string"}}},"required":["path"]}},"required":["name","arguments"]}"#;
    let doc = |i: usize| {
        format!(
            r#"{{"name": "search_files", "arguments": {{"path": "src/module_{i}/parser.py", "line": {}, "recursive": true, "patterns": ["def parse_", "class Token", "import re"]}}}}"#,
            100 + 37 * i
        )
    };
    let cases = [
        ("json_schema", ConstraintSpec::JsonSchema(schema.into())),
        ("json_object", ConstraintSpec::JsonObject),
        ("regex", ConstraintSpec::Regex(r#"\{"name": "[a-z_]+", "arguments": \{.*\}\}"#.into())),
    ];
    let mut rows = Vec::new();
    for (name, spec) in cases {
        let t = Instant::now();
        let mut constraints: Vec<_> = (0..ROWS).map(|_| grammars.compile(&spec).expect("compiles")).collect();
        let compile_us = t.elapsed().as_secs_f64() * 1e6 / ROWS as f64;
        let docs: Vec<Vec<u32>> = (0..ROWS).map(|i| tokenize(doc(i).as_bytes(), &ids)).collect();
        let steps = docs.iter().map(Vec::len).min().unwrap();
        let mut mask = TokenMask::default();
        let (mut row_us, mut step_us) = (Vec::new(), Vec::new());
        for s in 0..steps {
            let step = Instant::now();
            for (c, d) in constraints.iter_mut().zip(&docs) {
                let t = Instant::now();
                c.allowed(&mut mask).expect("a mask");
                assert!(mask.allows(d[s]), "{name}: step {s} forbids the document's token");
                c.commit(d[s]).expect("the token is allowed");
                row_us.push(t.elapsed().as_secs_f64() * 1e6);
            }
            step_us.push(step.elapsed().as_secs_f64() * 1e6);
        }
        // The same steps again, each step's masks all at once (fresh states).
        let mut constraints: Vec<_> = (0..ROWS).map(|_| grammars.compile(&spec).expect("compiles")).collect();
        let mut masks = vec![TokenMask::default(); ROWS];
        let mut together_us = Vec::new();
        for s in 0..steps {
            let step = Instant::now();
            let mut states: Vec<_> = constraints.iter_mut().collect();
            let errors = allowed_all(&mut states, &mut masks);
            together_us.push(step.elapsed().as_secs_f64() * 1e6);
            assert!(errors.iter().all(Option::is_none), "{name}: step {s}: {errors:?}");
            for ((c, d), mask) in constraints.iter_mut().zip(&docs).zip(&masks) {
                assert!(mask.allows(d[s]), "{name}: step {s} forbids the document's token");
                c.commit(d[s]).expect("the token is allowed");
            }
        }
        row_us.sort_by(f64::total_cmp);
        step_us.sort_by(f64::total_cmp);
        let mean = step_us.iter().sum::<f64>() / step_us.len() as f64;
        let together = together_us.iter().sum::<f64>() / together_us.len() as f64;
        rows.push((
            name,
            compile_us,
            steps,
            percentile(&row_us, 0.5),
            percentile(&row_us, 0.99),
            mean,
            percentile(&step_us, 0.99),
            together,
        ));
    }

    println!("grammar masks, {VOCAB}-token stand-in vocabulary (built in {vocab_s:.1} s), batch {ROWS}");
    println!(
        "{:<12} {:>11} {:>6} {:>11} {:>11} {:>13} {:>12} {:>17}",
        "constraint",
        "compile_us",
        "steps",
        "row_p50_us",
        "row_p99_us",
        "step_mean_us",
        "step_p99_us",
        "together_mean_us"
    );
    for r in &rows {
        println!(
            "{:<12} {:>11.0} {:>6} {:>11.1} {:>11.1} {:>13.1} {:>12.1} {:>17.1}",
            r.0, r.1, r.2, r.3, r.4, r.5, r.6, r.7
        );
    }
    let json_rows: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                r#"{{"constraint":"{}","compile_us":{:.1},"steps":{},"row_p50_us":{:.2},"row_p99_us":{:.2},"step_mean_us":{:.2},"step_p99_us":{:.2},"together_mean_us":{:.2}}}"#,
                r.0, r.1, r.2, r.3, r.4, r.5, r.6, r.7
            )
        })
        .collect();
    let json = format!(
        r#"{{"benchmark":"grammar","vocab":{VOCAB},"rows":{ROWS},"vocab_build_s":{vocab_s:.2},"results":[{}]}}"#,
        json_rows.join(",")
    );
    let path = std::env::var("MK_BENCH_JSON").unwrap_or_else(|_| "target/grammar.json".into());
    std::fs::write(&path, json).unwrap();
    println!("wrote {path}");
}
