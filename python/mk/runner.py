"""The Python half of the `Reference` decode backend: the PyTorch reference model over a paged KV
pool, called by the Rust decode loop (`rust/python/reference_backend.rs`) with the GIL held.

Rust owns the block ids; this object owns the K/V tensors and a mirror of the dense page table,
patched with the rows Rust reports as changed. It returns logits as float32 numpy arrays and Rust
samples them.
"""

from __future__ import annotations

import numpy as np
import torch

from mk.config import PAGE_SIZE
from mk.model.reference import Model


class ReferenceRunner:
    def __init__(self, model: Model, num_blocks: int, max_batch: int, max_context: int) -> None:
        self.model = model
        self.kv = model.new_kv(num_blocks)
        self.layers = model.config.num_hidden_layers
        self.max_pages = -(-max_context // PAGE_SIZE)
        # [row, layer, page] on the CPU: the model reads block tables per sequence.
        self.tables = torch.full((max_batch, self.layers, self.max_pages), -1, dtype=torch.int32)

    def _sync(self, dirty: list[tuple[int, bytes]]) -> None:
        for row, data in dirty:
            self.tables[row] = torch.frombuffer(bytearray(data), dtype=torch.int32).view(self.layers, self.max_pages)

    def prefill(self, row: int, tokens: list[int], start: int, dirty: list[tuple[int, bytes]], last: bool):
        self._sync(dirty)
        logits = self.model.forward(torch.tensor(tokens), start, self.kv, self.tables[row], last_only=True)
        return _host(logits[-1]) if last else None

    def decode(self, rows: list[int], tokens: list[int], positions: list[int], dirty: list[tuple[int, bytes]]):
        self._sync(dirty)
        tables = [self.tables[r] for r in rows]
        return _host(self.model.decode(torch.tensor(tokens), torch.tensor(positions), self.kv, tables))


def _host(logits: torch.Tensor) -> np.ndarray:
    return logits.detach().to("cpu", torch.float32).contiguous().numpy()
