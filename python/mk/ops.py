"""PyTorch-facing wrappers of mk's standalone CUDA kernels (launched by Rust via the driver API)."""

from __future__ import annotations

import torch

from mk import _native


def _check(name: str, t: torch.Tensor, device: torch.device, shape: tuple[int, ...]) -> None:
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name} must be bfloat16, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def add_rmsnorm(
    x: torch.Tensor,
    gamma: torch.Tensor,
    eps: float,
    delta: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x += delta` (in place, when given) then `out = rmsnorm(x) * gamma`, fused, in bf16 with
    fp32 math. Runs on the tensors' device, on PyTorch's current stream."""
    if x.device.type != "cuda":
        raise ValueError(f"add_rmsnorm runs on CUDA tensors; x is on {x.device}")
    if x.dim() != 2:
        raise ValueError(f"x must be [rows, dim], got shape {tuple(x.shape)}")
    rows, dim = x.shape
    _check("x", x, x.device, (rows, dim))
    _check("gamma", gamma, x.device, (dim,))
    if delta is not None:
        _check("delta", delta, x.device, (rows, dim))
    if out is None:
        out = torch.empty_like(x)
    _check("out", out, x.device, (rows, dim))
    _native.add_rmsnorm(
        x.device.index or 0,
        torch.cuda.current_stream(x.device).cuda_stream,
        x.data_ptr(),
        0 if delta is None else delta.data_ptr(),
        gamma.data_ptr(),
        out.data_ptr(),
        rows,
        dim,
        float(eps),
    )
    return out


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ w.T` for a decode batch (1-64 rows) with bf16 weights in nn.Linear layout [n, k],
    on the tensor cores, reading each weight byte once. n % 16 == 0 and k % 32 == 0."""
    if x.device.type != "cuda":
        raise ValueError(f"gemv runs on CUDA tensors; x is on {x.device}")
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"x must be [batch, k] and w [n, k]; got {tuple(x.shape)} and {tuple(w.shape)}")
    batch, k = x.shape
    n = w.shape[0]
    _check("x", x, x.device, (batch, k))
    _check("w", w, x.device, (n, k))
    if out is None:
        out = torch.empty(batch, n, dtype=torch.bfloat16, device=x.device)
    _check("out", out, x.device, (batch, n))
    _native.gemv(
        x.device.index or 0,
        torch.cuda.current_stream(x.device).cuda_stream,
        w.data_ptr(),
        x.data_ptr(),
        out.data_ptr(),
        n,
        k,
        batch,
    )
    return out
