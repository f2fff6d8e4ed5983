//! The `Reference` decode backend: the one place the decode loop calls Python. It forwards each
//! call to a runner object (`mk.runner.ReferenceRunner`: the PyTorch reference model over a paged
//! KV pool), takes the GIL only for that call, and samples the returned logits in Rust with the
//! shared sampler after letting the GIL go.
//!
//! Runner protocol (positional arguments; `dirty` is a list of `(row, bytes)`, each the row's
//! entries of every layer as little-endian int32 `[layer][page]`):
//! - `prefill(pieces, dirty)`, `pieces` a list of `(row, tokens, start, last)` chunks of distinct
//!   sequences → float32 buffer `[number of pieces with last, vocab]`, in piece order
//! - `decode(rows, tokens, positions, dirty)` → float32 buffer `[len(rows), vocab]`

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::engine::{BackendError, DecodeBackend, DecodeInput, PrefillInput, PrefillResult};
use crate::sampling::{Sampled, Sampler};
use crate::sched::PageTable;

pub struct ReferenceBackend {
    runner: Py<PyAny>,
    vocab: usize,
    sampler: Sampler,
    logits: Vec<f32>,
    row: Vec<i32>,
}

impl ReferenceBackend {
    pub fn new(runner: Py<PyAny>, vocab: usize) -> Self {
        Self { runner, vocab, sampler: Sampler::new(), logits: Vec::new(), row: Vec::new() }
    }

    fn dirty<'py>(&mut self, py: Python<'py>, table: &PageTable, rows: &[usize]) -> PyResult<Bound<'py, PyList>> {
        let list = PyList::empty(py);
        for &r in rows {
            self.row.clear();
            table.copy_row(r, &mut self.row);
            let bytes: Vec<u8> = self.row.iter().flat_map(|v| v.to_le_bytes()).collect();
            list.append((r, PyBytes::new(py, &bytes)))?;
        }
        Ok(list)
    }

    /// Copies `rows × vocab` float32 logits out of the runner's buffer.
    fn take_logits(&mut self, py: Python<'_>, out: &Bound<'_, PyAny>, rows: usize) -> PyResult<()> {
        let buf = PyBuffer::<f32>::get(out)?;
        if buf.item_count() != rows * self.vocab {
            return Err(PyValueError::new_err(format!(
                "the runner returned {} logits; expected {rows} × {}",
                buf.item_count(),
                self.vocab
            )));
        }
        self.logits.resize(rows * self.vocab, 0.0);
        buf.copy_to_slice(py, &mut self.logits)
    }

    /// One runner call for `input`'s chunks; on success `out` gets one result per chunk (a
    /// sampling error is that chunk's result).
    fn prefill_packed(&mut self, input: &PrefillInput<'_>, out: &mut Vec<PrefillResult>) -> Result<(), BackendError> {
        let lasts = input.chunks.iter().filter(|c| c.last).count();
        self.call(|me, py| {
            let dirty = me.dirty(py, input.table, input.dirty_rows)?;
            let pieces = PyList::empty(py);
            for c in input.chunks {
                pieces.append((c.row, c.tokens, c.start, c.last))?;
            }
            let logits = me.runner.call_method1(py, "prefill", (pieces, dirty))?;
            me.take_logits(py, logits.bind(py), lasts)
        })?;
        let mut rows = self.logits.chunks_exact(self.vocab);
        for input in input.chunks {
            out.push(match input.last {
                false => Ok(None),
                true => {
                    let logits = rows.next().expect("counted above");
                    self.sampler.sample(logits, &input.spec).map(Some).map_err(|e| BackendError(e.to_string()))
                }
            });
        }
        Ok(())
    }

    /// Runs `f` holding the GIL; a Python error becomes a backend error (traceback to stderr).
    fn call(&mut self, f: impl FnOnce(&mut Self, Python<'_>) -> PyResult<()>) -> Result<(), BackendError> {
        Python::try_attach(|py| {
            f(self, py).map_err(|e| {
                e.display(py);
                BackendError(e.to_string())
            })
        })
        .unwrap_or_else(|| Err(BackendError("the Python interpreter is shutting down".into())))
    }
}

impl DecodeBackend for ReferenceBackend {
    /// One runner call for every chunk (the engine retries a failed packed call chunk by chunk).
    fn prefill(&mut self, input: &PrefillInput<'_>, out: &mut Vec<PrefillResult>) -> Result<(), BackendError> {
        self.prefill_packed(input, out)
    }

    fn decode(&mut self, input: &DecodeInput<'_>, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        self.call(|me, py| {
            let dirty = me.dirty(py, input.table, input.dirty_rows)?;
            let args = (input.rows, input.tokens, input.positions, dirty);
            let logits = me.runner.call_method1(py, "decode", args)?;
            me.take_logits(py, logits.bind(py), input.len())
        })?;
        for (i, spec) in input.specs.iter().enumerate() {
            let row = &self.logits[i * self.vocab..(i + 1) * self.vocab];
            out.push(self.sampler.sample(row, spec).map_err(|e| BackendError(format!("row {}: {e}", input.rows[i])))?);
        }
        Ok(())
    }
}
