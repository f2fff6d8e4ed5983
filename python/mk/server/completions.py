"""POST /v1/completions: prompts as text or token ids, several prompts, n choices each, streamed or not.

Text prompts are healed (mk.text.healing) unless the request's `token_healing` or the server's
`--token-healing off` says not to: a prompt ending where a longer token could start goes to the engine
without its last token(s), under a grammar that makes the completion begin with their text, which the
choice's text then leaves out. The usage counts the prompt's own tokens as `prompt_tokens` (the healed
tail among them) and every generated token as `completion_tokens` (the one that covers the healed tail
among them, as max_tokens counts it); `echo` gives the prompt as sent; logprobs keep every generated
token, the first one's text cut to what the choice's text holds."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mk.engine.sampling import ConstraintSpec
from mk.server.errors import bad_request, error_body
from mk.server.generate import ChoiceRun, collect, gather_all, note, start_runs, stream_choices, usage
from mk.server.http import parse_json
from mk.server.logprobs import completion_logprobs
from mk.server.params import (
    context_exceeded,
    encode_prompt,
    max_new_tokens,
    parse_request,
    prepared_constraint,
    sampling_params,
)
from mk.server.schemas import CompletionRequest
from mk.server.state import ServerState
from mk.text.healing import Healing, heal, prompt_bytes_left


@dataclass(slots=True)
class _Choice:
    run: ChoiceRun
    echo: str  # prompt text to put before the completion ("" without echo)
    healed_bytes: int  # bytes of the generated text's start that token healing took from the prompt


@dataclass(slots=True)
class _Prepared:
    req: CompletionRequest
    prompts: list[tuple[list[int], str]]  # (token ids, text to echo) of every prompt
    budgets: list[int]  # new tokens of each prompt's choices
    grammar: ConstraintSpec | None
    healings: list[Healing | None]  # each prompt's token healing, where it has one


async def completions(state: ServerState, body: bytes, info: dict) -> dict | AsyncIterator:
    arrival = time.monotonic()
    prepared = await state.offload.run(len(body), _prepare, state, body)
    req, prompts = prepared.req, prepared.prompts
    rid = "cmpl-" + info["id"]
    requests, healed = [], []
    for (ids, _), budget, healing in zip(prompts, prepared.budgets, prepared.healings, strict=True):
        for i in range(req.n):
            params = sampling_params(req, budget, i, req.logprobs, prepared.grammar)
            requests.append((ids, params) if healing is None else (healing.prompt, healing.params(params)))
            healed.append(healing.removed if healing else "")
    runs = start_runs(state, requests, rid, req.stop, arrival, healed=healed)
    echoes = [text for _, text in prompts for _ in range(req.n)]
    choices = [
        _Choice(run, echo, len(removed.encode())) for run, echo, removed in zip(runs, echoes, healed, strict=True)
    ]
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
    """The request from its body, its prompts tokenized, their budgets, its grammar and their token
    healing (on a thread of mk.server.offload: for a long prompt this takes seconds; the grammars,
    the healing ones too, are compiled here rather than on the event loop)."""
    req = parse_request(CompletionRequest, parse_json(body), state)
    grammar = prepared_constraint(state, req)
    prompts = _prompt_ids(req, state)
    budgets = [max_new_tokens(req, len(ids), state.engine.max_context) for ids, _ in prompts]
    healing = state.token_healing if req.token_healing is None else req.token_healing
    healings: list[Healing | None] = []
    for (ids, _), budget, text in zip(prompts, budgets, _texts(req.prompt), strict=True):
        healed = None
        if healing and text:
            healed = heal(state.tokenizer, ids, sampling_params(req, budget, 0, req.logprobs, grammar))
        if healed is not None:
            state.engine.prepare_constraint(healed.constraint)
        healings.append(healed)
    return _Prepared(req, prompts, budgets, grammar, healings)


def _texts(prompt: str | list) -> list[bool]:
    """Which of the request's prompts are text (token ids are taken as given)."""
    if isinstance(prompt, str):
        return [True]
    if isinstance(prompt[0], int):
        return [False]
    return [isinstance(p, str) for p in prompt]


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
    logprobs = None
    if req.logprobs is not None:
        logprobs = completion_logprobs(state.tokenizer, got.tokens, len(c.echo), c.healed_bytes)
    return {"index": c.run.index, "text": c.echo + got.text, "logprobs": logprobs, "finish_reason": got.finish_reason}


async def _stream(
    state: ServerState, req: CompletionRequest, choices: list[_Choice], head: dict, prompt_tokens: int, info: dict
) -> AsyncIterator:
    def chunk(index: int, text: str, finish: str | None = None, logprobs: Any = None) -> dict:
        return {**head, "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    async def events(c: _Choice) -> AsyncIterator:
        if c.echo:
            yield chunk(c.run.index, c.echo)
        offset, healed_bytes = len(c.echo), c.healed_bytes
        async for piece in c.run.pieces():
            if piece.finish_reason == "error":
                yield error_body(f"generation failed: {piece.error}", "generation_error")
                return
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(state.tokenizer, piece.tokens, offset, healed_bytes)
                logprobs = logprobs if logprobs["tokens"] else None  # only special tokens: no entry to send
                healed_bytes = prompt_bytes_left(state.tokenizer, [t for t, _, _ in piece.tokens], healed_bytes)
            offset += len(piece.text)
            if piece.text or logprobs or (c.run.every_token and piece.tokens):
                yield chunk(c.run.index, piece.text, None, logprobs)
            if piece.finish_reason is not None:
                yield chunk(c.run.index, "", piece.finish_reason)

    runs = [c.run for c in choices]
    async for item in stream_choices([events(c) for c in choices], runs, head, req.stream_options, prompt_tokens, info):
        yield item
