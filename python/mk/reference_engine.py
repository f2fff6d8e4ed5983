"""A stand-in `AsyncEngine` over the PyTorch reference model, until the Rust engine lands.

One background thread runs a continuous-batching loop: each turn it prefills one chunk of the oldest
admitted prompt, then runs one batched decode step of every running sequence. A request is admitted
when a batch slot is free and the KV blocks for its whole length (prompt + max_tokens) can be
reserved, so a running sequence never runs out of blocks. Tokens reach asyncio through
`loop.call_soon_threadsafe`, once per step for all requests of that loop.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

import torch

from mk.engine_api import EngineClosed, EngineFull, EngineStats, PromptTooLong
from mk.model.paged import PageAllocator, pages_needed
from mk.model.reference import Model
from mk.outputs import TokenEvent
from mk.sampling import SamplingParams


class _Request:
    def __init__(self, rid: str, prompt: list[int], params: SamplingParams, blocks: int) -> None:
        self.id = rid
        self.prompt = prompt
        self.params = params
        self.blocks = blocks  # reserved KV blocks
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.table: torch.Tensor | None = None
        self.prefilled = 0
        self.pos = 0  # position the next decode step writes
        self.generated: list[int] = []
        self.gen: torch.Generator | None = None
        self.done = False


class _Stream:
    def __init__(self, engine: ReferenceEngine, req: _Request) -> None:
        self._engine, self._req = engine, req
        self.request_id = req.id
        self.prompt_token_ids = req.prompt

    def cancel(self) -> None:
        self._engine._cancel(self._req)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        while True:
            event = await self._req.queue.get()
            yield event
            if event.finish_reason is not None:
                return


class ReferenceEngine:
    """`AsyncEngine` over `mk.model.reference.Model` (CPU or GPU)."""

    def __init__(
        self,
        model: Model,
        max_batch: int = 8,
        max_context: int = 4096,
        max_waiting: int = 256,
        kv_blocks: int | None = None,
        prefill_chunk: int = 512,
    ) -> None:
        self.model = model
        self.config = model.config
        self.max_batch = max_batch
        self.max_context = max_context
        self.max_waiting = max_waiting
        self.prefill_chunk = prefill_chunk
        layers = self.config.num_hidden_layers
        per_seq = layers * pages_needed(max_context)
        kv_blocks = kv_blocks if kv_blocks is not None else max_batch * per_seq
        if kv_blocks < per_seq:
            raise ValueError(
                f"the KV cache holds {kv_blocks} blocks but one {max_context}-token sequence needs {per_seq}: "
                "lower the context limit or give the cache more memory"
            )
        self.kv = model.new_kv(kv_blocks)
        self.alloc = PageAllocator(kv_blocks)
        self._reserved = 0
        self._lock = threading.Condition()
        self._waiting: deque[_Request] = deque()
        self._cancels: list[_Request] = []
        self._prefilling: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._closed = self._draining = False
        self._stats = EngineStats(kv_blocks_total=kv_blocks)
        self._thread = threading.Thread(target=self._loop, name="mk-reference-engine", daemon=True)
        self._thread.start()

    # ---- AsyncEngine ------------------------------------------------------------------------
    def submit(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> _Stream:
        params.validate()
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if min(prompt) < 0 or max(prompt) >= self.config.vocab_size:
            raise ValueError(f"prompt token ids must lie in [0, {self.config.vocab_size})")
        if len(prompt) + params.max_tokens > self.max_context:
            raise PromptTooLong(len(prompt), params.max_tokens, self.max_context)
        blocks = self.config.num_hidden_layers * pages_needed(len(prompt) + params.max_tokens)
        req = _Request(request_id or uuid.uuid4().hex, prompt, params, blocks)
        with self._lock:
            if self._closed or self._draining:
                raise EngineClosed("the engine is shutting down")
            if len(self._waiting) >= self.max_waiting:
                raise EngineFull(f"{len(self._waiting)} requests are already waiting")
            self._waiting.append(req)
            self._lock.notify()
        return _Stream(self, req)

    def stats(self) -> EngineStats:
        with self._lock:
            s = self._stats
            return EngineStats(
                running=len(self._running) + len(self._prefilling),
                waiting=len(self._waiting),
                kv_blocks_total=s.kv_blocks_total,
                kv_blocks_used=s.kv_blocks_total - self.alloc.num_free,
                prompt_tokens=s.prompt_tokens,
                generated_tokens=s.generated_tokens,
            )

    async def drain(self, timeout: float) -> None:
        with self._lock:
            self._draining = True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.stats()
            if s.running == 0 and s.waiting == 0:
                return
            await asyncio.sleep(0.05)
        with self._lock:
            self._cancels.extend([*self._waiting, *self._prefilling, *self._running])
            self._lock.notify()
        while self.stats().running or self.stats().waiting:
            await asyncio.sleep(0.01)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join()

    # ---- the loop thread --------------------------------------------------------------------
    def _cancel(self, req: _Request) -> None:
        with self._lock:
            if req in self._waiting:
                self._waiting.remove(req)
                self._deliver([(req, TokenEvent(None, finish_reason="cancelled"))])
                req.done = True
            elif not req.done:
                self._cancels.append(req)
                self._lock.notify()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._closed or self._cancels or self._waiting or self._prefilling or self._running):
                    self._lock.wait()
                if self._closed:
                    return
                cancels, self._cancels = self._cancels, []
                events: list[tuple[_Request, TokenEvent]] = []
                for req in cancels:
                    if req in self._waiting:
                        self._waiting.remove(req)
                        req.done = True
                        events.append((req, TokenEvent(None, finish_reason="cancelled")))
                self._admit()
            for req in cancels:
                if not req.done:
                    events.append((req, self._finish(req, None, "cancelled")))
            try:
                if self._prefilling:
                    self._prefill_chunk(self._prefilling[0], events)
                if self._running:
                    self._decode(events)
            except Exception as e:  # a failed step fails its requests, not the engine
                for req in [*self._prefilling, *self._running]:
                    events.append((req, self._finish(req, None, "error", f"{type(e).__name__}: {e}")))
            self._deliver(events)

    def _admit(self) -> None:
        """Move waiting requests in FIFO order into prefill while slots and KV blocks allow (lock held)."""
        while self._waiting and len(self._prefilling) + len(self._running) < self.max_batch:
            req = self._waiting[0]
            if self._reserved + req.blocks > self._stats.kv_blocks_total:
                return
            self._waiting.popleft()
            self._reserved += req.blocks
            max_pages = pages_needed(len(req.prompt) + req.params.max_tokens)
            req.table = self.alloc.new_table(self.config, max_pages)
            if not req.params.greedy:
                req.gen = torch.Generator(device=self.model.device)
                seed = req.params.seed if req.params.seed is not None else secrets.randbits(63)
                req.gen.manual_seed(seed % (1 << 63))
            self._prefilling.append(req)

    def _prefill_chunk(self, req: _Request, events: list) -> None:
        start = req.prefilled
        end = min(start + self.prefill_chunk, len(req.prompt))
        self.alloc.release_out_of_window(req.table, self.config, start)
        self.alloc.ensure(req.table, end, from_pos=start)
        logits = self.model.forward(torch.tensor(req.prompt[start:end]), start, self.kv, req.table, last_only=True)
        req.prefilled = end
        if end < len(req.prompt):
            return
        self._prefilling.popleft()
        with self._lock:
            self._stats.prompt_tokens += len(req.prompt)
        req.pos = len(req.prompt)
        event = self._emit(req, logits[-1])
        events.append((req, event))
        if event.finish_reason is None:
            self._running.append(req)

    def _decode(self, events: list) -> None:
        batch = self._running
        for req in batch:
            self.alloc.release_out_of_window(req.table, self.config, req.pos)
            self.alloc.ensure(req.table, req.pos + 1, from_pos=req.pos)
        tokens = torch.tensor([r.generated[-1] for r in batch])
        positions = torch.tensor([r.pos for r in batch])
        logits = self.model.decode(tokens, positions, self.kv, [r.table for r in batch])
        still = []
        for req, row in zip(batch, logits, strict=True):
            req.pos += 1
            event = self._emit(req, row)
            events.append((req, event))
            if event.finish_reason is None:
                still.append(req)
        self._running = still

    def _emit(self, req: _Request, logits: torch.Tensor) -> TokenEvent:
        """Sample the next token of `req`, record it and end the request if it stops there."""
        p = req.params
        token, logprob, top = sample(logits, p, req.gen)
        req.generated.append(token)
        with self._lock:
            self._stats.generated_tokens += 1
        reason = None
        if (token == self.config.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif len(req.generated) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            self._release(req)
        return TokenEvent(token, logprob, top, finish_reason=reason)

    def _finish(self, req: _Request, token: int | None, reason: str, error: str | None = None) -> TokenEvent:
        if req in self._running:
            self._running.remove(req)
        if req in self._prefilling:
            self._prefilling.remove(req)
        self._release(req)
        return TokenEvent(token, finish_reason=reason, error=error)

    def _release(self, req: _Request) -> None:
        req.done = True
        if req.table is not None:
            self.alloc.free(req.table)
            req.table = None
            with self._lock:
                self._reserved -= req.blocks

    @staticmethod
    def _deliver(events: list[tuple[_Request, TokenEvent]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for req, event in events:
            by_loop.setdefault(req.loop, []).append((req.queue, event))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # that event loop is closed: nobody is listening any more
                pass


def _put_all(items: list[tuple[asyncio.Queue, TokenEvent]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


def sample(
    logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None
) -> tuple[int, float | None, tuple[tuple[int, float], ...] | None]:
    """Pick one token from a row of logits: greedy, or temperature / top-k / top-p with `gen`.
    Log-probabilities are the model's own (before temperature and filtering), as vLLM reports them."""
    logits = logits.float()
    if p.greedy:
        token = int(torch.argmax(logits))
    else:
        x = logits / p.temperature
        if p.top_k > 0 and p.top_k < x.numel():
            x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
        if p.top_p < 1.0:
            probs, order = torch.sort(torch.softmax(x, -1), descending=True)
            drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest head whose mass reaches top_p
            x = x.index_fill(0, order[drop], float("-inf"))
        token = int(torch.multinomial(torch.softmax(x, -1), 1, generator=gen))
    if p.logprobs is None:
        return token, None, None
    lp = torch.log_softmax(logits, -1)
    top = None
    if p.logprobs > 0:
        values, ids = torch.topk(lp, p.logprobs)
        top = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return token, float(lp[token]), top
