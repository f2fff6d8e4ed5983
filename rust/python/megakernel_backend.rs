//! The `Megakernel` decode backend: prefill through the Python runner (PyTorch writes the
//! prompt's K/V into the pool the kernel reads, exactly as the Reference backend does), decode in
//! Rust with one megakernel launch per step and no Python at all.
//!
//! Runner protocol: the Reference backend's `prefill`, plus `megakernel_setup()`, read once at
//! construction: an object with `Setup`'s fields as attributes (mk.megakernel.runner's
//! `MegakernelSetup`).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::errors;
use super::graph::geometry_from;
use super::reference_backend::{reference_backend, ReferenceBackend};
use crate::engine::backend::UnseenRows;
use crate::engine::megakernel::MegakernelDecoder;
use crate::engine::{Backend, BackendError, DecodeInput, LaunchTimes, PrefillInput, PrefillResult, QueuedDecoder};
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

/// What `megakernel_setup()` gives, read by attribute: the device and the CUstream prefill runs
/// on (the launches share it, so they follow the prefill's K/V writes), `step_args` (bytes of an
/// MkStepArgs template holding every address Python owns), the buffers' sizes, the graph's build
/// options, and `kernel_masks`/`late_masks` (`MegakernelDecoder`'s).
#[derive(FromPyObject)]
struct Setup {
    device: usize,
    stream: u64,
    step_args: Vec<u8>,
    rows: usize,
    max_splits: usize,
    slots: usize,
    max_pages: usize,
    num_blocks: usize,
    attn_chunk: usize,
    row_groups: usize,
    sample_parts: usize,
    dealing: String,
    kernel_masks: bool,
    late_masks: bool,
}

impl MegakernelBackend {
    pub fn new(py: Python<'_>, runner: Py<PyAny>, vocab: usize) -> PyResult<Self> {
        let s: Setup = runner
            .call_method0(py, "megakernel_setup")?
            .extract(py)
            .map_err(|e| PyValueError::new_err(format!("megakernel_setup(): {e}")))?;
        let size = std::mem::size_of::<MkStepArgs>();
        if s.step_args.len() != size {
            return Err(PyValueError::new_err(format!("MkStepArgs is {size} bytes, got {}", s.step_args.len())));
        }
        // SAFETY: MkStepArgs is plain old data of exactly `size` bytes; any bit pattern is valid.
        let args: MkStepArgs = unsafe { std::ptr::read_unaligned(s.step_args.as_ptr().cast()) };
        let geometry = geometry_from(runner.bind(py).getattr("model")?.getattr("config")?.as_any())?;
        let step = StepSetup {
            args,
            geometry,
            rows: s.rows,
            max_splits: s.max_splits,
            slots: s.slots,
            max_pages: s.max_pages,
            num_blocks: s.num_blocks,
            options: BuildOptions {
                num_sms: 0, // the device's, filled in by GpuLauncher
                attn_chunk: s.attn_chunk,
                row_groups: s.row_groups,
                sample_parts: s.sample_parts,
                dealing: crate::python::graph::parse_dealing(&s.dealing)?,
                ..BuildOptions::default()
            },
        };
        let (device, stream) = (s.device, s.stream);
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
        decoder.kernel_masks = s.kernel_masks;
        decoder.late_masks = s.late_masks;
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

    fn queued(&mut self) -> Option<&mut dyn QueuedDecoder> {
        Some(self)
    }

    fn queued_ref(&self) -> Option<&dyn QueuedDecoder> {
        Some(self)
    }

    fn launch_times(&self) -> LaunchTimes {
        self.decoder.launch_times()
    }
}

impl QueuedDecoder for MegakernelBackend {
    fn can_queue(&self, input: &DecodeInput<'_>) -> bool {
        self.decoder.can_queue(input)
    }

    fn late_masks(&self) -> bool {
        self.decoder.kernel_masks && self.decoder.late_masks
    }

    fn deliver_masks(&mut self, masks: &[Option<&TokenMask>]) -> Result<(), BackendError> {
        self.decoder.deliver_masks(masks)
    }

    fn queue(&mut self, input: &DecodeInput<'_>, previous: &[Option<usize>]) -> Result<(), BackendError> {
        self.unseen.note(input.table.rows(), input.dirty_rows);
        self.decoder.queue(input, previous)
    }

    fn collect(&mut self, out: &mut Vec<Sampled>) -> Result<(), BackendError> {
        self.decoder.collect(out)
    }
}
