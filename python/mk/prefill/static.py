"""Static-shape prefill passes and their CUDA graphs: one replay instead of thousands of launches.

A chunk padded to a bucket of N rows (`BUCKETS`) has the same shapes and the same pool addresses
every time, so on CUDA its whole pass over every layer is captured once per shape as a CUDA graph
and replayed: the host then costs one replay instead of a kernel launch per op of every layer
and a compiled-region call per elementwise step from Python, a fixed host cost that is most of a short prompt's time to
first token (docs/PERF.md, tuning decisions). On the CPU the same pass runs eagerly, which is what
the CPU tests check. Two kinds share this machinery: a fresh prompt (`mk.prefill.fresh`) and
chunks after cached prefixes (`mk.prefill.prefixed`).

Padding: the pads are token 0 after every real row, so no real query sees them. Their K and V
rows are replaced by the last real row's before the pool write, which sends them to that row's
slot: repeated writes of equal values. The graphs hold the addresses of one KV cache; a call with
another cache drops them, and `release` drops them all (each graph keeps its peak activations'
memory reserved while it lives). A chunk of several sequences that up to `STATIC_PASSES_MAX`
static passes take (`Prefill._static_groups`) replays them one after another instead of running
one packed pass on the usual path.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from mk.config import PAGE_SIZE
from mk.model.paged import PagedKV
from mk.model.varlen import PackedKeys, Piece

if TYPE_CHECKING:
    from mk.prefill.packed import Prefill

# Padded chunk lengths. Below a few thousand tokens a prefill reads nearly every expert's weights
# whatever its length, so padding a short prompt up to the next bucket costs little GPU time.
BUCKETS = (256, 512, 1024, 2048, 4096, 8192)
# A chunk of several sequences that static passes cover (a fresh prompt alone, or up to
# PACKED_SEQUENCES after cached prefixes) runs as up to this many of them, one after another (CUDA:
# one graph replay each), instead of one packed pass on the usual path, whose launches cost the
# same at any size: up to three replays cost about what that one packed call does (docs/PERF.md,
# tuning decisions).
STATIC_PASSES_MAX = 3


@dataclass(eq=False)
class Bucket:
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


class StaticPasses:
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

    def _shape_name(self, b: Bucket) -> str:
        return f"{b.n}-token"

    def _bucket(
        self, n: int, m: int, cos: torch.Tensor, sin: torch.Tensor, keys: dict, pieces: list[Piece] | None = None
    ) -> Bucket:
        """A bucket of n rows and m outputs with zeroed static inputs and output, besides the given
        ones."""
        pf, cfg, device = self.prefill, self.prefill.config, self.prefill.device
        return Bucket(
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
            end_abandoned_capture(self.prefill, pool)
            what = f"{type(e).__name__}: {e}"
            warnings.warn(f"capturing the {self._shape_name(b)} prefill failed ({what}); eager", stacklevel=4)
            b.uncapturable = True
            return
        b.graph = graph


def end_abandoned_capture(prefill: Prefill, pool) -> None:
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


def slots_of(tables: torch.Tensor, layers: torch.Tensor, piece: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """long [len(layers), m]: the pool slot of position positions[j] of piece piece[j]'s sequence on
    each of `layers`, from the pieces' block tables `tables` [pieces, all layers, pages]."""
    _, num_layers, pages = tables.shape
    index = piece[None, :] * (num_layers * pages) + layers[:, None] * pages + (positions // PAGE_SIZE)[None, :]
    return tables.reshape(-1)[index] * PAGE_SIZE + (positions % PAGE_SIZE)[None, :]
