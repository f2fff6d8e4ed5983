"""POST /v1/completions: prompts as text or token ids, several prompts, n choices each, streamed or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mk.server.app import ServerState, validate
from mk.server.errors import APIError, bad_request, error_body
from mk.server.generate import ChoiceRun, gather_all, merged, submit
from mk.server.logprobs import completion_logprobs
from mk.server.params import max_new_tokens, refuse_unsupported, sampling_params
from mk.server.schemas import CompletionRequest


@dataclass(slots=True)
class _Choice:
    run: ChoiceRun
    prompt_ids: list[int]
    echo: str  # prompt text to put before the completion ("" without echo)


async def completions(state: ServerState, obj: Any, info: dict) -> dict | AsyncIterator:
    arrival = time.monotonic()
    req: CompletionRequest = validate(CompletionRequest, obj)
    state.check_model(req.model)
    refuse_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    prompts = await asyncio.to_thread(_prompt_ids, req, state)  # tokenizing is slow: off the event loop
    budgets = [max_new_tokens(req, len(ids), state.engine.max_context) for ids, _ in prompts]
    rid = "cmpl-" + info["id"]
    choices: list[_Choice] = []
    try:
        for p, ((ids, text), budget) in enumerate(zip(prompts, budgets, strict=True)):
            for i in range(req.n):
                index = p * req.n + i
                stream = submit(state.engine, ids, sampling_params(req, budget, i, req.logprobs), f"{rid}-{index}")
                run = ChoiceRun(index, stream, state.tokenizer, req.stop, state.metrics, arrival, True)
                choices.append(_Choice(run, ids, text if req.echo else ""))
    except BaseException:
        for c in choices:
            c.run.stream.cancel()
        raise
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    state.metrics.count_prompt(prompt_tokens * req.n)
    info["prompt_tokens"] = prompt_tokens
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    if req.stream:
        return _stream(state, req, choices, head, prompt_tokens, info)
    results = await gather_all([_collect(state, req, c) for c in choices])
    _note(info, choices)
    return {**head, "choices": results, "usage": _usage(prompt_tokens, choices)}


def _prompt_ids(req: CompletionRequest, state: ServerState) -> list[tuple[list[int], str]]:
    """(token ids, prompt text) of every prompt; text prompts get the tokenizer's BOS."""
    p = req.prompt
    if isinstance(p, str):
        raw: list = [p]
    elif isinstance(p[0], int):
        raw = [p]
    else:
        raw = list(p)
    out = []
    vocab = state.engine.config.vocab_size
    for item in raw:
        if isinstance(item, str):
            out.append((state.tokenizer.encode(item, add_special_tokens=True), item))
            continue
        bad = [t for t in item if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
        out.append((list(item), state.tokenizer.decode(item, skip_special_tokens=True)))
    return out


async def _collect(state: ServerState, req: CompletionRequest, c: _Choice) -> dict[str, Any]:
    text, tokens, reason, error = "", [], None, None
    async for piece in c.run.pieces():
        text += piece.text
        tokens += piece.tokens
        reason, error = piece.finish_reason, piece.error
    if reason == "error":
        raise APIError(500, f"generation failed: {error}", type="generation_error")
    logprobs = completion_logprobs(state.tokenizer, tokens, len(c.echo)) if req.logprobs is not None else None
    return {"index": c.run.index, "text": c.echo + text, "logprobs": logprobs, "finish_reason": reason}


async def _stream(
    state: ServerState, req: CompletionRequest, choices: list[_Choice], head: dict, prompt_tokens: int, info: dict
) -> AsyncIterator:
    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> dict:
        return {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    async def events(c: _Choice) -> AsyncIterator:
        if c.echo:
            yield chunk(c.run.index, c.echo)
        offset = len(c.echo)
        async for piece in c.run.pieces():
            if piece.finish_reason == "error":
                yield error_body(f"generation failed: {piece.error}", "generation_error")
                return
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(state.tokenizer, piece.tokens, offset)
            offset += len(piece.text)
            if piece.text or logprobs:
                yield chunk(c.run.index, piece.text, None, logprobs)
            if piece.finish_reason is not None:
                yield chunk(c.run.index, "", piece.finish_reason)

    try:
        async for item in merged([events(c) for c in choices]):
            yield item
            if "error" in item:
                break
    finally:
        _note(info, choices)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield {**head, "choices": [], "usage": _usage(prompt_tokens, choices)}
    yield "[DONE]"


def _usage(prompt_tokens: int, choices: list[_Choice]) -> dict[str, int]:
    completion = sum(len(c.run.token_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}


def _note(info: dict, choices: list[_Choice]) -> None:
    info["completion_tokens"] = sum(len(c.run.token_ids) for c in choices)
    info["finish"] = ",".join(str(c.run.finish_reason) for c in choices)
    first = [c.run.first_token_at for c in choices if c.run.first_token_at is not None]
    if first:
        info["ttft_ms"] = f"{(min(first) - choices[0].run.arrival) * 1000:.0f}"
