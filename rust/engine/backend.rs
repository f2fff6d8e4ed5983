//! The seam between the control plane and whatever computes the model: the megakernel on a GPU,
//! or the PyTorch model (through Python) for CPU tests and GPU comparisons.
//!
//! A backend owns the K/V arena and any device copy of the page table; the engine owns the block
//! ids. Before each call the engine has mapped every position the call writes, and it lists the
//! batch rows whose page-table entries changed since the previous call (of either kind), so a
//! backend re-uploads only those rows. Sampling is the backend's: one that ends in logits uses
//! `crate::sampling::Sampler`; the megakernel samples greedy rows on the GPU by the same argmax rule
//! and hands the others to that sampler.

use crate::grammar::{MaskSet, TokenMask};
use crate::sampling::{SampleSpec, Sampled};
use crate::sched::{PageTable, RequestId};

/// One chunk of one sequence's prefill.
#[derive(Debug, Clone, Copy)]
pub struct PrefillChunkInput<'a> {
    /// The sequence's batch row (its entries in the page table).
    pub row: usize,
    pub request: RequestId,
    /// Tokens at positions `start..start + tokens.len()`; positions below `start` are in the cache.
    pub tokens: &'a [u32],
    pub start: usize,
    /// Last chunk of this prefill: return the next token, sampled with `spec` among the tokens
    /// the call's mask `entry` allows (`PrefillInput::allowed`: a grammar's mask, or any).
    pub last: bool,
    pub spec: SampleSpec,
    pub entry: usize,
}

/// One iteration's prefill: chunks of distinct sequences, to compute in one call (a backend that
/// can packs them into one forward pass). The last chunks' grammar masks may still be being
/// computed while the call runs: `allowed` waits for them.
#[derive(Debug, Clone, Copy)]
pub struct PrefillInput<'a> {
    pub chunks: &'a [PrefillChunkInput<'a>],
    pub masks: &'a MaskSet,
    pub table: &'a PageTable,
    pub dirty_rows: &'a [usize],
    /// None: the whole model. Some: one slice of a layer-sliced prefill (`Core::layer_slices`).
    pub layers: Option<LayerSlice>,
}

/// Layers `start..end` of a prefill spread over several iterations, a decode step between each:
/// the same chunks in every call, the slices in order from layer 0 to the model's last. Only the
/// call that ends at the last layer (`last`) computes the chunks' results; the others leave `out`
/// empty. A backend keeps the chunks' state from one slice to the next (a call from layer 0
/// starts over).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerSlice {
    pub start: usize,
    pub end: usize,
    pub last: bool,
}

impl<'a> PrefillInput<'a> {
    /// The mask `chunk` samples under, if it has one (waiting until it is computed).
    pub fn allowed(&self, chunk: &PrefillChunkInput<'_>) -> Option<&'a TokenMask> {
        self.masks.get(chunk.entry)
    }
}

/// One decode step: row `rows[i]` feeds `tokens[i]` at position `positions[i]` (writing its K/V
/// there) and samples the next token with `specs[i]` among the tokens `masks` allows row i (a
/// grammar's; the loop may still be computing them while the step runs: `allowed` waits). Rows
/// are ascending; rows not listed are idle (their page-table entries may be stale until they
/// appear in `dirty_rows`).
#[derive(Debug, Clone, Copy)]
pub struct DecodeInput<'a> {
    pub rows: &'a [usize],
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    pub specs: &'a [SampleSpec],
    pub masks: &'a MaskSet,
    pub table: &'a PageTable,
    pub dirty_rows: &'a [usize],
}

impl<'a> DecodeInput<'a> {
    pub fn len(&self) -> usize {
        self.rows.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The mask of the i-th row, if it has one (waiting until it is computed).
    pub fn allowed(&self, i: usize) -> Option<&'a TokenMask> {
        self.masks.get(i)
    }

    /// Whether the i-th row samples under a mask (known before the masks are).
    pub fn is_constrained(&self, i: usize) -> bool {
        self.masks.is_constrained(i)
    }
}

pub use crate::gpu::step::LaunchTimes;

/// A failed backend call; the requests it concerned end with finish reason `error`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct BackendError(pub String);

/// What one prefill chunk gave: the next token after a last chunk, else None.
pub type PrefillResult = Result<Option<Sampled>, BackendError>;

/// What the engine's loop needs of whatever computes: prefill chunks and decode steps, run when
/// called. Launch-ahead is a separate capability (`QueuedDecoder`) a backend may have.
pub trait Backend: Send {
    /// Computes K/V for every chunk; `out` receives one result per chunk, in order: the sampled
    /// next token for a last chunk, else None (or the error that ended that chunk). `Err`: the call
    /// as a whole failed and `out` is untouched (the engine then retries the chunks one by one).
    /// A slice that is not the last (`input.layers`) only advances the chunks' layers: `out` stays
    /// empty.
    fn prefill(&mut self, input: &PrefillInput<'_>, out: &mut Vec<PrefillResult>) -> Result<(), BackendError>;

    /// Runs one decode step; `out` receives one `Sampled` per row, in row order.
    fn decode(&mut self, input: &DecodeInput<'_>, out: &mut Vec<Sampled>) -> Result<(), BackendError>;

    /// The backend's queued decoding (launch-ahead), where it has one.
    fn queued(&mut self) -> Option<&mut dyn QueuedDecoder> {
        None
    }

    /// The same, to ask what it takes (`can_queue`, `late_masks`).
    fn queued_ref(&self) -> Option<&dyn QueuedDecoder> {
        None
    }

    /// Where the decode calls' host time went so far (zeros where the backend does not measure).
    fn launch_times(&self) -> LaunchTimes {
        LaunchTimes::default()
    }
}

/// Decode steps queued on the device behind each other and collected later (launch-ahead),
/// optionally with the masks of their rows under a grammar delivered after they were queued.
pub trait QueuedDecoder {
    /// Whether `queue` takes this step. One takes rows under a grammar (`input.is_constrained`,
    /// their masks not yet known) only where it has `late_masks`.
    fn can_queue(&self, input: &DecodeInput<'_>) -> bool;

    /// Whether a queued step may hold rows under a grammar whose masks come after it is queued
    /// (`deliver_masks`): the device waits for them only where it samples those rows, so the
    /// masks of step n + 1 are computed while it runs, once step n's tokens have landed.
    fn late_masks(&self) -> bool {
        false
    }

    /// The masks of the step queued last, one per row in its order (None: any token, for a row
    /// that is not under a grammar or whose request has left), once every token before them has
    /// landed. A step queued with rows under a grammar gets exactly one call, before its
    /// `collect`; a backend must not sample those rows before it.
    fn deliver_masks(&mut self, _masks: &[Option<&TokenMask>]) -> Result<(), BackendError> {
        Err(BackendError("this backend does not take late masks".into()))
    }

    /// Queues one decode step behind the steps queued before it and returns before it has run: row
    /// i feeds `input.tokens[i]`, or, where `previous[i]` is `Some(j)`, the token the step queued
    /// just before this one samples for its row j, which the host has not seen yet (it stays on
    /// the device). `previous` has one entry per row, or none (every token is in `input`).
    /// `collect` returns each queued step's tokens, oldest first.
    fn queue(&mut self, input: &DecodeInput<'_>, previous: &[Option<usize>]) -> Result<(), BackendError>;

    /// Waits for the oldest queued step; `out` receives one `Sampled` per row, in row order.
    fn collect(&mut self, out: &mut Vec<Sampled>) -> Result<(), BackendError>;
}

impl<B: Backend + ?Sized> Backend for Box<B> {
    fn prefill(&mut self, input: &PrefillInput<'_>, out: &mut Vec<PrefillResult>) -> Result<(), BackendError> {
        (**self).prefill(input, out)
    }

    fn decode(&mut self, input: &DecodeInput<'_>, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        (**self).decode(input, out)
    }

    fn queued(&mut self) -> Option<&mut dyn QueuedDecoder> {
        (**self).queued()
    }

    fn queued_ref(&self) -> Option<&dyn QueuedDecoder> {
        (**self).queued_ref()
    }

    fn launch_times(&self) -> LaunchTimes {
        (**self).launch_times()
    }
}

/// For a backend that prefills through one component and decodes through another: the rows whose
/// block tables changed in decode steps, which the prefill side never saw. Its next prefill call
/// gets them with that call's own dirty rows, and they are cleared once the call went through.
#[derive(Debug, Default)]
pub struct UnseenRows {
    unseen: Vec<bool>,
    merged: Vec<usize>,
}

impl UnseenRows {
    /// Records a decode step's dirty rows (of a table with `rows` rows).
    pub fn note(&mut self, rows: usize, dirty: &[usize]) {
        self.unseen.resize(rows, false);
        for &r in dirty {
            self.unseen[r] = true;
        }
    }

    /// Every row changed since the last `sent`, this prefill's `dirty` included, ascending.
    pub fn pending(&mut self, rows: usize, dirty: &[usize]) -> &[usize] {
        self.note(rows, dirty);
        self.merged.clear();
        self.merged.extend(self.unseen.iter().enumerate().filter(|(_, &u)| u).map(|(r, _)| r));
        &self.merged
    }

    /// The prefill side has the pending rows.
    pub fn sent(&mut self) {
        self.unseen.fill(false);
    }
}

#[cfg(test)]
mod unseen_rows_tests {
    use super::UnseenRows;

    #[test]
    fn decode_steps_rows_reach_the_next_prefill_once_and_survive_a_failed_one() {
        let mut u = UnseenRows::default();
        u.note(4, &[2]);
        u.note(4, &[0, 2]);
        assert_eq!(u.pending(4, &[3]), &[0, 2, 3]);
        // The call failed: nothing is lost.
        assert_eq!(u.pending(4, &[]), &[0, 2, 3]);
        u.sent();
        assert_eq!(u.pending(4, &[1]), &[1]);
        u.sent();
        assert!(u.pending(4, &[]).is_empty());
        u.note(6, &[5]); // the table grew
        assert_eq!(u.pending(6, &[]), &[5]);
    }
}
