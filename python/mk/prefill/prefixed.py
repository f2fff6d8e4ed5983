"""Chunks after cached prefixes as static passes: padded (rows, keys) shapes' CUDA graphs
(`mk.prefill.static`).

A chunk with a cached prefix (positions start..start+n-1 of one sequence, start > 0) reads the
prefix's keys from the cache, so its shapes depend on start too: `PrefixedChunks` pads it to a
bucket of N rows and its full-attention keys to one of `KEY_BUCKETS` columns (sliding layers: room
for `PACKED_SEQUENCES` windows before their chunks, which N fixes), gathers the keys by static
slot tables that pad with the first key's slot, and gives each query row its visible key columns
as intervals (lo, hi) in static buffers; the flex block mask's tensors are rewritten from them
before each replay. Up to `PACKED_SEQUENCES` such chunks of different sequences (next turns
arriving together, a fresh prompt beside them) share one pass: their rows back to back, each
one's keys a segment of the key columns, each row's interval inside its own segment, so a shape's
graph serves any packing of it. One graph per (N, key bucket), captured at its first use (the
engine's warm-up captures every shape its contexts can reach: `PrefixedChunks.warm_up_chunks`).
By default only for chunks of up to `NEXT_TURN_BUCKETS[-1]` tokens, a conversation's next turn
after its cached history: there the eager path's launches are most of the time to first token,
while a long prompt's later chunks are compute bound and gain too little from a graph to be worth
the captures and their memory (docs/PERF.md, tuning decisions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from mk.model.paged import PagedKV
from mk.model.rope import cos_sin
from mk.model.varlen import (
    FLEX_BLOCK,
    PackedKeys,
    Piece,
    attend_flex,
    attend_intervals_sdpa,
    check_mapped,
    flex_len,
    refresh_block_mask,
    static_block_mask,
    to_device,
)
from mk.prefill.static import BUCKETS, Bucket, StaticPasses, slots_of

if TYPE_CHECKING:
    from mk.config import ModelConfig
    from mk.prefill.packed import Prefill

# Padded key columns of a full-attention layer for a chunk with a cached prefix (prefix + chunk).
KEY_BUCKETS = tuple(1 << i for i in range(11, 19))  # 2K .. 256K
# The chunk buckets after a cached prefix that run as CUDA graphs by default (module docs).
NEXT_TURN_BUCKETS = tuple(b for b in BUCKETS if b <= 2048)
# Most sequences one pass after cached prefixes packs (next turns arriving together; a fresh prompt
# may join them). The sliding layers' key columns are fixed per shape, a window for each of these,
# so a lone next turn gathers that many windows' keys where it needs one, a small part of its
# replay (docs/PERF.md, tuning decisions).
PACKED_SEQUENCES = 4


class PrefixedChunks(StaticPasses):
    """Prefills a chunk of up to PACKED_SEQUENCES sequences, each after its cached prefix (module
    docs; a fresh prompt may join others), through static-shape passes, captured as CUDA graphs
    when `capture` (CUDA only). A chunk's sequences are given as (start, n) spans: positions
    start..start+n-1 of each."""

    def __init__(
        self,
        prefill: Prefill,
        buckets: tuple[int, ...] = BUCKETS,
        key_buckets: tuple[int, ...] = KEY_BUCKETS,
        capture: bool = True,
    ) -> None:
        super().__init__(prefill, capture)
        self.buckets = tuple(sorted(b for b in buckets if b <= prefill.chunk))
        if not self.buckets or any(b % FLEX_BLOCK or b < 2 * FLEX_BLOCK for b in (*self.buckets, *key_buckets)):
            raise ValueError(f"buckets must be multiples of {FLEX_BLOCK}, at least {2 * FLEX_BLOCK} (flex_len)")
        self.key_buckets = tuple(sorted(key_buckets))
        # The shapes several sequences packed together may take (one alone may take any): those
        # the warm-up captured (`limit_packing`); None: any.
        self.packed_shapes: set[tuple[int, int]] | None = None
        self._layer_rows: dict[int | None, torch.Tensor] = {}  # per window: its layers, on the device

    def covers(self, spans: Sequence[tuple[int, int]]) -> bool:
        """Whether one pass takes these (start, n) spans of distinct sequences: up to
        PACKED_SEQUENCES of them (a fresh one only beside others), their rows within a bucket and
        their keys within a key bucket."""
        if not 0 < len(spans) <= PACKED_SEQUENCES or any(n < 1 or start < 0 for start, n in spans):
            return False
        if len(spans) == 1 and spans[0][0] == 0:
            return False  # a fresh prompt alone is FreshPrompts' (or the usual path's)
        rows, keys = sum(n for _, n in spans), sum(start + n for start, n in spans)
        if rows > self.buckets[-1] or max(next(b for b in self.buckets if b >= rows), keys) > self.key_buckets[-1]:
            return False
        return len(spans) == 1 or self.packed_shapes is None or self.shape(spans) in self.packed_shapes

    def shape(self, spans: Sequence[tuple[int, int]]) -> tuple[int, int]:
        """The padded (rows, full-attention key columns) of spans it covers."""
        rows, keys = sum(n for _, n in spans), sum(start + n for start, n in spans)
        size = next(b for b in self.buckets if b >= rows)
        return size, next(k for k in self.key_buckets if k >= max(size, keys))

    def warm_up_chunks(self, max_end: int) -> list[tuple[int, int]]:
        """(start, n) of one chunk per shape that chunks ending by position `max_end` can take, so
        that a warm-up can capture them all before serving (a shape's graph serves any of its
        packings)."""
        chunks = {}
        for size in self.buckets:
            for k_full in self.key_buckets:
                end = min(k_full, max_end)
                n = min(size, end - 1)  # this bucket's longest chunk ending there, after a cached token
                if n > 0 and self.covers([(end - n, n)]):
                    chunks.setdefault(self.shape([(end - n, n)]), (end - n, n))
        return sorted(chunks.values(), key=lambda c: (c[1], c[0]))

    def limit_packing(self, max_end: int) -> None:
        """Packs sequences only into the shapes that one chunk ending by position `max_end` takes
        (those `warm_up_chunks(max_end)` captures): their rows and keys add up, and a larger sum
        would take a shape that was never captured."""
        self.packed_shapes = {self.shape([c]) for c in self.warm_up_chunks(max_end)}

    def __call__(self, tokens: torch.Tensor, pieces: Sequence[Piece], kv: PagedKV) -> torch.Tensor:
        """The residual [len(pieces), hidden] at each piece's last row: `tokens` holds the pieces'
        rows back to back (`Piece.q_off`), each piece positions first..first+n-1 of its own
        sequence, whose earlier positions are in the cache and whose block table (int32 [layers,
        pages]) is `table` on the CPU and `table_dev` on the device; their K and V are written.
        The static inputs are computed on the device from one upload of a few numbers a piece,
        which waits for nothing on the device."""
        pf = self.prefill
        cfg, device = pf.config, pf.device
        size, k_full = self.shape([(p.first, p.n) for p in pieces])
        check_pieces(cfg, pieces)
        windows = _windows(cfg)
        # Per piece: its first position, rows and first row; per window its first key and key count.
        host = [[p.first, p.n, p.q_off, *(x for w in windows for x in _key_range(w, p))] for p in pieces]
        self._use(kv)
        b = self._buckets.get((size, k_full)) or self._new_bucket(size, k_full)
        meta = to_device(torch.tensor(host), device)
        k, total = len(pieces), len(tokens)
        piece_of = torch.repeat_interleave(torch.arange(k, device=device), meta[:, 1], output_size=total)
        source = torch.arange(size, device=device).clamp(max=total - 1)  # pads write as the last real row
        row_piece = piece_of[source]
        positions = meta[row_piece, 0] + source - meta[row_piece, 2]
        # [pieces, layers, pages], each table padded to the widest (no position maps to the padding)
        width = max(p.table_dev.shape[1] for p in pieces)
        pad = torch.nn.functional.pad
        tables = torch.stack([pad(p.table_dev, (0, width - p.table_dev.shape[1]), value=-1) for p in pieces]).long()
        b.source.copy_(source)
        b.slots.copy_(slots_of(tables, self._layers, row_piece, positions))
        b.tokens.zero_()
        b.tokens[:total].copy_(tokens)
        b.last.zero_()
        b.last[:k].copy_(meta[:, 2] + meta[:, 1] - 1)
        cos, sin = cos_sin(cfg, positions, pf.dtype)
        b.cos.copy_(cos)
        b.sin.copy_(sin)
        for i, window in enumerate(windows):
            used = sum(row[4 + 2 * i] for row in host)
            keys = meta[:, 3 + 2 * i], meta[:, 4 + 2 * i], used
            self._fill_keys(b.keys[window], window, keys, tables, row_piece, positions)
        self._run(b, kv)
        return b.out[:k].clone()

    def _fill_keys(
        self,
        ks: PackedKeys,
        window: int | None,
        keys: tuple[torch.Tensor, torch.Tensor, int],
        tables: torch.Tensor,
        row_piece: torch.Tensor,
        positions: torch.Tensor,
    ) -> None:
        """The pieces' key columns, one segment after the other (`keys`: each piece's first key
        position and count, its prefix within the window and its chunk, and their sum; pad columns
        take the first piece's first key's slot, which no row sees), and each row's visible columns
        [lo, hi] in its piece's segment."""
        first, count, used = keys
        device = positions.device
        if window not in self._layer_rows:
            self._layer_rows[window] = torch.tensor(sorted(ks.row_of, key=ks.row_of.__getitem__), device=device)
        cols = ks.slots.shape[1]
        start = torch.cumsum(count, 0) - count  # each piece's first column
        col_piece = torch.repeat_interleave(torch.arange(len(count), device=device), count, output_size=used)
        col_piece = torch.nn.functional.pad(col_piece, (0, cols - used))
        col = torch.arange(cols, device=device)
        kpos = torch.where(col < used, first[col_piece] + col - start[col_piece], first[0])
        ks.slots.copy_(slots_of(tables, self._layer_rows[window], col_piece, kpos))
        base = start[row_piece] - first[row_piece]  # a row's column of position p: base + p
        lo = first[row_piece] if window is None else torch.maximum(first[row_piece], positions - window + 1)
        ks.lo.copy_(base + lo)
        ks.hi.copy_(base + positions)
        if ks.backend_data is not None:
            refresh_block_mask(ks.backend_data, ks.lo, ks.hi, cols)

    def _new_bucket(self, n: int, k_full: int) -> Bucket:
        pf, cfg, device = self.prefill, self.prefill.config, self.prefill.device
        cos, sin = cos_sin(cfg, torch.zeros(n, dtype=torch.long, device=device), pf.dtype)  # rewritten per call
        keys = {}
        for window in {cfg.window(layer) for layer in range(cfg.num_hidden_layers)}:
            layers = [layer for layer in range(cfg.num_hidden_layers) if cfg.window(layer) == window]
            # Sliding: for each sequence the window - 1 keys before its chunk, and the chunks' own (no
            # more than all their keys: a short context's take fewer).
            cols = k_full if window is None else min(k_full, flex_len(PACKED_SEQUENCES * (window - 1) + n))
            q = torch.zeros(n, dtype=torch.int32, device=device)
            slots = torch.zeros(len(layers), cols, dtype=torch.long, device=device)
            empty = torch.empty(0, dtype=torch.long, device=device)
            row_of = {layer: i for i, layer in enumerate(layers)}
            ks = PackedKeys(window, row_of, slots, empty, [0], [0], [cols], cols, q, q.clone())
            if pf.attention != "sdpa":
                ks.backend_data = static_block_mask(ks.lo, ks.hi, cols)
            keys[window] = ks
        b = self._bucket(n, PACKED_SEQUENCES, cos, sin, keys)
        self._buckets[n, k_full] = b
        return b

    def _shape_name(self, b: Bucket) -> str:
        full = b.keys.get(None)  # (a model without full-attention layers has no key bucket)
        return f"{b.n}-token after a prefix" + (f" ({full.slots.shape[1]} key columns)" if full else "")

    def _attend(self, b: Bucket, layer: int, q, k, v, pool_k, pool_v, attn_dtype: torch.dtype) -> torch.Tensor:
        """Over the prefixes and the chunks, gathered from the pool by the static slot tables."""
        pf = self.prefill
        ks = b.keys[pf.config.window(layer)]
        cols = ks.slots[ks.row_of[layer]]
        kk, vv = pool_k.index_select(0, cols).to(attn_dtype), pool_v.index_select(0, cols).to(attn_dtype)
        if pf.attention == "sdpa":
            return attend_intervals_sdpa(q, kk, vv, ks.lo, ks.hi)
        return attend_flex(q, kk, vv, ks, compiled=pf.attention != "flex_eager")


def check_pieces(cfg: ModelConfig, pieces: Sequence[Piece]) -> None:
    """Raises KVMappingError unless every page a static pass of these pieces writes (their own
    positions, every layer) or reads (their keys, per window) is mapped: before anything is
    written, whichever pieces run in which pass."""
    layers = torch.arange(cfg.num_hidden_layers)
    for p in pieces:
        check_mapped(p.table, layers, p.first, p.first + p.n, "written")
    for window in _windows(cfg):
        of_kind = torch.tensor([i for i in range(cfg.num_hidden_layers) if cfg.window(i) == window])
        for p in pieces:
            first, count = _key_range(window, p)
            check_mapped(p.table, of_kind, first, first + count, "read")


def _windows(cfg: ModelConfig) -> list[int | None]:
    """The attention windows of the model's layers (None: full attention), in one order."""
    return sorted({cfg.window(layer) for layer in range(cfg.num_hidden_layers)}, key=lambda w: w or 0)


def _key_range(window: int | None, p: Piece) -> tuple[int, int]:
    """The first key position a piece's rows see through `window`, and the count from there to its end."""
    first = 0 if window is None else max(0, p.first - window + 1)
    return first, p.first + p.n - first
