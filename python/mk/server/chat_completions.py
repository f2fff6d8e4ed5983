"""POST /v1/chat/completions: streamed and not, with reasoning, tool calls, n choices, logprobs."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from mk.server.app import ServerState, validate
from mk.server.chat import ChatPrompt, build_prompt
from mk.server.errors import APIError, bad_request, error_body
from mk.server.generate import ChoiceRun, gather_all, merged, submit
from mk.server.logprobs import chat_logprobs
from mk.server.params import max_new_tokens, refuse_unsupported, sampling_params
from mk.server.schemas import ChatRequest
from mk.toolcalls import Cmd4Stream, ContentTokens, Delta, ToolCallError


class _StreamError:
    """An in-band error that ends the whole stream."""

    def __init__(self, message: str, kind: str) -> None:
        self.body = error_body(message, kind)


async def chat_completions(state: ServerState, obj: Any, info: dict) -> dict | AsyncIterator:
    arrival = time.monotonic()
    req: ChatRequest = validate(ChatRequest, obj)
    state.check_model(req.model)
    refuse_unsupported(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    # Rendering and tokenizing a long conversation takes seconds: off the event loop, so other
    # streams and /health are not held up.
    prompt = await asyncio.to_thread(build_prompt, req, state.tokenizer)
    max_tokens = max_new_tokens(req, len(prompt.token_ids), state.engine.max_context)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    rid = "chatcmpl-" + info["id"]
    runs: list[ChoiceRun] = []
    try:
        for i in range(req.n):
            params = sampling_params(req, max_tokens, i, logprobs)
            stream = submit(state.engine, prompt.token_ids, params, f"{rid}-{i}")
            runs.append(ChoiceRun(i, stream, state.tokenizer, req.stop, state.metrics, arrival, False))
    except BaseException:
        for run in runs:
            run.stream.cancel()
        raise
    state.metrics.count_prompt(len(prompt.token_ids) * req.n)
    info["prompt_tokens"] = len(prompt.token_ids)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name}
    if req.stream:
        return _stream(state, req, prompt, runs, head, info)
    choices = await gather_all([_collect(state, req, prompt, run) for run in runs])
    _note(info, runs)
    return {
        **head,
        "choices": choices,
        "usage": _usage(prompt, runs),
    }


async def _collect(state: ServerState, req: ChatRequest, prompt: ChatPrompt, run: ChoiceRun) -> dict[str, Any]:
    text, tokens, reason, error = "", [], None, None
    async for piece in run.pieces():
        text += piece.text
        tokens += piece.tokens
        reason, error = piece.finish_reason, piece.error
    if reason == "error":
        raise APIError(500, f"generation failed: {error}", type="generation_error")
    parsed = Cmd4Stream(prompt.thinking, prompt.policy.calls_allowed)
    parsed.feed(text)
    parsed.finish()
    calls = parsed.calls
    if reason == "length":  # a call cut off by max_tokens is no call
        calls = [c for c in calls if _is_object(c.arguments)]
    else:
        try:
            prompt.policy.check_final(parsed)
        except ToolCallError as e:
            raise APIError(502, str(e), type="tool_call_generation_error") from None
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if calls else "")}
    if req.include_reasoning and parsed.reasoning:
        message["reasoning_content"] = parsed.reasoning
    if calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls
        ]
    return {
        "index": run.index,
        "message": message,
        "logprobs": chat_logprobs(state.tokenizer, ContentTokens(state.tokenizer, prompt.thinking).take(tokens))
        if req.logprobs
        else None,
        "finish_reason": "tool_calls" if calls and reason != "length" else reason,
    }


async def _stream(
    state: ServerState, req: ChatRequest, prompt: ChatPrompt, runs: list[ChoiceRun], head: dict, info: dict
) -> AsyncIterator:
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(index: int, delta: dict, finish: str | None = None, logprobs: Any = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return {**head, "choices": [choice]}

    for run in runs:
        yield chunk(run.index, {"role": "assistant", "content": ""})
    try:
        async for item in merged([_choice_events(state, req, prompt, run, chunk) for run in runs]):
            if isinstance(item, _StreamError):
                yield item.body
                break
            yield item
    finally:
        _note(info, runs)
    if req.stream_options is not None and req.stream_options.include_usage:
        yield {**head, "choices": [], "usage": _usage(prompt, runs)}
    yield "[DONE]"


async def _choice_events(
    state: ServerState, req: ChatRequest, prompt: ChatPrompt, run: ChoiceRun, chunk: Any
) -> AsyncIterator:
    parser = Cmd4Stream(prompt.thinking, prompt.policy.calls_allowed)
    content_tokens = ContentTokens(state.tokenizer, prompt.thinking)
    tokens: list = []  # the content tokens since the last chunk
    async for piece in run.pieces():
        tokens += content_tokens.take(piece.tokens)
        delta = parser.feed(piece.text)
        if piece.finish_reason is not None:
            tail = parser.finish()
            delta = Delta(
                delta.reasoning + tail.reasoning, delta.content + tail.content, delta.tool_calls + tail.tool_calls
            )
        try:
            for call in delta.tool_calls:
                if "id" in call:
                    prompt.policy.check_name(call["function"]["name"])
        except ToolCallError as e:
            yield _StreamError(str(e), "tool_call_generation_error")
            return
        fields: dict[str, Any] = {}
        if delta.reasoning and req.include_reasoning:
            fields["reasoning_content"] = delta.reasoning
        if delta.content:
            fields["content"] = delta.content
        if delta.tool_calls:
            fields["tool_calls"] = delta.tool_calls
        if fields:
            yield chunk(run.index, fields, logprobs=chat_logprobs(state.tokenizer, tokens) if req.logprobs else None)
            tokens = []
        reason = piece.finish_reason
        if reason is None:
            continue
        if reason == "error":
            yield _StreamError(f"generation failed: {piece.error}", "generation_error")
            return
        if reason != "length":
            try:
                prompt.policy.check_final(parser)
            except ToolCallError as e:
                yield _StreamError(str(e), "tool_call_generation_error")
                return
        yield chunk(run.index, {}, "tool_calls" if parser.calls and reason != "length" else reason)


def _usage(prompt: ChatPrompt, runs: list[ChoiceRun]) -> dict[str, int]:
    completion = sum(len(r.token_ids) for r in runs)
    return {
        "prompt_tokens": len(prompt.token_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt.token_ids) + completion,
    }


def _note(info: dict, runs: list[ChoiceRun]) -> None:
    info["completion_tokens"] = sum(len(r.token_ids) for r in runs)
    info["finish"] = ",".join(str(r.finish_reason) for r in runs)
    first = [r.first_token_at for r in runs if r.first_token_at is not None]
    if first:
        info["ttft_ms"] = f"{(min(first) - runs[0].arrival) * 1000:.0f}"


def _is_object(arguments: str) -> bool:
    try:
        return isinstance(json.loads(arguments), dict)
    except json.JSONDecodeError:
        return False
