//! The Python model behind the PyTorch decode backend: the one place the decode loop calls
//! Python. It forwards each call to a runner object (`mk.engine.runner.PytorchRunner`: the PyTorch
//! model over a paged KV pool), holding the GIL only for that call, and hands back the
//! logits; `crate::engine::SamplingBackend` samples them in Rust. Conversion only: no policy here.
//!
//! Runner protocol (positional arguments; `dirty` is a list of `(row, bytes)`, each the row's
//! entries of every layer as little-endian int32 `[layer][page]`):
//! - `prefill(pieces, dirty[, layers])`, `pieces` a list of `(row, tokens, start, last)` chunks of
//!   distinct sequences, `layers` (only passed for a layer-sliced prefill, `crate::engine::LayerSlice`)
//!   `(start, end)`: one slice, the same pieces from layer 0 on, slice by slice → float32 buffer
//!   `[number of pieces with last, vocab]`, in piece order (`[0, vocab]` for a slice that does not
//!   end at the last layer)
//! - `decode(rows, tokens, positions, dirty)` → float32 buffer `[len(rows), vocab]`

use pyo3::buffer::PyBuffer;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use crate::engine::{BackendError, DecodeInput, LogitsModel, PrefillInput, SamplingBackend};
use crate::sched::PageTable;

/// The PyTorch backend: the Python runner's logits, sampled in Rust.
pub type PytorchBackend = SamplingBackend<PythonModel>;

pub fn pytorch_backend(runner: Py<PyAny>, vocab: usize) -> PytorchBackend {
    SamplingBackend::new(PythonModel { runner, vocab, row: Vec::new() })
}

pub struct PythonModel {
    runner: Py<PyAny>,
    vocab: usize,
    row: Vec<i32>,
}

impl PythonModel {
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

/// Copies the float32 buffer the runner returned into `logits`.
fn copy_logits(py: Python<'_>, out: &Bound<'_, PyAny>, logits: &mut Vec<f32>) -> PyResult<()> {
    let buf = PyBuffer::<f32>::get(out)?;
    logits.resize(buf.item_count(), 0.0);
    buf.copy_to_slice(py, logits)
}

impl LogitsModel for PythonModel {
    fn vocab(&self) -> usize {
        self.vocab
    }

    fn prefill(&mut self, input: &PrefillInput<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        self.call(|me, py| {
            let dirty = me.dirty(py, input.table, input.dirty_rows)?;
            let pieces = PyList::empty(py);
            for c in input.chunks {
                pieces.append((c.row, c.tokens, c.start, c.last))?;
            }
            let out = match input.layers {
                None => me.runner.call_method1(py, "prefill", (pieces, dirty))?,
                Some(s) => me.runner.call_method1(py, "prefill", (pieces, dirty, (s.start, s.end)))?,
            };
            copy_logits(py, out.bind(py), logits)
        })
    }

    fn decode(&mut self, input: &DecodeInput<'_>, logits: &mut Vec<f32>) -> Result<(), BackendError> {
        self.call(|me, py| {
            let dirty = me.dirty(py, input.table, input.dirty_rows)?;
            let args = (input.rows, input.tokens, input.positions, dirty);
            let out = me.runner.call_method1(py, "decode", args)?;
            copy_logits(py, out.bind(py), logits)
        })
    }
}
