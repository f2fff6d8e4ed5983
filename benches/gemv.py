"""Decode-batch GEMV (tensor-core swap-AB tiles) vs torch.matmul (cuBLAS) in CUDA graphs, same run.

Shapes are the real model's per-step products. Weight copies are rotated so that each call reads
its weights from HBM, not from the 60 MB L2. SOL = weight bytes / 4.8 TB/s.
Usage: python benches/gemv.py [--json out.json]
"""

from __future__ import annotations

import argparse

import torch

from common import HBM_BYTES_PER_S, print_table, time_graph, write_json
from mk import ops

SHAPES = {
    "qkv": (5120, 2048),
    "o_proj": (2048, 4096),
    "expert_gate_up": (1536, 2048),
    "expert_down": (2048, 768),
    "dense_gate_up": (6144, 2048),
    "lm_head": (262144, 2048),
}


def measure(name: str, n: int, k: int, batch: int) -> dict:
    copies = max(1, -(-(256 << 20) // (n * k * 2)))  # >= 256 MB of distinct weights per rotation
    ws = [(torch.randn(n, k, device="cuda") * 0.02).bfloat16() for _ in range(copies)]
    x = torch.randn(batch, k, device="cuda").bfloat16()
    out = torch.empty(batch, n, device="cuda", dtype=torch.bfloat16)
    state = {"i": 0}

    def run_mk():
        ops.gemv(x, ws[state["i"] % copies], out=out)
        state["i"] += 1

    def run_torch():
        torch.matmul(x, ws[state["i"] % copies].T, out=out)
        state["i"] += 1

    t_mk = time_graph(run_mk, iters_per_graph=copies * max(1, 8 // copies))
    t_pt = time_graph(run_torch, iters_per_graph=copies * max(1, 8 // copies))
    weight_bytes = n * k * 2
    return {
        "op": name,
        "n": n,
        "k": k,
        "batch": batch,
        "mk_us": t_mk * 1e6,
        "cublas_us": t_pt * 1e6,
        "speedup": t_pt / t_mk,
        "mk_TBps": weight_bytes / t_mk / 1e12,
        "sol_fraction": weight_bytes / HBM_BYTES_PER_S / t_mk,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default="bench-out/gemv.json")
    args = parser.parse_args()
    rows = [measure(name, n, k, b) for name, (n, k) in SHAPES.items() for b in (1, 8, 16, 64)]
    cols = ["op", "n", "k", "batch", "mk_us", "cublas_us", "speedup", "mk_TBps", "sol_fraction"]
    print_table("decode GEMV, bf16 weights (SOL 4.8 TB/s)", rows, cols)
    write_json(args.json, "gemv", rows)


if __name__ == "__main__":
    main()
