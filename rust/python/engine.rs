//! `mk._native.Engine`: the decode-loop engine over the Python PyTorch runner (or a no-op
//! backend for benchmarks). Thin: argument conversion only; every wait releases the GIL.

use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors;
use super::megakernel_backend::megakernel_backend;
use super::pytorch_backend::pytorch_backend;
use crate::engine::{Engine, EngineConfig, NoopBackend};
use crate::grammar::{CompiledConstraints, Constraint, ConstraintSpec, Grammars};
use crate::kv::KvConfig;
use crate::sched::{Event, Request, SamplingParams, SchedConfig};

/// One event of a request, as the event pump reads it (`mk.engine.engine._pump` makes a
/// `TokenEvent` of it): a token (with its logprob and top alternatives where asked), or the end
/// (finish reason, error); the first token also says how many prompt tokens came from the prefix
/// cache and how long the request waited for admission.
#[pyclass(name = "Event", module = "mk._native", frozen, get_all)]
pub struct PyEvent {
    id: u64,
    token: Option<u32>,
    logprob: Option<f32>,
    top: Option<Vec<(u32, f32)>>,
    finish: Option<&'static str>,
    error: Option<String>,
    cached_tokens: Option<usize>,
    queue_seconds: Option<f64>,
}

impl From<Event> for PyEvent {
    fn from(e: Event) -> Self {
        Self {
            id: e.id,
            token: e.token,
            logprob: e.logprob,
            top: e.top,
            finish: e.finish.map(|f| f.as_str()),
            error: e.error,
            cached_tokens: e.cached_tokens,
            queue_seconds: e.queue_seconds,
        }
    }
}

/// The engine's options as Python's `mk.engine.options.EngineOptions` holds them once resolved (every
/// automatic choice made), read by attribute: the same names on both sides.
#[derive(FromPyObject)]
struct Options {
    backend: String,
    max_batch: usize,
    max_context: usize,
    max_waiting: usize,
    prefill_chunk: usize,
    decode_prefill_budget: usize,
    sliced_prefill: bool,
    whole_chunk_tokens: usize,
    launch_ahead: bool,
    /// Speculative decoding's most draft tokens a sequence and step (0: off).
    max_draft: usize,
    check_invariants: bool,
    salt: Option<Vec<u8>>,
    tokenizer_json: Option<String>,
}

#[pyclass(name = "Engine", module = "mk._native", frozen)]
pub struct PyEngine {
    engine: Engine,
    page_size: usize,
    num_blocks: usize,
    /// The vocabulary constraints compile against (from `tokenizer_json`), if given.
    grammars: Option<Grammars>,
    compiled: CompiledConstraints,
}

/// A constraint from its kind ("json_object", "json_schema", "regex", "lark") and text.
fn constraint_spec(kind: &str, value: String) -> PyResult<ConstraintSpec> {
    Ok(match kind {
        "json_object" => ConstraintSpec::JsonObject,
        "json_schema" => ConstraintSpec::JsonSchema(value),
        "regex" => ConstraintSpec::Regex(value),
        "lark" => ConstraintSpec::Lark(value),
        "prefix" => ConstraintSpec::Prefix(value),
        other => {
            return Err(errors::ConstraintError::new_err(format!(
                "constraint kind must be json_object, json_schema, regex, lark or prefix, got {other:?}"
            )))
        }
    })
}

fn constraint_error(kind: &str, e: crate::grammar::GrammarError) -> PyErr {
    errors::ConstraintError::new_err(format!("invalid {kind}: {e}"))
}

#[pymethods]
impl PyEngine {
    /// Starts the loop thread over `runner` (None: the no-op backend, which "samples"
    /// `noop_token` every step; for control-plane benchmarks). `options`: the resolved
    /// `mk.engine.options.EngineOptions` (read by attribute, `Options`); its `backend` is "pytorch"
    /// (the runner prefills and decodes) or "megakernel" (the runner prefills, the megakernel
    /// decodes). The model gives the rest: which layers slide, the window, the KV pool's blocks,
    /// the vocabulary and EOS. `step_rows`: the rows of one decode step (the megakernel's: its
    /// launch's), which speculative decoding's drafts share with the batch.
    #[new]
    #[pyo3(signature = (
        runner, options, *, sliding, window, num_blocks, vocab_size, eos_token_id=None, noop_token=1,
        step_rows=crate::abi::STEP_MAX_ROWS
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        runner: Option<Py<PyAny>>,
        options: Options,
        sliding: Vec<bool>,
        window: usize,
        num_blocks: usize,
        vocab_size: usize,
        eos_token_id: Option<u32>,
        noop_token: u32,
        step_rows: usize,
    ) -> PyResult<Self> {
        let Options {
            backend,
            max_batch,
            max_context,
            max_waiting,
            prefill_chunk,
            decode_prefill_budget,
            sliced_prefill,
            whole_chunk_tokens,
            launch_ahead,
            max_draft,
            check_invariants,
            salt,
            tokenizer_json,
        } = options;
        let grammars = match (&tokenizer_json, eos_token_id) {
            (None, _) => None,
            (Some(json), Some(eos)) => Some(
                py.detach(|| Grammars::from_tokenizer_json(json, vocab_size, eos))
                    .map_err(|e| PyValueError::new_err(format!("tokenizer_json: {e}")))?,
            ),
            (Some(_), None) => return Err(PyValueError::new_err("constraints need an eos_token_id")),
        };
        let cfg = EngineConfig {
            sched: SchedConfig {
                max_batch,
                prefill_chunk,
                decode_prefill_budget: Some(decode_prefill_budget),
                max_context,
                vocab_size,
                eos_token_id,
                max_draft,
                step_rows,
            },
            kv: KvConfig {
                sliding,
                window,
                page_size: crate::kv::PAGE_SIZE,
                num_blocks,
                salt: salt.unwrap_or_default(),
            },
            max_waiting,
            check_invariants,
            launch_ahead,
            sliced_prefill,
            whole_chunk_tokens,
        };
        let engine = match (runner, backend.as_str()) {
            (Some(r), "pytorch") => Engine::start(cfg, pytorch_backend(r, vocab_size)),
            (Some(r), "megakernel") => Engine::start(cfg, megakernel_backend(py, r, vocab_size)?),
            (None, _) => Engine::start(cfg, NoopBackend::new(noop_token)),
            (Some(_), other) => {
                return Err(PyValueError::new_err(format!(
                    "backend must be one of 'megakernel', 'pytorch', not '{other}'"
                )))
            }
        }
        .map_err(errors::engine_to_py)?;
        Ok(Self {
            engine,
            page_size: crate::kv::PAGE_SIZE,
            num_blocks,
            grammars,
            compiled: CompiledConstraints::default(),
        })
    }

    /// Queues request `id` (unique among live requests). Never waits for the loop. `constraint`:
    /// (kind, text) of a grammar the output must follow; a ValueError says why one cannot be.
    #[pyo3(signature = (
        id, prompt, *, max_tokens, temperature=1.0, top_p=1.0, top_k=0, seed=None,
        stop_token_ids=Vec::new(), ignore_eos=false, logprobs=None, constraint=None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn submit(
        &self,
        py: Python<'_>,
        id: u64,
        prompt: Vec<u32>,
        max_tokens: usize,
        temperature: f32,
        top_p: f32,
        top_k: u32,
        seed: Option<u64>,
        stop_token_ids: Vec<u32>,
        ignore_eos: bool,
        logprobs: Option<u32>,
        constraint: Option<(String, String)>,
    ) -> PyResult<()> {
        let params =
            SamplingParams { max_tokens, temperature, top_p, top_k, seed, stop_token_ids, ignore_eos, logprobs };
        let constraint = match constraint {
            None => None,
            Some((kind, value)) => Some(self.compile(py, &kind, value)?),
        };
        self.engine.submit(Request { constraint, ..Request::new(id, prompt, params) }).map_err(errors::engine_to_py)
    }

    /// Compiles a constraint (kind, text) as `submit` would, without submitting anything: a
    /// ConstraintError says why it cannot be followed (the server checks the parts of a combined
    /// grammar this way, to name the field at fault).
    fn check_constraint(&self, py: Python<'_>, kind: String, value: String) -> PyResult<()> {
        let grammars = self.grammars()?;
        let spec = constraint_spec(&kind, value)?;
        py.detach(|| grammars.compile(&spec)).map(|_| ()).map_err(|e| constraint_error(&kind, e))
    }

    /// Compiles a constraint (kind, text) and keeps it for a `submit` that follows (the GIL
    /// released meanwhile: the server calls this while it prepares a request, off its event loop).
    fn compile_constraint(&self, py: Python<'_>, kind: String, value: String) -> PyResult<()> {
        self.compile(py, &kind, value).map(|_| ())
    }

    /// Keeps later submissions from the scheduler until `release` (holds nest): requests
    /// submitted under a hold start together.
    fn hold(&self) {
        self.engine.hold();
    }

    /// Ends one `hold`.
    fn release(&self) {
        self.engine.release();
    }

    /// Ends request `id` within one loop iteration (a `cancelled` event follows).
    fn cancel(&self, id: u64) {
        self.engine.cancel(id);
    }

    fn cancel_all(&self) {
        self.engine.cancel_all();
    }

    /// Events since the last call, waiting up to `timeout` seconds with the GIL released. [] on
    /// timeout; None once the engine has stopped and everything was delivered.
    fn next_events(&self, py: Python<'_>, timeout: f64) -> Option<Vec<PyEvent>> {
        let timeout = Duration::from_secs_f64(timeout.clamp(0.0, 3600.0));
        let events = py.detach(|| self.engine.next_events(timeout))?;
        Some(events.into_iter().map(PyEvent::from).collect())
    }

    /// Counters of the scheduler, the KV cache and the loop (refreshed every iteration).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.engine.stats();
        let d = PyDict::new(py);
        let (q, kv, m) = (s.sched, s.kv, s.metrics);
        for (k, v) in [
            ("running", q.running as u64),
            ("waiting", q.waiting as u64),
            ("prompt_tokens", q.prompt_tokens),
            ("prefill_tokens", q.prefill_tokens),
            ("generated_tokens", q.generated_tokens),
            ("preemptions", q.preemptions),
            ("finished", q.finished),
            ("draft_tokens", q.draft_tokens),
            ("accepted_tokens", q.accepted_tokens),
            ("kv_blocks_total", kv.total_blocks as u64),
            ("kv_blocks_free", kv.free_blocks as u64),
            ("kv_cached_blocks", kv.cached_blocks as u64),
            ("kv_sequences", kv.sequences as u64),
            ("prefix_lookups", kv.lookups),
            ("prefix_lookup_tokens", kv.lookup_tokens),
            ("prefix_hits", kv.hits),
            ("prefix_hit_tokens", kv.hit_tokens),
            ("prefix_evictions", kv.evictions),
            ("iterations", m.iterations),
            ("decode_steps", m.decode_steps),
            ("decode_rows", m.decode_rows),
            ("queued_steps", m.queued_steps),
            ("prefill_chunks", m.prefill_chunks),
            ("prefill_slices", m.prefill_slices),
            ("host_ns", m.host_ns),
            ("backend_ns", m.backend_ns),
            ("max_host_ns", m.max_host_ns),
            ("launches", m.launch.launches),
            ("launch_prepare_ns", m.launch.prepare_ns),
            ("launch_upload_ns", m.launch.upload_ns),
            ("launch_call_ns", m.launch.call_ns),
            ("launch_wait_ns", m.launch.wait_ns),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    /// Cancels everything and stops the loop thread (GIL released while it finishes).
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.engine.shutdown());
    }

    #[getter]
    fn is_running(&self) -> bool {
        self.engine.is_running()
    }

    #[getter]
    fn max_batch(&self) -> usize {
        self.engine.config().max_batch
    }

    #[getter]
    fn max_context(&self) -> usize {
        self.engine.config().max_context
    }

    #[getter]
    fn prefill_chunk(&self) -> usize {
        self.engine.config().prefill_chunk
    }

    #[getter]
    fn page_size(&self) -> usize {
        self.page_size
    }

    #[getter]
    fn num_blocks(&self) -> usize {
        self.num_blocks
    }
}

impl PyEngine {
    /// A request's constraint compiled against the engine's vocabulary, or the ConstraintError
    /// that says why it cannot be (compiling releases the GIL: a large schema takes a while).
    /// The constraint's parser at its start, compiled or kept (`CompiledConstraints`).
    fn compile(&self, py: Python<'_>, kind: &str, value: String) -> PyResult<Constraint> {
        let grammars = self.grammars()?;
        let spec = constraint_spec(kind, value)?;
        py.detach(|| self.compiled.get(grammars, &spec)).map_err(|e| constraint_error(kind, e))
    }

    fn grammars(&self) -> PyResult<&Grammars> {
        self.grammars.as_ref().ok_or_else(|| {
            errors::ConstraintError::new_err("this engine has no tokenizer to compile constraints against")
        })
    }
}

impl Drop for PyEngine {
    fn drop(&mut self) {
        // The loop may be waiting for the GIL inside a runner call: join it with the GIL released.
        let engine = &self.engine;
        if Python::try_attach(|py| py.detach(|| engine.shutdown())).is_none() {
            engine.shutdown();
        }
    }
}

/// Blocks a `len`-token sequence holds while decoding, and at most while prefilling in chunks
/// of `chunk` tokens, for a model whose layers slide as `sliding` (64-token pages).
#[pyfunction]
#[pyo3(signature = (sliding, window, len, chunk))]
fn kv_blocks_needed(sliding: Vec<bool>, window: usize, len: usize, chunk: usize) -> PyResult<(usize, usize)> {
    let g = crate::kv::KvGeometry::new(crate::kv::PAGE_SIZE, window, sliding).map_err(errors::kv_to_py)?;
    Ok((g.blocks_needed(len), g.prefill_blocks_needed(len, chunk)))
}

/// First page a sliding layer of `window` keys still needs when the earliest query still to come is
/// at `query` (the release rule the Python reference's page allocator must follow too).
#[pyfunction]
#[pyo3(signature = (window, query))]
fn kv_keep_from(window: usize, query: usize) -> PyResult<usize> {
    let g = crate::kv::KvGeometry::new(crate::kv::PAGE_SIZE, window, vec![true]).map_err(errors::kv_to_py)?;
    Ok(g.keep_from(query))
}

/// KV blocks (one page of K and V for every KV head) that fit in `budget` bytes of
/// `elem_bytes`-wide values.
#[pyfunction]
#[pyo3(signature = (budget, kv_heads, head_dim, elem_bytes))]
fn kv_pool_blocks(budget: u64, kv_heads: u64, head_dim: u64, elem_bytes: u64) -> usize {
    let per_block = crate::kv::bytes_per_block(crate::kv::PAGE_SIZE as u64, kv_heads, head_dim, elem_bytes);
    crate::kv::blocks_for_budget(budget, per_block)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyEngine>()?;
    m.add_class::<PyEvent>()?;
    m.add_function(wrap_pyfunction!(kv_blocks_needed, m)?)?;
    m.add_function(wrap_pyfunction!(kv_pool_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(kv_keep_from, m)?)?;
    m.add("QueueFullError", m.py().get_type::<errors::QueueFullError>())?;
    m.add("EngineStoppedError", m.py().get_type::<errors::EngineStoppedError>())?;
    m.add("ConstraintError", m.py().get_type::<errors::ConstraintError>())?;
    m.add("PromptTooLongError", m.py().get_type::<errors::PromptTooLongError>())?;
    Ok(())
}
