//! One loop iteration's work: prefill chunks within a token budget, then one decode step of every
//! decoding sequence. Blocks are mapped (`grow`) before the backend writes K/V; a grow the free
//! list cannot cover preempts (see `preempt.rs`).

use super::{Event, Phase, RequestId, Scheduler};
use crate::kv::KvError;
use crate::sampling::{SampleSpec, Sampled};

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

/// The rows of one decode step, ascending, with each row's request, input token and position.
#[derive(Debug, Clone, Default)]
pub struct DecodeBatch {
    pub rows: Vec<usize>,
    pub ids: Vec<RequestId>,
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub specs: Vec<SampleSpec>,
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
        let event = seq.accept(sampled, eos, max_context);
        self.emit(chunk.row, event, out);
    }

    /// Maps the next position of every decoding sequence (oldest first, preempting the youngest
    /// when blocks run out) and fills `batch` with the rows that made it.
    pub fn plan_decode(&mut self, batch: &mut DecodeBatch, out: &mut Vec<Event>) {
        batch.clear();
        let mut i = 0;
        while i < self.order.len() {
            let row = self.order[i];
            i += 1;
            let seq = self.rows[row].as_ref().expect("live row");
            if seq.phase != Phase::Decode {
                continue;
            }
            let len = seq.tokens.len();
            if self.grow_or_preempt(row, len, out) {
                self.rows[row].as_mut().expect("still live").planned = true;
            }
        }
        for (row, slot) in self.rows.iter_mut().enumerate() {
            let Some(seq) = slot.as_mut().filter(|s| s.planned) else { continue };
            seq.planned = false;
            seq.in_flight += 1;
            batch.rows.push(row);
            batch.ids.push(seq.id);
            batch.tokens.push(*seq.tokens.last().expect("a decoding sequence has tokens"));
            batch.positions.push((seq.tokens.len() - 1) as u32);
            batch.specs.push(seq.spec());
        }
    }

    /// Launch-ahead: the step after `flight` (launched, not yet `decoded`), planned before its
    /// tokens are known. A row of `flight` that still decodes feeds the token `flight` samples
    /// for it (`previous[i] = Some(j)`: entry j of `flight`) one position further, sampled as its
    /// next generation step; one whose pending token is its last (`max_tokens`, the context
    /// limit) gets no entry. Any other decoding row feeds its last token, as in `plan_decode`.
    /// Maps every position without preempting; false when the blocks are not there, or a row
    /// samples under a grammar (whose mask needs the pending token) unless `late_masks` (the
    /// backend takes the masks after the step is queued, once the pending tokens have landed):
    /// the caller then lands `flight` and plans with `plan_decode`. Rows that finish with the
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
    pub fn decoded(&mut self, batch: &DecodeBatch, sampled: &[Sampled], out: &mut Vec<Event>) {
        let (eos, max_context) = (self.cfg.eos_token_id, self.cfg.max_context);
        for ((&row, &id), s) in batch.rows.iter().zip(&batch.ids).zip(sampled) {
            let Some(seq) = self.rows[row].as_mut().filter(|s| s.landing(true, id)) else { continue };
            seq.in_flight -= 1;
            seq.computed = seq.tokens.len();
            let event = seq.accept(s, eos, max_context);
            self.emit(row, event, out);
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
