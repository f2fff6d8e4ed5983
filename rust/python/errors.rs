//! Rust errors become Python exceptions here, and nowhere else.

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::PyErr;

use crate::gpu;

create_exception!(_native, GpuError, PyRuntimeError, "The GPU path failed or is unavailable.");

pub fn to_py(err: gpu::GpuError) -> PyErr {
    match err {
        gpu::GpuError::InvalidArgument(msg) => PyValueError::new_err(msg),
        other => GpuError::new_err(other.to_string()),
    }
}
