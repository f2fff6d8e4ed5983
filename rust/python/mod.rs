//! The PyO3 surface, `mk._native`: thin wrappers that convert arguments and errors. No logic
//! lives here; each function calls into a plain-Rust module.

mod engine;
mod errors;
mod graph;
mod megakernel_backend;
mod pytorch_backend;
mod speculative;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::gpu;

/// True when a CUDA driver is present and sees a device.
#[pyfunction]
fn gpu_available(py: Python<'_>) -> bool {
    py.detach(gpu::available)
}

/// How the embedded kernels were built.
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let info = PyDict::new(py);
    info.set_item("nvcc", gpu::NVCC_VERSION)?;
    info.set_item("gencode", gpu::GENCODE)?;
    info.set_item("defines", gpu::DEFINES.to_vec())?;
    let cubins = PyDict::new(py);
    for (name, bytes) in gpu::CUBINS {
        cubins.set_item(*name, bytes.len())?;
    }
    info.set_item("cubins", cubins)?;
    info.set_item("abi_version", crate::abi::ABI_VERSION)?;
    Ok(info)
}

/// Bulk-copy descriptors of weight matrices for the megakernel (`MkStepArgs.layer_maps` etc.):
/// one (address, rows, cols) per matrix, address 0 for an empty entry; returns
/// MK_TENSOR_MAP_BYTES bytes per entry, in order, to be uploaded 64-byte aligned.
#[pyfunction]
fn weight_maps<'py>(py: Python<'py>, matrices: Vec<(u64, u64, u64)>) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let specs: Vec<gpu::tensor_map::MatrixSpec> =
        matrices.into_iter().map(|(address, rows, cols)| gpu::tensor_map::MatrixSpec { address, rows, cols }).collect();
    let bytes = py.detach(|| gpu::tensor_map::encode(&specs)).map_err(errors::to_py)?;
    Ok(pyo3::types::PyBytes::new(py, &bytes))
}

/// Bulk-copy descriptors of the K and V pools for the megakernel (`MkStepArgs.kv_maps`): their
/// addresses and shape as `rows` (blocks x page size) by `cols` (kv_heads x head_dim) bf16;
/// returns 2 x MK_TENSOR_MAP_BYTES bytes (K's map, then V's), to be uploaded 64-byte aligned.
#[pyfunction]
fn kv_maps<'py>(py: Python<'py>, k: u64, v: u64, rows: u64, cols: u64) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
    let bytes = py.detach(|| gpu::tensor_map::encode_kv(k, v, rows, cols)).map_err(errors::to_py)?;
    Ok(pyo3::types::PyBytes::new(py, &bytes))
}

/// Whether a request with this temperature and top-k (0 or less: off) draws greedily: the engine
/// core's rule, `crate::sampling::SampleSpec::is_greedy`.
#[pyfunction]
fn is_greedy(temperature: f32, top_k: i64) -> bool {
    let top_k = u32::try_from(top_k.max(0)).unwrap_or(u32::MAX);
    crate::sampling::SampleSpec { temperature, top_k, ..crate::sampling::SampleSpec::greedy(0) }.is_greedy()
}

/// The token a row with a temperature alone draws (`crate::sampling::gumbel_draw`): its fp32
/// logits as little-endian bytes, 1 / T, the request's seed and generation step. The megakernel's
/// sample tasks must draw the same (tests/test_megakernel_gpu.py).
#[pyfunction]
fn gumbel_draw(logits: &[u8], inv_temperature: f32, seed: u64, index: u32) -> PyResult<u32> {
    if logits.len() % 4 != 0 || !(inv_temperature > 0.0 && inv_temperature.is_finite()) {
        return Err(pyo3::exceptions::PyValueError::new_err("logits are f32 bytes and 1 / T is finite and > 0"));
    }
    let row: Vec<f32> = logits.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))).collect();
    crate::sampling::gumbel_draw(&row, inv_temperature, seed, index)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("GpuError", m.py().get_type::<errors::GpuError>())?;
    m.add("STEP_MAX_K", crate::abi::STEP_MAX_K)?;
    m.add("GEMV_MAX_GROUPS", crate::abi::GEMV_MAX_GROUPS)?;
    m.add("STEP_HEAD_DIM", crate::abi::STEP_HEAD_DIM)?;
    m.add("STEP_MAX_GROUP", crate::abi::STEP_MAX_GROUP)?;
    m.add("STEP_MAX_TOP_K", crate::abi::STEP_MAX_TOP_K)?;
    m.add("STEP_MAX_EXPERTS", crate::abi::STEP_MAX_EXPERTS)?;
    m.add("ROW_GROUPS", crate::graph::ROW_GROUPS)?;
    m.add("SAMPLE_PARTS", crate::graph::SAMPLE_PARTS)?;
    m.add("JSON_LAYOUT", crate::grammar::JSON_LAYOUT)?;
    m.add("STEP_MAX_ROWS", crate::abi::STEP_MAX_ROWS)?;
    m.add("MAX_DRAFT", crate::speculative::length::MAX_DRAFT)?;
    m.add_function(wrap_pyfunction!(gpu_available, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(weight_maps, m)?)?;
    m.add_function(wrap_pyfunction!(kv_maps, m)?)?;
    m.add_function(wrap_pyfunction!(gumbel_draw, m)?)?;
    m.add_function(wrap_pyfunction!(is_greedy, m)?)?;
    m.add("TENSOR_MAP_BYTES", crate::abi::TENSOR_MAP_BYTES)?;
    m.add("TRACE_ENTRY_BYTES", crate::abi::TRACE_ENTRY_BYTES)?;
    m.add("TRACE_MARKED", crate::abi::TRACE_MARKED)?;
    m.add("LEDGER_STAGES", crate::abi::LEDGER_STAGES)?;
    m.add("ROW_SAMPLE_BYTES", std::mem::size_of::<gpu::MkRowSample>())?;
    m.add("LAYER_WEIGHT_COUNT", crate::abi::LAYER_WEIGHT_COUNT)?;
    m.add("PER_STEP_FIELDS", gpu::step::PER_STEP_FIELDS.to_vec())?;
    m.add("LAYER_WEIGHTS", crate::abi::LAYER_WEIGHTS.to_vec())?;
    m.add("PAGE_SIZE", crate::kv::PAGE_SIZE)?;
    {
        use crate::graph::task::{Matrix, Op, COUNTERS_PER_LAYER, TASK_ARG_WORD, TASK_WORDS};
        let ops = PyDict::new(m.py());
        for (name, op) in Op::NAMED {
            ops.set_item(name, op as i32)?;
        }
        let matrices = PyDict::new(m.py());
        for (name, matrix) in Matrix::NAMED {
            matrices.set_item(name, matrix as i32)?;
        }
        m.add("TASK_OPS", ops)?;
        m.add("TASK_MATRICES", matrices)?;
        m.add("TASK_WORDS", TASK_WORDS)?;
        m.add("TASK_ARG_WORD", TASK_ARG_WORD)?;
        m.add("COUNTERS_PER_LAYER", COUNTERS_PER_LAYER)?;
    }
    m.add_function(wrap_pyfunction!(graph::build_step_graph, m)?)?;
    m.add_function(wrap_pyfunction!(graph::graph_dims_error, m)?)?;
    m.add_function(wrap_pyfunction!(graph::step_args_layout, m)?)?;
    m.add_function(wrap_pyfunction!(graph::decode_step, m)?)?;
    m.add_function(wrap_pyfunction!(graph::megakernel_count, m)?)?;
    m.add_class::<speculative::PySpeculator>()?;
    engine::register(m)?;
    Ok(())
}
