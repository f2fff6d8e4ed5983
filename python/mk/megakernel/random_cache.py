"""Random decode-step inputs for kernel tests and tools: a paged cache full of N(0, 0.5) values
mapped for each row up to its write position (sliding-window pages already released)."""

from __future__ import annotations

import torch

from mk.model import PageAllocator, PagedKV
from mk.model.paged import pages_needed
from mk.model.reference import Model


def random_step_inputs(
    model: Model, positions: list[int], max_pages: int, gen: torch.Generator, alloc_seed: int | None = None
) -> tuple[PagedKV, list[torch.Tensor], torch.Tensor]:
    """(cache, per-row block tables [layers, max_pages], input tokens) for rows at `positions`."""
    cfg = model.config
    # Every page each row maps on the way to its position (its out-of-window ones are freed after
    # it, for the rows after it): no more, so that a real-geometry batch fits an 80 GB card twice.
    pages = sum(pages_needed(pos + 1) for pos in positions)
    alloc = PageAllocator(cfg.num_hidden_layers * pages, seed=alloc_seed)
    kv = model.new_kv(alloc.num_free)
    kv.k.normal_(0, 0.5, generator=gen)
    kv.v.normal_(0, 0.5, generator=gen)
    tables = []
    for pos in positions:
        t = alloc.new_table(cfg, max_pages)
        alloc.ensure(t, pos + 1)
        alloc.release_out_of_window(t, cfg, pos)
        tables.append(t)
    tokens = torch.randint(0, cfg.vocab_size, (len(positions),), generator=gen, device=gen.device)
    return kv, tables, tokens
