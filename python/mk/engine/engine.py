"""`Engine`: the `AsyncEngine` over mk's Rust decode loop (`mk._native.Engine`).

Rust owns the scheduler, the KV block accounting and the loop thread; this module builds the KV
pool and the runner (PyTorch prefill; decode by the megakernel or the PyTorch model, see
`Engine`), hands requests over, and delivers tokens. One pump thread waits in Rust with the GIL
released and dispatches each batch of events to the requests' sinks: asyncio queues (through
`call_soon_threadsafe`, one call per event loop per batch) or plain callbacks (the offline
`LLM.generate`). No thread per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterator

from mk import _native
from mk.engine import memory
from mk.engine.api import EngineClosed, EngineFull, EngineStats, PromptTooLong
from mk.engine.options import WHOLE_CHUNK_TOKENS, EngineOptions
from mk.engine.outputs import TokenEvent
from mk.engine.runner import PrefillRunner, PytorchRunner
from mk.engine.sampling import ConstraintSpec, SamplingError, SamplingParams
from mk.megakernel.runner import MegakernelRunner
from mk.megakernel.support import STEP_MAX_ROWS, choose_backend
from mk.model.reference import Model
from mk.prefill.packed import Prefill, stack_experts

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
    """mk's engine over a model (CPU float32/float64 or GPU bf16): `Engine(model, options)` or
    `Engine(model, max_batch=4, ...)`, the keywords being `mk.engine.options.EngineOptions` fields that
    replace `options`' (or the defaults'). `self.options` holds them resolved: every automatic
    choice made (`EngineOptions.resolved`), the prefill graphs as the warm-up captured them, and
    `max_context` as the KV pool holds it.

    Prefill is PyTorch on the decode backend's stream; the packed prefill restacks the model's experts
    in place (`mk.prefill.packed.stack_experts`). The KV pool has `kv_blocks` blocks, else `kv_bytes`' worth,
    else on a GPU what the memory plan leaves within `gpu_memory_utilization` of the card's total
    memory once the warm-up's peak has been measured (`mk.engine.memory`; `self.memory_plan`), else (CPU)
    room for one sequence of `max_context` tokens or `max_batch` of up to CPU_BATCH_CONTEXT tokens,
    whichever is more (a full batch of long contexts would be gigabytes of zeros for a model small
    enough to run on the CPU). A `max_context` whose sequence the pool cannot hold is a
    `mk.engine.memory.MemoryPlanError` naming the longest that fits; with `fit_context` the engine takes
    that one instead.
    """

    def __init__(self, model: Model, options: EngineOptions | None = None, /, **overrides) -> None:
        self.config = cfg = model.config
        cuda = model.device.type == "cuda"
        asked = dataclasses.replace(options or EngineOptions(), **overrides)
        opts = asked.resolved(cuda=cuda, backend=choose_backend(model, asked.backend))
        packed = _packed_prefill(model, opts)
        sliding = [cfg.is_sliding(layer) for layer in range(cfg.num_hidden_layers)]
        chunk = opts.prefill_chunk

        def runner_over(blocks: int, context: int):
            common = dict(packed_prefill=packed, prefill_chunk=chunk)
            if opts.backend == "megakernel":
                kinds = dict(kernel_masks=opts.kernel_masks, late_masks=opts.late_masks, dealing=opts.dealing)
                # Drafts fill a launch's rows beyond the batch's own: its buffers take a whole launch.
                kinds["rows"] = STEP_MAX_ROWS if opts.speculative else None
                return MegakernelRunner(model, blocks, opts.max_batch, context, **common, **kinds)
            return PytorchRunner(model, blocks, opts.max_batch, context, **common)

        # The KV pool: as given, else on a GPU the memory plan's (mk.engine.memory), else (CPU) a batch's.
        self.memory_plan: memory.MemoryPlan | None = None
        max_context = opts.max_context
        if opts.kv_blocks is not None:
            num_blocks = opts.kv_blocks
        elif opts.kv_bytes is not None:
            num_blocks = _blocks_in(model, opts.kv_bytes)
        elif cuda:
            in_use, total = memory.settled(model.device)
            share = opts.gpu_memory_utilization
            max_context = memory.context_ceiling(
                cfg, model.dtype.itemsize, chunk, max_context, in_use, total, share, opts.fit_context
            )
            plan = memory.measure(
                model.device,
                cfg,
                model.dtype.itemsize,
                share,
                lambda blocks: runner_over(blocks, max_context),
                PrefillRunner.scratch_blocks(cfg, chunk, max_context),
                opts.progress,
            )
            self.memory_plan, num_blocks = plan, plan.kv_blocks
        else:
            batch_need, _ = _native.kv_blocks_needed(
                sliding, cfg.sliding_window, min(max_context, CPU_BATCH_CONTEXT), chunk
            )
            num_blocks = max(memory.blocks_needed(cfg, max_context, chunk), opts.max_batch * batch_need)
        max_context = _fitting_context(cfg, num_blocks, chunk, max_context, opts.fit_context, self.memory_plan)
        if max_context < asked.max_context:
            log.warning(
                "the context limit is %d tokens, the longest the KV pool holds (%d asked)",
                max_context,
                asked.max_context,
            )
        if self.memory_plan is not None:
            tokens = memory.largest_context(cfg, num_blocks, chunk, max(max_context, 1 << 24))
            log.info("%s", self.memory_plan.describe(tokens))
        self._runner = runner_over(num_blocks, max_context)
        try:
            self._runner.warm_up(opts.progress)
            self.options = _after_warm_up(opts, packed, max_context, model)
            self._native = _native.Engine(
                self._runner,
                self.options,
                sliding=sliding,
                window=cfg.sliding_window,
                num_blocks=num_blocks,
                vocab_size=cfg.vocab_size,
                eos_token_id=cfg.eos_token_id,
                step_rows=self._runner.rows if opts.backend == "megakernel" else STEP_MAX_ROWS,
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

    @property
    def max_context(self) -> int:
        """(`AsyncEngine`) The longest sequence, prompt plus completion."""
        return self.options.max_context

    @property
    def max_batch(self) -> int:
        """(`AsyncEngine`) The most sequences decoded together."""
        return self.options.max_batch

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
            if isinstance(e, _native.PromptTooLongError):
                raise PromptTooLong(*e.args) from None
            if isinstance(e, _native.QueueFullError):
                raise EngineFull(str(e)) from None
            if isinstance(e, _native.EngineStoppedError):
                raise EngineClosed(str(e)) from None
            if isinstance(e, _native.ConstraintError) and params.constraint is not None:
                raise SamplingError(*self._constraint_fault(params.constraint, str(e))) from None
            raise
        return stream

    def prepare_constraint(self, spec: ConstraintSpec | None) -> None:
        """Compiles `spec` ahead of the `submit` that uses it (mk.engine.api.AsyncEngine)."""
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
        for e in batch:
            stream = streams.get(e.id)
            if stream is None:
                continue
            top = None if e.top is None else tuple(e.top)
            event = TokenEvent(e.token, e.logprob, top, e.finish, e.error, e.cached_tokens, e.queue_seconds)
            if e.finish is not None:
                stream.finished = True
                del streams[e.id]
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


def _packed_prefill(model: Model, opts: EngineOptions) -> Prefill | None:
    """The engine's `mk.prefill.packed` runner, or None for the model's plain forward (`opts.prefill`)."""
    if opts.prefill == "plain":
        return None
    if model.device.type == "cuda":  # before anything records weight addresses (the megakernel's tables)
        stack_experts(model.weights, model.config)
    # Rust hands over at most one chunk's tokens a call, so each call is one chunk of mk.prefill.packed (or
    # two static passes: mk.prefill.fresh.fresh_split).
    return Prefill(
        model,
        chunk=opts.prefill_chunk,
        graphs="auto" if opts.prefill_graphs is None else opts.prefill_graphs,
        prefix_graphs="auto" if opts.prefix_graphs is None else opts.prefix_graphs,
        fresh_split=opts.fresh_split,
    )


def _after_warm_up(opts: EngineOptions, packed: Prefill | None, max_context: int, model: Model) -> EngineOptions:
    """`opts` with what the warm-up and the KV pool decided: the prefill graphs it captured (a
    shape whose capture failed runs eagerly), whole_chunk_tokens by them, the context the pool
    holds, and the prefix cache's salt."""
    fresh = packed is not None and packed.fresh is not None and packed.fresh.capture
    prefixed = packed is not None and packed.prefixed is not None and packed.prefixed.capture
    whole = opts.whole_chunk_tokens
    if whole is None:  # a lone chunk that replays a graph runs whole (if every shape's capture took)
        graphed = opts.sliced_prefill and fresh and prefixed
        graphed = graphed and not (packed.fresh.uncapturable() or packed.prefixed.uncapturable())
        whole = WHOLE_CHUNK_TOKENS if graphed else 0
    salt = opts.salt
    if salt is None:
        salt = repr((model.config, model.dtype, _weights_id(model))).encode()
    return dataclasses.replace(
        opts, prefill_graphs=fresh, prefix_graphs=prefixed, whole_chunk_tokens=whole, max_context=max_context, salt=salt
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
