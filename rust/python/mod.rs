//! The PyO3 surface, `mk._native`: thin wrappers that convert arguments and errors. No logic
//! lives here; each function calls into a plain-Rust module.

mod engine;
mod errors;
mod graph;
mod megakernel_backend;
mod reference_backend;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::gpu::{self, Gpu, MkAddRmsnormArgs, MkGemvArgs};

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
    let cubins = PyDict::new(py);
    for (name, bytes) in gpu::CUBINS {
        cubins.set_item(*name, bytes.len())?;
    }
    info.set_item("cubins", cubins)?;
    info.set_item("abi_version", gpu::abi::ABI_VERSION)?;
    Ok(info)
}

/// Fused residual add + RMSNorm on device `device`, enqueued on `stream` (a CUstream handle,
/// e.g. `torch.cuda.current_stream().cuda_stream`). Pointers are raw device addresses of bf16
/// tensors: x [rows, dim] (updated in place when delta != 0), delta [rows, dim] or 0,
/// gamma [dim], out [rows, dim].
#[pyfunction]
#[pyo3(signature = (device, stream, x, delta, gamma, out, rows, dim, eps))]
#[allow(clippy::too_many_arguments)]
fn add_rmsnorm(
    py: Python<'_>,
    device: usize,
    stream: u64,
    x: u64,
    delta: u64,
    gamma: u64,
    out: u64,
    rows: i32,
    dim: i32,
    eps: f32,
) -> PyResult<()> {
    let args = MkAddRmsnormArgs { x, delta, gamma, out, rows, dim, eps, reserved: 0 };
    py.detach(|| {
        let gpu = Gpu::shared(device)?;
        // SAFETY: the Python wrapper (mk.ops) passes pointers of live CUDA tensors of this
        // device with the shapes above, and torch's current stream of that device.
        unsafe { gpu.add_rmsnorm(&args, stream as usize as _) }
    })
    .map_err(errors::to_py)
}

/// `y = x · Wᵀ` for a decode batch on device `device`, enqueued on `stream`: x bf16 [batch, k],
/// w bf16 [n, k], y bf16 [batch, n] (raw device addresses).
#[pyfunction]
#[pyo3(signature = (device, stream, w, x, y, n, k, batch))]
#[allow(clippy::too_many_arguments)]
fn gemv(
    py: Python<'_>,
    device: usize,
    stream: u64,
    w: u64,
    x: u64,
    y: u64,
    n: i32,
    k: i32,
    batch: i32,
) -> PyResult<()> {
    let args = MkGemvArgs { w, x, y, n, k, batch, reserved: 0 };
    py.detach(|| {
        let gpu = Gpu::shared(device)?;
        // SAFETY: as for add_rmsnorm; mk.ops.gemv checks devices, dtypes and shapes.
        unsafe { gpu.gemv(&args, stream as usize as _) }
    })
    .map_err(errors::to_py)
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

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("GpuError", m.py().get_type::<errors::GpuError>())?;
    m.add("STEP_MAX_K", gpu::abi::STEP_MAX_K)?;
    m.add("GEMV_MAX_GROUPS", gpu::abi::GEMV_MAX_GROUPS)?;
    m.add("STEP_HEAD_DIM", gpu::abi::STEP_HEAD_DIM)?;
    m.add("STEP_MAX_GROUP", gpu::abi::STEP_MAX_GROUP)?;
    m.add("STEP_MAX_TOP_K", gpu::abi::STEP_MAX_TOP_K)?;
    m.add("STEP_MAX_EXPERTS", gpu::abi::STEP_MAX_EXPERTS)?;
    m.add("ROW_GROUPS", crate::graph::ROW_GROUPS)?;
    m.add("JSON_LAYOUT", crate::grammar::JSON_LAYOUT)?;
    m.add("STEP_MAX_BATCH", gpu::abi::STEP_MAX_BATCH)?;
    m.add_function(wrap_pyfunction!(gpu_available, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(add_rmsnorm, m)?)?;
    m.add_function(wrap_pyfunction!(gemv, m)?)?;
    m.add_function(wrap_pyfunction!(weight_maps, m)?)?;
    m.add("TENSOR_MAP_BYTES", gpu::abi::TENSOR_MAP_BYTES)?;
    m.add("LAYER_WEIGHT_COUNT", gpu::abi::LAYER_WEIGHT_COUNT)?;
    m.add("PER_STEP_FIELDS", gpu::step::PER_STEP_FIELDS.to_vec())?;
    m.add("LAYER_WEIGHTS", gpu::abi::LAYER_WEIGHTS.to_vec())?;
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
    m.add_function(wrap_pyfunction!(graph::step_args_layout, m)?)?;
    m.add_function(wrap_pyfunction!(graph::decode_step, m)?)?;
    engine::register(m)?;
    Ok(())
}
