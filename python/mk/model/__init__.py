"""The North Mini Code model in PyTorch: checkpoint loading, synthetic weights and the reference model."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mk.model.checkpoint import write_checkpoint
from mk.model.loader import CheckpointError, load_checkpoint, load_weights
from mk.model.paged import KVMappingError, PageAllocator, PagedKV
from mk.model.synthetic import synthetic_weights

if TYPE_CHECKING:
    from mk.model.reference import Model

__all__ = [
    "CheckpointError",
    "KVMappingError",
    "PageAllocator",
    "PagedKV",
    "load",
    "load_checkpoint",
    "load_weights",
    "synthetic_weights",
    "write_checkpoint",
]


def load(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Model:
    """The reference model of the checkpoint folder at `path` (config.json + safetensors shards)."""
    from mk.model.reference import Model

    config, weights = load_checkpoint(path, device=device, dtype=dtype, progress=progress)
    return Model(config, weights)
