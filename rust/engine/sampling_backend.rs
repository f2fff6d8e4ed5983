//! A backend for models that end in logits (the PyTorch model, through Python): the model
//! computes logits for the engine's calls, and this module samples them with the shared sampler
//! (the megakernel samples its greedy rows on the GPU by the same argmax rule).

use super::backend::{Backend, BackendError, DecodeInput, PrefillInput, PrefillResult};
use crate::sampling::{sample_rows, Job, SampleError, Sampled, Sampler};

/// What computes logits: the model part of a [`SamplingBackend`].
pub trait LogitsModel: Send {
    /// Entries per row of logits.
    fn vocab(&self) -> usize;

    /// Writes K/V for every chunk and puts `[chunks with last, vocab]` logits into `logits`, in
    /// chunk order; `Err` when the call as a whole failed.
    fn prefill(&mut self, input: &PrefillInput<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError>;

    /// One decode step: `[rows, vocab]` logits into `logits`.
    fn decode(&mut self, input: &DecodeInput<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError>;
}

/// A [`LogitsModel`] plus sampling: a [`Backend`].
pub struct SamplingBackend<M> {
    model: M,
    sampler: Sampler,
    /// A decode step's scratch: one sampler per thread of `sample_rows`, and its results.
    samplers: Vec<Sampler>,
    sampled: Vec<Result<Sampled, SampleError>>,
    logits: Vec<f32>,
}

impl<M: LogitsModel> SamplingBackend<M> {
    pub fn new(model: M) -> Self {
        Self { model, sampler: Sampler::new(), samplers: Vec::new(), sampled: Vec::new(), logits: Vec::new() }
    }
}

/// `expected` rows of `vocab` logits, or the error that the model returned another count.
fn rows(logits: &[f32], vocab: usize, expected: usize) -> Result<std::slice::ChunksExact<'_, f32>, BackendError> {
    if logits.len() != expected * vocab {
        return Err(BackendError(format!("the model returned {} logits; expected {expected} × {vocab}", logits.len())));
    }
    Ok(logits.chunks_exact(vocab))
}

impl<M: LogitsModel> Backend for SamplingBackend<M> {
    fn prefill(&mut self, input: &PrefillInput<'_>, out: &mut Vec<PrefillResult>) -> Result<(), BackendError> {
        self.model.prefill(input, &mut self.logits)?;
        if input.layers.is_some_and(|s| !s.last) {
            return Ok(()); // a slice before the last: no logits yet
        }
        let mut rows = rows(&self.logits, self.model.vocab(), input.chunks.iter().filter(|c| c.last).count())?;
        for chunk in input.chunks {
            out.push(match chunk.last {
                false => Ok(None),
                true => {
                    let logits = rows.next().expect("counted above");
                    let sampled = self.sampler.sample_allowed(logits, &chunk.spec, input.allowed(chunk));
                    sampled.map(Some).map_err(|e| BackendError(e.to_string()))
                }
            });
        }
        Ok(())
    }

    fn decode(&mut self, input: &DecodeInput<'_>, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        self.model.decode(input, &mut self.logits)?;
        let rows = rows(&self.logits, self.model.vocab(), input.len())?;
        let jobs: Vec<Job<'_>> = rows
            .zip(input.specs)
            .enumerate()
            .map(|(i, (logits, spec))| Job { logits, spec, allowed: input.allowed(i) })
            .collect();
        sample_rows(&mut self.samplers, &jobs, &mut self.sampled);
        for (sampled, row) in self.sampled.drain(..).zip(input.rows) {
            out.push(sampled.map_err(|e| BackendError(format!("row {row}: {e}")))?);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::PrefillChunkInput;
    use crate::sampling::SampleSpec;
    use crate::sched::PageTable;

    /// Logits that put all the mass on token `row + 1` (decode) or `start` (prefill).
    struct Peaked {
        vocab: usize,
        fail: bool,
    }

    impl LogitsModel for Peaked {
        fn vocab(&self) -> usize {
            self.vocab
        }
        fn prefill(&mut self, input: &PrefillInput<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError> {
            if self.fail {
                return Err(BackendError("down".into()));
            }
            logits.clear();
            for c in input.chunks.iter().filter(|c| c.last) {
                logits.extend((0..self.vocab).map(|t| if t == c.start { 10.0 } else { 0.0 }));
            }
            Ok(())
        }
        fn decode(&mut self, input: &DecodeInput<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError> {
            logits.clear();
            for &r in input.rows {
                logits.extend((0..self.vocab).map(|t| if t == r + 1 { 10.0 } else { 0.0 }));
            }
            Ok(())
        }
    }

    #[test]
    fn logits_are_sampled_per_last_chunk_and_per_row() {
        let table = PageTable::new(4, 2, 8);
        let mut b = SamplingBackend::new(Peaked { vocab: 16, fail: false });
        let chunks = [
            PrefillChunkInput {
                row: 0,
                request: 1,
                tokens: &[1, 2],
                start: 0,
                last: false,
                spec: SampleSpec::greedy(0),
                entry: 0,
            },
            PrefillChunkInput {
                row: 1,
                request: 2,
                tokens: &[3],
                start: 5,
                last: true,
                spec: SampleSpec::greedy(0),
                entry: 0,
            },
        ];
        let mut out = Vec::new();
        let prefill = PrefillInput {
            chunks: &chunks,
            masks: &crate::grammar::NO_MASKS,
            table: &table,
            dirty_rows: &[],
            layers: None,
        };
        b.prefill(&prefill, &mut out).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0], Ok(None));
        assert_eq!(out[1].as_ref().unwrap().as_ref().unwrap().token, 5);
        let specs = [SampleSpec::greedy(0), SampleSpec::greedy(0)];
        let input = DecodeInput {
            rows: &[0, 2],
            tokens: &[1, 1],
            positions: &[3, 4],
            specs: &specs,
            masks: &crate::grammar::NO_MASKS,
            table: &table,
            dirty_rows: &[],
        };
        let mut sampled = Vec::new();
        b.decode(&input, &mut sampled).unwrap();
        assert_eq!(sampled.iter().map(|s| s.token).collect::<Vec<_>>(), vec![1, 3]);
        // A failed call reports itself and leaves `out` as it was.
        let mut b = SamplingBackend::new(Peaked { vocab: 16, fail: true });
        let mut out = Vec::new();
        assert!(b.prefill(&prefill, &mut out).is_err());
        assert!(out.is_empty());
    }
}
