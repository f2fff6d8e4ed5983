"""GPT-J (interleaved-pair) rotary position embedding.

Dims (2i, 2i+1) rotate together by angle = position · theta^(-2i/head_dim):
    even' = x_e·cos − x_o·sin,   odd' = x_o·cos + x_e·sin.
"""

from __future__ import annotations

import torch

from mk.config import ModelConfig


def cos_sin(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [len(positions), head_dim // 2] for the given absolute positions.

    Angles are computed in float64 so the tables are exact to the output dtype, then cast; in bf16
    mode the caller gets bf16-rounded values (the rounding the engine applies) widened to fp32.
    """
    half = cfg.head_dim // 2
    i = torch.arange(half, dtype=torch.float64, device=positions.device)
    inv_freq = cfg.rope_theta ** (-2.0 * i / cfg.head_dim)
    angle = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos, sin = torch.cos(angle), torch.sin(angle)
    if dtype == torch.float64:
        return cos, sin
    if dtype != torch.float32:
        cos, sin = cos.to(dtype), sin.to(dtype)
    return cos.float(), sin.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, head_dim] with tables [T, head_dim // 2]; math in the tables' dtype.

    x is widened to the tables' dtype first, so a bf16 x enters the multiply-add bf16-rounded (as
    the engine does); the result stays in that (fp32/fp64) dtype for the caller to round.
    """
    x = x.to(cos.dtype)
    xe, xo = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.empty_like(x)
    out[..., 0::2] = xe * c - xo * s
    out[..., 1::2] = xo * c + xe * s
    return out
