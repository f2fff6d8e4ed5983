//! Host time to produce a decode step's per-SM task lists for the megakernel: a fresh
//! `build_step(..).padded()` against `GraphCache::step`, which reuses the previous step's lists
//! while the batch keeps its shape (every position + 1; the kernel computes the attention keys from
//! the positions), rewriting only attention chunks when they grow. Of the cached steps, how many
//! were rebuilt, patched (the launcher then uploads the attention bands), reused as they were
//! (it uploads no task) and switched to another cached shape (the launcher keeps a device copy per
//! cached shape: it uploads nothing, or the bands of a patch). The last case's batch verifies drafts
//! at some steps (`drafts_at`), so its row count changes from step to step.
//!
//! North Mini Code geometry (49 layers, 128 experts, top-8, 262144-token vocabulary), 132 SMs,
//! default options. Each case times `STEPS` consecutive decode steps from the given context. Also:
//! a fresh build with the `Balanced` dealing, and the step time the dealing's cost model predicts
//! for round-robin and balanced lists (`graph::deal::model`; a model, to be checked on the GPU).
//!
//! The launcher's other per-step host work on the same steps: compacting the engine's page table
//! into the launch's `[layer][row][page]` copy and checking every entry it touches against the
//! pool (`gpu::compact`), over rows that the KV manager grows one position a step.
//!
//! `cargo bench --bench graph_build` prints a table and writes JSON to `$MK_BENCH_JSON`
//! (default `target/graph_build.json`).

use std::time::Instant;

use mk::gpu::compact::{check_mapped, compact_tables, step_pages};
use mk::graph::cache::GraphCache;
use mk::graph::deal::{model, Dealing};
use mk::graph::{build_step, BuildOptions, ModelDims};
use mk::kv::{KvConfig, KvManager};
use mk::sched::PageTable;

const STEPS: usize = 200;

fn real() -> ModelDims {
    ModelDims {
        hidden: 2048,
        heads: 32,
        kv_heads: 4,
        head_dim: 128,
        experts: 128,
        top_k: 8,
        expert_ffn: 768,
        dense_ffn: 3072,
        vocab: 262_144,
        window: (0..49).map(|i| if i % 4 == 0 { None } else { Some(4096) }).collect(),
        moe: (0..49).map(|i| i >= 1).collect(),
    }
}

struct Row {
    batch: usize,
    context: usize,
    /// Steps of varying row counts (`drafts_at`).
    drafted: bool,
    tasks: usize,
    fresh_us: f64,
    cached_us: f64,
    rebuilds: u64,
    patches: u64,
    reuses: u64,
    /// Steps served by another cached shape than the previous step's.
    switches: u64,
    balanced_build_us: f64,
    model_rr_us: f64,
    model_balanced_us: f64,
    tables_us: f64,
}

/// Per step: `compact_tables` and `check_mapped` as the launcher runs them, over `batch` rows
/// that the KV manager grows one position a step from `start` (its page table synced as the
/// scheduler does).
fn tables_us(dims: &ModelDims, start: &[usize]) -> f64 {
    let batch = start.len();
    let max_context = start.iter().max().unwrap() + STEPS + 2;
    let sliding: Vec<bool> = dims.window.iter().map(Option::is_some).collect();
    let pages = max_context.div_ceil(64);
    let num_blocks = batch * dims.window.len() * pages;
    let mut kv =
        KvManager::new(KvConfig { sliding, window: 4096, page_size: 64, num_blocks, salt: Vec::new() }).unwrap();
    let mut table = PageTable::new(dims.window.len(), batch, pages);
    for (b, &p) in start.iter().enumerate() {
        kv.admit(b as u64, &[]).unwrap();
        kv.grow(b as u64, p + 1).unwrap();
        table.sync(b, kv.block_table(b as u64).unwrap()).unwrap();
    }
    let rows: Vec<usize> = (0..batch).collect();
    let (mut compact, mut spent) = (Vec::new(), 0.0);
    for i in 1..=STEPS {
        for (b, &p) in start.iter().enumerate() {
            if kv.grow(b as u64, p + i + 1).unwrap() {
                table.sync(b, kv.block_table(b as u64).unwrap()).unwrap();
            }
        }
        let positions: Vec<u32> = start.iter().map(|&p| (p + i) as u32).collect();
        let t = Instant::now();
        let pages = step_pages(&positions);
        compact_tables(&table, &rows, pages, &mut compact);
        check_mapped(&compact, &positions, pages, &dims.window, num_blocks).unwrap();
        spent += t.elapsed().as_secs_f64();
        std::hint::black_box(&compact);
    }
    spent * 1e6 / STEPS as f64
}

/// Whether sequence `b` verifies a one-token draft at step `i` (a row more at the next position):
/// a fixed pseudo-random bit, under which a batch of 8 runs 8 to 16 rows.
fn drafts_at(i: usize, b: usize) -> bool {
    let h = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (b as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F);
    (h >> 40).wrapping_mul(0x2545_F491_4F6C_DD1D) >> 63 == 1
}

fn case(dims: &ModelDims, opts: &BuildOptions, batch: usize, context: usize, drafted: bool) -> Row {
    let start: Vec<usize> = (0..batch).map(|b| context - 1 - 37 * b).collect();
    let step = |i: usize| {
        let mut rows = Vec::new();
        for (b, p) in start.iter().enumerate() {
            rows.push(p + i);
            if drafted && drafts_at(i, b) {
                rows.push(p + i + 1);
            }
        }
        rows
    };

    std::hint::black_box(build_step(dims, &step(0), opts).unwrap().padded()); // warm the allocator
    let t = Instant::now();
    let mut tasks = 0;
    for i in 0..STEPS / 10 {
        let (padded, _) = build_step(dims, &step(i), opts).unwrap().padded();
        tasks = padded.len();
        std::hint::black_box(&padded);
    }
    let fresh_us = t.elapsed().as_secs_f64() * 1e6 / (STEPS / 10) as f64;

    let mut cache = GraphCache::new(dims.clone(), opts.clone());
    cache.step(&step(0)).unwrap();
    let t = Instant::now();
    for i in 1..=STEPS {
        std::hint::black_box(cache.step(&step(i)).unwrap().tasks.len());
    }
    let cached_us = t.elapsed().as_secs_f64() * 1e6 / STEPS as f64;

    let balanced = BuildOptions { dealing: Dealing::Balanced, ..opts.clone() };
    let t = Instant::now();
    let bal = build_step(dims, &step(0), &balanced).unwrap();
    let balanced_build_us = t.elapsed().as_secs_f64() * 1e6;
    let rr = build_step(dims, &step(0), opts).unwrap();
    let model_rr_us = model(&rr.order, &rr.per_sm, dims, rr.num_counters).makespan_ns / 1e3;
    let model_balanced_us = model(&bal.order, &bal.per_sm, dims, bal.num_counters).makespan_ns / 1e3;
    let tables_us = tables_us(dims, &start);
    Row {
        batch,
        context,
        drafted,
        tasks,
        fresh_us,
        cached_us,
        rebuilds: cache.rebuilds - 1,
        patches: cache.patches,
        reuses: cache.reuses,
        switches: cache.switches,
        balanced_build_us,
        model_rr_us,
        model_balanced_us,
        tables_us,
    }
}

fn main() {
    let dims = real();
    let opts = BuildOptions::default();
    // The process's first large builds pay for page faults (several times slower): warm up first.
    case(&dims, &opts, 8, 2048, false);
    let mut rows = Vec::new();
    for batch in [1, 8] {
        for context in [2048, 8192, 32768] {
            rows.push(case(&dims, &opts, batch, context, false));
        }
    }
    rows.push(case(&dims, &opts, 8, 8192, true));
    println!("\nper-SM task lists of one decode step, NMC geometry, 132 SMs ({STEPS} consecutive steps)");
    println!(
        "{:>6} {:>8} {:>8} {:>9} {:>12} {:>12} {:>9} {:>9} {:>8} {:>7} {:>9} {:>13} {:>10} {:>10} {:>10}",
        "batch",
        "drafts",
        "context",
        "tasks",
        "fresh µs",
        "cached µs",
        "speed-up",
        "rebuilds",
        "patched",
        "reused",
        "switched",
        "balanced µs",
        "model rr",
        "model bal",
        "tables µs"
    );
    for r in &rows {
        println!(
            "{:>6} {:>8} {:>8} {:>9} {:>12.0} {:>12.1} {:>8.0}x {:>9} {:>8} {:>7} {:>9} {:>13.0} {:>8.0}µs {:>8.0}µs {:>10.1}",
            r.batch,
            r.drafted,
            r.context,
            r.tasks,
            r.fresh_us,
            r.cached_us,
            r.fresh_us / r.cached_us,
            r.rebuilds,
            r.patches,
            r.reuses,
            r.switches,
            r.balanced_build_us,
            r.model_rr_us,
            r.model_balanced_us,
            r.tables_us
        );
    }
    let body: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "    {{\"batch\": {}, \"context\": {}, \"drafted\": {}, \"padded_tasks\": {}, \"fresh_us\": {:.3}, \"cached_us\": {:.3}, \"rebuilds\": {}, \"patches\": {}, \"reuses\": {}, \"switches\": {}, \"balanced_build_us\": {:.1}, \"model_rr_us\": {:.1}, \"model_balanced_us\": {:.1}, \"tables_us\": {:.2}}}",
                r.batch, r.context, r.drafted, r.tasks, r.fresh_us, r.cached_us, r.rebuilds, r.patches, r.reuses, r.switches, r.balanced_build_us, r.model_rr_us, r.model_balanced_us, r.tables_us
            )
        })
        .collect();
    let json = format!("{{\n  \"steps\": {STEPS},\n  \"rows\": [\n{}\n  ]\n}}\n", body.join(",\n"));
    let path = std::env::var("MK_BENCH_JSON").unwrap_or_else(|_| "target/graph_build.json".into());
    std::fs::write(&path, json).unwrap();
    println!("wrote {path}");
}
