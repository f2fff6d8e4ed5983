//! The per-SM task lists of consecutive decode steps, built once and reused.
//!
//! A step's graph depends on the batch size and, through attention, on each row's position.
//! From one decode step to the next every position grows by one. An attention split's words name
//! its split, chunk and window, not its keys (the kernel computes those from the step's positions,
//! `split_keys`), so while every (layer, row)'s split count and chunk stay the same the lists do not
//! change at all, and the device copy is reused as it is. When only chunks change (automatic sizing
//! grows them with the context) `GraphCache` rewrites those words in the cached array (a few
//! thousand tasks) instead of building the whole graph again (tens of thousands of tasks: `cargo bench
//! --bench graph_build` times both); the `Balanced` dealing weighs attention tasks by split size, so for it a changed chunk
//! rebuilds. The result is the same array `build_step(..).padded()` gives, which the tests check
//! step by step. It keeps the last `CACHED_SHAPES` shapes of step it served, so a batch whose row
//! count changes (drafts that come and go) builds each shape once, and each in its own `entry`, so a
//! launcher that keeps a device copy per entry uploads nothing when a step goes back to a shape.

use super::task::{MkTask, Op};
use super::{build_step, BuildOptions, Dealing, GraphError, KeyRange, ModelDims};

/// A step's task lists as the kernel takes them.
#[derive(Debug, Clone, Copy)]
pub struct StepTasks<'a> {
    /// [num_sms][per_sm], padded with NOPs.
    pub tasks: &'a [MkTask],
    pub per_sm: usize,
    pub num_sms: usize,
    pub slots: usize,
    pub max_splits: usize,
    /// Which of the cache's entries holds this shape (below `CACHED_SHAPES`): a shape keeps its
    /// entry while it is cached, and a new shape takes the entry of the one it pushes out.
    pub entry: usize,
    /// Names the array among every array this cache made (in any entry): a step of the same
    /// version is the same array.
    pub version: u64,
    /// The version this array was patched from, which differs from it only inside `bands` (None: it
    /// was built).
    pub patched_from: Option<u64>,
    /// Per layer, the columns `[first, last]` of the padded array that hold its attention split
    /// tasks (on every SM's row): all a patch can change.
    pub bands: &'a [(usize, usize)],
}

/// What a device copy of an entry's task lists needs to hold a step's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Upload {
    /// It holds them already.
    Nothing,
    /// The band copies (`StepTasks::band_copies`) of the attention splits a patch rewrote.
    Bands,
    /// All of them.
    Full,
}

impl StepTasks<'_> {
    /// What a device copy of this step's entry that holds version `held` (None: unknown) needs.
    pub fn upload_for(&self, held: Option<u64>) -> Upload {
        match held {
            Some(v) if v == self.version => Upload::Nothing,
            Some(v) if Some(v) == self.patched_from => Upload::Bands,
            _ => Upload::Full,
        }
    }

    /// The 2D copies (one per band) that turn version `patched_from`'s array into this one's.
    pub fn band_copies(&self) -> impl Iterator<Item = BandCopy> + '_ {
        let task = std::mem::size_of::<MkTask>();
        self.bands.iter().map(move |&(first, last)| BandCopy {
            offset_bytes: first * task,
            width_bytes: (last + 1 - first) * task,
            pitch_bytes: self.per_sm * task,
            rows: self.num_sms,
        })
    }
}

/// `rows` rows of `width_bytes` at `offset_bytes + r * pitch_bytes`, the same in the host array and
/// the device copy (a `cuMemcpy2D`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BandCopy {
    pub offset_bytes: usize,
    pub width_bytes: usize,
    pub pitch_bytes: usize,
    pub rows: usize,
}

impl BandCopy {
    /// What the copy does, on host memory (tests; the GPU path hands the same numbers to the driver).
    pub fn apply(&self, src: &[u8], dst: &mut [u8]) {
        for r in 0..self.rows {
            let at = self.offset_bytes + r * self.pitch_bytes;
            dst[at..at + self.width_bytes].copy_from_slice(&src[at..at + self.width_bytes]);
        }
    }
}

/// How many step shapes a cache keeps (the most recently used): a batch whose drafts come and go
/// changes its row count from step to step, and a shape it ran a few steps ago then costs no
/// build. Each holds one padded array on the host (docs/PERF.md, tuning decisions).
pub const CACHED_SHAPES: usize = 8;

/// One cached graph: its padded task lists and what a patch needs to rewrite them.
struct Shape {
    entry: usize,
    version: u64,
    patched_from: Option<u64>,
    /// Every (layer, row)'s keys of the step this array was last made for, layer-major: the
    /// batch's shape (their count and split counts; with the `Balanced` dealing, which weighs
    /// tasks by split size, the sizes too) decides whether a step can use it.
    ranges: Vec<KeyRange>,
    padded: Vec<MkTask>,
    per_sm: usize,
    slots: usize,
    max_splits: usize,
    /// Padded index of every attention split task, in build order (layer, row, KV head, split).
    attn: Vec<usize>,
    bands: Vec<(usize, usize)>,
}

pub struct GraphCache {
    dims: ModelDims,
    opts: BuildOptions,
    /// Most recently used first: `shapes[0]` is the array of the last step.
    shapes: Vec<Shape>,
    /// The last version given to an array.
    version: u64,
    /// This step's ranges, computed once (then kept as its shape's `ranges`).
    scratch: Vec<KeyRange>,
    pub rebuilds: u64,
    pub patches: u64,
    /// Steps served with the previous step's array unchanged.
    pub reuses: u64,
    /// Steps served by a cached shape other than the previous step's.
    pub switches: u64,
}

impl GraphCache {
    pub fn new(dims: ModelDims, opts: BuildOptions) -> Self {
        GraphCache {
            dims,
            opts,
            shapes: Vec::new(),
            version: 0,
            scratch: Vec::new(),
            rebuilds: 0,
            patches: 0,
            reuses: 0,
            switches: 0,
        }
    }

    /// The task lists of a step whose rows write at `positions`.
    pub fn step(&mut self, positions: &[usize]) -> Result<StepTasks<'_>, GraphError> {
        if positions.is_empty() {
            return Err(GraphError::EmptyBatch);
        }
        self.scratch.clear();
        for l in 0..self.dims.layers() {
            for &pos in positions {
                self.scratch.push(KeyRange::of(&self.dims, &self.opts, positions.len(), l, pos));
            }
        }
        let sizes_matter = self.opts.dealing == Dealing::Balanced;
        let scratch = &self.scratch;
        let fits = |shape: &Shape| {
            shape.ranges.len() == scratch.len()
                && scratch
                    .iter()
                    .zip(&shape.ranges)
                    .all(|(a, b)| a.splits == b.splits && (!sizes_matter || a.chunk == b.chunk))
        };
        let replaced = match self.shapes.iter().position(fits) {
            Some(0) => false,
            Some(i) => {
                let shape = self.shapes.remove(i);
                self.shapes.insert(0, shape);
                self.switches += 1;
                true
            }
            None => {
                let mut shape = self.build(positions, self.version + 1)?;
                self.version += 1;
                // The least recently used shape gives up its entry when the cache is full.
                if self.shapes.len() == CACHED_SHAPES {
                    self.shapes.pop();
                }
                shape.entry =
                    (0..CACHED_SHAPES).find(|&e| self.shapes.iter().all(|x| x.entry != e)).expect("a free entry");
                self.shapes.insert(0, shape);
                self.rebuilds += 1;
                true
            }
        };
        let shape = &mut self.shapes[0];
        let same_chunks = shape.ranges.iter().zip(&self.scratch).all(|(a, b)| a.chunk == b.chunk);
        if !same_chunks {
            patch(shape, &self.scratch, self.dims.kv_heads);
            self.version += 1;
            shape.patched_from = Some(shape.version);
            shape.version = self.version;
            if !replaced {
                self.patches += 1;
            }
        } else if !replaced {
            self.reuses += 1;
        }
        std::mem::swap(&mut shape.ranges, &mut self.scratch);
        Ok(StepTasks {
            tasks: &shape.padded,
            per_sm: shape.per_sm,
            num_sms: self.opts.num_sms,
            slots: shape.slots,
            max_splits: shape.max_splits,
            entry: shape.entry,
            version: shape.version,
            patched_from: shape.patched_from,
            bands: &shape.bands,
        })
    }

    /// A new shape (its entry still to be given) of the step at `positions`.
    fn build(&self, positions: &[usize], version: u64) -> Result<Shape, GraphError> {
        let graph = build_step(&self.dims, positions, &self.opts)?;
        let (padded, per_sm) = graph.padded();
        // Where each task of the order sits in the padded [SM][column] array.
        let mut place = vec![(0, 0); graph.order.len()];
        for (s, list) in graph.per_sm.iter().enumerate() {
            for (column, &i) in list.iter().enumerate() {
                place[i] = (s, column);
            }
        }
        let (mut attn, mut bands) = (Vec::new(), Vec::<(usize, usize)>::new());
        let mut layer_of_band = None;
        for (i, t) in graph.order.iter().enumerate().filter(|(_, t)| t.op() == Op::AttnSplit) {
            let (s, column) = place[i];
            attn.push(s * per_sm + column);
            // A layer's splits are consecutive in the order: one band of columns spans them.
            match bands.last_mut() {
                Some(band) if layer_of_band == Some(t.layer) => *band = (band.0.min(column), band.1.max(column)),
                _ => bands.push((column, column)),
            }
            layer_of_band = Some(t.layer);
        }
        // No ranges yet: `step` finds nothing to patch and then gives it this step's.
        let ranges = Vec::new();
        let (slots, max_splits) = (graph.slots, graph.max_splits);
        Ok(Shape { entry: 0, version, patched_from: None, ranges, padded, per_sm, slots, max_splits, attn, bands })
    }
}

/// Rewrites every attention split's chunk from a step's `ranges` (in the builder's order: layer,
/// row, KV head, split); the split counts are the shape's.
fn patch(shape: &mut Shape, ranges: &[KeyRange], kv_heads: usize) {
    let mut at = shape.attn.iter();
    for keys in ranges {
        for _ in 0..kv_heads * keys.splits {
            shape.padded[*at.next().expect("one index per split")].arg[5] = keys.chunk as i32;
        }
    }
    debug_assert!(at.next().is_none());
}

#[cfg(test)]
mod tests {
    use super::super::tests::{gpu_test, tiny};
    use super::*;
    use proptest::prelude::*;

    fn fresh(dims: &ModelDims, opts: &BuildOptions, positions: &[usize]) -> (Vec<MkTask>, usize) {
        build_step(dims, positions, opts).unwrap().padded()
    }

    fn bytes(tasks: &[MkTask]) -> &[u8] {
        // SAFETY: MkTask is plain-old-data (16 × i32, no padding).
        unsafe { std::slice::from_raw_parts(tasks.as_ptr().cast::<u8>(), std::mem::size_of_val(tasks)) }
    }

    /// Decode steps of a batch that grows by one token a step, with rows joining and leaving. A
    /// "device" copy per entry follows along as the launcher keeps it: nothing when it holds the
    /// step's version, the band copies when it holds the version the array was patched from, else
    /// a full upload.
    fn check_run(
        dims: ModelDims,
        opts: BuildOptions,
        positions: Vec<usize>,
        steps: usize,
        churn: &[(usize, usize)],
    ) -> GraphCache {
        check_run_drafting(dims, opts, positions, steps, churn, false)
    }

    /// `check_run`, where with `drafts` a sequence also verifies a one-token draft (a row at its
    /// next position) at every third step, staggered by sequence, so the row count changes from
    /// step to step and steps go back to cached shapes.
    fn check_run_drafting(
        dims: ModelDims,
        opts: BuildOptions,
        mut positions: Vec<usize>,
        steps: usize,
        churn: &[(usize, usize)],
        drafts: bool,
    ) -> GraphCache {
        let mut cache = GraphCache::new(dims.clone(), opts.clone());
        let mut device: Vec<(Vec<u8>, Option<u64>)> = vec![(Vec::new(), None); CACHED_SHAPES]; // (copy, its version)
        for step in 0..steps {
            for &(at, pos) in churn {
                if at == step {
                    if positions.len() > 1 && pos % 2 == 0 {
                        positions.remove(pos % positions.len());
                    } else {
                        positions.push(pos);
                    }
                }
            }
            let mut rows = positions.clone();
            if drafts {
                rows.extend(positions.iter().enumerate().filter(|(b, _)| (step + b) % 3 == 0).map(|(_, p)| p + 1));
            }
            let got = cache.step(&rows).unwrap();
            let (want, per_sm) = fresh(&dims, &opts, &rows);
            assert_eq!((got.per_sm, got.tasks.len()), (per_sm, want.len()), "step {step} at {rows:?}");
            assert!(got.tasks == &want[..], "step {step} at {rows:?}: patched tasks differ");
            let (copy, held) = &mut device[got.entry];
            match got.upload_for(*held) {
                Upload::Nothing => {}
                Upload::Bands => got.band_copies().for_each(|band| band.apply(bytes(got.tasks), copy)),
                Upload::Full => *copy = bytes(got.tasks).to_vec(),
            }
            assert!(*copy == bytes(&want), "step {step} at {rows:?}: the device copy misses a change");
            *held = Some(got.version);
            for p in &mut positions {
                *p += 1;
            }
        }
        assert!(cache.patches + cache.reuses + cache.switches > 0, "a run of one-token steps must reuse the graph");
        cache
    }

    #[test]
    fn drafted_steps_go_back_to_cached_shapes_and_their_device_copies() {
        let opts = BuildOptions { num_sms: 7, ..Default::default() };
        let cache = check_run_drafting(tiny(), opts.clone(), vec![3, 130], 80, &[], true);
        assert!(cache.switches > 10, "{} switches", cache.switches);
        let balanced = BuildOptions { dealing: Dealing::Balanced, ..opts };
        let cache = check_run_drafting(tiny(), balanced, vec![3, 130, 60], 80, &[(40, 7)], true);
        assert!(cache.switches > 10, "{} switches", cache.switches);
    }

    #[test]
    fn patched_steps_equal_fresh_builds_across_pages_and_the_window() {
        // tiny: window 96, so sliding layers move their start every step past it.
        check_run(tiny(), BuildOptions { num_sms: 7, ..Default::default() }, vec![0, 60, 95, 200], 80, &[]);
        check_run(tiny(), BuildOptions { num_sms: 7, attn_chunk: 64, ..Default::default() }, vec![3, 130], 70, &[]);
        let balanced = BuildOptions { num_sms: 7, dealing: Dealing::Balanced, ..Default::default() };
        check_run(tiny(), balanced, vec![0, 60, 95, 200], 80, &[]);
    }

    #[test]
    fn steady_steps_reuse_the_array() {
        // Batch 1 at 8K on 132 SMs: 256-key chunks, and the split counts hold for these steps.
        let mut cache = GraphCache::new(gpu_test(), BuildOptions::default());
        let first = cache.step(&[8100]).unwrap().version;
        for pos in 8101..8120 {
            let got = cache.step(&[pos]).unwrap();
            assert!(got.entry == 0 && got.version == first, "position {pos}");
        }
        assert_eq!((cache.rebuilds, cache.patches, cache.reuses), (1, 0, 19));
    }

    #[test]
    fn a_changed_batch_rebuilds() {
        let opts = BuildOptions { num_sms: 16, ..Default::default() };
        let mut cache = GraphCache::new(tiny(), opts);
        let mut entry_version = |positions: &[usize]| {
            let got = cache.step(positions).unwrap();
            (got.entry, got.version)
        };
        assert_eq!(entry_version(&[10, 20]), (0, 1));
        assert_eq!(entry_version(&[11, 21]), (0, 1));
        assert_eq!(entry_version(&[12]), (1, 2));
        assert_eq!(entry_version(&[13, 5, 40]), (2, 3));
        assert_eq!(cache.step(&[]).unwrap_err(), GraphError::EmptyBatch);
        assert_eq!((cache.rebuilds, cache.patches + cache.reuses, cache.switches), (3, 1, 0));
    }

    #[test]
    fn a_shape_run_before_is_served_from_the_cache() {
        // A batch of 2 whose drafts come and go: 2, 5, 3 and 2 rows, then back; then shapes until one
        // finds the cache full and pushes out the least recently used (2 rows), taking its entry.
        let (dims, opts) = (tiny(), BuildOptions { num_sms: 16, ..Default::default() });
        let mut cache = GraphCache::new(dims.clone(), opts.clone());
        let rows = |n: usize, at: usize| -> Vec<usize> { (0..n).map(|i| at + i).collect() };
        let mut at = 10;
        let mut step = |cache: &mut GraphCache, n: usize| {
            at += 1;
            let positions = rows(n, at);
            let got = cache.step(&positions).unwrap();
            assert!(got.tasks == &fresh(&dims, &opts, &positions).0[..], "{n} rows at {at}");
            got.entry
        };
        let slots: Vec<usize> = [2, 5, 3, 2, 5, 3, 3].into_iter().map(|n| step(&mut cache, n)).collect();
        assert_eq!(slots, [0, 1, 2, 0, 1, 2, 2]);
        assert_eq!((cache.rebuilds, cache.switches, cache.reuses), (3, 3, 1));
        let new: Vec<usize> = (6..6 + CACHED_SHAPES - 2).map(|n| step(&mut cache, n)).collect();
        assert_eq!(new.last(), Some(&0), "the shape that finds the cache full takes the 2 rows' entry");
        assert_eq!(cache.rebuilds, 3 + CACHED_SHAPES as u64 - 2);
        assert_eq!(step(&mut cache, 5), 1);
        assert_eq!(step(&mut cache, 2), 2, "back, 2 rows push out 3 rows, the least recently used");
        assert_eq!((cache.rebuilds, cache.switches), (3 + CACHED_SHAPES as u64 - 1, 4));
    }

    #[test]
    fn gpu_geometry_long_contexts() {
        let opts = BuildOptions { num_sms: 132, ..Default::default() };
        check_run(gpu_test(), opts.clone(), vec![4090, 8191, 127], 12, &[(5, 7), (9, 300)]);
        check_run(gpu_test(), opts.clone(), vec![8185], 10, &[]);
        check_run(
            gpu_test(),
            BuildOptions { dealing: Dealing::Balanced, ..opts },
            vec![4090, 8191, 127],
            12,
            &[(5, 7)],
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
        #[test]
        fn any_run_of_steps_equals_fresh_builds(
            positions in prop::collection::vec(0usize..400, 1..6),
            sms in 1usize..40,
            churn in prop::collection::vec((0usize..30, 0usize..400), 0..4),
            balanced in any::<bool>(),
            drafts in any::<bool>(),
        ) {
            let dealing = if balanced { Dealing::Balanced } else { Dealing::RoundRobin };
            let opts = BuildOptions { num_sms: sms, dealing, ..Default::default() };
            check_run_drafting(tiny(), opts, positions, 30, &churn, drafts);
        }
    }
}
