"""`Engine`: the `AsyncEngine` over mk's Rust decode loop (`mk._native.Engine`).

Rust owns the scheduler, the KV block accounting and the loop thread; this module builds the KV
pool and the runner (PyTorch prefill; decode by the megakernel or the PyTorch reference, see
`Engine`), hands requests over, and delivers tokens. One pump thread waits in Rust with the GIL
released and dispatches each batch of events to the requests' sinks: asyncio queues (through
`call_soon_threadsafe`, one call per event loop per batch) or plain callbacks (the offline
`LLM.generate`). No thread per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator

from mk import _native, memory
from mk.engine_api import (
    CPU_MAX_BATCH,
    CPU_PREFILL_CHUNK,
    DECODE_PREFILL_BUDGET,
    MAX_BATCH,
    PREFILL_CHUNK,
    WHOLE_CHUNK_TOKENS,
    EngineClosed,
    EngineFull,
    EngineStats,
    PromptTooLong,
)
from mk.megakernel.runner import MegakernelRunner
from mk.megakernel.support import MAX_STEP_ROWS, choose_backend
from mk.model.reference import Model
from mk.outputs import TokenEvent
from mk.prefill import Prefill, stack_experts
from mk.runner import PrefillRunner, ReferenceRunner
from mk.sampling import ConstraintSpec, SamplingError, SamplingParams

_U64 = 1 << 64
log = logging.getLogger("mk")


class _Stream:
    """One request's token stream (`RequestStream`)."""

    def __init__(self, engine: Engine, nid: int, request_id: str, prompt: list[int], sink) -> None:
        self._engine, self._nid, self._sink = engine, nid, sink
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.finished = False

    def cancel(self) -> None:
        if not self.finished:
            self._engine._native.cancel(self._nid)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        queue = self._sink.queue
        try:
            while True:
                event = await queue.get()
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            self.cancel()  # the consumer walked away: stop spending steps on it


class _AsyncSink:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()


class _CallbackSink:
    """Runs `fn(event)` on the pump thread: it must be quick and must not block."""

    def __init__(self, fn: Callable[[TokenEvent], None]) -> None:
        self.fn = fn


class Engine:
    """mk's engine over a model (CPU float32/float64 or GPU bf16).

    `backend`: "megakernel" decodes with one megakernel launch per step (bf16 on a Hopper GPU;
    an error elsewhere), "reference" with the PyTorch reference model, "auto" (the default) with
    the megakernel wherever it can run. `self.backend` says which.

    `prefill`: "fast" runs prompt chunks through `mk.prefill` (flex attention and grouped-GEMM MoE on
    a GPU; it restacks the model's experts in place, see `mk.prefill.stack_experts`), "reference"
    through the reference model's forward, "auto" (the default) is "fast" on a GPU and "reference" on
    the CPU. Either way prefill is PyTorch, on the decode backend's stream.

    `max_batch`: most sequences decoded together; None (the default): mk.engine_api.MAX_BATCH (one
    megakernel launch's rows) on a GPU, CPU_MAX_BATCH on the CPU (`self.max_batch`).

    `prefill_chunk`: most prompt tokens one loop iteration prefills; None (the default):
    mk.engine_api.PREFILL_CHUNK on a GPU, CPU_PREFILL_CHUNK on the CPU (`self.prefill_chunk`).
    `decode_prefill_budget`: the same while some stream decodes (at most `prefill_chunk`): smaller
    chunks shorten a stream's longest wait while a long prompt is admitted, at the cost of more
    chunks for that prompt (cheap ones with `prefix_graphs`). None (the default):
    mk.engine_api.DECODE_PREFILL_BUDGET where `sliced_prefill` is on, else `prefill_chunk`
    (`self.decode_prefill_budget`).
    `sliced_prefill`: while some stream decodes, a prompt keeps chunks of up to `prefill_chunk`
    tokens (at most `decode_prefill_budget` times the layers) and each chunk runs over several
    iterations, a few layers each, so that an iteration's prefill is
    at most `decode_prefill_budget` tokens through the whole model (tokens x layers), with a decode
    step between the slices: the streams' pause shrinks like the budget's, while the prompt's time
    to first token grows only by the decode steps in between (rust/engine/core.rs; the default
    budget's measurements: docs/PERF.md, tuning decisions). Needs the fast prefill. None (the
    default): on wherever the fast prefill runs on a GPU.
    `whole_chunk_tokens`: with `sliced_prefill`, a call of one chunk of up to this many tokens is
    not sliced (0: every call beyond the budget is). None (the default): with both kinds of prefill
    graph mk.engine_api.WHOLE_CHUNK_TOKENS (such a chunk replays its graph at once), else 0
    (`self.whole_chunk_tokens`).

    `launch_ahead`: each decode step is launched before the previous step's tokens are handed
    over (rust/engine/core.rs); the streams are the same. The megakernel backend then queues steps
    of up to one launch's rows whose tokens the kernel draws itself (greedy, or a temperature alone)
    on the GPU, each behind the one before, so that the host's work between steps overlaps the
    GPU's; a step it cannot queue (rows that sample on the host: top-k/top-p, logprobs, a
    grammar; more rows than one launch; drafts to verify; another backend) runs at once, as without
    launch-ahead.
    None (the default): on with the megakernel backend.

    `prefill_graphs`: the fast prefill runs a chunk that is a fresh prompt alone as a CUDA graph of
    its padded length, captured at start (`mk.prefill_graphs`; a few GB of GPU memory). None (the
    default): on wherever the fast prefill runs on a GPU.

    `prefix_graphs`: the fast prefill also runs a chunk after a cached prefix (a conversation's next
    turn, a long prompt's later chunks) as a CUDA graph of its padded length and key count
    (`mk.prefill_graphs.PrefixedChunks`), each shape the context allows captured at start. None (the
    default): chunks of up to `mk.prefill_graphs.NEXT_TURN_BUCKETS[-1]` tokens on a GPU, where the
    eager path's launches are most of a next turn's time to first token (docs/PERF.md, tuning
    decisions); True: every chunk length, for more memory and captures; False: none.
    `fresh_split` (with both kinds of graph): a fresh prompt alone just past a bucket of 4K tokens
    or more replays that bucket's graph and then a next-turn graph of the rest, instead of the next
    bucket's graph of twice the rows (`mk.prefill_graphs.fresh_split`). On by default.

    `kernel_masks`: with the megakernel backend, a decode row under a grammar whose token the kernel
    can draw (greedy or a temperature alone) is drawn by the kernel among its mask's tokens (the
    mask uploaded before the step) instead of on the host from its logits (rust/engine/megakernel.rs;
    True with another backend is an error). Its tokens equal the host sampler's; the launch then
    waits for the masks the host path computes during the step, which costs less than the logits
    copied back and the host draw it saves. None (the default): on with the megakernel backend.
    `late_masks` (needs `kernel_masks` and launch-ahead): a step with such rows is launched ahead
    too, before their masks are known; the masks are computed once the previous step's tokens
    have landed, while the step runs, and the kernel's sample tasks wait for them
    (rust/engine/core.rs, `Backend::deliver_masks`), so that a grammar no longer adds host time
    between steps. The tokens are the same. None (the default): on wherever `kernel_masks` and
    launch-ahead are.

    `speculative`: "on" verifies drafts copied from each sequence's own text (its prompt and output so
    far, rust/speculative) as verification rows beside its next token in the same decode step, at
    most `self.max_draft` (mk._native.MAX_DRAFT) a sequence, fewer where its recent drafts failed or
    the launch has few spare rows; a step may then give a sequence several tokens. The tokens are
    those without drafts, greedy or sampled (each row draws with its generation index's noise), as
    far as a row's logits do not depend on the rows beside it. Under a grammar a sequence drafts only
    tokens the grammar takes.
    "off": none (`self.max_draft` 0). "auto" (the default): `draft_limit` decides by backend.
    `stats()` counts the draft tokens verified and accepted.

    `progress`: the start's prefill warm-up (on a GPU: compilation and every CUDA graph's capture,
    tens of seconds) shows a progress bar where stderr is a terminal.

    KV pool: `kv_blocks` blocks, else `kv_bytes`, else on a GPU what the memory plan leaves within
    `gpu_memory_utilization` of the card's total memory, everything included, once the warm-up's
    peak has been measured (`mk.memory`; `self.memory_plan`), else (CPU) room for one sequence of
    `max_context` tokens or `max_batch` of up to CPU_BATCH_CONTEXT tokens, whichever is more (a full
    batch of long contexts would be gigabytes of zeros for a model small enough to run on the CPU).
    A `max_context` whose sequence the pool cannot hold is a `mk.memory.MemoryPlanError` naming the
    longest that fits; with `fit_context` the engine takes that one instead (`self.max_context`).
    """

    def __init__(
        self,
        model: Model,
        *,
        max_batch: int | None = None,
        max_context: int = 4096,
        prefill_chunk: int | None = None,
        max_waiting: int = 1024,
        kv_blocks: int | None = None,
        kv_bytes: int | None = None,
        gpu_memory_utilization: float = memory.GPU_MEMORY_UTILIZATION,
        fit_context: bool = False,
        salt: bytes | None = None,
        check_invariants: bool = False,
        backend: str = "auto",
        prefill: str = "auto",
        tokenizer_json: str | None = None,
        launch_ahead: bool | None = None,
        prefill_graphs: bool | None = None,
        decode_prefill_budget: int | None = None,
        sliced_prefill: bool | None = None,
        kernel_masks: bool | None = None,
        late_masks: bool | None = None,
        prefix_graphs: bool | None = None,
        fresh_split: bool = True,
        whole_chunk_tokens: int | None = None,
        speculative: str = "auto",
        progress: bool = True,
    ) -> None:
        cfg = model.config
        if max_batch is None:
            max_batch = MAX_BATCH if model.device.type == "cuda" else CPU_MAX_BATCH
        if prefill_chunk is None:
            prefill_chunk = PREFILL_CHUNK if model.device.type == "cuda" else CPU_PREFILL_CHUNK
        self.prefill_chunk = prefill_chunk
        if whole_chunk_tokens is not None and whole_chunk_tokens < 0:
            raise ValueError(f"whole_chunk_tokens must be >= 0 (or None), got {whole_chunk_tokens}")
        if decode_prefill_budget is not None and decode_prefill_budget < 1:
            raise ValueError(f"decode_prefill_budget must be >= 1 (or None), got {decode_prefill_budget}")
        memory.check_utilization(gpu_memory_utilization)
        self.backend = choose_backend(model, backend)
        self.max_draft = draft_limit(speculative, self.backend)
        if kernel_masks and self.backend != "megakernel":
            raise ValueError(f"kernel_masks needs the megakernel backend; this engine decodes with {self.backend!r}")
        self.kernel_masks = self.backend == "megakernel" if kernel_masks is None else kernel_masks
        if late_masks and not self.kernel_masks:
            raise ValueError("late_masks needs kernel_masks (the megakernel backend's)")
        fast = _fast_prefill(model, prefill, prefill_chunk, prefill_graphs, prefix_graphs, fresh_split)
        self.prefill = "reference" if fast is None else "fast"
        if sliced_prefill and fast is None:
            raise ValueError("sliced_prefill needs the fast prefill (prefill='fast')")
        if sliced_prefill is None:
            sliced_prefill = fast is not None and model.device.type == "cuda"
        self.sliced_prefill = sliced_prefill
        if decode_prefill_budget is None and sliced_prefill:
            decode_prefill_budget = min(DECODE_PREFILL_BUDGET, prefill_chunk)
        self.decode_prefill_budget = prefill_chunk if decode_prefill_budget is None else decode_prefill_budget
        self.launch_ahead = self.backend == "megakernel" if launch_ahead is None else launch_ahead
        if late_masks and not self.launch_ahead:
            raise ValueError("late_masks needs launch-ahead (launch_ahead=False turns it off)")
        self.late_masks = bool(self.kernel_masks and self.launch_ahead) if late_masks is None else late_masks
        self.config = cfg
        self.max_batch = max_batch
        sliding = [cfg.is_sliding(layer) for layer in range(cfg.num_hidden_layers)]

        def runner_over(blocks: int, context: int):
            common = dict(fast_prefill=fast, prefill_chunk=prefill_chunk)
            if self.backend == "megakernel":
                kinds = dict(kernel_masks=self.kernel_masks, late_masks=self.late_masks)
                # Drafts fill a launch's rows beyond the batch's own: its buffers take a whole launch.
                kinds["rows"] = MAX_STEP_ROWS if self.max_draft else None
                return MegakernelRunner(model, blocks, max_batch, context, **common, **kinds)
            return ReferenceRunner(model, blocks, max_batch, context, **common)

        # The KV pool: as given, else on a GPU the memory plan's (mk.memory), else (CPU) a batch's.
        self.memory_plan: memory.MemoryPlan | None = None
        asked = max_context
        if kv_blocks is not None:
            num_blocks = kv_blocks
        elif kv_bytes is not None:
            num_blocks = _blocks_in(model, kv_bytes)
        elif model.device.type == "cuda":
            in_use, total = memory.settled(model.device)
            share = gpu_memory_utilization
            max_context = memory.context_ceiling(
                cfg, model.dtype.itemsize, prefill_chunk, max_context, in_use, total, share, fit_context
            )
            plan = memory.measure(
                model.device,
                cfg,
                model.dtype.itemsize,
                gpu_memory_utilization,
                lambda blocks: runner_over(blocks, max_context),
                PrefillRunner.scratch_blocks(cfg, prefill_chunk, max_context),
                progress,
            )
            self.memory_plan, num_blocks = plan, plan.kv_blocks
        else:
            batch_need, _ = _native.kv_blocks_needed(
                sliding, cfg.sliding_window, min(max_context, CPU_BATCH_CONTEXT), prefill_chunk
            )
            num_blocks = max(memory.blocks_needed(cfg, max_context, prefill_chunk), max_batch * batch_need)
        max_context = _fitting_context(cfg, num_blocks, prefill_chunk, max_context, fit_context, self.memory_plan)
        if max_context < asked:
            log.warning("the context limit is %d tokens, the longest the KV pool holds (%d asked)", max_context, asked)
        self.max_context = max_context
        if self.memory_plan is not None:
            tokens = memory.largest_context(cfg, num_blocks, prefill_chunk, max(max_context, 1 << 24))
            log.info("%s", self.memory_plan.describe(tokens))
        self._runner = runner_over(num_blocks, max_context)
        try:
            self._runner.warm_up(progress)
            # After the warm-up, which captures them (a shape whose capture failed runs eagerly).
            self.prefill_graphs = fast is not None and fast.fresh is not None and fast.fresh.capture
            self.prefix_graphs = fast is not None and fast.prefixed is not None and fast.prefixed.capture
            if whole_chunk_tokens is None:  # a lone chunk that replays a graph runs whole
                graphed = sliced_prefill and self.prefill_graphs and self.prefix_graphs
                if graphed:  # (and every shape's capture took)
                    graphed = not (fast.fresh.uncapturable() or fast.prefixed.uncapturable())
                whole_chunk_tokens = WHOLE_CHUNK_TOKENS if graphed else 0
            self.whole_chunk_tokens = whole_chunk_tokens
            self._native = _native.Engine(
                self._runner,
                sliding=sliding,
                window=cfg.sliding_window,
                num_blocks=num_blocks,
                vocab_size=cfg.vocab_size,
                eos_token_id=cfg.eos_token_id,
                max_batch=max_batch,
                max_context=max_context,
                prefill_chunk=prefill_chunk,
                max_waiting=max_waiting,
                salt=salt if salt is not None else repr((cfg, model.dtype, _weights_id(model))).encode(),
                check_invariants=check_invariants,
                backend=self.backend,
                tokenizer_json=tokenizer_json,
                launch_ahead=self.launch_ahead,
                decode_prefill_budget=decode_prefill_budget,
                layer_sliced_prefill=sliced_prefill,
                whole_chunk_tokens=self.whole_chunk_tokens,
                max_draft=self.max_draft,
                step_rows=self._runner.rows if self.backend == "megakernel" else MAX_STEP_ROWS,
            )
        except BaseException:
            # Drop the prefill's CUDA graphs now: left to the garbage collector, their memory pools
            # could be freed in the middle of another engine's graph capture, which that capture
            # does not survive (GPU tests saw captures fail after engines that failed here).
            self._runner.release()
            raise
        if self.memory_plan is not None:
            self.memory_plan.check(model.device)
        self._streams: dict[int, _Stream] = {}
        self._ids = itertools.count(1)
        self._draining = False
        self._closed = False
        # The pump holds the native engine and the stream table, not `self`, so an engine nobody
        # references is collected (and its loop stopped by the finalizer).
        self._pump = threading.Thread(
            target=_pump, args=(self._native, self._streams), name="mk-event-pump", daemon=True
        )
        self._pump.start()
        self._finalizer = weakref.finalize(self, _shut_down, self._native, self._runner)

    # ---- AsyncEngine ------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> _Stream:
        """Queue a request; call from a running event loop, then iterate the stream with `async for`."""
        return self.submit_with(prompt_token_ids, params, request_id, _AsyncSink(asyncio.get_running_loop()))

    def submit_callback(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        on_event: Callable[[TokenEvent], None],
        request_id: str | None = None,
    ) -> _Stream:
        """Queue a request whose events go to `on_event`, called on the pump thread."""
        return self.submit_with(prompt_token_ids, params, request_id, _CallbackSink(on_event))

    def submit_with(self, prompt_token_ids, params: SamplingParams, request_id: str | None, sink) -> _Stream:
        params.validate()
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if len(prompt) + params.max_tokens > self.max_context:
            raise PromptTooLong(len(prompt), params.max_tokens, self.max_context)
        if self._draining or self._closed:
            raise EngineClosed("the engine is shutting down")
        nid = next(self._ids)
        stream = _Stream(self, nid, request_id or uuid.uuid4().hex, prompt, sink)
        self._streams[nid] = stream
        try:
            self._native.submit(
                nid,
                prompt,
                max_tokens=params.max_tokens,
                temperature=float(params.temperature),
                top_p=float(params.top_p),
                top_k=max(params.top_k, 0),
                seed=None if params.seed is None else params.seed % _U64,
                stop_token_ids=list(params.stop_token_ids),
                ignore_eos=params.ignore_eos,
                logprobs=params.logprobs,
                constraint=None if params.constraint is None else (params.constraint.kind, params.constraint.value),
            )
        except BaseException as e:
            del self._streams[nid]
            if isinstance(e, _native.QueueFullError):
                raise EngineFull(str(e)) from None
            if isinstance(e, _native.EngineStoppedError):
                raise EngineClosed(str(e)) from None
            if isinstance(e, _native.ConstraintError) and params.constraint is not None:
                raise SamplingError(*self._constraint_fault(params.constraint, str(e))) from None
            raise
        return stream

    def prepare_constraint(self, spec: ConstraintSpec | None) -> None:
        """Compiles `spec` ahead of the `submit` that uses it (engine_api.AsyncEngine)."""
        if spec is not None:
            with contextlib.suppress(_native.ConstraintError):
                self._native.compile_constraint(spec.kind, spec.value)

    def _constraint_fault(self, spec: ConstraintSpec, error: str) -> tuple[str, str]:
        """(field, message) of a constraint that does not compile: the first of its parts that
        does not compile alone, else the whole grammar's origin."""
        for origin, kind, value in spec.parts:
            try:
                self._native.check_constraint(kind, value)
            except _native.ConstraintError as part_error:
                return origin, str(part_error)
        return spec.origin, error

    @contextlib.contextmanager
    def together(self) -> Iterator[None]:
        """Requests submitted inside the block reach the scheduler together when it ends, so they
        are admitted in one iteration whatever the loop thread did between the submissions: an
        offline batch (`mk.LLM.generate` submits under it) is cut into the same prefill chunks and
        decode steps every time, as far as `max_batch`, the prefill chunk and the KV pool let it
        start at once and nothing else runs beside it. The hold is the whole engine's: other
        clients' submissions wait for the block's end too, and a stream of a request submitted in
        the block gets nothing until then (do not wait on it inside). Cancels act at once; blocks
        nest; queue times count from the block's end."""
        self._native.hold()
        try:
            yield
        finally:
            self._native.release()

    def stats(self) -> EngineStats:
        s = self._native.stats()
        return EngineStats(
            running=s["running"],
            waiting=s["waiting"],
            kv_blocks_total=s["kv_blocks_total"],
            kv_blocks_used=s["kv_blocks_total"] - s["kv_blocks_free"],
            prefix_cache_queries=s["prefix_lookups"],
            prefix_cache_hits=s["prefix_hits"],
            prefix_cache_hit_tokens=s["prefix_hit_tokens"],
            prompt_tokens=s["prompt_tokens"],
            generated_tokens=s["generated_tokens"],
            preemptions=s["preemptions"],
            prefill_tokens=s["prefill_tokens"],
            draft_tokens=s["draft_tokens"],
            accepted_tokens=s["accepted_tokens"],
        )

    def native_stats(self) -> dict[str, int]:
        """Every counter of the Rust side (KV, prefix cache, loop timing)."""
        return self._native.stats()

    @property
    def active_requests(self) -> int:
        """Requests whose stream has not ended yet."""
        return len(self._streams)

    async def drain(self, timeout: float) -> None:
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._streams:
            self._native.cancel_all()
        while self._streams and self._pump.is_alive():
            await asyncio.sleep(0.01)

    def close(self) -> None:
        """Cancel everything and stop the loop and the pump. Idempotent."""
        self._closed = True
        self._finalizer()
        if self._pump is not threading.current_thread():
            self._pump.join(timeout=10)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shut_down(native: _native.Engine, runner) -> None:
    """Stop the loop, then free the KV pool and what the prefill's CUDA graphs hold (their pools)."""
    native.close()
    runner.release()


def _pump(native: _native.Engine, streams: dict[int, _Stream]) -> None:
    """Deliver event batches until the engine stops; then end any stream it left open."""
    while True:
        batch = native.next_events(0.5)
        if batch is None:
            break
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for nid, token, logprob, top, finish, error, cached, queued in batch:
            stream = streams.get(nid)
            if stream is None:
                continue
            event = TokenEvent(token, logprob, None if top is None else tuple(top), finish, error, cached, queued)
            if finish is not None:
                stream.finished = True
                del streams[nid]
            _deliver(stream, event, by_loop)
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass
    by_loop = {}
    for nid, stream in list(streams.items()):
        stream.finished = True
        del streams[nid]
        _deliver(stream, TokenEvent(None, finish_reason="error", error="the engine stopped"), by_loop)
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:
            pass


def _deliver(stream: _Stream, event: TokenEvent, by_loop: dict) -> None:
    sink = stream._sink
    if isinstance(sink, _AsyncSink):
        by_loop.setdefault(sink.loop, []).append((sink.queue, event))
    else:
        sink.fn(event)


def _put_all(items: list[tuple[asyncio.Queue, TokenEvent]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


SPECULATIVE = ("auto", "on", "off")


def draft_limit(speculative: str, backend: str) -> int:
    """The most draft tokens a sequence verifies in a step (`Engine(speculative=...)`; 0: none) on
    `backend` ("megakernel" or "reference")."""
    if speculative not in SPECULATIVE:
        raise ValueError(f"speculative must be 'auto', 'on' or 'off', not {speculative!r}")
    if speculative == "off":
        return 0
    # auto: off until the engine's speculative steps have passed the GPU tests and its benchmark
    # (on the CPU reference, where every row costs its own compute, it stays off).
    if speculative == "on":
        return _native.MAX_DRAFT
    return 0


def _fast_prefill(
    model: Model, mode: str, chunk: int, graphs: bool | None, prefix_graphs: bool | None, fresh_split: bool
) -> Prefill | None:
    """The engine's `mk.prefill` runner, or None for the reference model's forward (see `Engine`)."""
    if mode not in ("auto", "fast", "reference"):
        raise ValueError(f"prefill must be 'auto', 'fast' or 'reference', not {mode!r}")
    cuda = model.device.type == "cuda"
    if mode == "reference" or (mode == "auto" and not cuda):
        return None
    if cuda:  # before anything records weight addresses (the megakernel's tables)
        stack_experts(model.weights, model.config)
    # Rust hands over at most `chunk` tokens a call, so each call is one chunk of mk.prefill (or two
    # static passes: mk.prefill_graphs.fresh_split).
    return Prefill(
        model,
        chunk=chunk,
        graphs="auto" if graphs is None else graphs,
        prefix_graphs="auto" if prefix_graphs is None else prefix_graphs,
        fresh_split=fresh_split,
    )


# On the CPU the default pool fits a full batch of contexts up to this long (Engine's docstring).
CPU_BATCH_CONTEXT = 8192


def _weights_id(model: Model) -> int:
    """Distinguishes two models of one geometry in prefix-cache keys (same process)."""
    return model.weights["model.embed_tokens.weight"].data_ptr()


def _blocks_in(model: Model, nbytes: int) -> int:
    """KV blocks of `model`'s geometry that `nbytes` hold."""
    cfg = model.config
    return _native.kv_pool_blocks(nbytes, cfg.num_key_value_heads, cfg.head_dim, model.dtype.itemsize)


def _fitting_context(cfg, blocks: int, chunk: int, context: int, fit: bool, plan: memory.MemoryPlan | None) -> int:
    """`context`, or with `fit` the longest a pool of `blocks` holds up to it (memory.fitting_context);
    the error names the longest that fits and what would make room."""

    def explain(largest: int) -> str:
        if plan is None:  # (a pool of kv_blocks or kv_bytes, or the CPU's)
            more, where = "give the KV pool more blocks (kv_blocks, kv_bytes)", ""
        else:
            more, where = "raise gpu_memory_utilization (--gpu-memory-utilization)", f" ({plan.describe(largest)})"
        if largest < 2:
            less = (
                ""
                if plan is None
                else ", or give the prefill less memory (a smaller --prefill-chunk, --prefill-graphs off)"
            )
            return f"no KV cache fits{where}: {more}{less}"
        return (
            f"a context of {context} tokens does not fit the KV pool of {blocks} blocks{where}: the longest that "
            f"fits is {largest} tokens (--max-context {largest}), or {more}"
        )

    return memory.fitting_context(cfg, blocks, chunk, context, fit, explain)
