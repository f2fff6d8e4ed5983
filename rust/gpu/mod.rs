//! Driver-API access to the GPU: load the embedded cubins, launch kernels on a caller's stream.
//!
//! The CUDA driver is loaded at run time (cudarc's dynamic loading), so the crate links and the
//! Python package imports on machines with no GPU; only opening a device reports an error there.

pub mod compact;
pub mod probe;
pub mod step;
pub mod tensor_map;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::abi;
use cudarc::driver::{sys, CudaContext, CudaFunction, CudaStream, DriverError, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/cubins.rs"));
}
pub use embedded::{CUBINS, DEFINES, GENCODE, NVCC_VERSION};

/// The embedded cubin built from `cuda/<name>.cu` (`megakernel_wide`: megakernel.cu's wide image).
pub fn cubin(name: &str) -> Option<&'static [u8]> {
    CUBINS.iter().find(|(n, _)| *n == name).map(|(_, bytes)| *bytes)
}

/// Names the megakernel images to load instead of the embedded ones: a kernel change is measured on
/// the GPU machine by compiling `cuda/megakernel.cu` there, without rebuilding the wheel
/// (scripts/device-kernel.sh). They must be built from the same `cuda/abi.h`. One variant is a
/// `,`-separated list of images (its narrow and wide builds; a launch runs the narrowest that
/// holds its rows, as each image's `mk_image_rows` says); several variants separated by `:` load
/// into one process (`decode_step`'s `kernel` index; the first is the default), so that kernels
/// are compared on the same buffers (benches/decode.py times every variant; scripts/device-ab.sh).
pub const MEGAKERNEL_CUBIN_ENV: &str = "MK_MEGAKERNEL_CUBIN";

/// The embedded megakernel images: the narrow one, and the wide one where the build has it.
const EMBEDDED_MEGAKERNELS: [&str; 2] = ["megakernel", "megakernel_wide"];

/// The megakernel variants to load, each a list of images: those `$MK_MEGAKERNEL_CUBIN` names when
/// set, else the embedded ones.
fn megakernel_variants() -> Result<Vec<Vec<Vec<u8>>>, GpuError> {
    variants_named_by(std::env::var_os(MEGAKERNEL_CUBIN_ENV))
}

/// The variants a value of `MEGAKERNEL_CUBIN_ENV` names (None: the embedded megakernel).
fn variants_named_by(value: Option<std::ffi::OsString>) -> Result<Vec<Vec<Vec<u8>>>, GpuError> {
    let Some(value) = value else {
        let images = EMBEDDED_MEGAKERNELS.iter().filter_map(|name| cubin(name)).map(<[u8]>::to_vec).collect();
        return Ok(vec![images]);
    };
    std::env::split_paths(&value)
        .map(|variant| {
            variant
                .to_string_lossy()
                .split(',')
                .map(|path| {
                    std::fs::read(path)
                        .map_err(|e| GpuError::InvalidArgument(format!("{MEGAKERNEL_CUBIN_ENV}: {path}: {e}")))
                })
                .collect()
        })
        .collect()
}

/// One loaded megakernel image: its `mk_decode_step` (which holds the module) and the rows it takes.
struct Image {
    rows: usize,
    function: CudaFunction,
}

#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error("no CUDA driver (libcuda.so) on this machine: the GPU path needs an NVIDIA GPU and its driver")]
    NoDriver,
    #[error("CUDA device {ordinal} does not exist ({count} visible)")]
    NoDevice { ordinal: usize, count: i32 },
    #[error(
        "mk's kernels are built for Hopper (sm_90a); device {ordinal} ({name}) is compute capability {major}.{minor}"
    )]
    UnsupportedDevice { ordinal: usize, name: String, major: i32, minor: i32 },
    #[error("CUDA driver error while trying to {action}: {source}")]
    Driver { action: &'static str, source: DriverError },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

trait Context<T> {
    fn during(self, action: &'static str) -> Result<T, GpuError>;
}

impl<T> Context<T> for Result<T, DriverError> {
    fn during(self, action: &'static str) -> Result<T, GpuError> {
        self.map_err(|source| GpuError::Driver { action, source })
    }
}

/// True when a CUDA driver can be loaded and sees at least one device.
pub fn available() -> bool {
    // SAFETY: only tries to dlopen libcuda.
    if !unsafe { sys::is_culib_present() } {
        return false;
    }
    CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
}

/// One device's primary context (the one PyTorch uses too) and the loaded megakernel.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    /// The loaded megakernel variants (`megakernel_variants`, the default first), each its images
    /// from the narrowest.
    decode_step: Vec<Vec<Image>>,
    num_sms: u32,
}

impl Gpu {
    /// Opens device `ordinal` once per process and returns the shared handle.
    pub fn shared(ordinal: usize) -> Result<Arc<Gpu>, GpuError> {
        static OPEN: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
        let mut open = OPEN.get_or_init(Default::default).lock().unwrap();
        if let Some(gpu) = open.get(&ordinal) {
            return Ok(gpu.clone());
        }
        let gpu = Arc::new(Gpu::open(ordinal)?);
        open.insert(ordinal, gpu.clone());
        Ok(gpu)
    }

    fn open(ordinal: usize) -> Result<Gpu, GpuError> {
        // SAFETY: only tries to dlopen libcuda.
        if !unsafe { sys::is_culib_present() } {
            return Err(GpuError::NoDriver);
        }
        let count = CudaContext::device_count().during("count devices")?;
        if ordinal >= count.max(0) as usize {
            return Err(GpuError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal).during("retain the device's primary context")?;
        let (major, minor) = ctx.compute_capability().during("read the compute capability")?;
        if (major, minor) != (9, 0) {
            let name = ctx.name().unwrap_or_default();
            return Err(GpuError::UnsupportedDevice { ordinal, name, major, minor });
        }
        let mut decode_step = Vec::new();
        for (k, variant) in megakernel_variants()?.into_iter().enumerate() {
            let mut images = Vec::new();
            for (i, image) in variant.into_iter().enumerate() {
                images.push(load_image(&ctx, &image).map_err(|e| match e {
                    GpuError::InvalidArgument(why) => {
                        GpuError::InvalidArgument(format!("megakernel variant {k}, image {i}: {why}"))
                    }
                    other => other,
                })?);
            }
            images.sort_by_key(|image| image.rows);
            check_variant_rows(k, &images.iter().map(|image| image.rows).collect::<Vec<_>>())?;
            decode_step.push(images);
        }
        let num_sms = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .during("count the multiprocessors")? as u32;
        Ok(Gpu { ctx, decode_step, num_sms })
    }

    /// How many megakernel variants are loaded (`MEGAKERNEL_CUBIN_ENV`): valid `kernel` indices.
    pub fn kernel_count(&self) -> usize {
        self.decode_step.len()
    }

    /// Multiprocessors of the device: the decode step runs one block on each.
    pub fn num_sms(&self) -> u32 {
        self.num_sms
    }

    /// A handle for enqueueing on `stream`, a stream its owner (PyTorch) created on this device.
    ///
    /// # Safety
    /// `stream` must be a stream of this device's primary context (or null, the legacy default
    /// stream) and outlive the handle and everything allocated on it.
    pub unsafe fn borrow_stream(&self, stream: sys::CUstream) -> Arc<CudaStream> {
        self.ctx.wrap_borrowed_stream(stream)
    }

    /// One decode step of the megakernel (variant `kernel`, 0 = the default; its narrowest image
    /// that holds `args.batch` rows) over `grid` blocks (one per task list).
    ///
    /// # Safety
    /// Every pointer in `args` must be device memory of this device laid out as cuda/abi.h and
    /// python/mk/megakernel/buffers.py describe, and the task lists must pass `graph::check`
    /// (a list waiting on work that never comes hangs the GPU). `grid` must not exceed the number
    /// of multiprocessors, so every block is resident at once.
    pub unsafe fn decode_step(
        &self,
        args: &MkStepArgs,
        grid: u32,
        stream: sys::CUstream,
        kernel: usize,
    ) -> Result<(), GpuError> {
        let Some(images) = self.decode_step.get(kernel) else {
            return Err(GpuError::InvalidArgument(format!(
                "kernel {kernel} is not loaded ({} megakernel variants, see {MEGAKERNEL_CUBIN_ENV})",
                self.decode_step.len()
            )));
        };
        if grid == 0
            || grid > self.num_sms
            || args.per_sm <= 0
            || args.batch < 1
            || args.batch as usize > abi::STEP_MAX_ROWS
        {
            return Err(GpuError::InvalidArgument(format!(
                "decode_step needs 1 <= grid <= {} SMs, per_sm > 0 and 1 <= batch <= {}; got grid={grid}, per_sm={}, \
                 batch={}",
                self.num_sms,
                abi::STEP_MAX_ROWS,
                args.per_sm,
                args.batch
            )));
        }
        if args.head_dim as usize != abi::STEP_HEAD_DIM
            || args.kv_heads < 1
            || (args.heads / args.kv_heads) as usize > abi::STEP_MAX_GROUP
            || args.longest_reduction() > abi::STEP_MAX_K
            || args.top_k as usize > abi::STEP_MAX_TOP_K
            || args.experts as usize > abi::STEP_MAX_EXPERTS
        {
            return Err(GpuError::InvalidArgument(format!(
                "decode_step supports head_dim {}, query groups of at most {}, GEMV reductions (hidden, query \
                 width, FFN widths) of at most {}, top-{} routing and {} experts at most",
                abi::STEP_HEAD_DIM,
                abi::STEP_MAX_GROUP,
                abi::STEP_MAX_K,
                abi::STEP_MAX_TOP_K,
                abi::STEP_MAX_EXPERTS
            )));
        }
        // Every variant's widest image takes STEP_MAX_ROWS rows (checked at load).
        let image = images.iter().find(|image| image.rows >= args.batch as usize).expect("an image takes the batch");
        let stream = self.ctx.wrap_borrowed_stream(stream);
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (abi::STEP_THREADS, 1, 1),
            shared_mem_bytes: abi::STEP_SMEM_BYTES,
        };
        let mut launch = stream.launch_builder(&image.function);
        launch.arg(args);
        launch.launch(cfg).during("launch mk_decode_step")?;
        Ok(())
    }
}

/// A variant's images' rows, narrowest first, must be distinct and the widest must take
/// `STEP_MAX_ROWS` rows: the engine sizes its launches by that.
fn check_variant_rows(k: usize, rows: &[usize]) -> Result<(), GpuError> {
    if rows.windows(2).any(|w| w[0] == w[1]) || rows.last() != Some(&abi::STEP_MAX_ROWS) {
        return Err(GpuError::InvalidArgument(format!(
            "megakernel variant {k}: its images take {rows:?} rows; a variant needs images of distinct rows, the \
             widest taking {} (compile megakernel.cu as both images: compile_megakernel in scripts/device-env.sh)",
            abi::STEP_MAX_ROWS
        )));
    }
    Ok(())
}

/// Loads one megakernel image: its decode step, checked against this build's block size, with the
/// shared memory raised, and the rows it takes.
fn load_image(ctx: &Arc<CudaContext>, image: &[u8]) -> Result<Image, GpuError> {
    let module = ctx.load_module(Ptx::from_binary(image.to_vec())).during("load the megakernel")?;
    let function = module.load_function("mk_decode_step").during("find mk_decode_step")?;
    // Its __launch_bounds__ are MK_STEP_THREADS: a cubin of another cuda/abi.h (a
    // $MK_MEGAKERNEL_CUBIN file) would fail to launch, or lack a warp and hang.
    let threads = function.max_threads_per_block().during("read mk_decode_step's block size")?;
    let stale = || {
        GpuError::InvalidArgument(format!(
            "it was compiled from another cuda/abi.h than this build's (MK_ABI_VERSION {}, blocks of {} threads)",
            abi::ABI_VERSION,
            abi::STEP_THREADS
        ))
    };
    if threads != abi::STEP_THREADS as i32 {
        return Err(stale());
    }
    let stream = ctx.default_stream();
    let symbol = match module.get_global("mk_image_rows", &stream) {
        Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_FOUND)) => return Err(stale()),
        other => other.during("find mk_image_rows")?,
    };
    let bytes = stream.clone_dtoh(&symbol).during("read mk_image_rows")?;
    let rows = i32::from_le_bytes(bytes.get(..4).and_then(|b| b.try_into().ok()).ok_or_else(stale)?);
    if rows < 1 || rows as usize > abi::STEP_MAX_ROWS {
        return Err(GpuError::InvalidArgument(format!(
            "it says it takes {rows} rows (mk_image_rows), this build 1 to {}",
            abi::STEP_MAX_ROWS
        )));
    }
    function
        .set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            abi::STEP_SMEM_BYTES as i32,
        )
        .during("raise mk_decode_step's shared memory limit")?;
    Ok(Image { rows: rows as usize, function })
}

pub use crate::abi::{MkRowSample, MkStepArgs};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cuda_source_is_embedded() {
        let mut sources: Vec<String> = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/cuda"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "cu"))
            .map(|p| p.file_stem().unwrap().to_string_lossy().into_owned())
            .collect();
        if !abi::WEIGHT_SWIZZLE {
            sources.push("megakernel_wide".into());
        }
        sources.sort();
        let embedded: Vec<String> = CUBINS.iter().map(|(n, _)| n.to_string()).collect();
        assert_eq!(sources, embedded);
        for (name, bytes) in CUBINS {
            assert_eq!(&bytes[..4], b"\x7fELF", "{name} is not a cubin");
        }
    }

    #[test]
    fn the_cubin_variable_names_variants_of_one_image_or_several() {
        let dir = std::env::temp_dir().join(format!("mk-cubins-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b, c) = (dir.join("a.cubin"), dir.join("b.cubin"), dir.join("c.cubin"));
        std::fs::write(&a, b"first").unwrap();
        std::fs::write(&b, b"second").unwrap();
        std::fs::write(&c, b"third").unwrap();
        let bytes = |v: &[&[u8]]| v.iter().map(|x| x.to_vec()).collect::<Vec<_>>();
        let both = std::env::join_paths([&a, &b]).unwrap();
        assert_eq!(variants_named_by(Some(both)).unwrap(), vec![bytes(&[b"first"]), bytes(&[b"second"])]);
        let paired = format!("{},{}:{}", a.display(), b.display(), c.display());
        assert_eq!(
            variants_named_by(Some(paired.into())).unwrap(),
            vec![bytes(&[b"first", b"second"]), bytes(&[b"third"])]
        );
        assert_eq!(variants_named_by(Some(a.clone().into_os_string())).unwrap(), vec![bytes(&[b"first"])]);
        let embedded = variants_named_by(None).unwrap();
        assert_eq!(embedded.len(), 1);
        assert_eq!(embedded[0][0], cubin("megakernel").unwrap());
        assert_eq!(embedded[0].len(), if abi::WEIGHT_SWIZZLE { 1 } else { 2 });
        let missing = std::env::join_paths([a.clone(), dir.join("missing.cubin")]).unwrap();
        let err = variants_named_by(Some(missing)).unwrap_err().to_string();
        assert!(err.contains(MEGAKERNEL_CUBIN_ENV) && err.contains("missing.cubin"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_variant_must_take_a_whole_launch_with_images_of_distinct_rows() {
        let max = abi::STEP_MAX_ROWS;
        assert!(check_variant_rows(0, &[abi::NARROW_ROWS, abi::WIDE_ROWS]).is_ok() || abi::WEIGHT_SWIZZLE);
        assert!(check_variant_rows(0, &[max]).is_ok());
        for bad in [vec![], vec![max - 1], vec![max, max], vec![1, max - 1]] {
            let err = check_variant_rows(3, &bad).unwrap_err().to_string();
            assert!(err.contains("variant 3") && err.contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn each_megakernel_image_says_its_rows() {
        use object::{Object, ObjectSection, ObjectSymbol};
        for (name, rows) in [("megakernel", abi::NARROW_ROWS), ("megakernel_wide", abi::WIDE_ROWS)] {
            let image = cubin(name);
            assert_eq!(image.is_none(), abi::WEIGHT_SWIZZLE && rows == abi::WIDE_ROWS, "{name} embedded or not");
            let Some(image) = image else { continue };
            let elf = object::File::parse(image).unwrap();
            let symbol = elf.symbols().find(|s| s.name() == Ok("mk_image_rows")).expect("mk_image_rows");
            let section = elf.section_by_index(symbol.section_index().unwrap()).unwrap();
            let data = section.data().unwrap();
            let at = (symbol.address() - section.address()) as usize;
            assert_eq!(i32::from_le_bytes(data[at..at + 4].try_into().unwrap()) as usize, rows, "{name}");
        }
    }

    #[test]
    fn the_megakernel_cubins_export_the_decode_step_for_sm90a() {
        use object::{Object, ObjectSymbol};
        for name in EMBEDDED_MEGAKERNELS.iter().filter(|name| cubin(name).is_some()) {
            let elf = object::File::parse(cubin(name).unwrap()).unwrap();
            assert!(elf.symbols().any(|s| s.name() == Ok("mk_decode_step")), "{name}");
            // With CUDA ELF ABI 8, e_flags carry the SM version in bits 8..16 (0x5a = 90).
            let flags = match elf.flags() {
                object::FileFlags::Elf { e_flags, .. } => e_flags.0,
                other => panic!("unexpected flags {other:?}"),
            };
            assert_eq!((flags >> 8) & 0xff, 90, "{name} is not built for sm_90: e_flags={flags:#x}");
        }
    }

    #[test]
    fn opening_without_a_driver_is_a_clear_error() {
        if available() {
            return; // a GPU machine: the GPU tests cover opening
        }
        let err = Gpu::shared(0).err().expect("no GPU here");
        assert!(matches!(err, GpuError::NoDriver | GpuError::NoDevice { .. }), "{err}");
    }
}
