"""Fused residual-add + RMSNorm kernel vs the same math in PyTorch (CUDA graph), same run.

Memory-bound: reports achieved bandwidth and the fraction of the 4.8 TB/s speed of light.
Usage: python benches/norm.py [--json out.json]
"""

from __future__ import annotations

import argparse

import torch

from common import HBM_BYTES_PER_S, print_table, time_graph, write_json
from mk import ops


def torch_add_rmsnorm(x, delta, gamma, eps, out):
    v = x.float() + delta.float()
    x.copy_(v)
    out.copy_(v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps) * gamma.float())


def measure(rows: int, dim: int = 2048, eps: float = 1e-6) -> dict:
    x = torch.randn(rows, dim, device="cuda").bfloat16()
    delta = torch.randn(rows, dim, device="cuda").bfloat16() * 0.01
    gamma = torch.randn(dim, device="cuda").bfloat16()
    out = torch.empty_like(x)
    # x, delta and out once each, x written back, gamma once.
    moved = 4 * rows * dim * 2 + dim * 2
    t_mk = time_graph(lambda: ops.add_rmsnorm(x, gamma, eps, delta=delta, out=out))
    t_pt = time_graph(lambda: torch_add_rmsnorm(x, delta, gamma, eps, out))
    return {
        "rows": rows,
        "dim": dim,
        "mk_us": t_mk * 1e6,
        "torch_graph_us": t_pt * 1e6,
        "speedup_vs_torch": t_pt / t_mk,
        "mk_GBps": moved / t_mk / 1e9,
        "sol_fraction": moved / HBM_BYTES_PER_S / t_mk,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default="bench-out/norm.json")
    args = parser.parse_args()
    rows_out = [measure(rows) for rows in (1, 8, 64, 1024, 16384)]
    cols = ["rows", "dim", "mk_us", "torch_graph_us", "speedup_vs_torch", "mk_GBps", "sol_fraction"]
    print_table("add_rmsnorm (bf16, H200 SOL 4.8 TB/s)", rows_out, cols)
    write_json(args.json, "norm", rows_out)


if __name__ == "__main__":
    main()
