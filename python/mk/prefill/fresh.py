"""A fresh prompt's prefill as a static pass: its padded bucket's CUDA graph (`mk.prefill.static`).

A chunk that is the first n tokens of one sequence (no cached prefix: positions 0..n-1) reads
nothing from the KV cache, only writes to it, and attends causally over its own keys; padded to a
bucket of N tokens its pads sit at positions n..N-1, after every real row, so causal attention
hides them.

A fresh prompt just past a bucket of 4K or more (`fresh_split`: 4,097 to 6,144 tokens by default)
is cut in two: that bucket's fresh pass, then the rest as a chunk after a cached prefix
(`mk.prefill.prefixed`). Both replay graphs, and together cost less than the next bucket's pass
of twice the rows (`SPLIT_MIN_BUCKET`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mk.model.paged import PagedKV
from mk.model.rope import cos_sin
from mk.model.varlen import (
    PackedKeys,
    Piece,
    attend_causal,
    attend_flex,
    attend_sdpa,
    check_mapped,
    flex_block_mask,
    flex_len,
)
from mk.prefill.static import BUCKETS, Bucket, StaticPasses, slots_of

if TYPE_CHECKING:
    from mk.prefill.packed import Prefill
    from mk.prefill.prefixed import PrefixedChunks

# A fresh prompt just past a bucket of at least this many rows runs as that bucket's pass and, for the
# rest (at most half the bucket), a chunk after a cached prefix (`fresh_split`). From 4K tokens a
# fresh pass is compute bound, so a prompt just past the bucket pays nearly twice its work for the
# next bucket, while a short next-turn chunk after it costs a fraction of that; below 4K the step
# between buckets is too small to win (docs/PERF.md, tuning decisions).
SPLIT_MIN_BUCKET = 4096
# A fresh prompt's full-attention layers on CUDA take one fused causal kernel (`attend_causal`)
# instead of flex attention's block mask: faster (docs/PERF.md, tuning decisions).
FUSED_CAUSAL = True


def fresh_split(n: int, fresh: FreshPrompts | None, prefixed: PrefixedChunks | None) -> int:
    """Where a fresh prompt of n tokens is best cut in two static passes: the length of its first
    chunk, a fresh bucket B >= SPLIT_MIN_BUCKET just below n, when the rest (at most B / 2) is a
    chunk `prefixed` covers after it; else 0 (one chunk). The first costs about half of the next
    bucket's pass and the rest at most about half again (SPLIT_MIN_BUCKET's measurements)."""
    if fresh is None or prefixed is None:
        return 0
    first = max((b for b in fresh.buckets if b < n), default=0)
    rest = n - first
    if first < SPLIT_MIN_BUCKET or rest > first // 2 or not prefixed.covers([(first, rest)]):
        return 0
    return first


class FreshPrompts(StaticPasses):
    """Prefills fresh prompts of up to max(buckets) tokens through static-shape passes of
    `prefill`'s layers, captured as CUDA graphs when `capture` (CUDA only)."""

    def __init__(self, prefill: Prefill, buckets: tuple[int, ...] = BUCKETS, capture: bool = True) -> None:
        super().__init__(prefill, capture)
        self.buckets = tuple(sorted(b for b in buckets if b <= prefill.chunk)) or (prefill.chunk,)

    def covers(self, n: int) -> bool:
        return 0 < n <= self.buckets[-1]

    def __call__(self, tokens: torch.Tensor, piece: Piece, kv: PagedKV) -> torch.Tensor:
        """The residual [1, hidden] at the last of `tokens` (on the device: positions 0..n-1 of
        `piece`'s sequence, whose first must be 0), after writing their K and V. The static inputs
        are computed on the device, waiting for nothing queued there."""
        n = len(tokens)
        cfg, device = self.prefill.config, self.prefill.device
        if piece.first != 0 or piece.n != n:
            raise ValueError(f"a fresh prompt's piece holds positions 0..{n - 1}, not {piece.first}..+{piece.n}")
        check_mapped(piece.table, torch.arange(cfg.num_hidden_layers), 0, n, "written")
        self._use(kv)
        size = next(b for b in self.buckets if b >= n)
        b = self._buckets.get(size) or self._new_bucket(size)
        source = torch.arange(size, device=device).clamp(max=n - 1)  # pads write as the last real row
        b.source.copy_(source)
        b.slots.copy_(slots_of(piece.table_dev[None].long(), self._layers, torch.zeros_like(source), source))
        b.tokens.zero_()
        b.tokens[:n].copy_(tokens)
        b.last.fill_(n - 1)
        self._run(b, kv)
        return b.out.clone()

    def _new_bucket(self, n: int) -> Bucket:
        pf, cfg, device = self.prefill, self.prefill.config, self.prefill.device
        cos, sin = cos_sin(cfg, torch.arange(n, device=device), pf.dtype)
        pieces = [Piece(0, n, 0, torch.empty(0), torch.empty(0))]
        q = torch.arange(n, device=device, dtype=torch.int32)
        keys = {}
        for window in {cfg.window(layer) for layer in range(cfg.num_hidden_layers)}:
            lo = torch.zeros_like(q) if window is None else (q - window + 1).clamp(min=0)
            empty = torch.empty(0, dtype=torch.long, device=device)
            ks = PackedKeys(window, {}, empty, empty, [0], [0], [n], n, lo, q)
            if pf.attention != "sdpa":
                ks.backend_data = flex_block_mask(ks, flex_len(n), flex_len(n))
            keys[window] = ks
        b = self._bucket(n, 1, cos, sin, keys, pieces=pieces)
        self._buckets[n] = b
        return b

    def _attend(self, b: Bucket, layer: int, q, k, v, pool_k, pool_v, attn_dtype: torch.dtype) -> torch.Tensor:
        """Over the chunk's own keys: no prefix."""
        pf = self.prefill
        ks = b.keys[pf.config.window(layer)]
        kk, vv = k.to(attn_dtype), v.to(attn_dtype)
        if pf.attention == "sdpa":
            return attend_sdpa(q, kk, vv, ks, b.pieces)
        if ks.window is None and FUSED_CAUSAL and pf.device.type == "cuda":
            return attend_causal(q, kk, vv)  # (the pads follow every real row: causal hides them)
        # fa3 builds its sequence offsets per call; the static pass takes flex.
        return attend_flex(q, kk, vv, ks, compiled=pf.attention != "flex_eager")
