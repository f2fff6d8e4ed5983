//! Python access to the decode-step task graph (for the CPU interpreter, tests and the GPU
//! launch path while the engine's megakernel backend is being built).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::graph::{build_step, check, deal, BuildOptions, Dealing, ModelDims};

pub(crate) fn dims_from(cfg: &Bound<'_, PyAny>) -> PyResult<ModelDims> {
    let layers: usize = cfg.getattr("num_hidden_layers")?.extract()?;
    let mut window = Vec::with_capacity(layers);
    let mut moe = Vec::with_capacity(layers);
    for l in 0..layers {
        window.push(cfg.call_method1("window", (l,))?.extract::<Option<usize>>()?);
        moe.push(cfg.call_method1("is_moe", (l,))?.extract::<bool>()?);
    }
    let get = |name: &str| -> PyResult<usize> { cfg.getattr(name)?.extract() };
    Ok(ModelDims {
        hidden: get("hidden_size")?,
        heads: get("num_attention_heads")?,
        kv_heads: get("num_key_value_heads")?,
        head_dim: get("head_dim")?,
        experts: get("num_experts")?,
        top_k: get("num_experts_per_tok")?,
        expert_ffn: get("intermediate_size")?,
        dense_ffn: get("prefix_dense_intermediate_size")?,
        vocab: get("vocab_size")?,
        window,
        moe,
    })
}

/// The task graph of one decode step of `config` (an mk.ModelConfig) for rows writing at
/// `positions`. Returns a dict: `tasks` (bytes of int32 [num_sms, per_sm, 16], NOP-padded),
/// `order` (bytes of int32 [n, 16], the global order), `per_sm`, `num_counters`, `slots`,
/// `max_splits`, and `modelled_ns` (the step's time in the dealing's cost model, `graph::deal`).
/// With `check=True` the static checker runs first and any violation raises. `dealing`:
/// "round_robin" or "balanced".
#[pyfunction]
#[pyo3(signature = (config, positions, num_sms=132, attn_chunk=0, row_groups=None, sample_parts=crate::graph::SAMPLE_PARTS, check=false, dealing="round_robin", qkv_groups=None, gate_up_groups=None, attention_first=None, expert_queue=None, local_routing=None))]
#[allow(clippy::too_many_arguments)]
pub fn build_step_graph<'py>(
    py: Python<'py>,
    config: &Bound<'py, PyAny>,
    positions: Vec<usize>,
    num_sms: usize,
    attn_chunk: usize,
    row_groups: Option<usize>,
    sample_parts: usize,
    check: bool,
    dealing: &str,
    qkv_groups: Option<usize>,
    gate_up_groups: Option<usize>,
    attention_first: Option<bool>,
    expert_queue: Option<bool>,
    local_routing: Option<bool>,
) -> PyResult<Bound<'py, PyDict>> {
    let dims = dims_from(config)?;
    let dealing = parse_dealing(dealing)?;
    let d = BuildOptions::default();
    let opts = BuildOptions {
        num_sms,
        attn_chunk,
        row_groups: row_groups.unwrap_or(d.row_groups),
        qkv_groups: qkv_groups.unwrap_or(d.qkv_groups),
        gate_up_groups: gate_up_groups.unwrap_or(d.gate_up_groups),
        sample_parts,
        dealing,
        attention_first: attention_first.unwrap_or(d.attention_first),
        expert_queue: expert_queue.or(d.expert_queue),
        local_routing: local_routing.or(d.local_routing),
    };
    let graph = build_step(&dims, &positions, &opts).map_err(|e| PyValueError::new_err(e.to_string()))?;
    if check {
        let violations = check::check(&dims, &graph, 5);
        if !violations.is_empty() {
            return Err(PyValueError::new_err(format!("task graph violations: {violations:?}")));
        }
    }
    let (padded, per_sm) = graph.padded();
    let as_bytes = |tasks: &[crate::graph::task::MkTask]| -> Vec<u8> {
        tasks
            .iter()
            .flat_map(|t| {
                let words = [t.op, t.layer, t.wait0, t.target0, t.wait1, t.target1, t.signal];
                words.into_iter().chain(t.arg).flat_map(i32::to_le_bytes).collect::<Vec<u8>>()
            })
            .collect()
    };
    let out = PyDict::new(py);
    out.set_item("tasks", PyBytes::new(py, &as_bytes(&padded)))?;
    out.set_item("order", PyBytes::new(py, &as_bytes(&graph.order)))?;
    out.set_item("num_sms", num_sms)?;
    out.set_item("per_sm", per_sm)?;
    out.set_item("num_counters", graph.num_counters)?;
    out.set_item("slots", graph.slots)?;
    out.set_item("max_splits", graph.max_splits)?;
    out.set_item("modelled_ns", deal::model(&graph.order, &graph.per_sm, &dims, graph.num_counters).makespan_ns)?;
    Ok(out)
}

/// The field layout of `MkStepArgs`: a list of (name, byte offset, "u64" | "i32" | "f32") and the
/// struct's size. Python packs launch arguments by name from it (mk.megakernel.launch).
#[pyfunction]
pub fn step_args_layout() -> (Vec<(&'static str, usize, &'static str)>, usize) {
    (crate::gpu::MkStepArgs::layout(), std::mem::size_of::<crate::gpu::MkStepArgs>())
}

/// Launch one decode step on device `device`, stream `stream`: `args` are the packed bytes of
/// `MkStepArgs`, `grid` the number of task lists (one block each), `kernel` which of the loaded
/// megakernel variants runs (`megakernel_count`).
#[pyfunction]
#[pyo3(signature = (device, stream, args, grid, kernel = 0))]
pub fn decode_step(py: Python<'_>, device: usize, stream: u64, args: &[u8], grid: u32, kernel: usize) -> PyResult<()> {
    let size = std::mem::size_of::<crate::gpu::MkStepArgs>();
    if args.len() != size {
        return Err(PyValueError::new_err(format!("MkStepArgs is {size} bytes, got {}", args.len())));
    }
    // SAFETY: MkStepArgs is plain old data of exactly `size` bytes; any bit pattern is valid.
    let args: crate::gpu::MkStepArgs = unsafe { std::ptr::read_unaligned(args.as_ptr().cast()) };
    py.detach(|| {
        let gpu = crate::gpu::Gpu::shared(device)?;
        // SAFETY: mk.megakernel.launch builds the graph with the static checker on and passes
        // live device buffers sized from the same config (megakernel/buffers.py).
        unsafe { gpu.decode_step(&args, grid, stream as usize as _, kernel) }
    })
    .map_err(super::errors::to_py)
}

/// How many megakernel variants device `device` has loaded: 1, or the variants `$MK_MEGAKERNEL_CUBIN`
/// lists (separated by `:`) to be compared in one process.
#[pyfunction]
pub fn megakernel_count(py: Python<'_>, device: usize) -> PyResult<usize> {
    py.detach(|| crate::gpu::Gpu::shared(device).map(|gpu| gpu.kernel_count())).map_err(super::errors::to_py)
}

/// Why `config`'s shapes cannot be cut into the megakernel's tasks (`graph::validate_dims`:
/// GEMV widths in whole 32-column chunks, ...), or None.
#[pyfunction]
pub fn graph_dims_error(config: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let dims = dims_from(config)?;
    Ok(crate::graph::validate_dims(&dims).err().map(|e| e.to_string()))
}

pub fn parse_dealing(name: &str) -> PyResult<Dealing> {
    Dealing::parse(name)
        .ok_or_else(|| PyValueError::new_err(format!("dealing must be 'round_robin' or 'balanced', not {name:?}")))
}
