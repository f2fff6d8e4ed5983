"""Random weights of any geometry, generated on the target device.

Matrices are N(0, std). RMSNorm gains (the 1-D tensors) are 1 + N(0, std): gains near 0 would squash every
layer's input and make the model degenerate, while exact ones would hide a norm applied from the wrong layer.

Each tensor draws from its own stream, seeded from (seed, tensor name), so a tensor's values do not depend
on which other tensors exist or their order. Values are deterministic per (seed, device type, dtype): the
CPU and CUDA generators give different streams. On a GPU nothing passes through host memory.
"""

from __future__ import annotations

import zlib

import torch

from mk.config import ModelConfig
from mk.model.names import expected_shapes


def _stream_seed(seed: int, name: str) -> int:
    return (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)


def synthetic_weights(
    config: ModelConfig,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.bfloat16,
    std: float = 0.01,
) -> dict[str, torch.Tensor]:
    """Every tensor of `names.expected_shapes(config)`, in that order, on `device` in `dtype`."""
    device = torch.device(device)
    gen = torch.Generator(device=device)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        gen.manual_seed(_stream_seed(seed, name))
        mean = 1.0 if len(shape) == 1 else 0.0
        weights[name] = torch.empty(shape, device=device, dtype=dtype).normal_(mean, std, generator=gen)
    return weights
