"""Every build variant of the decode megakernel compiles for sm_90a, without register spills.

build.rs compiles the default kernel's two images (narrow, and wide: MK_IMAGE_ROWS 16) into the
package; the variant `MK_WEIGHT_SWIZZLE=1` and the diagnostic builds the device scripts use
(-DMK_NO_COPY=1, the trace marks, the stream ledger), and source variants waiting for their A/B
(-DMK_QKV_EARLY_SLOT=1), are compiled only on the GPU machine otherwise,
so a change that breaks one would first show there, in device time. No GPU is needed: this runs
nvcc alone. (The swizzled variant has no wide image: its 16-row loop spills 4 bytes at the
168-register cap, and abi.h refuses it.)
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # (compiles the kernel's variants with nvcc)

ROOT = Path(__file__).resolve().parent.parent

WIDE = ["-DMK_IMAGE_ROWS=MK_WIDE_ROWS"]
DIAGNOSTICS = {
    "no-copy": ["-DMK_NO_COPY=1"],
    "qkv-early-slot": ["-DMK_QKV_EARLY_SLOT=1"],  # a variant to measure, not a diagnostic
    "trace-marks": ["-DMK_TRACE_MARKS=1", "-DMK_GEMV_MARKS=1"],
    "stream-ledger": ["-DMK_STREAM_LEDGER=1"],
}
# The diagnostic builds of both images (the device scripts compile both: compile_megakernel).
VARIANTS = {
    "wide-image": WIDE,
    "swizzled-weights": ["-DMK_WEIGHT_SWIZZLE=1"],
    **DIAGNOSTICS,
    **{f"wide-{name}": WIDE + flags for name, flags in DIAGNOSTICS.items()},
}


def find_nvcc() -> Path | None:
    """nvcc: $NVCC, $CUDA_HOME/bin, PATH, then the PyPI package's (nvidia-cuda-nvcc 13, as build.rs)."""
    candidates = []
    if os.environ.get("NVCC"):
        candidates.append(Path(os.environ["NVCC"]))
    if os.environ.get("CUDA_HOME"):
        candidates.append(Path(os.environ["CUDA_HOME"]) / "bin" / "nvcc")
    if shutil.which("nvcc"):
        candidates.append(Path(shutil.which("nvcc")))
    try:
        import nvidia

        candidates += [Path(p) / "cu13" / "bin" / "nvcc" for p in nvidia.__path__]
    except ImportError:
        pass
    return next((c for c in candidates if c.is_file()), None)


def compile_cubin(source: str, flags: list[str], tmp_path: Path) -> str:
    """ptxas's report of `source` compiled for sm_90a (the test fails if it does not compile)."""
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (the build installs nvidia-cuda-nvcc from PyPI)")
    cmd = [str(nvcc), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-O3", "-std=c++17", "-Icuda"]
    cmd += ["-Xptxas=-v", *flags, "-o", str(tmp_path / "out.cubin"), source]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout + out.stderr


@pytest.mark.parametrize("flags", list(VARIANTS.values()), ids=list(VARIANTS))
def test_variant_compiles_without_spills(flags, tmp_path):
    report = compile_cubin("cuda/megakernel.cu", flags, tmp_path)
    assert "mk_decode_step" in report, report[-2000:]
    assert_no_spills(report)


def test_the_swizzled_variant_has_no_wide_image(tmp_path):
    nvcc = find_nvcc()
    if nvcc is None:
        pytest.skip("no nvcc (the build installs nvidia-cuda-nvcc from PyPI)")
    flags = ["-DMK_WEIGHT_SWIZZLE=1", *WIDE]
    cmd = [str(nvcc), "-cubin", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17", "-Icuda", *flags]
    out = subprocess.run(
        [*cmd, "-o", str(tmp_path / "out.cubin"), "cuda/megakernel.cu"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode != 0 and "no wide image" in out.stderr, out.stderr[-2000:]


def assert_no_spills(report: str) -> None:
    """Every function ptxas reports on spills nothing."""
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert spills, report[-2000:]
    assert all(int(st) == 0 and int(ld) == 0 for st, ld in spills), f"registers spill:\n{report[-2000:]}"


def test_the_consumer_benchmark_compiles_with_unserialized_wgmma(tmp_path):
    """benches/consumer.cu (mma.sync against wgmma on one weight stage) builds from the kernel's own
    headers, and ptxas does not serialize its wgmma (which would make that way's time meaningless)."""
    report = compile_cubin("benches/consumer.cu", [], tmp_path)
    assert "wgmma.mma_async instructions are serialized" not in report, report[-2000:]
    assert_no_spills(report)
