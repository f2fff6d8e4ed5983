"""POST /v1/completions: prompts as text or token ids, several prompts, n choices each, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mk.sampling import ConstraintSpec
from mk.server.errors import bad_request, error_body
from mk.server.generate import ChoiceRun, collect, gather_all, note, start_runs, stream_choices, usage
from mk.server.http import parse_json
from mk.server.logprobs import completion_logprobs
from mk.server.params import (
    constraint,
    context_exceeded,
    encode_prompt,
    max_new_tokens,
    parse_request,
    sampling_params,
)
from mk.server.schemas import CompletionRequest
from mk.server.state import ServerState


@dataclass(slots=True)
class _Choice:
    run: ChoiceRun
    echo: str  # prompt text to put before the completion ("" without echo)


@dataclass(slots=True)
class _Prepared:
    req: CompletionRequest
    prompts: list[tuple[list[int], str]]  # (token ids, text to echo) of every prompt
    budgets: list[int]  # new tokens of each prompt's choices
    grammar: ConstraintSpec | None


async def completions(state: ServerState, body: bytes, info: dict) -> dict | AsyncIterator:
    arrival = time.monotonic()
    prepared = await state.offload.run(len(body), _prepare, state, body)
    req, prompts = prepared.req, prepared.prompts
    rid = "cmpl-" + info["id"]
    requests = [
        (ids, sampling_params(req, budget, i, req.logprobs, prepared.grammar))
        for (ids, _), budget in zip(prompts, prepared.budgets, strict=True)
        for i in range(req.n)
    ]
    runs = start_runs(state, requests, rid, req.stop, arrival)
    echoes = [text for _, text in prompts for _ in range(req.n)]
    choices = [_Choice(run, echo) for run, echo in zip(runs, echoes, strict=True)]
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    state.metrics.count_prompt(prompt_tokens * req.n)
    info["prompt_tokens"] = prompt_tokens
    head = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": state.model_name}
    if req.stream:
        return _stream(state, req, choices, head, prompt_tokens, info)
    results = await gather_all([_collect(state, req, c) for c in choices])
    note(info, runs)
    return {**head, "choices": results, "usage": usage(prompt_tokens, runs)}


def _prepare(state: ServerState, body: bytes) -> _Prepared:
    """The request from its body, its prompts tokenized, their budgets and its grammar (on a thread of
    mk.server.offload: for a long prompt this takes seconds)."""
    req = parse_request(CompletionRequest, parse_json(body), state)
    grammar = constraint(req)
    state.engine.prepare_constraint(grammar)
    prompts = _prompt_ids(req, state)
    budgets = [max_new_tokens(req, len(ids), state.engine.max_context) for ids, _ in prompts]
    return _Prepared(req, prompts, budgets, grammar)


def _prompt_ids(req: CompletionRequest, state: ServerState) -> list[tuple[list[int], str]]:
    """(token ids, text to echo) of every prompt; text prompts get the tokenizer's BOS."""
    p = req.prompt
    if isinstance(p, str):
        raw: list = [p]
    elif isinstance(p[0], int):
        raw = [p]
    else:
        raw = list(p)
    out = []
    vocab, max_context = state.engine.config.vocab_size, state.engine.max_context
    for item in raw:
        if isinstance(item, str):
            out.append((encode_prompt(req, state.tokenizer, item, max_context, special=True), item if req.echo else ""))
            continue
        if len(item) >= max_context:
            raise context_exceeded(req, f"{len(item)} tokens", max_context)
        bad = [t for t in item if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
        echo = state.tokenizer.decode(item, skip_special_tokens=True) if req.echo else ""
        out.append((list(item), echo))
    return out


async def _collect(state: ServerState, req: CompletionRequest, c: _Choice) -> dict[str, Any]:
    got = await collect(c.run)
    logprobs = completion_logprobs(state.tokenizer, got.tokens, len(c.echo)) if req.logprobs is not None else None
    return {"index": c.run.index, "text": c.echo + got.text, "logprobs": logprobs, "finish_reason": got.finish_reason}


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
                logprobs = logprobs if logprobs["tokens"] else None  # only special tokens: no entry to send
            offset += len(piece.text)
            if piece.text or logprobs or (c.run.every_token and piece.tokens):
                yield chunk(c.run.index, piece.text, None, logprobs)
            if piece.finish_reason is not None:
                yield chunk(c.run.index, "", piece.finish_reason)

    runs = [c.run for c in choices]
    async for item in stream_choices([events(c) for c in choices], runs, head, req.stream_options, prompt_tokens, info):
        yield item
