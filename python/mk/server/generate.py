"""Engine requests as text, shared by the two generation routes: submit (engine refusals become HTTP
errors), turn each request's token events into text pieces with stop strings applied (timing every
token for the metrics), collect a choice, and the usage, log note and stream tail of a response."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mk.engine.api import AsyncEngine, EngineClosed, EngineFull, PromptTooLong, RequestStream
from mk.engine.sampling import SamplingError, SamplingParams
from mk.server.errors import APIError, bad_request
from mk.server.metrics import ABORT, Metrics
from mk.server.params import sampling_params
from mk.server.state import ServerState
from mk.text.healing import HealedText, heal
from mk.text.textstream import Detokenizer, StopMatcher
from mk.text.tokenizer import Tokenizer
from mk.text.toolcalls import MARKERS

if TYPE_CHECKING:
    from mk.server.chat import PreparedChat


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


# The finish reason a client sees for a generation the engine cancelled (one still running at the
# drain timeout): its text is cut short as max_tokens cuts it, and "length" is the OpenAI value every
# client treats as a truncated answer (vLLM's "abort" is none of OpenAI's; the Messages route says
# "max_tokens", the Responses route "incomplete"). The metrics count it as ABORT.
CUT_SHORT = "length"


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
        keep_special: Collection[str] = (),
        stop_token_ids: frozenset[int] = frozenset(),
        healed: str = "",
    ) -> None:
        self.index = index
        self.stream = stream
        # Tokens that end a request without adding text (EOS, the request's stop ids); a grammar's
        # end stops on a token that is part of the answer.
        self.silent_stops = stop_token_ids | {tokenizer.eos_token_id}
        # Special tokens add no text, but for the markers `keep_special` names (a chat answer's
        # sections, which mk.text.toolcalls parses).
        self.detok = Detokenizer(tokenizer, keep_special)
        # Token healing's removed text (mk.text.healing), which the generated text begins with and the prompt
        # holds: left out before the stop strings are matched, so none matches the prompt's own text.
        self.unhealed = HealedText(healed)
        self.stops = StopMatcher(stops)
        self.metrics = metrics
        self.arrival = arrival
        self.submitted = time.monotonic()  # constructed right after the engine took the request
        self.token_ids: list[int] = []
        self.first_token_at: float | None = None
        self.cached_tokens = 0  # prompt tokens the engine served from its prefix cache
        self.finish_reason: str | None = None
        # Yield a piece for every token, text or not (continuous usage stats).
        self.every_token = False

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
                        self.cached_tokens = event.cached_tokens or 0
                        if event.queue_time is not None:  # the engine's wait, then its prefill
                            self.metrics.queue.observe(event.queue_time)
                            self.metrics.prefill.observe(max(0.0, now - self.submitted - event.queue_time))
                    else:
                        self.metrics.itl.observe(now - last)
                    last = now
                    self.metrics.count_generated(1)
                    self.token_ids.append(event.token_id)
                    pending.append((event.token_id, event.logprob, event.top_logprobs))
                    if event.finish_reason != "stop" or event.token_id not in self.silent_stops:
                        text = self.stops.push(self.unhealed.push(self.detok.push(event.token_id)))
                    if self.stops.matched is not None:
                        self.stream.cancel()
                        yield self._end(Piece(text, pending, "stop"))
                        return
                if event.finish_reason is not None:
                    text += self.stops.push(self.unhealed.push(self.detok.flush()))
                    reason = "stop" if self.stops.matched is not None else event.finish_reason
                    text += self.stops.flush()
                    if reason == "cancelled":  # the engine cut it (a drain timeout): the client sees CUT_SHORT
                        yield self._end(Piece(text, pending, CUT_SHORT, event.error), counted_as=ABORT)
                    else:
                        yield self._end(Piece(text, pending, reason, event.error))
                    return
                # A client that asked for logprobs or continuous usage gets every token as it comes,
                # even one whose text the detokenizer still holds (a partial character): its stream
                # counts tokens.
                if text or (pending and (event.logprob is not None or self.every_token)):
                    yield Piece(text, pending)
                    pending = []
        finally:
            if self.finish_reason is None:  # the consumer went away (client disconnect): free the KV now
                self.stream.cancel()
                self.finish_reason = "cancelled"
                self.metrics.finished("cancelled")

    def _end(self, piece: Piece, counted_as: str | None = None) -> Piece:
        """The last piece; `counted_as` is the metrics' and the log's reason where it differs from the
        client's."""
        self.finish_reason = counted_as or piece.finish_reason
        self.metrics.finished(self.finish_reason or "error")
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


def continued(
    state: ServerState, ids: list[int], params: SamplingParams, prefilled: bool
) -> tuple[list[int], SamplingParams, str]:
    """A chat prompt's ids and params as the engine gets them, and the text healing removed from it:
    a prefilled answer (`continue_final_message`) is a text prompt that may end inside a token, healed
    as completions' prompts are (mk.text.healing) where the server heals; any other as it is."""
    if prefilled and state.token_healing:
        healing = heal(state.tokenizer, ids, params)
        if healing is not None:
            return healing.prompt, healing.params(params), healing.removed
    return ids, params, ""


def start_chat(
    state: ServerState, chat: PreparedChat, rid: str, arrival: float, info: dict, logprobs: int | None = None
) -> list[ChoiceRun]:
    """A prepared chat's runs, one per choice (`n`), its prompt counted (`info["prompt_tokens"]`, the
    metrics'); a prefilled answer healed (`continued`)."""
    req, ids = chat.req, chat.prompt.token_ids
    requests, healed = [], []
    for i in range(req.n):
        params = sampling_params(req, chat.max_tokens, i, logprobs, chat.grammar)
        prompt, params, removed = continued(state, ids, params, req.continue_final_message)
        requests.append((prompt, params))
        healed.append(removed)
    runs = start_runs(state, requests, rid, req.stop, arrival, keep_special=MARKERS, healed=healed)
    state.metrics.count_prompt(len(ids) * req.n)
    info["prompt_tokens"] = len(ids)
    return runs


def start_runs(
    state: ServerState,
    requests: list[tuple[list[int], SamplingParams]],
    rid: str,
    stops: list[str],
    arrival: float,
    keep_special: Collection[str] = (),
    healed: list[str] | None = None,
) -> list[ChoiceRun]:
    """One engine request and ChoiceRun per (prompt ids, params), choice i as `{rid}-{i}`; if one is
    refused, those already submitted are cancelled. `healed`: per request, the text token healing
    removed from its prompt (mk.text.healing; "" where none)."""
    runs: list[ChoiceRun] = []
    try:
        for i, (ids, params) in enumerate(requests):
            stream = submit(state.engine, ids, params, f"{rid}-{i}")
            stop_ids = frozenset(params.stop_token_ids)
            removed = healed[i] if healed else ""
            run = ChoiceRun(i, stream, state.tokenizer, stops, state.metrics, arrival, keep_special, stop_ids, removed)
            runs.append(run)
    except BaseException:
        for run in runs:
            run.stream.cancel()
        raise
    return runs


@dataclass(slots=True)
class Collected:
    text: str
    tokens: list[tuple[int, float | None, tuple | None]]
    finish_reason: str | None


async def collect(run: ChoiceRun) -> Collected:
    """A whole choice (not streamed); a failed generation is a 500."""
    text, tokens, reason, error = "", [], None, None
    async for piece in run.pieces():
        text += piece.text
        tokens += piece.tokens
        reason, error = piece.finish_reason, piece.error
    if reason == "error":
        raise APIError(500, f"generation failed: {error}", type="generation_error")
    return Collected(text, tokens, reason)


def usage(prompt_tokens: int, runs: list[ChoiceRun]) -> dict[str, int]:
    completion = sum(len(r.token_ids) for r in runs)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def note(info: dict, runs: list[ChoiceRun]) -> None:
    """The request log line's fields: completion tokens, finish reasons, time to first token."""
    info["completion_tokens"] = sum(len(r.token_ids) for r in runs)
    info["finish"] = ",".join(str(r.finish_reason) for r in runs)
    first = [r.first_token_at for r in runs if r.first_token_at is not None]
    if first:
        info["ttft_ms"] = f"{(min(first) - runs[0].arrival) * 1000:.0f}"


async def stream_choices(
    events: list[AsyncIterator],
    runs: list[ChoiceRun],
    head: dict,
    options,
    prompt_tokens: int,
    info: dict,
) -> AsyncIterator[Any]:
    """Every choice's chunks as they come, until one yields an error body (which ends the stream);
    then the usage chunk when asked for, and [DONE]. With continuous usage stats (`options`, the
    request's stream_options) every chunk carries the usage so far, and every token makes one."""
    include_usage = options is not None and options.include_usage
    for run in runs:
        run.every_token = options is not None and options.continuous_usage_stats
    try:
        async for item in merged(events):
            if "error" in item:
                yield item
                break
            yield with_usage(item, options, prompt_tokens, runs)
    finally:
        note(info, runs)
    if include_usage:
        yield {**head, "choices": [], "usage": usage(prompt_tokens, runs)}
    yield "[DONE]"


def with_usage(chunk: dict, options, prompt_tokens: int, runs: list[ChoiceRun]) -> dict:
    """A stream chunk as the request's stream_options ask: with continuous usage stats, the usage so
    far; with include_usage alone, a null usage (the last chunk has the usage: the OpenAI API's shape)."""
    if options is not None and options.continuous_usage_stats:
        return {**chunk, "usage": usage(prompt_tokens, runs)}
    if options is not None and options.include_usage:
        return {**chunk, "usage": None}
    return chunk
