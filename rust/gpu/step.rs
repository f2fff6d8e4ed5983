//! One decode step of the megakernel as the engine runs it: build the task graph for the rows,
//! upload tasks, tokens, positions and the compacted page tables, launch `mk_decode_step` on the
//! engine's stream, and copy back the sampled tokens (and the logits of rows that need them).
//!
//! Python owns the model's tensors (weights, KV pool, activation buffers, pointer tables) and
//! hands their addresses over once, packed as an `MkStepArgs` template; this side owns the
//! per-step indices (tasks, tokens, positions, tables) and the dependency counters.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{result, sys, CudaEvent, CudaSlice, CudaStream, DevicePtr, DriverError, PinnedHostSlice};

use super::compact::{check_mapped, compact_tables, step_pages};
use super::{Gpu, GpuError, MkRowSample, MkStepArgs};
use crate::abi::STEP_MAX_ROWS;
use crate::grammar::TokenMask;
use crate::graph::cache::{GraphCache, StepTasks, Upload};
use crate::graph::task::MkTask;
use crate::graph::{BuildOptions, ModelDims};
use crate::sched::PageTable;

/// Where a backend's decode calls spent their host time, summed over its life (`GpuLauncher`'s;
/// backends that do not measure report zeros): the task lists, page tables and checks
/// (`prepare`), the uploads, the launch call (`call`), and the wait for the step with the copies
/// back (`wait`, which holds the kernel's own time).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LaunchTimes {
    pub launches: u64,
    pub prepare_ns: u64,
    pub upload_ns: u64,
    pub call_ns: u64,
    pub wait_ns: u64,
}

/// The `MkStepArgs` fields `launch` fills in for every step (its buffers, or per-step values); Python
/// leaves them 0 in the template (`_native.PER_STEP_FIELDS`).
pub const PER_STEP_FIELDS: [&str; 17] = [
    "tasks",
    "counters",
    "tokens",
    "positions",
    "block_tables",
    "row_samples",
    "row_masks",
    "mask_ready",
    "mask_epoch",
    "per_sm",
    "num_counters",
    "parity",
    "batch",
    "max_pages",
    "max_splits",
    "slots",
    "sample_parts",
];

/// What Python allocated, described once at construction.
#[derive(Debug, Clone)]
pub struct StepSetup {
    /// Addresses of everything Python owns and the model's dimensions. The `PER_STEP_FIELDS` are
    /// ignored and filled in here.
    pub args: MkStepArgs,
    pub dims: ModelDims,
    /// Rows the activation buffers hold (at most `STEP_MAX_ROWS`).
    pub rows: usize,
    /// Attention partials per (row, KV head) the buffers hold.
    pub max_splits: usize,
    /// MoE slots the expert buffers hold.
    pub slots: usize,
    /// Pages per row of the engine's page table (this side's table buffer is that wide).
    pub max_pages: usize,
    /// Blocks of the KV pool: every table entry a step uses must be below it.
    pub num_blocks: usize,
    /// Task decomposition (`num_sms` is taken from the device).
    pub options: BuildOptions,
}

/// One launch's rows, in step order.
#[derive(Debug, Clone, Copy)]
pub struct StepRows<'a> {
    /// Engine rows: where each step row's pages are in `table`.
    pub rows: &'a [usize],
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub table: &'a PageTable,
    /// Rows whose fp32 logits must come back (sampled on the host).
    pub want_logits: &'a [bool],
    /// How the kernel draws each row's token (nothing is uploaded when every row is greedy).
    pub samples: &'a [MkRowSample],
    /// The mask of each row whose sample is `masked` (None for the others; empty: no row is, or
    /// `late_masks`).
    pub masks: &'a [Option<&'a TokenMask>],
    /// The masked rows' masks come after the launch (`GpuLauncher::deliver_masks`; queued launches
    /// only): the kernel's sample tasks wait for them.
    pub late_masks: bool,
    /// Which launch of the engine's step this is (0 unless the batch exceeds one launch's rows):
    /// each keeps its own cached task lists.
    pub launch: usize,
}

/// The task lists of one of a step's launches (cached per shape of step) and a device copy per
/// cached shape (`StepTasks::entry`), so a step that goes back to a shape uploads nothing.
struct LaunchTasks {
    graphs: GraphCache,
    copies: Vec<DeviceTasks>,
}

/// The device copy of one cache entry's task lists.
#[derive(Default)]
struct DeviceTasks {
    buf: Option<CudaSlice<MkTask>>,
    /// `version` of the lists `buf` holds (None: unknown, upload everything).
    uploaded: Option<u64>,
}

/// Launches decode steps of the megakernel on one stream: the task lists (cached per launch), the
/// counters and the per-step uploads. ("Runner" names only the Python objects the engine's
/// backends call; what launches is a launcher.)
pub struct GpuLauncher {
    gpu: Arc<Gpu>,
    stream: Arc<CudaStream>,
    setup: StepSetup,
    /// Per launch index: the last step's task lists, patched while the batch keeps its shape.
    launches: Vec<LaunchTasks>,
    /// Upload only the attention bands a patch changed (the default; `MK_TASK_UPLOAD=full`: the
    /// whole array every step).
    band_uploads: bool,
    tokens: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    tables: CudaSlice<i32>,
    /// MkRowSample [rows]: uploaded for a step with a row the kernel draws with noise or masks.
    samples: CudaSlice<MkRowSample>,
    /// uint32 [rows][TokenMask::words_for(vocab)]: the masked rows' masks (allocated with the first masked step),
    /// and their host staging (one copy a step).
    masks: Option<CudaSlice<u32>>,
    host_masks: Vec<u32>,
    /// Masks delivered while their launch runs (allocated with the first such launch).
    late: Option<LateMasks>,
    /// uint32 [2][num_counters]; launch s uses set s % 2 and zeroes the other.
    counters: CudaSlice<u32>,
    num_counters: usize,
    parity: i32,
    host_positions: Vec<usize>,
    host_i32: Vec<i32>,
    /// This step's compacted page tables, and what the device copy holds (`tables_held`: known
    /// to be that; a failed upload or launch leaves it unknown). Positions advance one a step and
    /// a page lasts 64 of them, so most steps' tables equal the last ones and are not uploaded.
    host_tables: Vec<i32>,
    device_tables: Vec<i32>,
    tables_held: bool,
    times: LaunchTimes,
    /// Launches queued and not yet collected (`queue`), oldest first: the slot of `pinned` their
    /// tokens come back to, and their rows.
    pending: VecDeque<(usize, usize)>,
    /// Launches queued so far (slots alternate).
    queued: u64,
    /// Two page-locked buffers of `rows` tokens, and per slot the event after its copy
    /// (allocated with the first queued launch).
    pinned: Vec<(PinnedHostSlice<i32>, CudaEvent)>,
}

/// Page-locked memory the device reads in place (`CU_MEMHOSTALLOC_DEVICEMAP`): word 0 says which
/// launch's masks are there (`MkStepArgs.mask_ready`, `mask_epoch`), the masks follow from word
/// `LATE_MASKS_AT` as [rows][words].
struct LateMasks {
    host: PinnedHostSlice<u32>,
    device: u64,
    /// The last launch queued with late masks, and its masked rows until they are delivered.
    epoch: u32,
    awaiting: Option<Vec<bool>>,
}

/// Where the masks start in `LateMasks` (128 bytes past the flag word).
const LATE_MASKS_AT: usize = 32;

impl Drop for GpuLauncher {
    /// A queued launch still copies its tokens into page-locked memory that drops with this (and
    /// one waiting for its masks gets its word first, or it would not finish before giving up).
    fn drop(&mut self) {
        let _ = self.release_masks();
        if !self.pending.is_empty() || self.late.is_some() {
            let _ = self.stream.synchronize();
        }
    }
}

/// Every masked row has a mask of the vocabulary's words, and only those rows have one.
fn check_masks(step: &StepRows<'_>, words: usize) -> Result<(), GpuError> {
    if step.late_masks {
        return match step.masks.is_empty() {
            true => Ok(()),
            false => Err(invalid("a launch with late masks has none yet".into())),
        };
    }
    if step.masks.is_empty() {
        return match step.samples.iter().any(|s| s.masked != 0) {
            true => Err(invalid("a masked row has no mask".into())),
            false => Ok(()),
        };
    }
    if step.masks.len() != step.samples.len() {
        return Err(invalid("masks and samples differ in length".into()));
    }
    for (i, (s, m)) in step.samples.iter().zip(step.masks).enumerate() {
        match (s.masked != 0, m) {
            (true, Some(m)) if m.words.len() == words => {}
            (true, Some(m)) => {
                return Err(invalid(format!("row {i}'s mask has {} words, the vocabulary {words}", m.words.len())))
            }
            (true, None) => return Err(invalid(format!("masked row {i} has no mask"))),
            (false, Some(_)) => return Err(invalid(format!("row {i} has a mask but is not masked"))),
            (false, None) => {}
        }
    }
    Ok(())
}

fn invalid(msg: String) -> GpuError {
    GpuError::InvalidArgument(msg)
}

fn driver(action: &'static str) -> impl FnOnce(DriverError) -> GpuError {
    move |source| GpuError::Driver { action, source }
}

impl GpuLauncher {
    /// Allocates this side's buffers on `stream` (the engine's stream, kept alive by its owner
    /// for as long as this launcher lives).
    ///
    /// # Safety
    /// Every address in `setup.args` must be live device memory of `gpu`'s device, laid out as
    /// python/mk/megakernel/buffers.py describes for `setup.rows` rows, `setup.max_splits` splits,
    /// `setup.slots` slots and `setup.options.sample_parts` parts, for as long as this launcher lives.
    pub unsafe fn new(gpu: Arc<Gpu>, stream: sys::CUstream, mut setup: StepSetup) -> Result<Self, GpuError> {
        setup.options.num_sms = gpu.num_sms() as usize;
        validate(&setup)?;
        let stream = gpu.borrow_stream(stream);
        let layers = setup.dims.layers();
        let num_counters = crate::graph::task::num_counters(layers);
        let alloc = |n: usize| stream.alloc_zeros::<i32>(n.max(1)).map_err(driver("allocate step inputs"));
        let tokens = alloc(setup.rows)?;
        let positions = alloc(setup.rows)?;
        let tables = alloc(layers * setup.rows * setup.max_pages)?;
        let samples = stream.alloc_zeros::<MkRowSample>(setup.rows.max(1)).map_err(driver("allocate step inputs"))?;
        let counters = stream.alloc_zeros::<u32>(2 * num_counters).map_err(driver("allocate the counters"))?;
        Ok(Self {
            gpu,
            stream,
            setup,
            launches: Vec::new(),
            band_uploads: !std::env::var("MK_TASK_UPLOAD").is_ok_and(|v| v == "full"),
            tokens,
            positions,
            tables,
            samples,
            masks: None,
            host_masks: Vec::new(),
            late: None,
            counters,
            num_counters,
            parity: 0,
            host_positions: Vec::new(),
            host_i32: Vec::new(),
            host_tables: Vec::new(),
            device_tables: Vec::new(),
            tables_held: false,
            times: LaunchTimes::default(),
            pending: VecDeque::new(),
            queued: 0,
            pinned: Vec::new(),
        })
    }

    pub fn max_rows(&self) -> usize {
        self.setup.rows
    }

    pub fn vocab(&self) -> usize {
        self.setup.dims.vocab
    }

    /// Where the launches' host time went so far (`run`'s phases).
    pub fn launch_times(&self) -> LaunchTimes {
        self.times
    }

    /// Runs one step over `step` (1..=max_rows rows) and waits for it. `sampled` receives the
    /// kernel's greedy token of every row; `logits` the `vocab` logits of each row with
    /// `want_logits`, in row order.
    pub fn run(&mut self, step: &StepRows<'_>, sampled: &mut Vec<u32>, logits: &mut Vec<f32>) -> Result<(), GpuError> {
        if !self.pending.is_empty() {
            return Err(invalid("a queued launch has not been collected".into()));
        }
        if step.late_masks {
            return Err(invalid("only a queued launch takes its masks late".into()));
        }
        self.launch(step, &[])?;
        let launched = Instant::now();
        self.download(step, sampled, logits)?;
        self.times.wait_ns += launched.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// Queues one step over `step` behind the launches before it and returns once it is launched
    /// (at most two are queued): a row with `previous[i] = Some(j)` takes as its token the one
    /// the launch queued just before samples for its row j, copied on the device (the host has
    /// not seen it; `previous` empty: every token is in `step`). No logits come back; `collect`
    /// returns the tokens, in queue order. (A row without a finite logit gets `vocab` as its
    /// token, which the host refuses when it collects the step, failing its rows; a step queued
    /// behind it reads the embedding row the kernel clamps that token to.)
    pub fn queue(&mut self, step: &StepRows<'_>, previous: &[Option<usize>]) -> Result<(), GpuError> {
        if !(previous.is_empty() || previous.len() == step.rows.len()) || step.want_logits.iter().any(|&w| w) {
            return Err(invalid("a queued launch names a source for every row or none, and wants no logits".into()));
        }
        if self.pending.len() >= 2 {
            return Err(invalid("two launches are queued already".into()));
        }
        if self.late.as_ref().is_some_and(|l| l.awaiting.is_some()) {
            return Err(invalid("the launch queued before still waits for its masks".into()));
        }
        let before = self.pending.back().map_or(0, |&(_, rows)| rows);
        if let Some(j) = previous.iter().flatten().find(|&&j| j >= before) {
            return Err(invalid(format!("row {j} of the launch before does not exist (it had {before} rows)")));
        }
        if self.pinned.is_empty() {
            for _ in 0..2 {
                let ctx = self.stream.context();
                // SAFETY: only ever read after a copy into it has completed (its event). Not
                // write-combined (cudarc's default): the host reads it.
                let buf = unsafe { ctx.alloc_pinned_with_flags::<i32>(self.setup.rows, 0) }
                    .map_err(driver("allocate pinned memory"))?;
                self.pinned.push((buf, ctx.new_event(None).map_err(driver("create an event"))?));
            }
        }
        // Once launched, a launch waiting for masks gets its word even if what follows fails (its
        // rows fail through the error), or it would wait until it gives up.
        let queued = self.launch(step, previous).and_then(|()| self.copy_back(step.rows.len()));
        if queued.is_err() {
            let _ = self.release_masks();
        }
        queued
    }

    /// After a queued launch: its tokens into the next page-locked slot behind an event.
    fn copy_back(&mut self, b: usize) -> Result<(), GpuError> {
        let slot = (self.queued % 2) as usize;
        self.stream.context().bind_to_thread().map_err(driver("bind the context"))?;
        let (buf, event) = &mut self.pinned[slot];
        let host = buf.as_mut_slice().map_err(driver("reuse pinned memory"))?;
        // SAFETY: `sampled` is int32 [rows] of Python's buffers, written by the launch just queued
        // on this stream; the page-locked destination outlives the copy, and is read only after
        // its event (`collect`), which waits for it.
        unsafe { result::memcpy_dtoh_async(&mut host[..b], self.setup.args.sampled, self.stream.cu_stream()) }
            .map_err(driver("copy back the sampled tokens"))?;
        event.record(&self.stream).map_err(driver("record an event"))?;
        self.queued += 1;
        self.pending.push_back((slot, b));
        Ok(())
    }

    /// A launch that waits for masks which will not come gets its word (its masks as the buffer
    /// can hold them; its rows fail through the caller's error).
    fn release_masks(&mut self) -> Result<(), GpuError> {
        match self.late.as_ref().and_then(|l| l.awaiting.as_ref()) {
            Some(rows) => {
                let none = vec![None; rows.len()];
                self.write_masks(&none).map(|_| ())
            }
            None => Ok(()),
        }
    }

    /// Waits for the oldest queued launch; `sampled` receives its rows' greedy tokens.
    pub fn collect(&mut self, sampled: &mut Vec<u32>) -> Result<(), GpuError> {
        let (slot, b) = self.pending.pop_front().ok_or_else(|| invalid("no launch is queued".into()))?;
        let waited = Instant::now();
        let (buf, event) = &self.pinned[slot];
        event.synchronize().map_err(driver("run the decode step"))?;
        let host = buf.as_slice().map_err(driver("read pinned memory"))?;
        sampled.extend(host[..b].iter().map(|&t| t as u32));
        self.times.wait_ns += waited.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// Uploads and launches one step on the stream (`previous`: see `queue`; empty: the tokens
    /// are `step.tokens`).
    fn launch(&mut self, step: &StepRows<'_>, previous: &[Option<usize>]) -> Result<(), GpuError> {
        let started = Instant::now();
        let b = step.rows.len();
        if b == 0 || b > self.setup.rows {
            return Err(invalid(format!("a launch takes 1 to {} rows, got {b}", self.setup.rows)));
        }
        if step.tokens.len() != b || step.positions.len() != b || step.want_logits.len() != b || step.samples.len() != b
        {
            return Err(invalid("rows, tokens, positions, want_logits and samples differ in length".into()));
        }
        let g = &self.setup.dims;
        check_masks(step, TokenMask::words_for(g.vocab))?;
        if let Some(t) = step.tokens.iter().find(|&&t| t as usize >= g.vocab) {
            return Err(invalid(format!("token {t} is outside the vocabulary of {}", g.vocab)));
        }
        let table = step.table;
        if table.layers() != g.layers() || table.max_pages() > self.setup.max_pages {
            return Err(invalid(format!(
                "the page table ({} layers, {} pages) does not fit this launcher ({} layers, {} pages)",
                table.layers(),
                table.max_pages(),
                g.layers(),
                self.setup.max_pages
            )));
        }

        self.host_positions.clear();
        self.host_positions.extend(step.positions.iter().map(|&p| p as usize));
        // Not checked per step: the builder is what the static checker tests prove correct, and a
        // patched graph equals a fresh build (graph::cache tests).
        while self.launches.len() <= step.launch {
            let graphs = GraphCache::new(g.clone(), self.setup.options.clone());
            self.launches.push(LaunchTasks { graphs, copies: Vec::new() });
        }
        let launch = &mut self.launches[step.launch];
        let graph = launch.graphs.step(&self.host_positions).map_err(|e| invalid(e.to_string()))?;
        if graph.max_splits > self.setup.max_splits || graph.slots > self.setup.slots {
            return Err(invalid(format!(
                "the step needs {} attention splits and {} MoE slots; the buffers hold {} and {}",
                graph.max_splits, graph.slots, self.setup.max_splits, self.setup.slots
            )));
        }
        let (per_sm, num_sms, slots) = (graph.per_sm, graph.num_sms, graph.slots);
        let pages = step_pages(step.positions);
        if pages > table.max_pages() {
            return Err(invalid(format!("a position needs page {} of a {}-page table", pages - 1, table.max_pages())));
        }
        compact_tables(table, step.rows, pages, &mut self.host_tables);
        check_mapped(&self.host_tables, step.positions, pages, &g.window, self.setup.num_blocks).map_err(invalid)?;

        let prepared = Instant::now();
        // A failed upload or launch leaves the device copy unknown. Most steps' lists are the
        // previous step's (the kernel computes attention keys from the positions).
        if launch.copies.len() <= graph.entry {
            launch.copies.resize_with(graph.entry + 1, DeviceTasks::default);
        }
        let copy = &mut launch.copies[graph.entry];
        match graph.upload_for(copy.uploaded.take()) {
            Upload::Nothing => {}
            Upload::Bands => upload_tasks(&self.stream, &mut copy.buf, &graph, self.band_uploads)?,
            Upload::Full => upload_tasks(&self.stream, &mut copy.buf, &graph, false)?,
        }
        let tasks = ptr(copy.buf.as_ref().expect("uploaded"), &self.stream);
        let (entry, version) = (graph.entry, graph.version);
        let same_tables = std::mem::take(&mut self.tables_held) && self.device_tables == self.host_tables;
        self.upload(step, !same_tables)?;
        self.forward_tokens(previous)?;
        if !same_tables {
            std::mem::swap(&mut self.host_tables, &mut self.device_tables);
        }
        let uploaded = Instant::now();
        let mut args = self.setup.args;
        args.tasks = tasks;
        args.counters = ptr(&self.counters, &self.stream);
        args.tokens = ptr(&self.tokens, &self.stream);
        args.positions = ptr(&self.positions, &self.stream);
        args.block_tables = ptr(&self.tables, &self.stream);
        args.row_samples = self.upload_samples(step.samples)?;
        (args.row_masks, args.mask_ready, args.mask_epoch) = match step.late_masks {
            true => self.await_masks(step.samples)?,
            false => (self.upload_masks(step.masks)?, 0, 0),
        };
        args.per_sm = per_sm as i32;
        args.num_counters = self.num_counters as i32;
        args.parity = self.parity;
        args.batch = b as i32;
        args.max_pages = pages as i32;
        args.max_splits = self.setup.max_splits as i32;
        args.slots = slots as i32;
        args.sample_parts = self.setup.options.sample_parts as i32;
        // SAFETY: the addresses are Python's live buffers (see `new`) and this launcher's, sized
        // for at least `b` rows, `pages` pages, these splits and slots (checked above); the task
        // lists come from `build_step`, whose graphs the static checker's tests cover.
        unsafe { self.gpu.decode_step(&args, num_sms as u32, self.stream.cu_stream(), 0)? };
        self.tables_held = true;
        self.parity ^= 1;
        self.launches[step.launch].copies[entry].uploaded = Some(version);
        let ns = |a: Instant, b: Instant| b.duration_since(a).as_nanos() as u64;
        let t = &mut self.times;
        t.launches += 1;
        t.prepare_ns += ns(started, prepared);
        t.upload_ns += ns(prepared, uploaded);
        t.call_ns += uploaded.elapsed().as_nanos() as u64;
        Ok(())
    }

    /// After the tokens' upload: each row with `previous[i] = Some(j)` gets, on the device, the
    /// token the launch before sampled for its row j (still in `sampled`: nothing else wrote it
    /// in between on this stream), one copy when the rows map one to one.
    fn forward_tokens(&self, previous: &[Option<usize>]) -> Result<(), GpuError> {
        if previous.iter().all(Option::is_none) {
            return Ok(());
        }
        const W: u64 = size_of::<i32>() as u64;
        let (s, sampled, tokens) = (self.stream.cu_stream(), self.setup.args.sampled, ptr(&self.tokens, &self.stream));
        let copy = |dst: u64, src: u64, bytes: u64| {
            // SAFETY: both are int32 [rows] device buffers (the launcher's tokens, Python's
            // sampled) and the indices were checked against the rows; ordered on the stream.
            unsafe { result::memcpy_dtod_async(dst, src, bytes as usize, s) }
                .map_err(driver("forward the sampled tokens"))
        };
        self.stream.context().bind_to_thread().map_err(driver("bind the context"))?;
        if previous.iter().enumerate().all(|(i, p)| *p == Some(i)) {
            return copy(tokens, sampled, previous.len() as u64 * W);
        }
        for (i, p) in previous.iter().enumerate() {
            if let Some(j) = *p {
                copy(tokens + i as u64 * W, sampled + j as u64 * W, W)?;
            }
        }
        Ok(())
    }

    /// Uploads the step's tokens and positions, and its page tables unless `tables` is false (the
    /// device copy already holds them).
    fn upload(&mut self, step: &StepRows<'_>, tables: bool) -> Result<(), GpuError> {
        let s = &self.stream;
        let b = step.rows.len();
        self.host_i32.clear();
        self.host_i32.extend(step.tokens.iter().map(|&t| t as i32));
        s.memcpy_htod(&self.host_i32[..], &mut self.tokens.slice_mut(..b)).map_err(driver("upload the tokens"))?;
        self.host_i32.clear();
        self.host_i32.extend(step.positions.iter().map(|&p| p as i32));
        s.memcpy_htod(&self.host_i32[..], &mut self.positions.slice_mut(..b))
            .map_err(driver("upload the positions"))?;
        if !tables {
            return Ok(());
        }
        let n = self.host_tables.len();
        s.memcpy_htod(&self.host_tables[..], &mut self.tables.slice_mut(..n)).map_err(driver("upload the page tables"))
    }

    /// Uploads the rows' draws where one is not greedy; returns MkStepArgs.row_samples (0: every
    /// row greedy, nothing uploaded).
    fn upload_samples(&mut self, samples: &[MkRowSample]) -> Result<u64, GpuError> {
        if samples.iter().all(MkRowSample::is_plain_greedy) {
            return Ok(0);
        }
        self.stream
            .memcpy_htod(samples, &mut self.samples.slice_mut(..samples.len()))
            .map_err(driver("upload the row samples"))?;
        Ok(ptr(&self.samples, &self.stream))
    }

    /// A launch whose masks come later: its masked rows, and MkStepArgs.row_masks, mask_ready and
    /// mask_epoch (the mapped buffer, its flag word and this launch's epoch).
    fn await_masks(&mut self, samples: &[MkRowSample]) -> Result<(u64, u64, i32), GpuError> {
        if self.late.is_none() {
            let words = TokenMask::words_for(self.setup.dims.vocab);
            let ctx = self.stream.context();
            // SAFETY: page-locked and mapped; the host writes it only while no launch reads it
            // (`deliver_masks`: the launch before has been collected) and the device reads it only
            // after the flag word says so.
            let mut host = unsafe {
                ctx.alloc_pinned_with_flags::<u32>(
                    LATE_MASKS_AT + self.setup.rows * words,
                    sys::CU_MEMHOSTALLOC_DEVICEMAP,
                )
            }
            .map_err(driver("allocate mapped memory"))?;
            host.as_mut_slice().map_err(driver("map the mask memory"))?.fill(0); // word 0: no epoch yet
            let p = host.as_mut_ptr().map_err(driver("map the mask memory"))?;
            let mut device = 0;
            // SAFETY: `p` is the start of a mapped page-locked allocation of this context.
            unsafe { sys::cuMemHostGetDevicePointer_v2(&mut device, p.cast(), 0) }
                .result()
                .map_err(driver("map the mask memory"))?;
            self.late = Some(LateMasks { host, device, epoch: 0, awaiting: None });
        }
        let late = self.late.as_mut().expect("allocated above");
        late.epoch = late.epoch.wrapping_add(1).max(1); // (0 is what the flag word starts at)
        late.awaiting = Some(samples.iter().map(|s| s.masked != 0).collect());
        let at = |words: usize| late.device + (words * size_of::<u32>()) as u64;
        Ok((at(LATE_MASKS_AT), at(0), late.epoch as i32))
    }

    /// The masks of the launch queued last with late masks (one per row, None: every token, for a
    /// row whose request has left), written where the device reads them, then the word its sample
    /// tasks wait for. Only once the launch before it has been collected (nothing else reads the
    /// buffer then).
    pub fn deliver_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<(), GpuError> {
        if self.late.as_ref().is_none_or(|l| l.awaiting.is_none()) {
            return Err(invalid("no launch waits for masks".into()));
        }
        self.write_masks(masks)?.map_or(Ok(()), Err)
    }

    /// `deliver_masks`'s writes, the word always; the outer error: nothing could be written, the
    /// inner one: the masks were not what the launch needs (it got every token allowed).
    fn write_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<Option<GpuError>, GpuError> {
        let words = TokenMask::words_for(self.setup.dims.vocab);
        let pending = self.pending.len();
        let late = self.late.as_mut().ok_or_else(|| invalid("no launch waits for masks".into()))?;
        let host = late.host.as_mut_slice().map_err(driver("reach the mask memory"))?;
        let rows = late.awaiting.take().ok_or_else(|| invalid("no launch waits for masks".into()))?;
        // Whatever goes wrong, the word is written: the launch must not wait forever (its rows
        // fail through the error instead).
        let mut error = None;
        if pending != 1 || masks.len() != rows.len() {
            // (the launch before may still read the buffer: its masks stay as they are)
            let (n, r) = (masks.len(), rows.len());
            error =
                Some(invalid(format!("masks for {n} rows, with {pending} launches queued, for a launch of {r} rows")));
        } else {
            for (i, (&masked, mask)) in rows.iter().zip(masks).enumerate() {
                let dst = &mut host[LATE_MASKS_AT + i * words..LATE_MASKS_AT + (i + 1) * words];
                match mask {
                    _ if !masked => {}
                    Some(m) if m.words.len() == words => dst.copy_from_slice(&m.words),
                    Some(_) => error = Some(invalid(format!("row {i}'s mask does not cover the vocabulary"))),
                    None => dst.fill(u32::MAX), // its request has left: the token is dropped
                }
            }
        }
        // The masks before the word that releases them (the device reads both over the bus).
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        // SAFETY: word 0 of the mapped allocation, which the device only reads.
        unsafe { std::ptr::write_volatile(&mut host[0], late.epoch) };
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        Ok(error)
    }

    /// Uploads each masked row's mask to its row of the mask buffer; returns MkStepArgs.row_masks
    /// (0: no row is masked, nothing uploaded). `check_masks` has checked their lengths.
    fn upload_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<u64, GpuError> {
        if masks.iter().all(Option::is_none) {
            return Ok(0);
        }
        let words = TokenMask::words_for(self.setup.dims.vocab);
        if self.masks.is_none() {
            let buffer =
                self.stream.alloc_zeros::<u32>(self.setup.rows * words).map_err(driver("allocate the masks"))?;
            self.masks = Some(buffer);
        }
        let buffer = self.masks.as_mut().expect("allocated above");
        // The launch's rows in one copy (a row without a mask uploads zeros the kernel never reads).
        self.host_masks.clear();
        self.host_masks.resize(masks.len() * words, 0);
        for (i, mask) in masks.iter().enumerate() {
            if let Some(mask) = mask {
                self.host_masks[i * words..(i + 1) * words].copy_from_slice(&mask.words);
            }
        }
        self.stream
            .memcpy_htod(&self.host_masks[..], &mut buffer.slice_mut(..masks.len() * words))
            .map_err(driver("upload the masks"))?;
        Ok(ptr(buffer, &self.stream))
    }

    fn download(&mut self, step: &StepRows<'_>, sampled: &mut Vec<u32>, logits: &mut Vec<f32>) -> Result<(), GpuError> {
        let b = step.rows.len();
        let vocab = self.setup.dims.vocab;
        let s = self.stream.cu_stream();
        self.stream.context().bind_to_thread().map_err(driver("bind the context"))?;
        self.host_i32.clear();
        self.host_i32.resize(b, -1);
        // SAFETY: `sampled` is int32 [rows] and `logits` fp32 [rows, vocab] of Python's buffers;
        // the copies are ordered after the launch on the same stream, and the host waits below.
        unsafe {
            result::memcpy_dtoh_async(&mut self.host_i32[..], self.setup.args.sampled, s)
                .map_err(driver("copy back the sampled tokens"))?;
            for (i, _) in step.want_logits.iter().enumerate().filter(|(_, &w)| w) {
                let at = logits.len();
                logits.resize(at + vocab, 0.0);
                let src = self.setup.args.logits + (i * vocab * size_of::<f32>()) as u64;
                result::memcpy_dtoh_async(&mut logits[at..], src, s).map_err(driver("copy back logits"))?;
            }
        }
        self.stream.synchronize().map_err(driver("run the decode step"))?;
        sampled.extend(self.host_i32.iter().map(|&t| t as u32));
        Ok(())
    }
}

/// Brings the device copy of a launch's task lists up to `graph`: everything, or (with `bands`:
/// the copy holds the lists `graph` patched) only the attention bands.
fn upload_tasks(
    s: &Arc<CudaStream>,
    buf: &mut Option<CudaSlice<MkTask>>,
    graph: &StepTasks<'_>,
    mut bands: bool,
) -> Result<(), GpuError> {
    let tasks = graph.tasks;
    if buf.as_ref().is_none_or(|t| t.len() < tasks.len()) {
        // Grows rarely (longer contexts add attention splits); the old buffer is freed in
        // stream order, after the launches that read it.
        let cap = tasks.len().next_power_of_two();
        *buf = Some(s.alloc_zeros::<MkTask>(cap).map_err(driver("allocate the task lists"))?);
        bands = false;
    }
    let dst = buf.as_mut().expect("allocated");
    if !bands {
        return s.memcpy_htod(tasks, &mut dst.slice_mut(..tasks.len())).map_err(driver("upload the task lists"));
    }
    let (base, _sync) = dst.device_ptr(s);
    s.context().bind_to_thread().map_err(driver("bind the context"))?;
    for copy in graph.band_copies() {
        let params = sys::CUDA_MEMCPY2D {
            srcXInBytes: copy.offset_bytes,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_HOST,
            srcHost: tasks.as_ptr().cast(),
            srcDevice: 0,
            srcArray: std::ptr::null_mut(),
            srcPitch: copy.pitch_bytes,
            dstXInBytes: copy.offset_bytes,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
            dstHost: std::ptr::null_mut(),
            dstDevice: base,
            dstArray: std::ptr::null_mut(),
            dstPitch: copy.pitch_bytes,
            WidthInBytes: copy.width_bytes,
            Height: copy.rows,
        };
        // SAFETY: the rectangle lies inside both arrays (rows × pitch = the lists' size; the device
        // buffer is at least that large, checked above), and from pageable host memory the call
        // returns once the source has been staged, so the host lists may change afterwards.
        unsafe { sys::cuMemcpy2DAsync_v2(&params, s.cu_stream()) }
            .result()
            .map_err(driver("upload the attention bands"))?;
    }
    Ok(())
}

fn ptr<T>(slice: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = slice.device_ptr(stream);
    p
}

/// The template must describe the geometry the graphs are built for, and hold every buffer.
fn validate(s: &StepSetup) -> Result<(), GpuError> {
    let (a, g) = (&s.args, &s.dims);
    let dims = [
        ("layers", a.layers, g.layers()),
        ("hidden", a.hidden, g.hidden),
        ("heads", a.heads, g.heads),
        ("kv_heads", a.kv_heads, g.kv_heads),
        ("head_dim", a.head_dim, g.head_dim),
        ("experts", a.experts, g.experts),
        ("top_k", a.top_k, g.top_k),
        ("expert_ffn", a.expert_ffn, g.expert_ffn),
        ("dense_ffn", a.dense_ffn, g.dense_ffn),
        ("vocab", a.vocab, g.vocab),
    ];
    for (name, got, want) in dims {
        if got as usize != want {
            return Err(invalid(format!("MkStepArgs.{name} is {got}, the model's geometry says {want}")));
        }
    }
    let pointers = [
        ("layer_weights", a.layer_weights),
        ("expert_weights", a.expert_weights),
        ("layer_maps", a.layer_maps),
        ("expert_maps", a.expert_maps),
        ("embed_map", a.embed_map),
        ("kv_maps", a.kv_maps),
        ("layer_window", a.layer_window),
        ("layer_rope", a.layer_rope),
        ("embed", a.embed),
        ("final_norm", a.final_norm),
        ("k_pool", a.k_pool),
        ("v_pool", a.v_pool),
        ("x", a.x),
        ("h", a.h),
        ("q", a.q),
        ("attn_o", a.attn_o),
        ("attn_ml", a.attn_ml),
        ("attn_out", a.attn_out),
        ("y_attn", a.y_attn),
        ("router", a.router),
        ("topk_slot", a.topk_slot),
        ("topk_score", a.topk_score),
        ("slot_expert", a.slot_expert),
        ("slot_count", a.slot_count),
        ("dense_act", a.dense_act),
        ("expert_act", a.expert_act),
        ("ffn_out", a.ffn_out),
        ("expert_out", a.expert_out),
        ("logits", a.logits),
        ("sample_score", a.sample_score),
        ("sample_id", a.sample_id),
        ("sampled", a.sampled),
        ("routing_log", a.routing_log),
        ("rope", a.rope),
    ];
    if let Some((name, _)) = pointers.iter().find(|(_, p)| *p == 0) {
        return Err(invalid(format!("MkStepArgs.{name} is a null pointer")));
    }
    if s.rows == 0 || s.rows > STEP_MAX_ROWS {
        return Err(invalid(format!("a launch holds 1 to {STEP_MAX_ROWS} rows, got buffers for {}", s.rows)));
    }
    let longest_k = a.longest_reduction(); // the dimensions equal the geometry's (checked above)
    if longest_k > crate::abi::STEP_MAX_K {
        return Err(invalid(format!(
            "a GEMV reduces over at most {} values (MK_STEP_MAX_K); this geometry needs {longest_k}",
            crate::abi::STEP_MAX_K
        )));
    }
    if s.max_splits == 0 || s.max_splits > s.options.num_sms || s.slots < g.slots(s.rows) || s.max_pages == 0 {
        return Err(invalid(format!(
            "buffers for {} splits (1..={} SMs), {} slots (at least {}) and {} pages (at least 1)",
            s.max_splits,
            s.options.num_sms,
            s.slots,
            g.slots(s.rows),
            s.max_pages
        )));
    }
    if s.options.attn_chunk != 0 {
        // A fixed chunk can need more splits than the buffers hold at long contexts.
        return Err(invalid("the engine sizes attention splits automatically (attn_chunk 0)".into()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A setup that passes: every address non-null, the GPU-test geometry, 8 rows.
    fn setup() -> StepSetup {
        let dims = crate::graph::tests::gpu_test();
        let g = &dims;
        let mut args = MkStepArgs {
            layers: g.layers() as i32,
            hidden: g.hidden as i32,
            heads: g.heads as i32,
            kv_heads: g.kv_heads as i32,
            head_dim: g.head_dim as i32,
            experts: g.experts as i32,
            top_k: g.top_k as i32,
            expert_ffn: g.expert_ffn as i32,
            dense_ffn: g.dense_ffn as i32,
            vocab: g.vocab as i32,
            ..Default::default()
        };
        // Every u64 field is an address here; give each a distinct non-null value.
        let base = std::ptr::addr_of_mut!(args).cast::<u8>();
        for (i, (_, offset, kind)) in MkStepArgs::layout().into_iter().enumerate() {
            if kind == "u64" {
                // SAFETY: `offset` is a u64 field of `args` (from its own layout table).
                unsafe { base.add(offset).cast::<u64>().write_unaligned(0x1000 * (i as u64 + 1)) };
            }
        }
        args.residual_log = 0;
        let options = BuildOptions { num_sms: 132, ..Default::default() };
        StepSetup { args, dims, rows: 8, max_splits: 132, slots: 32, max_pages: 128, num_blocks: 1000, options }
    }

    #[test]
    fn per_step_fields_are_fields_of_the_step_args() {
        let names: Vec<&str> = MkStepArgs::layout().into_iter().map(|(n, _, _)| n).collect();
        for f in PER_STEP_FIELDS {
            assert!(names.contains(&f), "{f}");
        }
    }

    #[test]
    fn a_complete_setup_passes() {
        validate(&setup()).unwrap();
    }

    #[test]
    fn a_setup_that_does_not_fit_is_refused() {
        let err = |s: StepSetup| validate(&s).unwrap_err().to_string();
        let mut s = setup();
        s.args.vocab = 262144;
        assert!(err(s).contains("MkStepArgs.vocab is 262144, the model's geometry says 32768"));
        let mut s = setup();
        s.args.routing_log = 0; // written by every TOPK task: it must exist
        assert!(err(s).contains("routing_log is a null pointer"));
        let too_many = err(StepSetup { rows: STEP_MAX_ROWS + 1, ..setup() });
        assert!(too_many.contains(&format!("1 to {STEP_MAX_ROWS} rows")), "{too_many}");
        assert!(err(StepSetup { max_splits: 133, ..setup() }).contains("133 splits"));
        assert!(err(StepSetup { slots: 31, ..setup() }).contains("31 slots"));
        let fixed = BuildOptions { attn_chunk: 256, ..setup().options };
        assert!(err(StepSetup { options: fixed, ..setup() }).contains("automatically"));
    }

    #[test]
    fn masks_go_with_masked_rows_only_and_cover_the_vocabulary() {
        let table = crate::sched::PageTable::new(1, 2, 1);
        let mask = TokenMask { words: vec![!0; TokenMask::words_for(100)] };
        let short = TokenMask { words: vec![!0; 3] };
        let (plain, masked) = (MkRowSample::default(), MkRowSample::default().with_mask());
        let check_late = |samples: &[MkRowSample], masks: &[Option<&TokenMask>], late_masks: bool| {
            let step = StepRows {
                rows: &[0, 1],
                tokens: &[0, 0],
                positions: &[0, 0],
                table: &table,
                want_logits: &[false, false],
                samples,
                masks,
                late_masks,
                launch: 0,
            };
            check_masks(&step, TokenMask::words_for(100)).is_ok()
        };
        let check = |samples: &[MkRowSample], masks: &[Option<&TokenMask>]| check_late(samples, masks, false);
        assert!(check_late(&[plain, masked], &[], true), "late masks come after the launch");
        assert!(!check_late(&[plain, masked], &[None, Some(&mask)], true), "late masks given at the launch");
        assert!(check(&[plain, plain], &[]));
        assert!(check(&[plain, masked], &[None, Some(&mask)]));
        assert!(!check(&[plain, masked], &[]), "a masked row without its mask");
        assert!(!check(&[plain, masked], &[None, None]), "a masked row without its mask");
        assert!(!check(&[plain, plain], &[Some(&mask), None]), "a mask on a row that is not masked");
        assert!(!check(&[plain, masked], &[None, Some(&short)]), "a mask shorter than the vocabulary");
        assert!(!check(&[plain, masked], &[Some(&mask)]), "masks for some rows only");
    }
}
