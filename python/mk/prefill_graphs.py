"""CUDA graphs of a fresh prompt's prefill: one replay instead of thousands of launches.

A chunk that is the first n tokens of one sequence (no cached prefix: positions 0..n-1) reads
nothing from the KV cache, only writes to it, and attends causally over its own keys. Padded to a
bucket of N tokens (`BUCKETS`), such a chunk has the same shapes and the same pool addresses every
time, so on CUDA the whole pass over every layer is captured once per bucket as a CUDA graph and
replayed: the host then costs one replay instead of ~1,700 kernel launches and ~300 compiled-region
calls from Python (about 100-200 ms at any length on the H200, most of a short prompt's time to
first token). On the CPU the same pass runs eagerly, which is what the CPU tests check.

Padding: the pads are token 0 at positions n..N-1, after every real row, so no real query sees
them (causal). Their K and V rows are replaced by the last real row's before the pool write, which
sends them to that row's slot: repeated writes of equal values. The graphs hold the addresses of
one KV cache; a call with another cache drops them, and `release` drops them all (each graph keeps
its peak activations' memory reserved while it lives).
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mk.config import PAGE_SIZE
from mk.model.paged import PagedKV
from mk.model.rope import cos_sin
from mk.model.varlen import PackedKeys, Piece, attend_flex, attend_sdpa, check_mapped, flex_block_mask, flex_len

if TYPE_CHECKING:
    from mk.prefill import Prefill

# Padded chunk lengths. Below a few thousand tokens a prefill reads nearly every expert's weights
# whatever its length, so padding a short prompt up to the next bucket costs little GPU time.
BUCKETS = (256, 512, 1024, 2048, 4096, 8192)


@dataclass(eq=False)
class _Bucket:
    """The static inputs and output of one padded length, and its graph (CUDA)."""

    n: int
    tokens: torch.Tensor  # long [n]: the prompt, then pads
    source: torch.Tensor  # long [n]: the prompt row each row writes as (its own; a pad: the last one)
    slots: torch.Tensor  # long [layers, n]: the pool slot of each row's source per layer
    out: torch.Tensor  # [1, hidden] (accumulation dtype): the residual at the last real row
    cos: torch.Tensor
    sin: torch.Tensor
    keys: dict[int | None, PackedKeys]  # per attention window: causal (and windowed) over own rows
    pieces: list[Piece]
    graph: torch.cuda.CUDAGraph | None = field(default=None)


class FreshPrompts:
    """Prefills fresh prompts of up to max(buckets) tokens through static-shape passes of
    `prefill`'s layers, captured as CUDA graphs when `capture` (CUDA only)."""

    def __init__(self, prefill: Prefill, buckets: tuple[int, ...] = BUCKETS, capture: bool = True) -> None:
        # A proxy: `prefill` owns this object, and a cycle would keep the graphs' memory until the
        # garbage collector's next full pass.
        self.prefill = weakref.proxy(prefill)
        self.buckets = tuple(sorted(b for b in buckets if b <= prefill.chunk)) or (prefill.chunk,)
        self.capture = capture and prefill.device.type == "cuda"
        self._buckets: dict[int, _Bucket] = {}
        self._kv: weakref.ref[PagedKV] | None = None
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None

    def covers(self, n: int) -> bool:
        return 0 < n <= self.buckets[-1]

    def release(self) -> None:
        """Drop every bucket and graph (captured again at their next use)."""
        self._buckets.clear()
        self._kv = None

    def __call__(self, tokens: torch.Tensor, table: torch.Tensor, kv: PagedKV) -> torch.Tensor:
        """The residual [1, hidden] at the last of `tokens` (positions 0..n-1 of the sequence whose
        block table, int32 [layers, pages] on the CPU, is `table`), after writing their K and V."""
        n = len(tokens)
        cfg = self.prefill.config
        check_mapped(table, torch.arange(cfg.num_hidden_layers), 0, n, "written")
        if self._kv is None or self._kv() is not kv:
            self._buckets.clear()  # graphs of another cache's addresses
            self._kv = weakref.ref(kv)
        size = next(b for b in self.buckets if b >= n)
        b = self._buckets.get(size) or self._new_bucket(size)
        source = torch.arange(size).clamp(max=n - 1)  # pads write as the last real row
        b.source.copy_(source)
        b.slots.copy_(table.index_select(1, source // PAGE_SIZE).long() * PAGE_SIZE + source % PAGE_SIZE)
        b.tokens.zero_()
        b.tokens[:n].copy_(tokens)
        if not self.capture:
            self._pass(b, kv)
        else:
            if b.graph is None:
                self._capture(b, kv)
            if b.graph is not None:
                b.graph.replay()
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
        b = _Bucket(
            n=n,
            tokens=torch.zeros(n, dtype=torch.long, device=device),
            source=torch.zeros(n, dtype=torch.long, device=device),
            slots=torch.zeros(cfg.num_hidden_layers, n, dtype=torch.long, device=device),
            out=torch.zeros(1, cfg.hidden_size, dtype=pf.acc, device=device),
            cos=cos,
            sin=sin,
            keys=keys,
            pieces=pieces,
        )
        self._buckets[n] = b
        return b

    def _pass(self, b: _Bucket, kv: PagedKV) -> None:
        """The static-shape pass over the bucket's inputs (what a graph captures)."""
        pf, cfg = self.prefill, self.prefill.config
        pool_k, pool_v = pf.pools(kv)
        attn_dtype = pf.attn_dtype(kv)

        def write_and_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            slots = b.slots[layer]
            pool_k.index_copy_(0, slots, k.index_select(0, b.source))
            pool_v.index_copy_(0, slots, v.index_select(0, b.source))
            ks = b.keys[cfg.window(layer)]
            kk, vv = k.to(attn_dtype), v.to(attn_dtype)
            if pf.attention == "sdpa":
                return attend_sdpa(q, kk, vv, ks, b.pieces)
            # fa3 builds its sequence offsets per call; the static pass takes flex.
            return attend_flex(q, kk, vv, ks, compiled=pf.attention != "flex_eager")

        x = pf.layers(pf.embed(b.tokens), b.cos, b.sin, kv.dtype, attn_dtype, write_and_attend)
        b.out.copy_(x.index_select(0, b.source[-1:]))  # the last row is, or writes as, the prompt's last

    def _capture(self, b: _Bucket, kv: PagedKV) -> None:
        """One eager pass (it compiles and allocates what this length needs, and computes this
        call's result), then the capture; a capture that fails warns and leaves the bucket eager."""
        device = self.prefill.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            self._pass(b, kv)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.current_stream(device)
        try:
            # Thread-local: the decode loop's launches on other threads go on during a capture.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._pass(b, kv)
        except Exception as e:  # a capture failure must cost speed, not the request
            # An invalidated capture raises while ending it, before the graph's context gives the
            # stream back: this thread must not stay on the capture stream.
            torch.cuda.set_stream(stream)
            warnings.warn(f"capturing the {b.n}-token prefill failed ({type(e).__name__}: {e}); eager", stacklevel=3)
            self.capture = False
            return
        b.graph = graph
