"""Paged KV cache and a small page allocator for the reference model's own generation loop,
`python -m mk` and tests. The engine's KV accounting is the Rust control plane's (rust/kv); the
allocator here follows the same sliding-window release rule (`window_start_page`, which a test
compares with the Rust one). This module imports without mk's compiled extension (the training
script, scripts/train_embedded.py, runs where it is not built), so the rule is stated here too.

Pools: K and V, each [num_blocks, PAGE_SIZE, kv_heads, head_dim], token-major inside a page. A
block holds one layer's PAGE_SIZE tokens of one sequence. A sequence's block table is int32
[num_layers, max_pages]; entry (l, j) is the block holding positions [64j, 64j+64) of layer l, or
-1 when unmapped. Sliding layers may have released pages wholly before their window.
"""

from __future__ import annotations

import random
from collections import deque

import torch

from mk.config import PAGE_SIZE, ModelConfig

UNMAPPED = -1


class KVMappingError(RuntimeError):
    """The model needed a KV page that the block table does not map."""


class OutOfBlocks(RuntimeError):
    """The allocator has no free block left."""


class PagedKV:
    """The K and V pools shared by all layers and sequences."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_blocks, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device

    def fill_blocks(self, blocks: list[int], value: float) -> None:
        """Overwrite whole blocks (tests poison released blocks with NaN this way)."""
        if blocks:
            idx = torch.tensor(blocks, dtype=torch.long, device=self.device)
            self.k[idx] = value
            self.v[idx] = value


def pages_needed(upto_pos: int) -> int:
    """Pages covering positions [0, upto_pos)."""
    return -(-upto_pos // PAGE_SIZE)


def window_start_page(cfg: ModelConfig, pos: int) -> int:
    """First page a sliding layer still needs when the lowest future query is at `pos` (rust/kv
    `KvGeometry::keep_from`)."""
    return max(0, pos - cfg.sliding_window + 1) // PAGE_SIZE


class PageAllocator:
    """FIFO free list of physical blocks; `seed` shuffles the initial order (scattered tables)."""

    def __init__(self, num_blocks: int, seed: int | None = None) -> None:
        order = list(range(num_blocks))
        if seed is not None:
            random.Random(seed).shuffle(order)
        self._free = deque(order)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise OutOfBlocks("no free KV block left")
        return self._free.popleft()

    def release(self, blocks: list[int]) -> None:
        self._free.extend(blocks)

    def new_table(self, cfg: ModelConfig, max_pages: int) -> torch.Tensor:
        return torch.full((cfg.num_hidden_layers, max_pages), UNMAPPED, dtype=torch.int32)

    def ensure(
        self,
        table: torch.Tensor,
        upto_pos: int,
        from_pos: int = 0,
        layers: range | list[int] | None = None,
    ) -> int:
        """Map every unmapped page holding a position in [from_pos, upto_pos) for `layers` (all by
        default); returns the number of blocks taken. Pass from_pos = chunk start so pages
        released below the window are not mapped again."""
        layers = range(table.shape[0]) if layers is None else layers
        last = pages_needed(upto_pos)
        if last > table.shape[1]:
            raise KVMappingError(f"position {upto_pos - 1} needs page {last - 1} but the table has {table.shape[1]}")
        taken = 0
        for layer in layers:
            for page in range(from_pos // PAGE_SIZE, last):
                if table[layer, page] == UNMAPPED:
                    table[layer, page] = self.alloc()
                    taken += 1
        return taken

    def release_out_of_window(self, table: torch.Tensor, cfg: ModelConfig, pos: int) -> list[int]:
        """Free sliding-layer pages that no query at position >= pos can see; returns the blocks."""
        keep_from = window_start_page(cfg, pos)
        freed: list[int] = []
        for layer in range(table.shape[0]):
            if not cfg.is_sliding(layer):
                continue
            for page in range(min(keep_from, table.shape[1])):
                block = int(table[layer, page])
                if block != UNMAPPED:
                    freed.append(block)
                    table[layer, page] = UNMAPPED
        self.release(freed)
        return freed

    def free(self, table: torch.Tensor) -> list[int]:
        """Free every block of the table (later pages first, like the engine) and unmap them."""
        freed = [int(b) for b in table.flip(1).flatten().tolist() if b != UNMAPPED]
        table.fill_(UNMAPPED)
        self.release(freed)
        return freed
