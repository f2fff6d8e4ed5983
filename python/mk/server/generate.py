"""Engine requests as text: submit (engine refusals become HTTP errors) and turn each request's token
events into text pieces with stop strings applied, timing every token for the metrics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from mk.engine_api import AsyncEngine, EngineClosed, EngineFull, PromptTooLong, RequestStream
from mk.sampling import SamplingError, SamplingParams
from mk.server.errors import APIError, bad_request
from mk.server.metrics import Metrics
from mk.textstream import Detokenizer, StopMatcher
from mk.tokenizer import Tokenizer

# An engine "cancelled" ending the client did not ask for (the server drained past its timeout).
ABORT = "abort"


def submit(engine: AsyncEngine, prompt: list[int], params: SamplingParams, request_id: str) -> RequestStream:
    try:
        return engine.submit(prompt, params, request_id)
    except PromptTooLong as e:
        raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
    except EngineFull as e:
        raise APIError(503, f"the server is busy ({e}); retry shortly", headers={"Retry-After": "1"}) from None
    except EngineClosed:
        raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"}) from None
    except SamplingError as e:
        raise bad_request(str(e), e.field) from None
    except ValueError as e:
        raise bad_request(str(e), "prompt") from None


@dataclass(slots=True)
class Piece:
    """Text a choice added, the tokens behind it (id, logprob, top alternatives), and how it ended."""

    text: str
    tokens: list[tuple[int, float | None, tuple | None]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


class ChoiceRun:
    """One choice: an engine request read as text. Cancelling the consuming task cancels the request."""

    def __init__(
        self,
        index: int,
        stream: RequestStream,
        tokenizer: Tokenizer,
        stops: list[str],
        metrics: Metrics,
        arrival: float,
        skip_special_tokens: bool,
    ) -> None:
        self.index = index
        self.stream = stream
        self.detok = Detokenizer(tokenizer, skip_special_tokens)
        self.stops = StopMatcher(stops)
        self.metrics = metrics
        self.arrival = arrival
        self.token_ids: list[int] = []
        self.first_token_at: float | None = None
        self.finish_reason: str | None = None

    async def pieces(self) -> AsyncIterator[Piece]:
        pending: list[tuple[int, float | None, tuple | None]] = []
        last = self.arrival
        try:
            async for event in self.stream:
                now = time.monotonic()
                text = ""
                if event.token_id is not None:
                    if self.first_token_at is None:
                        self.first_token_at = now
                        self.metrics.ttft.observe(now - self.arrival)
                        if event.queue_time is not None:  # the rest of the wait is prefill
                            self.metrics.queue.observe(event.queue_time)
                            self.metrics.prefill.observe(max(0.0, now - self.arrival - event.queue_time))
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                    self.metrics.count_generated(1)
                    self.token_ids.append(event.token_id)
                    pending.append((event.token_id, event.logprob, event.top_logprobs))
                    if event.finish_reason != "stop":  # EOS and stop-token ids add no text
                        text = self.stops.push(self.detok.push(event.token_id))
                    if self.stops.matched is not None:
                        self.stream.cancel()
                        yield self._end(Piece(text, pending, "stop"))
                        return
                if event.finish_reason is not None:
                    text += self.stops.push(self.detok.flush())
                    reason = "stop" if self.stops.matched is not None else event.finish_reason
                    text += self.stops.flush()
                    yield self._end(Piece(text, pending, ABORT if reason == "cancelled" else reason, event.error))
                    return
                if text:
                    yield Piece(text, pending)
                    pending = []
        finally:
            if self.finish_reason is None:  # the consumer went away (client disconnect): free the KV now
                self.stream.cancel()
                self.finish_reason = "cancelled"
                self.metrics.finished("cancelled")

    def _end(self, piece: Piece) -> Piece:
        self.finish_reason = piece.finish_reason
        self.metrics.finished(piece.finish_reason or "error")
        now = time.monotonic()
        self.metrics.e2e.observe(now - self.arrival)
        if self.first_token_at is not None:
            self.metrics.decode.observe(now - self.first_token_at)
        return piece


async def merged(streams: list[AsyncIterator]) -> AsyncIterator:
    """Items of several async iterators as they come (one task per iterator; closing this closes them)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(it: AsyncIterator) -> None:
        try:
            async for item in it:
                await queue.put(item)
        except Exception as e:  # handed to the reader, which raises it
            await queue.put(e)
        finally:
            await queue.put(done)

    tasks = [asyncio.create_task(pump(it)) for it in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def gather_all(coros: list) -> list:
    """Results of all; if one fails (or this is cancelled), the others are cancelled too."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
