//! `mk._native.Speculator`: one sequence's drafting (`crate::speculative::Speculator`), for the
//! acceptance benchmark and tests.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::speculative;

#[pyclass(name = "Speculator", module = "mk._native")]
pub struct PySpeculator(speculative::Speculator);

#[pymethods]
impl PySpeculator {
    #[new]
    fn new(prompt: Vec<u32>) -> Self {
        Self(speculative::Speculator::new(&prompt))
    }

    /// The next step's draft, at most `most` tokens.
    fn draft(&self, most: usize) -> Vec<u32> {
        self.0.draft(most, &[]).to_vec()
    }

    /// After a step that verified `drafted` draft tokens and gained `gained` (1 to drafted + 1).
    fn advance(&mut self, drafted: usize, gained: Vec<u32>) -> PyResult<()> {
        if gained.is_empty() || gained.len() > drafted + 1 {
            return Err(PyValueError::new_err("a step gains 1 to drafted + 1 tokens"));
        }
        self.0.advance(drafted, &gained);
        Ok(())
    }
}
