//! Compiles every `cuda/*.cu` with nvcc for sm_90a and embeds the cubins in the crate.
//!
//! nvcc is looked up in this order: `$NVCC`, `$CUDA_HOME/bin/nvcc`, `nvcc` on `PATH`, and the
//! PyPI package `nvidia-cuda-nvcc` in the Python environment doing the build (so `pip install .`
//! works on a machine without a CUDA toolkit). No nvcc is a build error, never a CPU-only build.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const GENCODE: &str = "-gencode=arch=compute_90a,code=sm_90a";

/// A build variant: `MK_WEIGHT_SWIZZLE=1` compiles the kernels with 128-byte-swizzled weight boxes
/// (cuda/abi.h) and the host with the matching tensor maps (`cfg(mk_weight_swizzle)`).
const WEIGHT_SWIZZLE: &str = "MK_WEIGHT_SWIZZLE";
/// The megakernel is compiled twice: `megakernel` for launches of 1-8 rows and this one for 9-16
/// (two n-tiles; cuda/abi.h, MK_IMAGE_ROWS). The swizzled variant has only the narrow one.
const WIDE_MEGAKERNEL: &str = "megakernel_wide";
const WIDE_DEFINE: &str = "-DMK_IMAGE_ROWS=MK_WIDE_ROWS";

fn main() {
    println!("cargo:rerun-if-changed=cuda");
    let vars = ["NVCC", "CUDA_HOME", "PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE", "VIRTUAL_ENV", "PATH"];
    for var in vars.into_iter().chain([WEIGHT_SWIZZLE]) {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rustc-check-cfg=cfg(mk_weight_swizzle)");
    let mut defines = Vec::new();
    let swizzled = env::var(WEIGHT_SWIZZLE).is_ok_and(|v| v == "1");
    if swizzled {
        println!("cargo:rustc-cfg=mk_weight_swizzle");
        defines.push("-DMK_WEIGHT_SWIZZLE=1");
    }
    let out_dir = PathBuf::from(env::var("OUT_DIR").unwrap());
    let nvcc = find_nvcc().unwrap_or_else(|tried| {
        panic!(
            "\n\nmk: no CUDA compiler (nvcc) found; it is needed to build the GPU kernels.\n\
             Tried: {}\n\
             Fix: `pip install nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
             'nvidia-cuda-runtime==13.0.*' 'nvidia-cuda-cccl==13.0.*'` into the Python environment \
             that builds mk, or set NVCC=/path/to/nvcc (or CUDA_HOME).\n",
            tried.join("; ")
        )
    });
    let version = nvcc_version(&nvcc);

    let mut sources: Vec<PathBuf> = fs::read_dir("cuda")
        .expect("cuda/ directory")
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "cu"))
        .collect();
    sources.sort();

    let mut table =
        String::from("/// (name, cubin) for every `cuda/*.cu` and the megakernel's wide image, compiled for sm_90a.\n");
    table.push_str("pub const CUBINS: &[(&str, &[u8])] = &[\n");
    let mut images: Vec<(String, &Path, Vec<&str>)> = Vec::new();
    for src in &sources {
        let stem = src.file_stem().unwrap().to_str().unwrap().to_owned();
        if stem == "megakernel" && !swizzled {
            images.push((WIDE_MEGAKERNEL.to_owned(), src, [defines.as_slice(), &[WIDE_DEFINE]].concat()));
        }
        images.push((stem, src, defines.clone()));
    }
    images.sort_by(|a, b| a.0.cmp(&b.0));
    for (name, src, flags) in &images {
        let cubin = out_dir.join(format!("{name}.cubin"));
        compile(&nvcc, src, &cubin, flags);
        writeln!(table, "    ({name:?}, include_bytes!({:?})),", cubin.display().to_string()).unwrap();
    }
    table.push_str("];\n");
    writeln!(table, "/// `nvcc --version` of the compiler that built the cubins.").unwrap();
    writeln!(table, "pub const NVCC_VERSION: &str = {version:?};").unwrap();
    writeln!(table, "/// The nvcc target flag the cubins were built with.").unwrap();
    writeln!(table, "pub const GENCODE: &str = {GENCODE:?};").unwrap();
    writeln!(table, "/// The build variant's nvcc defines (none: the default build; the wide image adds its own).")
        .unwrap();
    writeln!(table, "pub const DEFINES: &[&str] = &{defines:?};").unwrap();
    fs::write(out_dir.join("cubins.rs"), table).unwrap();
}

fn compile(nvcc: &Path, src: &Path, cubin: &Path, defines: &[&str]) {
    let status = Command::new(nvcc)
        .args(["-cubin", GENCODE, "-O3", "-std=c++17", "-Icuda", "-Xptxas=-warn-spills"])
        .args(defines)
        .arg("-o")
        .arg(cubin)
        .arg(src)
        .status()
        .unwrap_or_else(|e| panic!("mk: could not run {}: {e}", nvcc.display()));
    assert!(status.success(), "mk: nvcc failed on {}", src.display());
}

fn nvcc_version(nvcc: &Path) -> String {
    let out = Command::new(nvcc).arg("--version").output().expect("nvcc --version");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines().find(|l| l.contains("release")).unwrap_or("unknown").trim().to_owned()
}

/// Returns nvcc's path, or every place that was tried.
fn find_nvcc() -> Result<PathBuf, Vec<String>> {
    let mut tried = Vec::new();
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(p) = env::var("NVCC") {
        candidates.push(p.into());
    }
    if let Ok(home) = env::var("CUDA_HOME") {
        candidates.push(Path::new(&home).join("bin/nvcc"));
    }
    if let Some(path) = env::var_os("PATH") {
        candidates.extend(env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.extend(pip_nvcc_candidates());
    for c in candidates {
        if c.is_file() {
            return Ok(c);
        }
        tried.push(c.display().to_string());
    }
    tried.dedup();
    Err(tried)
}

/// nvcc inside the `nvidia` namespace package (`nvidia/cu13/bin/nvcc`) of each Python we can
/// find: the one maturin builds for, the active virtualenv, then `python3` on PATH.
fn pip_nvcc_candidates() -> Vec<PathBuf> {
    let mut pythons: Vec<String> =
        ["PYO3_PYTHON", "PYTHON_SYS_EXECUTABLE"].iter().filter_map(|v| env::var(v).ok()).collect();
    if let Ok(venv) = env::var("VIRTUAL_ENV") {
        pythons.push(format!("{venv}/bin/python"));
    }
    pythons.push("python3".into());
    let probe = "import nvidia, sys; print('\\n'.join(nvidia.__path__))";
    let mut found = Vec::new();
    for py in pythons {
        let Ok(out) = Command::new(&py).args(["-c", probe]).output() else { continue };
        for dir in String::from_utf8_lossy(&out.stdout).lines() {
            for cu in ["cu13", "cuda_nvcc"] {
                found.push(Path::new(dir).join(cu).join("bin/nvcc"));
            }
        }
    }
    found
}
