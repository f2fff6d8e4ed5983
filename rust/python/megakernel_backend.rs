//! The megakernel backend from Python's `MegakernelRunner`: its setup (`megakernel_setup()`,
//! read once) converted into a GPU launcher, and its `prefill` as the prefilling backend
//! (`crate::engine::megakernel::MegakernelBackend`; the PyTorch backend's prefill: PyTorch writes
//! the prompt's K/V into the pool the kernel reads).

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::errors;
use super::graph::dims_from;
use super::pytorch_backend::{pytorch_backend, PytorchBackend};
use crate::engine::megakernel::{MegakernelBackend, MegakernelDecoder};
use crate::gpu::step::{GpuLauncher, StepSetup};
use crate::gpu::{Gpu, MkStepArgs};
use crate::graph::BuildOptions;

/// The megakernel backend over a Python `MegakernelRunner`.
pub type PythonMegakernel = MegakernelBackend<PytorchBackend, GpuLauncher>;

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

/// The backend of `runner` (a `MegakernelRunner`) over a vocabulary of `vocab` tokens.
pub fn megakernel_backend(py: Python<'_>, runner: Py<PyAny>, vocab: usize) -> PyResult<PythonMegakernel> {
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
    let dims = dims_from(runner.bind(py).getattr("model")?.getattr("config")?.as_any())?;
    let step = StepSetup {
        args,
        dims,
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
    Ok(MegakernelBackend::new(decoder, pytorch_backend(runner, vocab)))
}
