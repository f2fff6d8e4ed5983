"""The packed prefill: chunked prefill of North Mini Code into the paged KV cache.

`Prefill(model)(requests, kv)` runs one or several prompts at once. Each request carries the new
tokens of one sequence, the position of its first new token (`start`: the cached prefix length)
and that sequence's block table. The new tokens of all requests are packed back to back and cut
into chunks of at most `chunk` tokens (a long prompt spans several chunks; short prompts share
one); every chunk goes through all layers before the next, so activations are bounded by the
chunk whatever the prompt length. Each chunk writes its post-RoPE K and V straight into the pages
(raw K on NoPE layers), attends over the cache, and the call returns the logits (and optionally
the residual) of each request's last position.

Numerics follow the reference model (`mk.model.reference`): matmuls in the weights' dtype, norms,
RoPE (bf16-rounded cos/sin), softmax, SwiGLU activation and the MoE combine in fp32.

Paths. Attention gathers each piece's visible keys from the pages by position (only pages inside
the window are touched) and runs FlashAttention-3 varlen when `flash_attn_interface` is
importable, else compiled `flex_attention` with a block mask (CUDA), else SDPA (CPU; also the
fallback if flex fails to compile): `mk.model.varlen`. MoE runs two `torch._grouped_mm` over the
(token, choice) pairs sorted by expert on the device (CUDA bf16; experts stacked per layer, see
`stack_experts`), or the reference's loop over the experts in use (CPU): `mk.model.experts`.
On CUDA the elementwise steps (norm, RoPE, SwiGLU activation, combine, residual) run through
`torch.compile` (dynamic shapes: one compile each per process; eager if compiling fails). A chunk
that is one fresh prompt (no cached prefix, the common case of a short prompt) runs as a
static-shape pass padded to a bucket and, on CUDA, as a CUDA graph replay (`mk.prefill.static`):
its thousands of launches and compiled-region calls are otherwise most of its time (one
just past a bucket of 4K or more runs as that bucket and the rest after it: `fresh_split`). Such
a pass of at least STATIC_STEPS_MIN_ROWS rows takes elementwise steps compiled for its exact
shape, faster than the dynamic ones, and so does a chunk on the usual path whose row count
is a bucket's (a long prompt's full chunks, sliced between decode steps or not).

Page contract (the caller owns every page; prefill maps, releases and frees nothing). For a chunk
that computes positions [a, b) of a sequence:
- pages holding [a, b) must be mapped on every layer before the chunk runs (they are written);
- pages holding [0, a) must stay mapped and unchanged on full-attention layers, and those holding
  [max(0, a - W + 1), a) on sliding layers (W = sliding_window);
- sliding-layer pages wholly below a - W + 1 are never read: the caller may release them (and
  hand the blocks to anyone) before the chunk. `before_chunk` is called with the chunk's spans
  before each chunk runs so the caller can do exactly that between the chunks of one call
  (what `PageAllocator.release_out_of_window(table, cfg, a)` and the Rust `KvManager::grow` do).
A missing page raises `KVMappingError` before anything of that chunk is written.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch

from mk.config import ModelConfig
from mk.engine.options import PREFILL_CHUNK
from mk.model.experts import combine, copy_stacks, expert_names, moe_grouped, stack_experts, stacked_experts, swiglu_act
from mk.model.moe import moe_ffn, swiglu
from mk.model.paged import KVMappingError, PagedKV
from mk.model.reference import Model, rms_norm
from mk.model.rope import apply_rope, cos_sin
from mk.model.varlen import (
    PackedKeys,
    Piece,
    attend_fa3,
    attend_flex,
    attend_sdpa,
    compile_settings,
    fa3_available,
    pack_keys,
    to_device,
)
from mk.prefill.fresh import FreshPrompts, fresh_split
from mk.prefill.prefixed import NEXT_TURN_BUCKETS, PrefixedChunks, check_pieces
from mk.prefill.static import BUCKETS, STATIC_PASSES_MAX

# Tokens per chunk by default (the engine's prefill chunk on a GPU, which it passes here): large
# enough that a chunk is compute bound on a Hopper GPU (each chunk re-reads all ~60 GB of expert
# weights), small enough that activations stay a few GB.
DEFAULT_CHUNK = PREFILL_CHUNK


@dataclass(frozen=True, slots=True)
class PrefillRequest:
    """New tokens of one sequence at positions start .. start+len-1, written through `block_table`
    (int32 [num_layers, max_pages], -1 = unmapped; read on every chunk, so the caller may change
    it from `before_chunk`)."""

    tokens: torch.Tensor | Sequence[int]
    start: int
    block_table: torch.Tensor


@dataclass(frozen=True, slots=True)
class Span:
    """Positions [start, end) of request `request` computed by the next chunk."""

    request: int
    start: int
    end: int


@dataclass(slots=True)
class PrefillOutput:
    """logits: [requests, vocab] of each request's last position (float32; float64 for a float64
    model). hidden: the residual after the last layer at that position (before the final norm),
    [requests, hidden] in fp32 (fp64 for a float64 model), when asked for."""

    logits: torch.Tensor
    hidden: torch.Tensor | None = None


def plan_chunks(lengths: Sequence[int], chunk: int) -> list[list[tuple[int, int, int]]]:
    """Pack the requests' tokens in order into chunks of at most `chunk` tokens.

    Each chunk is a list of (request, offset, count): tokens [offset, offset+count) of that
    request. A request appears at most once per chunk and its pieces come in order."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    chunks: list[list[tuple[int, int, int]]] = []
    cur: list[tuple[int, int, int]] = []
    room = chunk
    for r, n in enumerate(lengths):
        off = 0
        while off < n:
            take = min(room, n - off)
            cur.append((r, off, take))
            off += take
            room -= take
            if room == 0:
                chunks.append(cur)
                cur, room = [], chunk
    if cur:
        chunks.append(cur)
    return chunks


# ---- elementwise steps (compiled on CUDA) -----------------------------------------------------------
def _norm(x: torch.Tensor, w: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    return rms_norm(x, w, eps).to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return apply_rope(x, cos, sin).to(dtype)


def _residual(x: torch.Tensor, attn: torch.Tensor, ffn: torch.Tensor) -> torch.Tensor:
    return x + attn.to(x.dtype) + ffn.to(x.dtype)


_COMPILED: dict = {}

# A bucketed static pass of at least this many rows runs its elementwise steps compiled for its
# exact shapes: a symbolic row count costs the kernels their vector loads, and at large shapes the
# static kernels take about half the time (docs/PERF.md, tuning decisions). Each shape is one more
# compile at warm-up, so smaller buckets, which matmuls and launches dominate, keep the dynamic ones.
STATIC_STEPS_MIN_ROWS = 2048
# Compiles a static step may hold: one per bucket and head count (RoPE's q and k), with room.
STATIC_RECOMPILE_LIMIT = 32


class _Op:
    """`fn`, or its torch.compile'd version (`compile_settings`; one per process and kind, shared by
    every Prefill) when `compiled`: dynamic shapes, or with `static` one compile per input shape
    (for the bucketed static passes). A compile failure warns and falls back to `fn`."""

    def __init__(self, fn, compiled: bool, static: bool = False) -> None:
        self.fn = fn
        self.static = static
        self.compiled = _COMPILED.setdefault((fn, static), torch.compile(fn, dynamic=not static)) if compiled else None

    def __call__(self, *args):
        # A one-row tensor would compile a second, size-1 specialised graph: small work, run eager.
        if self.compiled is not None and all(
            a.shape[0] > 1 for a in args if isinstance(a, torch.Tensor) and a.dim() > 1
        ):
            try:
                with compile_settings(), self._limit():
                    return self.compiled(*args)
            except Exception as e:
                warnings.warn(f"compiling {self.fn.__name__} failed ({type(e).__name__}: {e}); eager", stacklevel=2)
                self.compiled = None
        return self.fn(*args)

    def _limit(self):
        from torch._dynamo import config as dynamo_config

        return dynamo_config.patch(recompile_limit=STATIC_RECOMPILE_LIMIT) if self.static else nullcontext()


@dataclass(frozen=True, slots=True)
class _Steps:
    """The elementwise steps of a layer, as one kind of _Op."""

    norm: _Op
    rope: _Op
    residual: _Op
    act: _Op
    combine: _Op

    @staticmethod
    def make(compiled: bool, static: bool) -> _Steps:
        ops = (_Op(f, compiled, static) for f in (_norm, _rope, _residual, swiglu_act, combine))
        return _Steps(*ops)


# ---- the prefill -------------------------------------------------------------------------------------
class Prefill:
    """Chunked, packed prefill over a reference `Model`'s weights (used in place).

    chunk: most tokens per chunk, all requests together. attention: "auto" (CUDA: "fa3" if
    importable, else "flex"; CPU: "sdpa"), "flex", "flex_eager" (uncompiled flex: CPU tests of the
    mask), "fa3" or "sdpa". moe: "auto" ("grouped" on CUDA bf16, else "loop"), "grouped" or
    "loop". compile: compile the elementwise steps ("auto": on CUDA). graphs: a chunk that is a
    fresh prompt alone (no cached prefix) runs as a static-shape pass padded to a bucket
    (`mk.prefill.static`), captured as a CUDA graph on CUDA ("auto": on CUDA with the grouped MoE;
    True on the CPU runs the static pass eagerly, for tests). prefix_graphs: the same for a chunk
    of up to PACKED_SEQUENCES sequences after their cached prefixes (`PrefixedChunks`; a chunk of
    more takes up to STATIC_PASSES_MAX static passes, `_static_groups`): "auto" (the default) for
    chunks of up to NEXT_TURN_BUCKETS[-1] tokens on CUDA, True for every bucket, False for none; on
    CUDA only with compiled flex and the grouped MoE, and only where the chunk holds the smallest
    bucket.
    fresh_split: with both kinds of static pass, a fresh prompt alone just past a bucket of at
    least SPLIT_MIN_BUCKET tokens runs as that bucket's pass and its rest as a chunk after a cached
    prefix (`mk.prefill.fresh.fresh_split`), instead of the next bucket's pass of twice the rows.

    Grouped MoE needs each layer's experts stacked: views when they already are (see
    `stack_experts`, which the engine should call once after loading), else a copy per layer
    (refused on CUDA when it would not fit). The first call compiles (tens of seconds on CUDA):
    warm up with a short prompt before serving.
    """

    def __init__(
        self,
        model: Model,
        chunk: int = DEFAULT_CHUNK,
        attention: str = "auto",
        moe: str = "auto",
        compile: bool | str = "auto",
        graphs: bool | str = "auto",
        prefix_graphs: bool | str = "auto",
        fresh_split: bool = True,
    ) -> None:
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.model = model
        self.config = cfg = model.config
        self.chunk = chunk
        self.dtype, self.device, self.acc = model.dtype, model.device, model.acc
        cuda = self.device.type == "cuda"
        if attention == "auto":
            attention = ("fa3" if fa3_available() else "flex") if cuda else "sdpa"
        if attention not in ("flex", "flex_eager", "fa3", "sdpa"):
            raise ValueError(f"unknown attention path {attention!r}")
        if attention == "fa3" and not cuda:
            raise ValueError("the fa3 attention path needs CUDA tensors")
        self.attention = attention
        if moe == "auto":
            moe = "grouped" if cuda and self.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm") else "loop"
        if moe not in ("grouped", "loop"):
            raise ValueError(f"unknown MoE path {moe!r}")
        if moe == "grouped" and not hasattr(torch, "_grouped_mm"):
            raise ValueError("this torch has no torch._grouped_mm")
        if moe == "grouped" and self.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"grouped MoE needs bf16, fp16 or fp32 weights, not {self.dtype}")
        self.moe = moe
        self._graph_pool = None
        compiled = cuda if compile == "auto" else bool(compile)
        self.compiled = compiled
        self._steps = _Steps.make(compiled, static=False)
        self._static_steps = _Steps.make(compiled, static=True)
        self._stacks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if moe == "grouped":
            self._stack_all()
        self._full_layers = [i for i in range(cfg.num_hidden_layers) if cfg.window(i) is None]
        self._sliding_layers = [i for i in range(cfg.num_hidden_layers) if cfg.window(i) is not None]
        if graphs not in ("auto", True, False):
            raise ValueError(f"graphs must be 'auto', True or False, got {graphs!r}")
        # "auto": where the pass is capturable, which the loop MoE (host-side routing) is not.
        self.fresh = FreshPrompts(self) if (cuda and moe == "grouped" if graphs == "auto" else graphs) else None
        # CUDA: the static pass takes compiled flex (SDPA and eager flex would materialise [rows,
        # keys] scores) and a capturable MoE; every chunk: at least the smallest bucket.
        fits = chunk >= BUCKETS[0] and not (cuda and (attention in ("sdpa", "flex_eager") or moe != "grouped"))
        if prefix_graphs not in ("auto", True, False):
            raise ValueError(f"prefix_graphs must be 'auto', True or False, got {prefix_graphs!r}")
        prefix_buckets = {"auto": NEXT_TURN_BUCKETS if cuda else (), True: BUCKETS, False: ()}[prefix_graphs]
        self.prefixed = PrefixedChunks(self, buckets=prefix_buckets) if prefix_buckets and fits else None
        self.fresh_split = fresh_split

    def graph_pool(self):
        """The memory pool every CUDA graph of this prefill's static passes is captured in (one:
        they never run at once, and each keeps only its peak while the others' are reused)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        return self._graph_pool

    def renew_graph_pool(self) -> None:
        """Later captures take a new pool (`graph_pool`): the current one is unusable after a
        capture CUDA invalidated (mk.prefill.static). The graphs in the old one keep it."""
        self._graph_pool = None

    def _stack_all(self) -> None:
        cfg, w = self.config, self.model.weights
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe(i)]
        missing = [i for i in moe_layers if stacked_experts(w, cfg, i) is None]
        if missing and self.device.type == "cuda":
            need = len(missing) * 3 * cfg.num_experts * cfg.intermediate_size * cfg.hidden_size * self.dtype.itemsize
            free, _ = torch.cuda.mem_get_info(self.device)
            if need > 0.9 * free:
                raise ValueError(
                    f"copying the experts of {len(missing)} layers into stacks needs {need / 2**30:.1f} GiB; call "
                    "mk.prefill.packed.stack_experts(weights, config) once after loading instead (restacks in place)"
                )
        for i in moe_layers:
            self._stacks[i] = stacked_experts(w, cfg, i) or copy_stacks(w, cfg, i)

    # ---- public API ------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(
        self,
        requests: Sequence[PrefillRequest],
        kv: PagedKV,
        *,
        return_hidden: bool = False,
        before_chunk: Callable[[list[Span]], None] | None = None,
    ) -> PrefillOutput:
        """Prefill every request (each a distinct sequence); returns each one's last-position
        logits. See the module doc for the page contract; `before_chunk(spans)` runs before each
        chunk, after which the block tables are read again."""
        if kv.device != self.device:
            raise ValueError(f"KV cache is on {kv.device}, the model on {self.device}")
        tokens = self._check_requests(requests)
        last_x: list[torch.Tensor | None] = [None] * len(requests)
        for plan in self._plan(requests, tokens):
            if before_chunk is not None:
                before_chunk([Span(r, requests[r].start + off, requests[r].start + off + n) for r, off, n in plan])
            pieces = self._pieces(requests, plan)
            x_last = self._chunk(torch.cat([tokens[r][off : off + n] for r, off, n in plan]), pieces, kv)
            for i, (r, off, n) in enumerate(plan):
                if off + n == len(tokens[r]):
                    last_x[r] = x_last[i]
        x = torch.stack(last_x)  # type: ignore[arg-type]
        return PrefillOutput(self.head(x), x if return_hidden else None)

    def _plan(self, requests: Sequence[PrefillRequest], tokens: list[torch.Tensor]) -> list[list[tuple[int, int, int]]]:
        """`plan_chunks`, with a chunk that is a fresh prompt alone just past a bucket cut in two
        static passes where that is faster (`fresh_split`)."""
        plan = []
        for chunk in plan_chunks([len(t) for t in tokens], self.chunk):
            (r, off, n), cut = chunk[0], 0
            if self.fresh_split and len(chunk) == 1 and requests[r].start + off == 0:
                cut = fresh_split(n, self.fresh, self.prefixed)
            plan += [[(r, 0, cut)], [(r, cut, n - cut)]] if cut else [chunk]
        return plan

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of residual rows x [n, D]: the final norm and the LM head."""
        cfg = self.config
        h = rms_norm(x, self.model.weights["model.norm.weight"], cfg.rms_norm_eps).to(self.dtype)
        out_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        return (h @ self.model.weights["model.embed_tokens.weight"].T).to(out_dtype) * cfg.logit_scale

    @torch.no_grad()
    def sliced(self, requests: Sequence[PrefillRequest], kv: PagedKV) -> SlicedPrefill:
        """The same prefill as `self(requests, kv)`, its layers run a slice at a time
        (`SlicedPrefill.run`), so that a caller can run other work between the slices (the engine's
        decode steps). The requests' tokens must fit one chunk; the usual path (no static passes),
        whose operations are exactly the unsliced call's."""
        if kv.device != self.device:
            raise ValueError(f"KV cache is on {kv.device}, the model on {self.device}")
        tokens = self._check_requests(requests)
        plan = plan_chunks([len(t) for t in tokens], self.chunk)
        if len(plan) != 1:
            raise ValueError(f"a sliced prefill takes at most one chunk ({self.chunk} tokens) of requests")
        # (tables copied: the caller's may be views it updates in place before the last slice)
        return SlicedPrefill(self, torch.cat(tokens), self._pieces(requests, plan[0], copy=True), kv)

    def _pieces(self, requests: Sequence[PrefillRequest], plan: list[tuple[int, int, int]], copy=False) -> list[Piece]:
        """One chunk's pieces (`plan_chunks`' (request, offset, count)), packed back to back."""
        pieces, q_off = [], 0
        for r, off, n in plan:
            table = requests[r].block_table.to(device="cpu", dtype=torch.int32, copy=copy)
            pieces.append(Piece(requests[r].start + off, n, q_off, table, to_device(table, self.device)))
            q_off += n
        return pieces

    def _check_requests(self, requests: Sequence[PrefillRequest]) -> list[torch.Tensor]:
        """Each request's tokens on the device, once every request is checked."""
        if not requests:
            raise ValueError("no requests")
        cfg = self.config
        tokens = [self._check_tokens(r.tokens) for r in requests]
        for r in requests:
            if r.start < 0:
                raise ValueError(f"start must be >= 0, got {r.start}")
            t = r.block_table
            if t.dim() != 2 or t.shape[0] != cfg.num_hidden_layers:
                raise ValueError(
                    f"block table must be [num_layers={cfg.num_hidden_layers}, max_pages], got {tuple(t.shape)}"
                )
        if len({id(r.block_table) for r in requests}) != len(requests):
            raise ValueError("each request needs its own sequence: a block table appears twice")
        return tokens

    # ---- one chunk -------------------------------------------------------------------------------
    def _chunk(self, tokens: torch.Tensor, pieces: list[Piece], kv: PagedKV) -> torch.Tensor:
        """All layers over one packed chunk; returns the residual at each piece's last row [pieces, D]."""
        groups = self._static_groups(pieces) if len(pieces) > 1 else None
        if groups is not None and 1 < len(groups) <= STATIC_PASSES_MAX:
            # A few static passes (graph replays) beat one packed pass on the usual path.
            check_pieces(self.config, pieces)  # (a missing page raises before any pass writes)
            return torch.cat([self._chunk(*_group(tokens, g), kv) for g in groups])
        if self.fresh is not None and len(pieces) == 1 and pieces[0].first == 0 and self.fresh.covers(len(tokens)):
            try:
                return self.fresh(tokens, pieces[0], kv)
            except KVMappingError:
                raise
            except torch.cuda.OutOfMemoryError as e:
                _out_of_memory(e, "fresh-prompt")
            except Exception as e:  # a compile or capture failure must cost speed, not the request
                warnings.warn(f"the fresh-prompt pass failed ({type(e).__name__}: {e}); the usual path", stacklevel=2)
                self.fresh = None
        if self.prefixed is not None and self.prefixed.covers(_spans(pieces)):
            try:
                return self.prefixed(tokens, pieces, kv)
            except KVMappingError:
                raise
            except torch.cuda.OutOfMemoryError as e:
                _out_of_memory(e, "prefixed-chunk")
            except Exception as e:  # as above
                warnings.warn(f"the prefixed-chunk pass failed ({type(e).__name__}: {e}); the usual path", stacklevel=2)
                self.prefixed = None
        sliced = SlicedPrefill(self, tokens, pieces, kv)
        sliced.run(0, self.config.num_hidden_layers)
        return sliced.last_rows()

    def _static_groups(self, pieces: list[Piece]) -> list[list[Piece]] | None:
        """The pieces in order, in groups that one static pass each takes (a fresh prompt alone, or
        up to PACKED_SEQUENCES after cached prefixes, a fresh one among them), each as large as it
        can be; None if some piece is left alone without a static pass."""
        groups: list[list[Piece]] = []
        for p in pieces:
            if groups and self.prefixed is not None and self.prefixed.covers(_spans(groups[-1] + [p])):
                groups[-1].append(p)
            else:
                groups.append([p])
        alone = [g[0] for g in groups if len(g) == 1]
        if any(not self._static_alone(p) for p in alone):
            return None
        return groups

    def _static_alone(self, p: Piece) -> bool:
        """Whether a static pass takes this piece alone."""
        if p.first == 0:
            return self.fresh is not None and self.fresh.covers(p.n)
        return self.prefixed is not None and self.prefixed.covers(_spans([p]))

    def pools(self, kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V pools as [slots, kv_heads, head_dim] (a slot: block * page size + offset)."""
        cfg = self.config
        return kv.k.view(-1, cfg.num_key_value_heads, cfg.head_dim), kv.v.view(
            -1, cfg.num_key_value_heads, cfg.head_dim
        )

    def attn_dtype(self, kv: PagedKV) -> torch.dtype:
        """Fused attention kernels take one dtype for Q, K and V: the cache's. On the CPU Q stays
        fp32, as in the reference."""
        return kv.dtype if self.device.type == "cuda" else self.acc

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model.weights["model.embed_tokens.weight"][tokens].to(self.acc)

    def layers(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_dtype: torch.dtype,
        attn_dtype: torch.dtype,
        write_and_attend: Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        first: int = 0,
        end: int | None = None,
        static: bool = False,
    ) -> torch.Tensor:
        """Layers [first, end) (default: every layer) over the residual x [n, D] of rows at the
        positions cos/sin are for. `write_and_attend(layer, q, k, v)` stores the rows' K and V
        (post-RoPE, in the cache's dtype) and returns their attention output [n, heads * head_dim].
        `static`: x's shape is one of a few (a bucketed static pass), so from STATIC_STEPS_MIN_ROWS
        rows the elementwise steps are compiled for it."""
        cfg, w = self.config, self.model.weights
        n = x.shape[0]
        steps = self._static_steps if static and n >= STATIC_STEPS_MIN_ROWS else self._steps
        hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        for layer in range(first, cfg.num_hidden_layers if end is None else end):
            p = f"model.layers.{layer}."
            h = steps.norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps, self.dtype)
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(n, hq, hd)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(n, hkv, hd)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(n, hkv, hd)
            if cfg.needs_rope(layer):
                q, k = steps.rope(q, cos, sin, attn_dtype), steps.rope(k, cos, sin, kv_dtype)
            attn = write_and_attend(layer, q.to(attn_dtype), k.to(kv_dtype), v.to(kv_dtype))
            attn = attn.to(self.dtype) @ w[p + "self_attn.o_proj.weight"].T
            if cfg.is_moe(layer):
                ffn = self._moe(h, layer, steps)
            else:
                m = p + "mlp."
                ffn = swiglu(h, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
            x = steps.residual(x, attn, ffn)
        return x

    def _attend(self, q, k, v, keys: PackedKeys, pieces: list[Piece]) -> torch.Tensor:
        if self.attention == "fa3":
            return attend_fa3(q, k, v, keys, pieces)
        if self.attention in ("flex", "flex_eager"):
            try:
                return attend_flex(q, k, v, keys, compiled=self.attention == "flex")
            except Exception as e:  # a compile failure must cost speed, not the request
                if self.attention == "flex_eager":
                    raise
                warnings.warn(f"compiled flex_attention failed ({type(e).__name__}: {e}); using SDPA", stacklevel=2)
                self.attention = "sdpa"
        return attend_sdpa(q, k, v, keys, pieces)

    def _moe(self, h: torch.Tensor, layer: int, steps: _Steps) -> torch.Tensor:
        cfg, w = self.config, self.model.weights
        router = w[f"model.layers.{layer}.mlp.gate.weight"]
        if self.moe == "loop":
            experts = [tuple(w[n] for n in expert_names(layer, e)) for e in range(cfg.num_experts)]
            return moe_ffn(h, router, experts, cfg.num_experts_per_tok)
        w13, w2 = self._stacks[layer]
        return moe_grouped(h, router, w13, w2, cfg.num_experts_per_tok, steps.act, steps.combine)

    def _check_tokens(self, tokens) -> torch.Tensor:
        t = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
        if len(t) == 0:
            raise ValueError("a request has no tokens")
        if int(t.min()) < 0 or int(t.max()) >= self.config.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.config.vocab_size})")
        return to_device(t, self.device)


def _out_of_memory(error: Exception, what: str) -> None:
    """A static pass that ran out of memory (its padded shape, e.g. a long context's key bucket):
    this chunk takes the usual path, which pads nothing, and the static passes stay on for the
    others."""
    warnings.warn(f"the {what} pass ran out of GPU memory ({error}); this chunk takes the usual path", stacklevel=3)


def _spans(pieces: list[Piece]) -> list[tuple[int, int]]:
    return [(p.first, p.n) for p in pieces]


def _group(tokens: torch.Tensor, group: list[Piece]) -> tuple[torch.Tensor, list[Piece]]:
    """The rows of consecutive pieces of a chunk, and the pieces with their rows counted from there."""
    lo = group[0].q_off
    return tokens[lo : group[-1].q_off + group[-1].n], [replace(p, q_off=p.q_off - lo) for p in group]


class SlicedPrefill:
    """One packed chunk of a prefill on the usual path, its layers run in order by `run` calls
    (`Prefill.sliced`; `Prefill._chunk` runs them all at once). Holds the chunk's residual between
    calls; the pages are the caller's as in the page contract, and must stay mapped until the last
    layer has run."""

    def __init__(self, prefill: Prefill, tokens: torch.Tensor, pieces: list[Piece], kv: PagedKV) -> None:
        cfg = prefill.config
        self.prefill, self.pieces, self.kv = prefill, pieces, kv
        positions = to_device(torch.cat([torch.arange(p.first, p.first + p.n) for p in pieces]), prefill.device)
        self.cos, self.sin = cos_sin(cfg, positions, prefill.dtype)
        self.keys: dict[int | None, PackedKeys] = {}
        if prefill._full_layers:
            self.keys[None] = pack_keys(pieces, prefill._full_layers, None, prefill.device)
        if prefill._sliding_layers:
            self.keys[cfg.sliding_window] = pack_keys(
                pieces, prefill._sliding_layers, cfg.sliding_window, prefill.device
            )
        self.x = prefill.embed(tokens)
        # A chunk of exactly a fresh-prompt bucket's rows (a long prompt's full chunks, run here when
        # sliced between decode steps or when no static pass takes them) has the static passes'
        # shapes, whose per-shape steps the warm-up compiled: it takes them too.
        self.static = prefill.fresh is not None and len(tokens) in prefill.fresh.buckets
        self.done = 0  # layers run so far

    # Without autograd, as every Prefill call: the compiled functions are guarded on the grad mode,
    # and slices run with it on would compile every one of them again (a pause of seconds, every
    # decoding stream waiting).
    @torch.no_grad()
    def run(self, start: int, end: int) -> None:
        """Layers [start, end): the next ones (start is the number run so far)."""
        layers = self.prefill.config.num_hidden_layers
        if start != self.done or not start < end <= layers:
            raise ValueError(f"layers {start}..{end} do not follow the {self.done} run so far (of {layers})")
        p, kv = self.prefill, self.kv
        pool_k, pool_v = p.pools(kv)
        attn_dtype = p.attn_dtype(kv)

        def write_and_attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            ks = self.keys[p.config.window(layer)]
            slots = ks.slots[ks.row_of[layer]]
            written = slots.index_select(0, ks.write_cols)
            pool_k.index_copy_(0, written, k)
            pool_v.index_copy_(0, written, v)
            kk = pool_k.index_select(0, slots).to(attn_dtype)
            vv = pool_v.index_select(0, slots).to(attn_dtype)
            return p._attend(q, kk, vv, ks, self.pieces)

        self.x = p.layers(
            self.x, self.cos, self.sin, kv.dtype, attn_dtype, write_and_attend, start, end, static=self.static
        )
        self.done = end

    def last_rows(self) -> torch.Tensor:
        """The residual at each piece's last row [pieces, D]."""
        rows = to_device(torch.tensor([pc.q_off + pc.n - 1 for pc in self.pieces]), self.prefill.device)
        return self.x.index_select(0, rows)

    @torch.no_grad()
    def logits(self) -> torch.Tensor:
        """Each request's last-position logits, once every layer has run (as `Prefill.__call__`)."""
        if self.done != self.prefill.config.num_hidden_layers:
            raise ValueError(f"only {self.done} layers have run")
        return self.prefill.head(self.last_rows())


def prefill_flops(cfg: ModelConfig, start: int, n: int) -> float:
    """Matrix FLOPs of prefilling positions [start, start+n) of one sequence: weights (active
    experts only) for every token, attention over the visible keys, the LM head for the last token."""
    d = cfg.hidden_size
    per_token = 0.0
    for layer in range(cfg.num_hidden_layers):
        per_token += 2 * d * (2 * cfg.q_width + 2 * cfg.kv_width)
        if cfg.is_moe(layer):
            per_token += 2 * d * cfg.num_experts + cfg.num_experts_per_tok * 6 * d * cfg.intermediate_size
        else:
            per_token += 6 * d * cfg.prefix_dense_intermediate_size
    attn = 0
    for layer in range(cfg.num_hidden_layers):
        w = cfg.window(layer)
        keys = _visible_keys(start, n, w)
        attn += keys * 4 * cfg.num_attention_heads * cfg.head_dim
    return per_token * n + attn + 2 * d * cfg.vocab_size


def _visible_keys(start: int, n: int, window: int | None) -> int:
    """Σ over queries p in [start, start+n) of the keys p sees: min(p + 1, window)."""
    lo, hi = start + 1, start + n  # p + 1 runs over [lo, hi]
    if window is None:
        return (lo + hi) * n // 2
    below = max(0, min(hi, window - 1) - lo + 1)  # counts still under the window
    return (2 * lo + below - 1) * below // 2 + (n - below) * window


__all__ = [
    "DEFAULT_CHUNK",
    "Prefill",
    "PrefillOutput",
    "PrefillRequest",
    "SlicedPrefill",
    "Span",
    "plan_chunks",
    "prefill_flops",
    "stack_experts",
    "stacked_experts",
]
