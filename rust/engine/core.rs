//! One loop iteration, synchronous and thread-free (the worker thread wraps it; tests drive it
//! directly): admit, prefill up to one chunk's worth of tokens, then one decode step of every
//! decoding sequence.
//!
//! Launch-ahead (`Core::launch_ahead`): an iteration without prefill launches decode step n + 1
//! before it lands step n (hands its tokens to the scheduler), each row's input being the token
//! step n samples for it, so that a backend that queues steps on a device never waits for the
//! host between them. A row that finishes with step n's token is in step n + 1 too: that token
//! is dropped when step n + 1 lands. Prefill, rows under a grammar and blocks that run out fall
//! back to one synchronous step. A backend that can queue the step (`QueuedDecoder::can_queue`) gets it
//! with, for each row, which of step n's rows samples its token (the token stays on the device),
//! and the step lands through `QueuedDecoder::collect`. A step the backend cannot queue is not launched
//! ahead: it runs synchronously (one planned behind a queued step runs before that step lands,
//! while its rows still hold their pages, and lands right after it), so no token is handed over
//! an iteration late. Launch-ahead changes when tokens are handed over, never what they are.
//!
//! Layer-sliced prefill (`Core::layer_slices`): while a sequence decodes, a prefill call holds up
//! to `prefill_chunk` tokens (not just the decode budget; at most the budget times the layers, one
//! layer a slice) and runs over several iterations, a few
//! layers each, so that each iteration's prefill work is at most the budget's tokens through the
//! whole model (tokens × layers ≤ budget × layers) and a decode step runs between the slices: a
//! decoding stream waits at most one slice, and the admitted prompt keeps its large chunks (once
//! nothing decodes, a call's remaining layers run at once). The call's sequences are checked
//! before every slice; if one has left (cancelled, preempted) the call is dropped and its other
//! sequences are planned again (their progress only moves when the last slice lands). With
//! launch-ahead, a slice between the first and the last goes to the backend while the step queued
//! before it is still in flight (it lands after the slice is issued), so that a device runs the
//! step and the slice back to back instead of idling while the host lands the step. A call of one
//! chunk of at most `Core::whole_chunk_tokens` tokens is not sliced: the engine sets that where
//! such a chunk replays a CUDA graph, which pauses the streams once and for less than the slices
//! of the eager path would, each of them one share of its fixed launch cost.

use std::time::Instant;

use super::backend::{
    Backend, BackendError, DecodeInput, LaunchTimes, LayerSlice, PrefillChunkInput, PrefillInput, PrefillResult,
    QueuedDecoder,
};
use crate::grammar::{allowed_all, Constraint, MaskError, MaskSet, TokenMask, NO_MASKS};
use crate::sampling::Sampled;
use crate::sched::{DecodeBatch, Event, Phase, PrefillChunk, Scheduler};

/// A layer-sliced prefill call in progress: its chunks, who each was planned for, and its slices.
struct Sliced {
    chunks: Vec<PrefillChunk>,
    owners: Vec<Owner>,
    /// Layers per slice, the next slice's first layer and the model's layers.
    per_slice: usize,
    next: usize,
    layers: usize,
}

/// What a prefill call gave (`Core::step_with`): results to land, a slice before the last that went
/// through, or a failed sliced call of several chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Called {
    Land,
    SliceDone,
    Isolate,
}

/// A chunk's sequence as planned: a sequence that was cancelled and resubmitted under the same id
/// (another arrival), preempted (another count) or has moved on is not the one the chunk is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Owner {
    arrival: u64,
    preemptions: u32,
    computed: usize,
}

fn owner(sched: &Scheduler, chunk: &PrefillChunk) -> Option<Owner> {
    let seq = sched.seq(chunk.row).filter(|s| s.id == chunk.id && matches!(s.phase, Phase::Prefill { .. }))?;
    Some(Owner { arrival: seq.arrival, preemptions: seq.preemptions, computed: seq.computed })
}

/// A decode step launched and not yet landed: its batch, what it gives when it lands, whether it
/// was queued with rows under a grammar whose masks are still to be delivered (`late_masks`), and
/// an error that fails its rows when it lands (their masks could not be delivered; it is still
/// collected, so that the backend's queue stays in step).
struct Flight {
    batch: DecodeBatch,
    landing: Landing,
    masks_due: bool,
    failed: Option<BackendError>,
}

/// A launched step's tokens: known (the backend ran it when it was launched, or it failed), or
/// still on the device (queued: `QueuedDecoder::collect` waits for them).
enum Landing {
    Ran(Result<Vec<Sampled>, BackendError>),
    Queued,
}

/// Where the loop's time goes. Host time is an iteration's wall time minus its backend calls:
/// the control plane's own cost per step.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoopMetrics {
    /// Iterations that ran a decode step.
    pub decode_steps: u64,
    /// Rows over all decode steps.
    pub decode_rows: u64,
    /// Decode steps queued behind the one before (launch-ahead), not run at once.
    pub queued_steps: u64,
    pub prefill_chunks: u64,
    /// Prefill calls that ran one slice of a layer-sliced prefill (`Core::layer_slices`).
    pub prefill_slices: u64,
    pub iterations: u64,
    pub host_ns: u64,
    pub backend_ns: u64,
    /// The slowest iteration's host time.
    pub max_host_ns: u64,
    /// Inside the backend's decode calls: where its host time went (`Backend::launch_times`).
    pub launch: LaunchTimes,
}

pub struct Core<B> {
    pub sched: Scheduler,
    pub backend: B,
    batch: DecodeBatch,
    sampled: Vec<Sampled>,
    chunks: Vec<PrefillChunk>,
    prefilled: Vec<PrefillResult>,
    pub metrics: LoopMetrics,
    /// Run `Scheduler::check` after every iteration (tests; O(arena) per step).
    pub check_invariants: bool,
    /// Launch decode step n + 1 before landing step n (module docs).
    pub launch_ahead: bool,
    /// The model's layers, where prefill is layer-sliced while a sequence decodes (module docs);
    /// None: every prefill call runs the whole model.
    pub layer_slices: Option<usize>,
    /// A prefill call of one chunk of at most this many tokens runs the whole model even where
    /// `layer_slices` would slice it (module docs); 0: none.
    pub whole_chunk_tokens: usize,
    in_flight: Option<Flight>,
    previous: Vec<Option<usize>>,
    sliced: Option<Sliced>,
    /// Prefill calls still to plan with one chunk each, after a sliced call of several failed (so
    /// that the error ends only the request it concerns).
    isolate: usize,
}

impl<B: Backend> Core<B> {
    pub fn new(sched: Scheduler, backend: B) -> Self {
        Self {
            sched,
            backend,
            batch: DecodeBatch::default(),
            sampled: Vec::new(),
            chunks: Vec::new(),
            prefilled: Vec::new(),
            metrics: LoopMetrics::default(),
            check_invariants: false,
            launch_ahead: false,
            layer_slices: None,
            whole_chunk_tokens: 0,
            in_flight: None,
            previous: Vec::new(),
            sliced: None,
            isolate: 0,
        }
    }

    /// This iteration's prefill call into `chunks`: the next slice of a sliced call whose
    /// sequences all still wait for it, else newly planned chunks, sliced (module docs) where
    /// `layer_slices` is set, a sequence decodes and they hold more tokens than the budget (and
    /// than `whole_chunk_tokens` if they are one chunk). None: the call runs the whole model.
    fn plan_prefill_call(&mut self, chunks: &mut Vec<PrefillChunk>, out: &mut Vec<Event>) -> Option<LayerSlice> {
        if let Some(mut sl) = self.sliced.take() {
            if sl.chunks.iter().zip(&sl.owners).all(|(c, o)| owner(&self.sched, c) == Some(*o)) {
                if self.sched.prefill_budget() >= self.sched.config().prefill_chunk {
                    sl.per_slice = sl.layers; // nothing decodes any more: the rest at once
                }
                chunks.clone_from(&sl.chunks);
                return Some(self.next_slice(sl));
            }
            // A sequence of the call has left: the call is dropped, the others are planned again.
        }
        let budget = self.sched.prefill_budget();
        let chunk = self.sched.config().prefill_chunk;
        let layers = self.layer_slices.filter(|&l| l > 1 && budget < chunk);
        // Sliced: up to a chunk, and at most the budget's tokens through one layer a slice.
        self.sched.plan_prefill(layers.map_or(budget, |l| chunk.min(budget * l)), chunks, out);
        if self.isolate > 0 && !chunks.is_empty() {
            // (the others stay mapped; their next chunks take those positions: Scheduler::plan_prefill)
            self.isolate -= 1;
            chunks.truncate(1);
        }
        let layers = layers?;
        let tokens: usize = chunks.iter().map(|c| c.end - c.start).sum();
        if tokens <= budget || (chunks.len() == 1 && tokens <= self.whole_chunk_tokens) {
            return None;
        }
        let owners = chunks.iter().map(|c| owner(&self.sched, c).expect("a planned chunk's sequence")).collect();
        let per_slice = (budget * layers / tokens).max(1);
        Some(self.next_slice(Sliced { chunks: chunks.clone(), owners, per_slice, next: 0, layers }))
    }

    /// The next slice of `sl`, which is kept for the one after unless this is its last.
    fn next_slice(&mut self, mut sl: Sliced) -> LayerSlice {
        let start = sl.next;
        let end = (start + sl.per_slice).min(sl.layers);
        let last = end == sl.layers;
        sl.next = end;
        if !last {
            self.sliced = Some(sl);
        }
        LayerSlice { start, end, last }
    }

    /// Whether an iteration would do anything: a live or waiting request, or a step to land.
    pub fn busy(&self) -> bool {
        self.sched.busy() || self.in_flight.is_some()
    }

    /// One iteration; events for the clients are appended to `out`.
    pub fn step(&mut self, out: &mut Vec<Event>) {
        self.step_with(out, |_: &mut Self, _: &mut Vec<Event>| {});
    }

    /// One iteration, calling `between` after the prefill chunks and before the decode step (the
    /// worker delivers first tokens there instead of one decode step later): admit, prefill, land
    /// the step in flight and launch the next one ahead where it can, else decode now, then the
    /// late masks and the loop's metrics.
    pub fn step_with(&mut self, out: &mut Vec<Event>, mut between: impl FnMut(&mut Self, &mut Vec<Event>)) {
        let started = Instant::now();
        self.sched.admit();
        let mut backend_ns = self.prefill_phase(out);
        if !out.is_empty() {
            between(self, out);
        }
        let (ns, launched) = self.launch_ahead_phase(out);
        backend_ns += ns;
        backend_ns += self.decode_phase(launched, out);
        backend_ns += self.deliver_masks();
        self.account(started, backend_ns);
    }

    /// This iteration's prefill call, its results landed (the step in flight lands first, unless
    /// the call is a slice in the middle of a layer-sliced chunk). Returns the backend's time in ns.
    fn prefill_phase(&mut self, out: &mut Vec<Event>) -> u64 {
        let mut backend_ns = 0;
        // Every prefill chunk of this iteration (one per sequence, a chunk's worth of tokens in
        // all) goes to the backend as one call, which packs them into one forward pass.
        let mut chunks = std::mem::take(&mut self.chunks);
        let layers = self.plan_prefill_call(&mut chunks, out);
        let results_due = layers.is_none_or(|s| s.last);
        if !chunks.is_empty() {
            // The step in flight first: the prefill writes K/V the scheduler has just mapped, and its
            // last slice hands over results. A slice in the middle of a call maps nothing and hands
            // over nothing: the step stays in flight and lands after it (below, as without
            // prefill), so that the device runs the slice right behind the step instead of waiting
            // for the host to land the step and only then start the slice.
            let mid_slice = layers.is_some_and(|s| s.start > 0 && !s.last);
            if !mid_slice {
                if let Some(flight) = self.in_flight.take() {
                    backend_ns += self.land(flight, out);
                }
            }
            // A prompt's last chunk samples its first token: under a grammar, with its mask, which a
            // helper thread computes while the backend runs the forward pass.
            let sampling = chunks.iter().map(|c| (c.last && results_due).then_some(c.row));
            let (mut lent, masks) = Lent::take(&mut self.sched, sampling).unzip();
            let sched = &self.sched;
            let inputs: Vec<PrefillChunkInput<'_>> = chunks
                .iter()
                .enumerate()
                .map(|(i, c)| PrefillChunkInput {
                    row: c.row,
                    request: c.id,
                    tokens: &sched.seq(c.row).expect("planned row is live").tokens[c.start..c.end],
                    start: c.start,
                    last: c.last,
                    spec: c.spec,
                    entry: i,
                })
                .collect();
            let input = PrefillInput {
                chunks: &inputs,
                masks: masks.as_ref().unwrap_or(&NO_MASKS),
                table: sched.page_table(),
                dirty_rows: sched.dirty_rows(),
                layers,
            };
            let mut results = std::mem::take(&mut self.prefilled);
            results.clear();
            let t = Instant::now();
            let backend = &mut self.backend;
            let outcome = std::thread::scope(|s| {
                if let (Some(l), Some(masks)) = (&mut lent, &masks) {
                    s.spawn(move || l.fill(masks));
                }
                match backend.prefill(&input, &mut results) {
                    Ok(()) if results_due => Called::Land,
                    Ok(()) if results.is_empty() => Called::SliceDone,
                    Ok(()) => {
                        let n = results.len();
                        results.clear();
                        let e = BackendError(format!("the backend returned {n} results before the last slice"));
                        results.resize(inputs.len(), Err(e));
                        Called::Land
                    }
                    Err(e) if inputs.len() == 1 => {
                        results.clear();
                        results.push(Err(e));
                        Called::Land
                    }
                    // A sliced call cannot be retried from here (its mask-free slices before the
                    // last, its earlier slices' writes): its chunks go again one call each.
                    Err(_) if layers.is_some() => {
                        results.clear();
                        Called::Isolate
                    }
                    Err(_) => {
                        // A failed packed call is retried chunk by chunk, so an error ends only the
                        // requests it concerns (a retried chunk rewrites the same K/V).
                        results.clear();
                        for chunk in &inputs {
                            let alone = PrefillInput { chunks: std::slice::from_ref(chunk), ..input };
                            if let Err(e) = backend.prefill(&alone, &mut results) {
                                results.push(Err(e));
                            }
                        }
                        Called::Land
                    }
                }
            });
            backend_ns += t.elapsed().as_nanos() as u64;
            drop(inputs);
            if let Some(l) = lent {
                l.give_back(&mut self.sched);
            }
            self.sched.clear_dirty();
            self.metrics.prefill_slices += u64::from(layers.is_some());
            // A slice before the last that went through leaves its chunks waiting for the next
            // (`plan_prefill_call` kept them); a failed sliced call is dropped, its chunks planned
            // again one a call; anything else lands now.
            if outcome == Called::Isolate {
                self.sliced = None;
                self.isolate = chunks.len();
            }
            if outcome == Called::Land {
                self.sliced = None;
                self.metrics.prefill_chunks += chunks.len() as u64;
                if results.len() != chunks.len() {
                    let n = results.len();
                    results.resize_with(chunks.len(), || Err(BackendError(format!("prefill returned {n} results"))));
                }
                for (chunk, result) in chunks.iter().zip(results.drain(..)) {
                    match result {
                        Ok(sampled) => self.sched.prefill_done(chunk, sampled.as_ref(), out),
                        Err(e) => self.sched.fail(chunk.row, &format!("prefill failed: {e}"), out),
                    }
                }
            }
            self.prefilled = results;
        }
        self.chunks = chunks;
        backend_ns
    }

    /// Lands the step in flight, with step n + 1 launched before it lands where the backend can
    /// queue it behind step n (or run right after it). Returns the backend's time in ns and
    /// whether a step went out.
    fn launch_ahead_phase(&mut self, out: &mut Vec<Event>) -> (u64, bool) {
        let mut backend_ns = 0;
        let mut launched = false;
        if let Some(mut flight) = self.in_flight.take() {
            let mut batch = std::mem::take(&mut self.batch);
            let mut previous = std::mem::take(&mut self.previous);
            let usable = match &flight.landing {
                Landing::Ran(Ok(sampled)) => sampled.len() == flight.batch.len(),
                Landing::Ran(Err(_)) => false,
                Landing::Queued => true,
            };
            let late = usable && self.late_masks_ahead();
            if usable && self.sched.plan_ahead(&flight.batch, &mut batch, &mut previous, late) && !batch.is_empty() {
                let masks = self.pending_masks(&batch);
                if matches!(flight.landing, Landing::Queued)
                    && !self.can_queue(&DecodeInput { masks: &masks, ..unmasked_input(&self.sched, &batch) })
                {
                    // (`late_masks_ahead` asked this of every decoding row: a step with a row under
                    // a grammar is queueable, or plan_ahead would not have planned it.)
                    debug_assert!(!masks.any_constrained(), "a step under a grammar must be queued");
                    // Step n's tokens are on the device and this step cannot follow them there.
                    backend_ns += self.collect(&mut flight);
                }
                match &flight.landing {
                    Landing::Queued => {
                        // (The backend can queue it: otherwise step n was collected above.)
                        backend_ns += self.launch(std::mem::take(&mut batch), &previous, true);
                        launched = true;
                    }
                    Landing::Ran(Ok(sampled)) if sampled.len() == flight.batch.len() => {
                        // Collected above: this step cannot be queued, so `launch` runs it now,
                        // while every row it was planned with still holds its pages; it lands
                        // right after step n, below, so that none of its tokens waits an iteration.
                        for (t, p) in batch.tokens.iter_mut().zip(&previous) {
                            if let Some(s) = p.and_then(|j| sampled.get(j)) {
                                *t = s.token;
                            }
                        }
                        backend_ns += self.launch(std::mem::take(&mut batch), &[], false);
                        launched = true;
                    }
                    Landing::Ran(_) => {} // step n failed: its rows fail as it lands
                }
            }
            self.batch = batch;
            self.previous = previous;
            backend_ns += self.land(flight, out);
            backend_ns += self.land_if_ran(out);
        }
        (backend_ns, launched)
    }

    /// Where no step went out ahead: plans the decode step and queues it (launch-ahead, when the
    /// backend can) or runs it now. Returns the backend's time in ns.
    fn decode_phase(&mut self, launched: bool, out: &mut Vec<Event>) -> u64 {
        if launched {
            return 0;
        }
        self.sched.plan_decode(&mut self.batch, out);
        if self.batch.is_empty() {
            return 0;
        }
        let batch = std::mem::take(&mut self.batch);
        let constrained = batch.rows.iter().any(|&r| self.sched.seq(r).is_some_and(|s| s.constrained()));
        // Only a step the backend can queue goes out ahead: one it would run at once would hand
        // its tokens over an iteration late (a step's time added to every token). Rows under a
        // grammar go with it where the backend takes their masks late.
        let masks = self.pending_masks(&batch);
        let input = DecodeInput { masks: &masks, ..unmasked_input(&self.sched, &batch) };
        let queueable = batch.drafts == 0 && (!constrained || self.takes_late_masks()) && self.can_queue(&input);
        if self.launch_ahead && queueable {
            // (a queue that refused it leaves it ran: its rows fail now)
            self.launch(batch, &[], true) + self.land_if_ran(out)
        } else {
            self.decode_now(batch, out)
        }
    }

    /// The loop's metrics of an iteration that started at `started` and spent `backend_ns` in the
    /// backend; the scheduler's invariants where they are checked.
    fn account(&mut self, started: Instant, backend_ns: u64) {
        let host = (started.elapsed().as_nanos() as u64).saturating_sub(backend_ns);
        let m = &mut self.metrics;
        m.iterations += 1;
        m.host_ns += host;
        m.backend_ns += backend_ns;
        m.max_host_ns = m.max_host_ns.max(host);
        if self.check_invariants {
            if let Err(e) = self.sched.check() {
                panic!("scheduler invariant broken: {e}");
            }
        }
    }
}

impl<B: Backend> Core<B> {
    /// Whether the backend queues this step (`QueuedDecoder::can_queue`; never without one).
    fn can_queue(&self, input: &DecodeInput<'_>) -> bool {
        self.backend.queued_ref().is_some_and(|q| q.can_queue(input))
    }

    /// Whether the backend takes the masks of a queued step's rows late (`QueuedDecoder::late_masks`).
    fn takes_late_masks(&self) -> bool {
        self.backend.queued_ref().is_some_and(|q| q.late_masks())
    }

    /// Queues `batch`'s step where `queue` says (the caller has asked `QueuedDecoder::can_queue`;
    /// `previous`: for each row, the row of the step in flight whose token it feeds, or nothing
    /// where `batch.tokens` holds it), else runs it (its tokens are all known then), and keeps it
    /// in flight: a queued step lands in the next iteration, one that ran through `land_if_ran`.
    /// Returns the backend's time in ns.
    fn launch(&mut self, batch: DecodeBatch, previous: &[Option<usize>], queue: bool) -> u64 {
        let t = Instant::now();
        // A queued step's rows under a grammar get their masks at the end of the iteration.
        let masks = if queue { self.pending_masks(&batch) } else { MaskSet::pending(Vec::new()) };
        let input = DecodeInput { masks: &masks, ..unmasked_input(&self.sched, &batch) };
        let landing = if queue {
            match queued_decoder(&mut self.backend).and_then(|q| q.queue(&input, previous)) {
                Ok(()) => {
                    self.metrics.queued_steps += 1;
                    Landing::Queued
                }
                Err(e) => Landing::Ran(Err(e)),
            }
        } else {
            debug_assert!(previous.iter().all(Option::is_none), "the tokens of a step not queued are known");
            // The landing step gives its buffer back (`land`): two alternate, none is allocated per step.
            let mut sampled = std::mem::take(&mut self.sampled);
            sampled.clear();
            Landing::Ran(self.backend.decode(&input, &mut sampled).map(|()| sampled))
        };
        let ns = t.elapsed().as_nanos() as u64;
        self.finish_call(&batch);
        let masks_due = matches!(landing, Landing::Queued) && masks.any_constrained();
        self.in_flight = Some(Flight { batch, landing, masks_due, failed: None });
        ns
    }

    /// Which rows of `batch` are under a grammar, their masks to come: built only where the backend
    /// takes masks late and a row has a grammar (otherwise no such step is queued, and a step
    /// builds no mask set).
    fn pending_masks(&self, batch: &DecodeBatch) -> MaskSet {
        let constrained = |r: &usize| self.sched.seq(*r).is_some_and(|s| s.constrained());
        if !self.takes_late_masks() || !batch.rows.iter().any(constrained) {
            return MaskSet::pending(Vec::new());
        }
        MaskSet::pending(batch.rows.iter().map(constrained).collect())
    }

    /// Whether the next step may be planned ahead with rows under a grammar: the backend takes
    /// their masks late and can queue a step of every decoding row as they sample now (so any
    /// step `plan_ahead` plans from them: `can_queue` holds for a subset of a queueable step).
    fn late_masks_ahead(&self) -> bool {
        if !self.takes_late_masks() || !self.sched.decoding_constrained() {
            return false; // (no grammar: plan_ahead needs no leave, and nothing is built per step)
        }
        let (mut rows, mut specs, mut constrained) = (Vec::new(), Vec::new(), Vec::new());
        self.sched.decoding_rows(&mut rows, &mut specs, &mut constrained);
        let zeros = vec![0u32; rows.len()];
        let masks = MaskSet::pending(constrained);
        let input = DecodeInput {
            rows: &rows,
            tokens: &zeros,
            positions: &zeros,
            specs: &specs,
            masks: &masks,
            table: self.sched.page_table(),
            dirty_rows: &[],
        };
        self.can_queue(&input)
    }

    /// The masks of the step in flight where it was queued with rows under a grammar: computed now,
    /// every token before it having landed, while it runs (`QueuedDecoder::deliver_masks`). A row whose
    /// request has left gets none (its token is dropped when the step lands). Returns the
    /// backend's time in ns.
    fn deliver_masks(&mut self) -> u64 {
        let Some(mut flight) = self.in_flight.take_if(|f| f.masks_due) else { return 0 };
        flight.masks_due = false;
        let batch = &flight.batch;
        let rows: Vec<Option<usize>> = (0..batch.len())
            .map(|i| self.sched.seq(batch.rows[i]).filter(|s| s.id == batch.ids[i]).map(|_| batch.rows[i]))
            .collect();
        let (lent, masks) = Lent::take(&mut self.sched, rows.into_iter()).unzip();
        if let (Some(mut l), Some(m)) = (lent, &masks) {
            l.fill(m);
            l.give_back(&mut self.sched);
        }
        let list: Vec<Option<&TokenMask>> = (0..batch.len()).map(|i| masks.as_ref().and_then(|m| m.get(i))).collect();
        let t = Instant::now();
        if let Err(e) = queued_decoder(&mut self.backend).and_then(|q| q.deliver_masks(&list)) {
            flight.failed = Some(e); // its rows fail as it lands
        }
        let ns = t.elapsed().as_nanos() as u64;
        self.in_flight = Some(flight);
        ns
    }

    /// Lands the step in flight if it has run (or failed to queue): its tokens wait for no later
    /// iteration. Returns the backend's time in ns.
    fn land_if_ran(&mut self, out: &mut Vec<Event>) -> u64 {
        match self.in_flight.take_if(|f| matches!(f.landing, Landing::Ran(_))) {
            Some(ran) => self.land(ran, out),
            None => 0,
        }
    }

    /// Waits for a queued step's tokens; returns the backend's time in ns.
    fn collect(&mut self, flight: &mut Flight) -> u64 {
        if !matches!(flight.landing, Landing::Queued) {
            return 0;
        }
        let t = Instant::now();
        let mut sampled = std::mem::take(&mut self.sampled);
        sampled.clear();
        flight.landing =
            Landing::Ran(queued_decoder(&mut self.backend).and_then(|q| q.collect(&mut sampled)).map(|()| sampled));
        t.elapsed().as_nanos() as u64
    }

    /// Runs `batch`'s step and lands it; returns the backend's time in ns. Constrained rows lend
    /// their grammar states to a helper thread that computes their masks while the backend runs
    /// the step; the backend waits for them only where it samples those rows.
    fn decode_now(&mut self, batch: DecodeBatch, out: &mut Vec<Event>) -> u64 {
        let (mut lent, masks) = Lent::take_step(&mut self.sched, &batch).unzip();
        let mut sampled = std::mem::take(&mut self.sampled);
        sampled.clear();
        let t = Instant::now();
        let result = std::thread::scope(|s| {
            if let (Some(l), Some(masks)) = (&mut lent, &masks) {
                s.spawn(move || l.fill(masks));
            }
            let input = DecodeInput {
                rows: &batch.rows,
                tokens: &batch.tokens,
                positions: &batch.positions,
                specs: &batch.specs,
                masks: masks.as_ref().unwrap_or(&NO_MASKS),
                table: self.sched.page_table(),
                dirty_rows: self.sched.dirty_rows(),
            };
            self.backend.decode(&input, &mut sampled)
        });
        if let Some(l) = lent {
            l.give_back(&mut self.sched);
        }
        let ns = t.elapsed().as_nanos() as u64;
        self.finish_call(&batch);
        let flight = Flight { batch, landing: Landing::Ran(result.map(|()| sampled)), masks_due: false, failed: None };
        ns + self.land(flight, out)
    }

    /// After a decode call: the page-table rows are the backend's, and the step is counted.
    fn finish_call(&mut self, batch: &DecodeBatch) {
        self.sched.clear_dirty();
        self.metrics.decode_steps += 1;
        self.metrics.decode_rows += batch.len() as u64;
        self.metrics.launch = self.backend.launch_times();
    }

    /// Hands a step's tokens to the scheduler (or fails its rows), waiting for them if the step is
    /// queued; the tokens' buffer is kept for reuse. Returns the backend's time in ns.
    fn land(&mut self, mut flight: Flight, out: &mut Vec<Event>) -> u64 {
        debug_assert!(!flight.masks_due, "a step lands after its masks were delivered");
        let ns = self.collect(&mut flight);
        let Flight { batch, landing, failed, .. } = flight;
        let Landing::Ran(result) = landing else { unreachable!("collected above") };
        let result = match failed {
            Some(e) => Err(e),
            None => result,
        };
        let result = result.and_then(|sampled| match sampled.len() == batch.len() {
            true => Ok(sampled),
            false => Err(BackendError(format!("decode returned {} tokens for {} rows", sampled.len(), batch.len()))),
        });
        match result {
            Ok(sampled) => {
                self.sched.decoded(&batch, &sampled, out);
                self.sampled = sampled;
            }
            Err(e) => self.sched.fail_batch(&batch, &format!("decode failed: {e}"), out),
        }
        ns
    }
}

/// `batch` as a backend call's input, without masks (no row under a grammar).
fn unmasked_input<'a>(sched: &'a Scheduler, batch: &'a DecodeBatch) -> DecodeInput<'a> {
    DecodeInput {
        rows: &batch.rows,
        tokens: &batch.tokens,
        positions: &batch.positions,
        specs: &batch.specs,
        masks: &NO_MASKS,
        table: sched.page_table(),
        dirty_rows: sched.dirty_rows(),
    }
}

/// `backend`'s queued decoding; the loop asks for it only after `can_queue` said yes.
fn queued_decoder<B: Backend>(backend: &mut B) -> Result<&mut dyn QueuedDecoder, BackendError> {
    backend.queued().ok_or_else(|| BackendError("this backend does not queue decode steps".into()))
}

/// The grammar states of one backend call's constrained entries, lent out of their sequences
/// while their masks are computed and the backend samples.
struct Lent {
    /// (entry of the call, its batch row, the state)
    states: Vec<(usize, usize, Constraint)>,
    /// Per state: whether it is its sequence's own (given back), not a verification row's copy.
    own: Vec<bool>,
    /// Per state: why its grammar failed (it then allows only EOS and the request ends).
    errors: Vec<Option<String>>,
    eos_only: TokenMask,
}

impl Lent {
    /// The states of `rows` (one per entry of the call; None: the entry samples nothing) and the
    /// masks to come, or None when no entry is constrained.
    fn take(sched: &mut Scheduler, rows: impl Iterator<Item = Option<usize>>) -> Option<(Lent, MaskSet)> {
        let (mut states, mut constrained) = (Vec::new(), Vec::new());
        for (i, row) in rows.enumerate() {
            let c = row.and_then(|r| sched.take_constraint(r).map(|c| (r, c)));
            constrained.push(c.is_some());
            states.extend(c.map(|(r, c)| (i, r, c)));
        }
        let own = vec![true; states.len()];
        Lent::of(sched, states, own, constrained)
    }

    /// The states of a decode step's entries: a sequence's own state for its first entry and, for
    /// each verification row after it, a copy advanced by the draft tokens the rows before it feed.
    fn take_step(sched: &mut Scheduler, batch: &DecodeBatch) -> Option<(Lent, MaskSet)> {
        let (mut states, mut own, mut constrained) = (Vec::new(), Vec::new(), Vec::new());
        let mut group: Option<(usize, usize)> = None; // (the group's first entry, its state's index)
        for i in 0..batch.len() {
            let row = batch.rows[i];
            let same = i > 0 && batch.rows[i - 1] == row && batch.ids[i - 1] == batch.ids[i];
            if !same {
                group = sched.take_constraint(row).map(|c| {
                    states.push((i, row, c));
                    own.push(true);
                    (i, states.len() - 1)
                });
                constrained.push(group.is_some());
                continue;
            }
            let Some((first, at)) = group else {
                constrained.push(false);
                continue;
            };
            let mut copy = states[at].2.clone();
            // (the scheduler drafted only tokens the grammar takes: a failure leaves an EOS-only mask)
            let _ = batch.tokens[first + 1..=i].iter().try_for_each(|&t| copy.commit(t));
            states.push((i, row, copy));
            own.push(false);
            constrained.push(true);
        }
        Lent::of(sched, states, own, constrained)
    }

    fn of(
        sched: &Scheduler,
        states: Vec<(usize, usize, Constraint)>,
        own: Vec<bool>,
        constrained: Vec<bool>,
    ) -> Option<(Lent, MaskSet)> {
        if states.is_empty() {
            return None;
        }
        let mut eos_only = TokenMask::default();
        sched.eos_only(&mut eos_only);
        Some((Lent { states, own, errors: Vec::new(), eos_only }, MaskSet::pending(constrained)))
    }

    /// Fills `masks` from the states (`allowed_all`: several at once); a grammar that fails or
    /// panics allows only EOS and its error goes to `errors`, in `states`' order.
    fn fill(&mut self, masks: &MaskSet) {
        let entries = self.states.last().map_or(0, |&(i, _, _)| i + 1);
        let mut own = vec![TokenMask::default(); self.states.len()];
        let mut states: Vec<&mut Constraint> = self.states.iter_mut().map(|(_, _, c)| c).collect();
        // A panic outside the grammars (the thread pool failing to start) must still fill the
        // masks, or the backend would wait for them forever: every row then allows only EOS.
        let errors = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| allowed_all(&mut states, &mut own)))
            .unwrap_or_else(|_| vec![Some(MaskError::Panicked); own.len()]);
        let mut out = vec![TokenMask::default(); entries];
        for (((i, _, _), mask), error) in self.states.iter().zip(own).zip(errors) {
            out[*i] = if error.is_some() { self.eos_only.clone() } else { mask };
            self.errors.push(error.map(|e| match e {
                MaskError::Grammar(e) => format!("the grammar failed: {e}"),
                MaskError::Panicked => "the grammar engine failed".to_string(),
            }));
        }
        masks.fill(out);
    }

    fn give_back(self, sched: &mut Scheduler) {
        for (((_, row, c), error), own) in self.states.into_iter().zip(self.errors).zip(self.own) {
            if own {
                sched.return_constraint(row, c, error);
            }
        }
    }
}
