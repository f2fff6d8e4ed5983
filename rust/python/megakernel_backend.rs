//! The `Megakernel` decode backend: prefill through the Python runner (PyTorch writes the
//! prompt's K/V into the pool the kernel reads, exactly as the Reference backend does), decode in
//! Rust with one megakernel launch per step and no Python at all.
//!
//! Runner protocol: the Reference backend's `prefill`, plus `megakernel_setup()` → dict, read
//! once at construction (mk.megakernel.runner.MegakernelRunner): `device`, `stream` (the CUstream
//! prefill runs on, which the launches share, so they follow the prefill's K/V writes),
//! `step_args` (bytes of an MkStepArgs template holding every address Python owns), `rows`,
//! `max_splits`, `slots`, `max_pages`, `num_blocks`, `attn_chunk`, `row_groups`, `sample_parts`,
//! `dealing`, `kernel_masks` and `late_masks` (`MegakernelDecoder`'s).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors;
use super::graph::geometry_from;
use super::reference_backend::{reference_backend, ReferenceBackend};
use crate::engine::backend::UnseenRows;
use crate::engine::megakernel::MegakernelDecoder;
use crate::engine::{Backend, BackendError, DecodeInput, LaunchTimes, PrefillInput, PrefillResult};
use crate::gpu::step::{GpuLauncher, StepSetup};
use crate::gpu::{Gpu, MkStepArgs};
use crate::grammar::TokenMask;
use crate::graph::BuildOptions;
use crate::sampling::Sampled;

pub struct MegakernelBackend {
    // Declared first so it drops first: its device buffers are freed on the runner's stream,
    // which the runner (below) keeps alive.
    decoder: MegakernelDecoder<GpuLauncher>,
    python: ReferenceBackend,
    /// Rows whose table changed in decode calls, which never reach Python: the runner's mirror
    /// gets them with the next prefill.
    unseen: UnseenRows,
}

fn get<'py, T: FromPyObjectOwned<'py>>(d: &Bound<'py, PyDict>, key: &str) -> PyResult<T> {
    d.get_item(key)?
        .ok_or_else(|| PyValueError::new_err(format!("megakernel_setup() has no {key:?}")))?
        .extract()
        .map_err(Into::into)
}

impl MegakernelBackend {
    pub fn new(py: Python<'_>, runner: Py<PyAny>, vocab: usize) -> PyResult<Self> {
        let setup = runner.call_method0(py, "megakernel_setup")?;
        let d = setup.bind(py).cast::<PyDict>().map_err(|_| PyValueError::new_err("megakernel_setup() → dict"))?;
        let raw: Vec<u8> = get(d, "step_args")?;
        let size = std::mem::size_of::<MkStepArgs>();
        if raw.len() != size {
            return Err(PyValueError::new_err(format!("MkStepArgs is {size} bytes, got {}", raw.len())));
        }
        // SAFETY: MkStepArgs is plain old data of exactly `size` bytes; any bit pattern is valid.
        let args: MkStepArgs = unsafe { std::ptr::read_unaligned(raw.as_ptr().cast()) };
        let geometry = geometry_from(runner.bind(py).getattr("model")?.getattr("config")?.as_any())?;
        let step = StepSetup {
            args,
            geometry,
            rows: get(d, "rows")?,
            max_splits: get(d, "max_splits")?,
            slots: get(d, "slots")?,
            max_pages: get(d, "max_pages")?,
            num_blocks: get(d, "num_blocks")?,
            options: BuildOptions {
                num_sms: 0, // the device's, filled in by GpuLauncher
                attn_chunk: get(d, "attn_chunk")?,
                row_groups: get(d, "row_groups")?,
                sample_parts: get(d, "sample_parts")?,
                dealing: crate::python::graph::parse_dealing(&get::<String>(d, "dealing")?)?,
                ..BuildOptions::default()
            },
        };
        let kernel_masks: bool = get(d, "kernel_masks")?;
        let late_masks: bool = get(d, "late_masks")?;
        let device: usize = get(d, "device")?;
        let stream: u64 = get(d, "stream")?;
        let launcher = py
            .detach(|| {
                let gpu = Gpu::shared(device)?;
                // SAFETY: the runner keeps the stream and every tensor in `step_args` alive and
                // sized as `setup` says (MegakernelRunner allocates them from the same numbers);
                // this backend holds the runner for as long as it lives.
                unsafe { GpuLauncher::new(gpu, stream as usize as _, step) }
            })
            .map_err(errors::to_py)?;
        let mut decoder = MegakernelDecoder::new(launcher);
        decoder.kernel_masks = kernel_masks;
        decoder.late_masks = late_masks;
        Ok(Self { decoder, python: reference_backend(runner, vocab), unseen: UnseenRows::default() })
    }
}

impl Backend for MegakernelBackend {
    fn prefill(&mut self, input: &PrefillInput<'_>, out: &mut Vec<PrefillResult>) -> Result<(), BackendError> {
        let dirty_rows = self.unseen.pending(input.table.rows(), input.dirty_rows);
        self.python.prefill(&PrefillInput { dirty_rows, ..*input }, out)?;
        self.unseen.sent();
        Ok(())
    }

    fn decode(&mut self, input: &DecodeInput<'_>, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        self.unseen.note(input.table.rows(), input.dirty_rows);
        self.decoder.decode(input, out)
    }

    fn can_queue(&self, input: &DecodeInput<'_>) -> bool {
        self.decoder.can_queue(input)
    }

    fn queue(&mut self, input: &DecodeInput<'_>, previous: &[Option<usize>]) -> Result<(), BackendError> {
        self.unseen.note(input.table.rows(), input.dirty_rows);
        self.decoder.queue(input, previous)
    }

    fn collect(&mut self, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        self.decoder.collect(out)
    }

    fn late_masks(&self) -> bool {
        self.decoder.kernel_masks && self.decoder.late_masks
    }

    fn deliver_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<(), BackendError> {
        self.decoder.deliver_masks(masks)
    }

    fn launch_times(&self) -> LaunchTimes {
        self.decoder.launch_times()
    }
}
