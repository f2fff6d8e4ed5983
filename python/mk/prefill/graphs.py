"""CUDA graphs of a fresh prompt's prefill: one replay instead of thousands of launches.

A chunk that is the first n tokens of one sequence (no cached prefix: positions 0..n-1) reads
nothing from the KV cache, only writes to it, and attends causally over its own keys. Padded to a
bucket of N tokens (`BUCKETS`), such a chunk has the same shapes and the same pool addresses every
time, so on CUDA the whole pass over every layer is captured once per bucket as a CUDA graph and
replayed: the host then costs one replay instead of ~1,700 kernel launches and ~300 compiled-region
calls from Python, a fixed host cost that is most of a short prompt's time to first token
(docs/PERF.md, tuning decisions). On the CPU the same pass runs eagerly, which is what the CPU
tests check.

Padding: the pads are token 0 at positions n..N-1, after every real row, so no real query sees
them (causal). Their K and V rows are replaced by the last real row's before the pool write, which
sends them to that row's slot: repeated writes of equal values. The graphs hold the addresses of
one KV cache; a call with another cache drops them, and `release` drops them all (each graph keeps
its peak activations' memory reserved while it lives).

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
engine's warm-up captures every shape its contexts can reach: `PrefixedChunks.warm_up_chunks`);
pads write as the last real row, as above. By default only for chunks of up to
`NEXT_TURN_BUCKETS[-1]` tokens, a conversation's next turn after its cached history: there the
eager path's launches are most of the time to first token, while a long prompt's later chunks are
compute bound and gain too little from a graph to be worth the captures and their memory
(docs/PERF.md, tuning decisions).

A fresh prompt just past a bucket of 4K or more (`fresh_split`: 4,097 to 6,144 tokens by default)
is cut in two: that bucket's fresh pass, then the rest as a chunk after a cached prefix. Both
replay graphs, and together cost less than the next bucket's pass of twice the rows
(`SPLIT_MIN_BUCKET`). And a chunk of several sequences that up to `STATIC_PASSES_MAX` static
passes take (`Prefill._static_groups`) replays them one after another instead of running one
packed pass on the usual path.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mk.config import PAGE_SIZE
from mk.model.paged import PagedKV
from mk.model.rope import cos_sin
from mk.model.varlen import (
    FLEX_BLOCK,
    PackedKeys,
    Piece,
    attend_causal,
    attend_flex,
    attend_intervals_sdpa,
    attend_sdpa,
    check_mapped,
    flex_block_mask,
    flex_len,
    refresh_block_mask,
    static_block_mask,
    to_device,
)

if TYPE_CHECKING:
    from mk.config import ModelConfig
    from mk.prefill.packed import Prefill

# Padded chunk lengths. Below a few thousand tokens a prefill reads nearly every expert's weights
# whatever its length, so padding a short prompt up to the next bucket costs little GPU time.
BUCKETS = (256, 512, 1024, 2048, 4096, 8192)
# Padded key columns of a full-attention layer for a chunk with a cached prefix (prefix + chunk).
KEY_BUCKETS = tuple(1 << i for i in range(11, 19))  # 2K .. 256K
# The chunk buckets after a cached prefix that run as CUDA graphs by default (module docs).
NEXT_TURN_BUCKETS = tuple(b for b in BUCKETS if b <= 2048)
# A fresh prompt just past a bucket of at least this many rows runs as that bucket's pass and, for the
# rest (at most half the bucket), a chunk after a cached prefix (`fresh_split`). From 4K tokens a
# fresh pass is compute bound, so a prompt just past the bucket pays nearly twice its work for the
# next bucket, while a short next-turn chunk after it costs a fraction of that; below 4K the step
# between buckets is too small to win (docs/PERF.md, tuning decisions).
SPLIT_MIN_BUCKET = 4096
# Most sequences one pass after cached prefixes packs (next turns arriving together; a fresh prompt
# may join them). The sliding layers' key columns are fixed per shape, a window for each of these,
# so a lone next turn gathers that many windows' keys where it needs one, a small part of its
# replay (docs/PERF.md, tuning decisions).
PACKED_SEQUENCES = 4
# A chunk of several sequences that static passes cover (a fresh prompt alone, or up to
# PACKED_SEQUENCES after cached prefixes) runs as up to this many of them, one after another (CUDA:
# one graph replay each), instead of one packed pass on the usual path, whose launches cost the
# same at any size: up to three replays cost about what that one packed call does (docs/PERF.md,
# tuning decisions).
STATIC_PASSES_MAX = 3
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


@dataclass(eq=False)
class _Bucket:
    """The static inputs and output of one padded shape (fresh prompts: n rows; chunks after cached
    prefixes: n rows and the full-attention key columns, keys[None].slots' width), and its graph
    (CUDA)."""

    n: int
    tokens: torch.Tensor  # long [n]: the prompt or chunks, then pads
    source: torch.Tensor  # long [n]: the row each row writes as (its own; a pad: the last real one)
    slots: torch.Tensor  # long [layers, n]: the pool slot of each row's source per layer
    last: torch.Tensor  # long [m]: the rows whose residuals are the output (each sequence's last)
    out: torch.Tensor  # [m, hidden] (accumulation dtype): the residuals at `last`
    cos: torch.Tensor  # [n, head_dim / 2] at each row's source position
    sin: torch.Tensor
    # Per attention window. Fresh: causal and windowed over the rows themselves. Prefixed: slots
    # [layers of the kind, columns] of each sequence's keys before and in the chunk, one segment
    # after the other, and each row's lo/hi [n] in its sequence's segment.
    keys: dict[int | None, PackedKeys]
    pieces: list[Piece] = field(default_factory=list)  # the SDPA path's pieces (fresh only)
    graph: torch.cuda.CUDAGraph | None = field(default=None)
    uncapturable: bool = False  # its capture failed: this shape runs eagerly from then on


class _StaticPasses:
    """What both static passes share: their buckets for one KV cache, and running a bucket's pass
    eagerly or as its CUDA graph (captured at its first use when `capture`, CUDA only)."""

    def __init__(self, prefill: Prefill, capture: bool) -> None:
        # A proxy: `prefill` owns this object, and a cycle would keep the graphs' memory until the
        # garbage collector's next full pass.
        self.prefill = weakref.proxy(prefill)
        self.capture = capture and prefill.device.type == "cuda"
        self._buckets: dict = {}
        self._kv: weakref.ref[PagedKV] | None = None
        self._layers = torch.arange(prefill.config.num_hidden_layers, device=prefill.device)  # every layer's index

    def release(self) -> None:
        """Drop every bucket and graph (captured again at their next use)."""
        self._buckets.clear()
        self._kv = None

    def _use(self, kv: PagedKV) -> None:
        if self._kv is None or self._kv() is not kv:
            self._buckets.clear()  # graphs of another cache's addresses
            self._kv = weakref.ref(kv)

    def _run(self, b, kv: PagedKV) -> None:
        if b.graph is None and self.capture and not b.uncapturable:
            self._capture(b, kv)
            if b.graph is None:
                return  # (the capture's eager pass computed this call's result)
        if b.graph is None:
            self._pass(b, kv)
        else:
            b.graph.replay()

    def _pass(self, b, kv: PagedKV) -> None:
        """The static-shape pass over the bucket's inputs (what a graph captures): each row's K and
        V written as its source row's (pads: the last prompt row's), then `_attend`."""
        pf = self.prefill
        pool_k, pool_v = pf.pools(kv)
        attn_dtype = pf.attn_dtype(kv)

        def write_and_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            slots = b.slots[layer]
            pool_k.index_copy_(0, slots, k.index_select(0, b.source))
            pool_v.index_copy_(0, slots, v.index_select(0, b.source))
            return self._attend(b, layer, q, k, v, pool_k, pool_v, attn_dtype)

        x = pf.layers(pf.embed(b.tokens), b.cos, b.sin, kv.dtype, attn_dtype, write_and_attend, static=True)
        b.out.copy_(x.index_select(0, b.last))

    def _attend(self, b, layer: int, q, k, v, pool_k, pool_v, attn_dtype: torch.dtype) -> torch.Tensor:
        """Layer `layer`'s attention output for the bucket's rows (their K and V already written)."""
        raise NotImplementedError

    def uncapturable(self) -> int:
        """How many of its shapes failed to capture (and run eagerly)."""
        return sum(b.uncapturable for b in self._buckets.values())

    def _shape_name(self, b: _Bucket) -> str:
        return f"{b.n}-token"

    def _bucket(
        self, n: int, m: int, cos: torch.Tensor, sin: torch.Tensor, keys: dict, pieces: list[Piece] | None = None
    ) -> _Bucket:
        """A bucket of n rows and m outputs with zeroed static inputs and output, besides the given
        ones."""
        pf, cfg, device = self.prefill, self.prefill.config, self.prefill.device
        return _Bucket(
            n=n,
            tokens=torch.zeros(n, dtype=torch.long, device=device),
            source=torch.zeros(n, dtype=torch.long, device=device),
            slots=torch.zeros(cfg.num_hidden_layers, n, dtype=torch.long, device=device),
            last=torch.zeros(m, dtype=torch.long, device=device),
            out=torch.zeros(m, cfg.hidden_size, dtype=pf.acc, device=device),
            cos=cos,
            sin=sin,
            keys=keys,
            pieces=pieces or [],
        )

    def _capture(self, b, kv: PagedKV) -> None:
        """One eager pass (it compiles and allocates what this length needs, and computes this
        call's result), then the capture. A capture that fails (e.g. out of memory for a long
        context's key bucket) warns and leaves this shape eager; the others keep their graphs."""
        device = self.prefill.device
        stream = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(stream)
        try:
            with torch.cuda.stream(side):
                self._pass(b, kv)
        finally:  # (a pass that raised, e.g. out of memory, has queued writes the next path must follow)
            stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        pool = self.prefill.graph_pool()
        try:
            # Thread-local: the decode loop's launches on other threads go on during a capture.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._pass(b, kv)
        except Exception as e:  # a capture failure must cost speed, not the request
            # An invalidated capture raises while ending it, before the graph's context gives the
            # stream back: this thread must not stay on the capture stream.
            torch.cuda.set_stream(stream)
            _end_abandoned_capture(self.prefill, pool)
            what = f"{type(e).__name__}: {e}"
            warnings.warn(f"capturing the {self._shape_name(b)} prefill failed ({what}); eager", stacklevel=4)
            b.uncapturable = True
            return
        b.graph = graph


class FreshPrompts(_StaticPasses):
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
        b.slots.copy_(_slots(piece.table_dev[None].long(), self._layers, torch.zeros_like(source), source))
        b.tokens.zero_()
        b.tokens[:n].copy_(tokens)
        b.last.fill_(n - 1)
        self._run(b, kv)
        return b.out.clone()

    def _new_bucket(self, n: int) -> _Bucket:
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

    def _attend(self, b: _Bucket, layer: int, q, k, v, pool_k, pool_v, attn_dtype: torch.dtype) -> torch.Tensor:
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


class PrefixedChunks(_StaticPasses):
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
        b.slots.copy_(_slots(tables, self._layers, row_piece, positions))
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
        ks.slots.copy_(_slots(tables, self._layer_rows[window], col_piece, kpos))
        base = start[row_piece] - first[row_piece]  # a row's column of position p: base + p
        lo = first[row_piece] if window is None else torch.maximum(first[row_piece], positions - window + 1)
        ks.lo.copy_(base + lo)
        ks.hi.copy_(base + positions)
        if ks.backend_data is not None:
            refresh_block_mask(ks.backend_data, ks.lo, ks.hi, cols)

    def _new_bucket(self, n: int, k_full: int) -> _Bucket:
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

    def _shape_name(self, b: _Bucket) -> str:
        full = b.keys.get(None)  # (a model without full-attention layers has no key bucket)
        return f"{b.n}-token after a prefix" + (f" ({full.slots.shape[1]} key columns)" if full else "")

    def _attend(self, b: _Bucket, layer: int, q, k, v, pool_k, pool_v, attn_dtype: torch.dtype) -> torch.Tensor:
        """Over the prefixes and the chunks, gathered from the pool by the static slot tables."""
        pf = self.prefill
        ks = b.keys[pf.config.window(layer)]
        cols = ks.slots[ks.row_of[layer]]
        kk, vv = pool_k.index_select(0, cols).to(attn_dtype), pool_v.index_select(0, cols).to(attn_dtype)
        if pf.attention == "sdpa":
            return attend_intervals_sdpa(q, kk, vv, ks.lo, ks.hi)
        return attend_flex(q, kk, vv, ks, compiled=pf.attention != "flex_eager")


def _end_abandoned_capture(prefill: Prefill, pool) -> None:
    """After a capture that failed: if CUDA invalidated it, PyTorch's `capture_end` raised before
    telling its allocators that the capture into `pool` was over, so the pool stays "recording"
    and every later capture into it is refused ("already recording to mempool_id"). End that
    (PyTorch's own call), and have later captures use a new pool: the pinned-memory allocator
    may hold the same stale entry, which no Python call ends. (The abandoned capture's share of
    the old pool stays reserved.)"""
    device = prefill.device.index if prefill.device.index is not None else torch.cuda.current_device()
    end = getattr(torch._C, "_cuda_endAllocateToPool", None) or torch._C._cuda_endAllocateCurrentStreamToPool
    try:
        end(device, pool)
    except RuntimeError:
        return  # the capture had ended (an error inside a valid capture): the pool is fine
    prefill.renew_graph_pool()


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


def _slots(tables: torch.Tensor, layers: torch.Tensor, piece: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """long [len(layers), m]: the pool slot of position positions[j] of piece piece[j]'s sequence on
    each of `layers`, from the pieces' block tables `tables` [pieces, all layers, pages]."""
    _, num_layers, pages = tables.shape
    index = piece[None, :] * (num_layers * pages) + layers[:, None] * pages + (positions // PAGE_SIZE)[None, :]
    return tables.reshape(-1)[index] * PAGE_SIZE + (positions % PAGE_SIZE)[None, :]
