//! Admission, continuous batching, chunked prefill and preemption over one KV arena.
//!
//! The scheduler is synchronous and backend-free: the engine loop asks it what to compute
//! (`admit`, `plan_prefill`, `plan_decode`), runs the backend, and reports back (`prefill_done`,
//! `decoded`, `fail`). Every sequence holds a batch row from admission to its end, so its row of
//! the dense page table stays put while it prefills and decodes.
//!
//! Policies (docs/ARCHITECTURE.md, "Control plane"):
//! - FIFO admission by arrival when a row is free and the prompt's prefill, the outstanding
//!   prefills and one more page for every decoding sequence fit the free blocks.
//! - Chunked prefill: the engine spends at most `prefill_chunk` prompt tokens per iteration, then
//!   runs one decode step, so a decoding stream waits at most one chunk per token.
//! - Preemption (recompute): when a grow cannot be satisfied, the youngest live sequence is
//!   published to the prefix cache, freed and put back at the head of the queue; nothing is
//!   admitted again until some sequence has left (or nothing is live), so it cannot thrash.

mod admit;
mod check;
mod pagetable;
mod plan;
mod preempt;
pub mod request;

#[cfg(test)]
mod tests;

use std::collections::{HashSet, VecDeque};

use crate::grammar::{Constraint, TokenMask};
use crate::kv::{KvConfig, KvError, KvManager, KvStats};
use crate::sampling::SampleSpec;
pub use pagetable::PageTable;
pub use plan::{DecodeBatch, PrefillChunk};
pub use request::{Event, FinishReason, Phase, Request, RequestId, SamplingParams, Seq};

/// Limits of one engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchedConfig {
    /// Sequences that hold a batch row (prefilling or decoding) at once.
    pub max_batch: usize,
    /// Prompt tokens prefilled per loop iteration, over all prefilling sequences.
    pub prefill_chunk: usize,
    /// The same while some sequence decodes (at most `prefill_chunk`; None: `prefill_chunk`):
    /// a smaller budget shortens a decoding stream's longest wait while a long prompt is admitted,
    /// in more, smaller chunks.
    pub decode_prefill_budget: Option<usize>,
    /// Longest sequence (prompt + generated) served.
    pub max_context: usize,
    pub vocab_size: usize,
    pub eos_token_id: Option<u32>,
    /// Speculative decoding: the most draft tokens a sequence verifies in a step (0: none;
    /// `crate::speculative`). Drafting sequences' steps run synchronously.
    pub max_draft: usize,
    /// Rows a decode step may take in all, its sequences' own rows and their drafts' (a launch's
    /// rows on the megakernel): drafts only fill what the batch leaves.
    pub step_rows: usize,
}

impl SchedConfig {
    pub fn new(max_batch: usize, max_context: usize, vocab_size: usize) -> Self {
        Self {
            max_batch,
            prefill_chunk: 512,
            decode_prefill_budget: None,
            max_context,
            vocab_size,
            eos_token_id: None,
            max_draft: 0,
            step_rows: crate::abi::STEP_MAX_ROWS,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    #[error("invalid engine configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Kv(#[from] KvError),
}

/// Why a request was refused at submission.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the prompt has no tokens")]
    EmptyPrompt,
    #[error("prompt token {token} is outside the vocabulary of {vocab} tokens")]
    BadToken { token: u32, vocab: usize },
    #[error(
        "the prompt has {prompt} tokens and max_tokens asks for {max_tokens} more, but the context limit is {max_context} tokens"
    )]
    TooLong { prompt: usize, max_tokens: usize, max_context: usize },
    #[error("invalid sampling parameters: {0}")]
    Params(String),
    #[error("request {0} is already in the engine")]
    Duplicate(RequestId),
}

/// Counters since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedStats {
    pub running: usize,
    pub waiting: usize,
    /// Prompt tokens of admitted requests (counted once per request).
    pub prompt_tokens: u64,
    /// Tokens actually prefilled (cache hits excluded, recomputation after preemption included).
    pub prefill_tokens: u64,
    pub generated_tokens: u64,
    pub preemptions: u64,
    pub finished: u64,
    /// Draft tokens verified, and those of them accepted (speculative decoding).
    pub draft_tokens: u64,
    pub accepted_tokens: u64,
}

pub struct Scheduler {
    cfg: SchedConfig,
    kv: KvManager,
    table: PageTable,
    waiting: VecDeque<Seq>,
    rows: Vec<Option<Seq>>,
    /// Live rows, oldest arrival first (every live sequence arrived before every waiting one).
    order: Vec<usize>,
    /// Ids of every live or waiting request (duplicate submissions are refused in O(1)).
    known: HashSet<RequestId>,
    next_arrival: u64,
    /// Live sequences that have ended; a preemption holds admission until this moves.
    left: u64,
    hold: Option<u64>,
    dirty: Vec<usize>,
    /// Fresh requests that left the queue since `take_dequeued` (the engine's queue limit).
    dequeued: usize,
    stats: SchedStats,
}

impl Scheduler {
    /// Fails when the arena cannot prefill one `max_context` sequence alone: such an engine
    /// could accept a request it can never run.
    pub fn new(cfg: SchedConfig, kv: KvConfig) -> Result<Self, SchedError> {
        if cfg.max_batch == 0 || cfg.prefill_chunk == 0 || cfg.max_context == 0 || cfg.vocab_size == 0 {
            return Err(SchedError::Config("max_batch, prefill_chunk, max_context and vocab_size must be >= 1".into()));
        }
        if cfg.decode_prefill_budget == Some(0) {
            return Err(SchedError::Config("decode_prefill_budget must be >= 1 (or None)".into()));
        }
        let kv = KvManager::new(kv)?;
        let need = kv.prefill_blocks_needed(cfg.max_context, cfg.prefill_chunk);
        if need > kv.total_blocks() {
            return Err(SchedError::Config(format!(
                "the KV arena holds {} blocks but one {}-token sequence needs {need}: give it more memory or lower the context limit",
                kv.total_blocks(),
                cfg.max_context
            )));
        }
        let max_pages = kv.geometry().pages_for(cfg.max_context);
        let table = PageTable::new(kv.geometry().num_layers(), cfg.max_batch, max_pages);
        Ok(Self {
            rows: vec![None; cfg.max_batch],
            cfg,
            kv,
            table,
            waiting: VecDeque::new(),
            order: Vec::new(),
            known: HashSet::new(),
            next_arrival: 0,
            left: 0,
            hold: None,
            dirty: Vec::new(),
            dequeued: 0,
            stats: SchedStats::default(),
        })
    }

    pub fn config(&self) -> &SchedConfig {
        &self.cfg
    }

    /// Tests change a setting that needs no other state to follow it (`max_draft`, `step_rows`).
    #[cfg(test)]
    pub(crate) fn config_mut(&mut self) -> &mut SchedConfig {
        &mut self.cfg
    }

    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    pub fn page_table(&self) -> &PageTable {
        &self.table
    }

    /// Rows whose page-table entries changed since `clear_dirty` (the backend re-uploads them).
    pub fn dirty_rows(&self) -> &[usize] {
        &self.dirty
    }

    pub fn clear_dirty(&mut self) {
        self.dirty.clear();
    }

    fn mark_dirty(&mut self, row: usize) {
        if !self.dirty.contains(&row) {
            self.dirty.push(row);
        }
    }

    /// The live sequence in batch row `row`.
    pub fn seq(&self, row: usize) -> Option<&Seq> {
        self.rows.get(row).and_then(Option::as_ref)
    }

    /// Whether a decoding row is under a grammar.
    pub fn decoding_constrained(&self) -> bool {
        self.rows.iter().flatten().any(|s| s.phase == Phase::Decode && s.constrained())
    }

    /// The decoding rows (ascending), each one's sampling spec and whether it samples under a
    /// grammar: what a step of all of them would sample (a backend is asked whether it could
    /// queue such a step before one is planned ahead).
    pub fn decoding_rows(&self, rows: &mut Vec<usize>, specs: &mut Vec<SampleSpec>, constrained: &mut Vec<bool>) {
        for (row, seq) in self.rows.iter().enumerate().filter_map(|(r, s)| s.as_ref().map(|s| (r, s))) {
            if seq.phase == Phase::Decode {
                rows.push(row);
                specs.push(seq.spec());
                constrained.push(seq.constrained());
            }
        }
    }

    /// Lends row `row`'s grammar state out (to compute its mask on another thread); give it back
    /// with `return_constraint` before the row's next token is accepted.
    pub fn take_constraint(&mut self, row: usize) -> Option<Constraint> {
        self.rows.get_mut(row).and_then(Option::as_mut).and_then(|s| s.constraint.take())
    }

    /// Gives a lent grammar state back; `error` (its mask failed) ends the request at its next token.
    pub fn return_constraint(&mut self, row: usize, c: Constraint, error: Option<String>) {
        if let Some(seq) = self.rows.get_mut(row).and_then(Option::as_mut) {
            seq.constraint = Some(c);
            if error.is_some() {
                seq.constraint_error = error;
            }
        }
    }

    /// Only EOS (the mask of a grammar that failed), `words` words long.
    pub fn eos_only(&self, mask: &mut TokenMask) {
        let words = TokenMask::words_for(self.cfg.vocab_size);
        mask.words.clear();
        mask.words.resize(words, 0);
        if let Some(eos) = self.cfg.eos_token_id.filter(|&t| (t as usize) < words * 32) {
            mask.words[eos as usize / 32] |= 1 << (eos % 32);
        }
    }

    pub fn live(&self) -> usize {
        self.order.len()
    }

    /// Prompt tokens this iteration may prefill: `prefill_chunk`, or while some sequence decodes
    /// its `decode_prefill_budget` (the smaller of the two).
    pub fn prefill_budget(&self) -> usize {
        let decoding = || self.order.iter().any(|&r| self.rows[r].as_ref().is_some_and(|s| s.phase == Phase::Decode));
        match self.cfg.decode_prefill_budget {
            Some(b) if decoding() => b.min(self.cfg.prefill_chunk),
            _ => self.cfg.prefill_chunk,
        }
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether a step would do anything.
    pub fn busy(&self) -> bool {
        !self.order.is_empty() || !self.waiting.is_empty()
    }

    /// Fresh requests that left the waiting queue (admitted or cancelled) since the last call.
    pub fn take_dequeued(&mut self) -> usize {
        std::mem::take(&mut self.dequeued)
    }

    pub fn stats(&self) -> SchedStats {
        SchedStats { running: self.order.len(), waiting: self.waiting.len(), ..self.stats }
    }

    pub fn kv_stats(&self) -> KvStats {
        self.kv.stats()
    }

    /// The checks `submit` makes, for callers that must refuse a request synchronously.
    pub fn check_request(cfg: &SchedConfig, req: &Request) -> Result<(), SubmitError> {
        if req.prompt.is_empty() {
            return Err(SubmitError::EmptyPrompt);
        }
        if let Some(&token) = req.prompt.iter().find(|&&t| t as usize >= cfg.vocab_size) {
            return Err(SubmitError::BadToken { token, vocab: cfg.vocab_size });
        }
        let p = &req.params;
        if req.prompt.len().saturating_add(p.max_tokens) > cfg.max_context {
            return Err(SubmitError::TooLong {
                prompt: req.prompt.len(),
                max_tokens: p.max_tokens,
                max_context: cfg.max_context,
            });
        }
        p.validate().map_err(SubmitError::Params)
    }

    /// Queues a request behind every earlier one; `seed` is used when the request names none.
    pub fn submit(&mut self, req: Request, seed: u64) -> Result<(), SubmitError> {
        Self::check_request(&self.cfg, &req)?;
        if !self.known.insert(req.id) {
            return Err(SubmitError::Duplicate(req.id));
        }
        let seed = req.params.seed.unwrap_or(seed);
        self.waiting.push_back(Seq::new(req, seed, self.next_arrival));
        self.next_arrival += 1;
        Ok(())
    }

    /// Where request `id` is: Ok(row) if live, Err(queue index) if waiting.
    fn find(&self, id: RequestId) -> Option<Result<usize, usize>> {
        if !self.known.contains(&id) {
            return None;
        }
        if let Some(&row) = self.order.iter().find(|&&r| self.rows[r].as_ref().is_some_and(|s| s.id == id)) {
            return Some(Ok(row));
        }
        self.waiting.iter().position(|s| s.id == id).map(Err)
    }

    /// Ends request `id` with `cancelled`, freeing its blocks now. False if it is not here.
    pub fn cancel(&mut self, id: RequestId, out: &mut Vec<Event>) -> bool {
        match self.find(id) {
            Some(Ok(row)) => self.end(row, FinishReason::Cancelled, None, out),
            Some(Err(i)) => {
                let seq = self.waiting.remove(i).expect("index from find");
                self.known.remove(&seq.id);
                self.dequeued += usize::from(seq.fresh);
                out.push(Event::ended(seq.id, FinishReason::Cancelled, None));
            }
            None => return false,
        }
        true
    }

    /// Ends every request, live and waiting, with `reason`.
    pub fn end_all(&mut self, reason: FinishReason, error: Option<&str>, out: &mut Vec<Event>) {
        while let Some(&row) = self.order.last() {
            self.end(row, reason, error.map(str::to_owned), out);
        }
        for seq in self.waiting.drain(..) {
            self.known.remove(&seq.id);
            self.dequeued += usize::from(seq.fresh);
            out.push(Event::ended(seq.id, reason, error.map(str::to_owned)));
        }
    }

    /// Ends the request in `row` with an error (its backend call failed).
    pub fn fail(&mut self, row: usize, error: &str, out: &mut Vec<Event>) {
        if self.rows[row].is_some() {
            self.end(row, FinishReason::Error, Some(error.to_owned()), out);
        }
    }

    /// Takes the sequence out of its row and frees its blocks (publishing its written pages
    /// first unless they may be garbage).
    fn release(&mut self, row: usize, publish: bool) -> Seq {
        let seq = self.rows[row].take().expect("release of an empty row");
        self.order.retain(|&r| r != row);
        if publish {
            // Later prompts (the next chat turn, or this request after preemption) reuse it.
            let _ = self.kv.publish(seq.id, &seq.tokens[..seq.computed]);
        }
        self.kv.release(seq.id).expect("a live sequence is admitted");
        self.table.clear(row);
        self.mark_dirty(row);
        seq
    }

    /// A live sequence leaves for good: blocks freed, final event emitted.
    fn end(&mut self, row: usize, reason: FinishReason, error: Option<String>, out: &mut Vec<Event>) {
        let seq = self.release(row, reason != FinishReason::Error);
        self.known.remove(&seq.id);
        self.left += 1;
        self.stats.finished += 1;
        out.push(Event::ended(seq.id, reason, error));
    }

    /// Takes row `row` back to `new_len` positions (`KvManager::rewind`), patching its page-table
    /// row if blocks went back.
    fn rewind(&mut self, row: usize, new_len: usize) {
        let id = self.rows[row].as_ref().expect("rewind of an empty row").id;
        if self.kv.rewind(id, new_len).expect("a live sequence is admitted") {
            self.table.sync(row, self.kv.block_table(id).expect("admitted")).expect("a table that fitted still fits");
            self.mark_dirty(row);
        }
    }

    /// Grows row `row` to `new_len` positions and patches its page-table row if blocks moved.
    fn grow(&mut self, row: usize, new_len: usize) -> Result<(), KvError> {
        let id = self.rows[row].as_ref().expect("grow of an empty row").id;
        if self.kv.grow(id, new_len)? {
            self.table.sync(row, self.kv.block_table(id)?)?;
            self.mark_dirty(row);
        }
        Ok(())
    }
}
