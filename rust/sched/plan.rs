//! One loop iteration's work: prefill chunks within a token budget, then one decode step of every
//! decoding sequence. Blocks are mapped (`grow`) before the backend writes K/V; a grow the free
//! list cannot cover preempts (see `preempt.rs`).

use super::{Event, Phase, RequestId, Scheduler};
use crate::kv::KvError;
use crate::sampling::{SampleSpec, Sampled};
use crate::speculative::{self, share_rows, Speculator};

/// Positions [start, end) of the sequence in `row` to prefill now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillChunk {
    pub row: usize,
    pub id: RequestId,
    pub start: usize,
    pub end: usize,
    /// The chunk ends the prefill: the backend returns the next token, sampled with `spec`.
    pub last: bool,
    pub spec: SampleSpec,
}

/// The rows of one decode step, ascending, with each row's request, input token and position. A
/// sequence verifying a draft (speculative decoding) has one entry per draft token after its own,
/// in the same row at the next positions, fed the draft and sampling the generation steps after.
#[derive(Debug, Clone, Default)]
pub struct DecodeBatch {
    pub rows: Vec<usize>,
    pub ids: Vec<RequestId>,
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub specs: Vec<SampleSpec>,
    /// Draft entries in all (such a step runs synchronously: what it gains is known when it lands).
    pub drafts: usize,
}

impl DecodeBatch {
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    fn clear(&mut self) {
        self.rows.clear();
        self.ids.clear();
        self.tokens.clear();
        self.positions.clear();
        self.specs.clear();
        self.drafts = 0;
    }

    fn push(&mut self, row: usize, id: RequestId, token: u32, position: usize, spec: SampleSpec) {
        self.rows.push(row);
        self.ids.push(id);
        self.tokens.push(token);
        self.positions.push(position as u32);
        self.specs.push(spec);
    }
}

impl Scheduler {
    /// One loop iteration's prefill work, to run as one backend call: chunks of distinct
    /// sequences, oldest first, `budget` tokens in all, every chunk's blocks mapped. Each chunk
    /// must then be reported with `prefill_done` (or its row failed).
    pub fn plan_prefill(&mut self, mut budget: usize, chunks: &mut Vec<PrefillChunk>, out: &mut Vec<Event>) {
        chunks.clear();
        // Rows older than the cursor are planned; a preemption only ever removes the youngest
        // row, which is never one of them, so the cursor stays valid.
        let mut cursor = 0;
        while budget > 0 {
            let Some(chunk) = self.next_prefill(&mut cursor, budget, out) else { break };
            budget = budget.saturating_sub(chunk.end - chunk.start); // (a mapped rest may exceed it)
            chunks.push(chunk);
        }
    }

    /// The next prefill chunk of at most `budget` tokens from position `*cursor` of the age order
    /// on, its blocks mapped; leaves the cursor after the row it returns. None when nothing is left.
    fn next_prefill(&mut self, cursor: &mut usize, budget: usize, out: &mut Vec<Event>) -> Option<PrefillChunk> {
        let i = cursor;
        while *i < self.order.len() {
            let row = self.order[*i];
            *i += 1;
            let seq = self.rows[row].as_ref().expect("live row");
            let Phase::Prefill { target } = seq.phase else { continue };
            let start = seq.computed;
            // A layer-sliced call that was dropped or cut to one chunk (rust/engine/core.rs) may
            // have mapped the sequence further: the chunk is then exactly those positions, so that
            // nothing grows (a grow releases the sliding-window pages out of reach of the mapped
            // end, which this chunk's first queries still read, and blocks never shrink).
            let mapped = self.kv.len(seq.id).unwrap_or(start);
            let end = if mapped > start { mapped } else { target.min(start + budget) };
            if self.grow_or_preempt(row, end, out) {
                let seq = self.rows[row].as_ref().expect("still live");
                return Some(PrefillChunk { row, id: seq.id, start, end, last: end == target, spec: seq.spec() });
            }
            // `row` was the youngest and is gone; nobody younger is left to prefill.
        }
        None
    }

    /// The backend wrote K/V for `chunk`; on the last chunk `sampled` is the next token.
    pub fn prefill_done(&mut self, chunk: &PrefillChunk, sampled: Option<&Sampled>, out: &mut Vec<Event>) {
        let (eos, max_context) = (self.cfg.eos_token_id, self.cfg.max_context);
        let seq = self.rows[chunk.row].as_mut().expect("prefilled row is live");
        seq.computed = chunk.end;
        self.stats.prefill_tokens += (chunk.end - chunk.start) as u64;
        if !chunk.last {
            return;
        }
        let Some(sampled) = sampled else {
            return self.fail(chunk.row, "the backend returned no token for the last prefill chunk", out);
        };
        let _ = self.kv.publish(seq.id, &seq.tokens[..seq.computed]);
        seq.phase = Phase::Decode;
        seq.speculator = None; // (after a preemption: rebuilt over every token when it drafts)
        let event = seq.accept(sampled, eos, max_context);
        self.emit(chunk.row, event, out);
    }

    /// Maps the next position of every decoding sequence (oldest first, preempting the youngest
    /// when blocks run out) and fills `batch` with the rows that made it. With speculative
    /// decoding, a sequence's draft is mapped too where the free blocks allow it without
    /// preempting anyone (else it decodes without one).
    pub fn plan_decode(&mut self, batch: &mut DecodeBatch, out: &mut Vec<Event>) {
        batch.clear();
        self.draft_all();
        let mut i = 0;
        while i < self.order.len() {
            let row = self.order[i];
            i += 1;
            let seq = self.rows[row].as_ref().expect("live row");
            if seq.phase != Phase::Decode {
                continue;
            }
            let (len, k) = (seq.tokens.len(), seq.draft.len());
            if k > 0 && self.grow(row, len + k).is_err() {
                self.rows[row].as_mut().expect("live row").draft.clear();
            } else if k > 0 {
                self.rows[row].as_mut().expect("live row").planned = true;
                continue;
            }
            if self.grow_or_preempt(row, len, out) {
                self.rows[row].as_mut().expect("still live").planned = true;
            }
        }
        for (row, slot) in self.rows.iter_mut().enumerate() {
            let Some(seq) = slot.as_mut().filter(|s| s.planned) else { continue };
            seq.planned = false;
            seq.in_flight += 1;
            let (len, spec) = (seq.tokens.len(), seq.spec());
            batch.push(row, seq.id, *seq.tokens.last().expect("a decoding sequence has tokens"), len - 1, spec);
            for (i, &token) in seq.draft.iter().enumerate() {
                batch.push(row, seq.id, token, len + i, SampleSpec { index: spec.index + 1 + i as u32, ..spec });
            }
            batch.drafts += seq.draft.len();
        }
    }

    /// Each decoding sequence's draft for the next step (`Seq::draft`; empty without speculative
    /// decoding or where the text offers none): at most `max_draft` tokens, no more than its
    /// `max_tokens` and the context leave, within the rows the batch's own leave; under a grammar,
    /// only the tokens the grammar takes in turn (a row never draws one it refuses).
    fn draft_all(&mut self) {
        let (max_draft, max_context) = (self.cfg.max_draft, self.cfg.max_context);
        if max_draft == 0 {
            return; // (no sequence has a draft: `decoded` empties each as it lands)
        }
        let mut most = Vec::new();
        for seq in self.rows.iter_mut().flatten().filter(|s| s.phase == Phase::Decode) {
            seq.draft.clear();
            let room = seq.params.max_tokens.saturating_sub(seq.generated()).min(max_context - seq.tokens.len());
            seq.speculator.get_or_insert_with(|| Speculator::new(&seq.tokens));
            most.push(max_draft.min(room.saturating_sub(1)));
        }
        if most.len() >= self.cfg.step_rows {
            return; // (the batch's own rows fill the launch: no row is left for a draft)
        }
        // Each one's longest draft, from its own text or another decoding sequence's.
        let drafts: Vec<Vec<u32>> = {
            let speculators: Vec<&Speculator> = self.decoding_speculators().collect();
            let indices: Vec<_> = speculators.iter().map(|s| s.index()).collect();
            speculators.iter().zip(&most).map(|(s, &most)| s.draft(most, &indices).to_vec()).collect()
        };
        let wants: Vec<usize> = drafts.iter().map(Vec::len).collect();
        if wants.iter().all(|&w| w == 0) {
            return;
        }
        let got = share_rows(&wants, self.cfg.step_rows.saturating_sub(wants.len()));
        let decoding = self.rows.iter_mut().flatten().filter(|s| s.phase == Phase::Decode);
        for ((seq, k), draft) in decoding.zip(got).zip(drafts) {
            // (a shorter draft of the same match is this one's first k tokens)
            seq.draft.extend_from_slice(&draft[..k]);
            if let Some(c) = seq.constraint.as_ref().filter(|_| !seq.draft.is_empty()) {
                let mut state = c.clone();
                let taken = seq.draft.iter().take_while(|&&t| !state.is_stopped() && state.commit(t).is_ok()).count();
                seq.draft.truncate(taken);
            }
        }
    }

    /// The speculators of the decoding sequences (those that drafted before), in row order.
    fn decoding_speculators(&self) -> impl Iterator<Item = &Speculator> {
        self.rows.iter().flatten().filter(|s| s.phase == Phase::Decode).filter_map(|s| s.speculator.as_ref())
    }

    /// Whether the next step would verify a draft for some decoding sequence (launch-ahead then
    /// waits: what a verification step gains is known only when it lands).
    pub fn would_draft(&self) -> bool {
        let mut decoding = self.rows.iter().flatten().filter(|s| s.phase == Phase::Decode);
        if self.cfg.max_draft == 0 || decoding.clone().count() >= self.cfg.step_rows {
            return false;
        }
        let indices: Vec<_> = self.decoding_speculators().map(Speculator::index).collect();
        decoding.any(|s| s.speculator.as_ref().is_none_or(|sp| sp.would_draft(&indices)))
    }

    /// Launch-ahead: the step after `flight` (launched, not yet `decoded`), planned before its
    /// tokens are known. A row of `flight` that still decodes feeds the token `flight` samples
    /// for it (`previous[i] = Some(j)`: entry j of `flight`) one position further, sampled as its
    /// next generation step; one whose pending token is its last (`max_tokens`, the context
    /// limit) gets no entry. Any other decoding row feeds its last token, as in `plan_decode`.
    /// Maps every position without preempting; false when the blocks are not there, or a row
    /// samples under a grammar (whose mask needs the pending token) unless `late_masks` (the
    /// backend takes the masks after the step is queued, once the pending tokens have landed):
    /// the caller then lands `flight` and plans with `plan_decode` (as it does where a sequence would
    /// verify a draft). Rows that finish with the
    /// pending token (EOS, a stop id) are in the step too; `decoded` drops their tokens.
    pub fn plan_ahead(
        &mut self,
        flight: &DecodeBatch,
        batch: &mut DecodeBatch,
        previous: &mut Vec<Option<usize>>,
        late_masks: bool,
    ) -> bool {
        batch.clear();
        previous.clear();
        if self.would_draft() {
            return false;
        }
        let max_context = self.cfg.max_context;
        for row in 0..self.rows.len() {
            let Some(seq) = self.rows[row].as_ref().filter(|s| s.phase == Phase::Decode) else { continue };
            if seq.constrained() && !late_masks {
                return false;
            }
            let pending = (0..flight.len()).find(|&j| seq.landing(flight.rows[j] == row, flight.ids[j]));
            let len = seq.tokens.len() + usize::from(pending.is_some());
            if pending.is_some() && (seq.generated() + 1 >= seq.params.max_tokens || len >= max_context) {
                continue;
            }
            let mut spec = seq.spec();
            spec.index += u32::from(pending.is_some());
            let token = match pending {
                Some(_) => 0, // on the device: the backend takes it from `flight`'s output
                None => *seq.tokens.last().expect("a decoding sequence has tokens"),
            };
            let id = seq.id;
            if self.grow(row, len).is_err() {
                return false;
            }
            batch.rows.push(row);
            batch.ids.push(id);
            batch.tokens.push(token);
            batch.positions.push((len - 1) as u32);
            batch.specs.push(spec);
            previous.push(pending);
        }
        for &row in &batch.rows {
            self.rows[row].as_mut().expect("planned row is live").in_flight += 1;
        }
        true
    }

    /// The backend decoded `batch`; `sampled[i]` is the token of `batch.rows[i]`. An entry whose
    /// request has left its row since the step was planned (it finished one step earlier, or was
    /// cancelled; a request resubmitted under its id is not that request) is dropped: never
    /// emitted, never counted.
    /// A sequence's entries (its own and its draft's, consecutive) land together: it gains the
    /// tokens of the accepted draft and the first drawn past it (`crate::speculative`), one event
    /// each, until one ends it; what the rejected entries mapped is given back.
    pub fn decoded(&mut self, batch: &DecodeBatch, sampled: &[Sampled], out: &mut Vec<Event>) {
        let (eos, max_context) = (self.cfg.eos_token_id, self.cfg.max_context);
        let mut end = 0;
        while end < batch.len().min(sampled.len()) {
            let (start, row, id) = (end, batch.rows[end], batch.ids[end]);
            while end < batch.len() && batch.rows[end] == row && batch.ids[end] == id {
                end += 1;
            }
            let Some(seq) = self.rows[row].as_mut().filter(|s| s.landing(true, id)) else { continue };
            seq.in_flight -= 1;
            let drafted = seq.draft.len();
            let accepted = match drafted {
                0 => 0,
                _ if end - start != drafted + 1 => 0,
                _ => {
                    let drawn: Vec<u32> = sampled[start..end].iter().map(|s| s.token).collect();
                    speculative::accepted(&seq.draft, &drawn)
                }
            };
            seq.draft.clear();
            self.stats.draft_tokens += drafted as u64;
            self.stats.accepted_tokens += accepted as u64;
            let before = seq.tokens.len();
            for s in &sampled[start..=start + accepted] {
                let seq = self.rows[row].as_mut().expect("live until an event ends it");
                seq.computed = seq.tokens.len();
                let event = seq.accept(s, eos, max_context);
                let finished = event.finish.is_some();
                self.emit(row, event, out);
                if finished {
                    break;
                }
            }
            let Some(seq) = self.rows[row].as_mut().filter(|s| s.id == id) else { continue };
            if let Some(speculator) = seq.speculator.as_mut() {
                speculator.advance(drafted, &seq.tokens[before..]);
            }
            if drafted > 0 {
                let len = seq.tokens.len() - 1;
                self.rewind(row, len);
            }
        }
    }

    /// Fails every row of `batch` that still holds its request (the backend's step failed).
    pub fn fail_batch(&mut self, batch: &DecodeBatch, error: &str, out: &mut Vec<Event>) {
        for (&row, &id) in batch.rows.iter().zip(&batch.ids) {
            if self.rows[row].as_ref().is_some_and(|s| s.landing(true, id)) {
                self.fail(row, error, out);
            }
        }
    }

    /// Delivers a token event; a finishing one frees the row.
    fn emit(&mut self, row: usize, event: Event, out: &mut Vec<Event>) {
        self.stats.generated_tokens += 1;
        if event.finish.is_some() {
            self.release(row, true);
            self.known.remove(&event.id);
            self.left += 1;
            self.stats.finished += 1;
        }
        out.push(event);
    }

    /// Grows `row` to `new_len`, preempting the youngest sequences until it fits. False when
    /// `row` itself had to go (it was the youngest) or failed.
    fn grow_or_preempt(&mut self, row: usize, new_len: usize, out: &mut Vec<Event>) -> bool {
        loop {
            match self.grow(row, new_len) {
                Ok(()) => return true,
                Err(KvError::OutOfBlocks { .. }) if self.order.len() > 1 => {
                    let victim = *self.order.last().expect("more than one live");
                    self.preempt(victim);
                    if victim == row {
                        return false;
                    }
                }
                Err(e) => {
                    // Alone and still out of blocks, or a table bug: never loop, fail the request.
                    self.fail(row, &format!("KV cache: {e}"), out);
                    return false;
                }
            }
        }
    }
}
