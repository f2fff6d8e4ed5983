//! Rust errors become Python exceptions here, and nowhere else.

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::PyErr;

use crate::engine::EngineError;
use crate::gpu;
use crate::kv::KvError;
use crate::sched::SubmitError;

create_exception!(_native, GpuError, PyRuntimeError, "The GPU path failed or is unavailable.");
create_exception!(_native, QueueFullError, PyRuntimeError, "The engine's waiting queue is full.");
create_exception!(_native, EngineStoppedError, PyRuntimeError, "The engine is shut down.");
create_exception!(_native, ConstraintError, PyValueError, "A request's constraint cannot be compiled or followed.");
create_exception!(
    _native,
    PromptTooLongError,
    PyValueError,
    "A prompt and its max_tokens do not fit the context: args (message, prompt tokens, max_tokens, context limit)."
);

pub fn to_py(err: gpu::GpuError) -> PyErr {
    match err {
        gpu::GpuError::InvalidArgument(msg) => PyValueError::new_err(msg),
        other => GpuError::new_err(other.to_string()),
    }
}

pub fn engine_to_py(err: EngineError) -> PyErr {
    match err {
        EngineError::Rejected(SubmitError::TooLong { prompt, max_tokens, max_context }) => {
            PromptTooLongError::new_err((err.to_string(), prompt, max_tokens, max_context))
        }
        EngineError::Config(_) | EngineError::Rejected(_) => PyValueError::new_err(err.to_string()),
        EngineError::QueueFull(_) => QueueFullError::new_err(err.to_string()),
        EngineError::Closed => EngineStoppedError::new_err(err.to_string()),
        EngineError::Spawn(_) => PyRuntimeError::new_err(err.to_string()),
    }
}

pub fn kv_to_py(err: KvError) -> PyErr {
    PyValueError::new_err(err.to_string())
}
