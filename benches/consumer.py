"""The megakernel's consumer side alone: one 24 KB weight stage times 8 activation rows, by
mma.sync from dense rows (the default kernel), mma.sync from 128-byte-swizzled boxes
(MK_WEIGHT_SWIZZLE) and wgmma m64n8k16 straight from shared memory, and times 16 rows by the
dense mma.sync with two n-tiles (the wide megakernel image's) (benches/consumer.cu: nothing
copied, no ring hand-off, every SM busy; each way checked against a float64 product first).

Batch 1 is bound by what the compute warps do per stage, not by HBM (docs/PERF.md, hardware
ceilings): this says which instruction path moves a stage fastest. "consumer TB/s" is the rate all
SMs together would take weights at if the consumers alone set the pace; against the card's HBM
bandwidth (`vs_hbm`: the speed-of-light denominator, benches/common.py) it says how much room a way
leaves.

Needs a CUDA toolkit with nvcc and the runtime library (the GPU machine's /usr/local/cuda; $NVCC
or $CUDA_HOME pick another). Usage: python benches/consumer.py [--reps N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from common import card_bandwidth, card_sol, print_table, write_json

ROOT = Path(__file__).resolve().parent.parent


def find_nvcc() -> str:
    for candidate in (
        os.environ.get("NVCC"),
        os.environ.get("CUDA_HOME") and os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"),
        shutil.which("nvcc"),
        "/usr/local/cuda/bin/nvcc",
    ):
        if candidate and os.path.isfile(candidate):
            return candidate
    raise SystemExit("no nvcc: set NVCC or CUDA_HOME (a toolkit with the CUDA runtime library)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2000, help="passes over the 4 stages per block per launch")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "consumer"
        build = [find_nvcc(), "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", f"-I{ROOT / 'cuda'}"]
        build += ["-Xptxas=-v", "-o", str(exe), str(ROOT / "benches" / "consumer.cu")]
        compiled = subprocess.run(build, capture_output=True, text=True)
        advisories = [line for line in compiled.stderr.splitlines() if "C75" in line or "spill" in line]
        if compiled.returncode != 0:
            raise SystemExit(compiled.stderr)
        ran = subprocess.run([str(exe), str(args.reps)], capture_output=True, text=True, timeout=300)
        if ran.returncode != 0:
            raise SystemExit(f"consumer failed:\n{ran.stdout}{ran.stderr}")
    rows = [json.loads(line) for line in ran.stdout.splitlines() if line.startswith("{")]
    dense = next(r["us_per_stage"] for r in rows if r["way"] == "mma_dense")
    for r in rows:
        r["consumer_tb_s"] = r["sms"] * r["stage_bytes"] / (r["us_per_stage"] * 1e-6) / 1e12
        r["vs_hbm"] = r["consumer_tb_s"] * 1e12 / card_bandwidth()
        r["vs_mma_dense"] = dense / r["us_per_stage"]
    columns = ["way", "batch", "us_per_stage", "consumer_tb_s", "vs_hbm", "vs_mma_dense", "rel_err", "ok"]
    print_table(f"one 24 KB weight stage x 8 or 16 rows, consumers alone (all SMs; {card_sol()})", rows, columns)
    for line in advisories:
        print("ptxas:", line)
    if not all(r["ok"] for r in rows):
        print("WARNING: a way's product differs from the float64 reference: its time means nothing")
    if args.json:
        write_json(args.json, "consumer", rows, reps=args.reps, ptxas=advisories)


if __name__ == "__main__":
    main()
