"""POST /v1/chat/completions: streamed and not, with reasoning, tool calls, n choices, logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from mk.server.chat import ChatPrompt, PreparedChat, prepare_chat
from mk.server.errors import APIError, bad_request, error_body
from mk.server.generate import (
    ChoiceRun,
    collect,
    gather_all,
    note,
    start_chat,
    stream_choices,
    usage,
    with_usage,
)
from mk.server.http import parse_json
from mk.server.logprobs import chat_logprobs
from mk.server.params import parse_request
from mk.server.schemas import ChatRequest
from mk.server.state import ServerState
from mk.text.toolcalls import Cmd4Stream, ContentTokens, Delta, ToolCallError, parse


async def chat_completions(state: ServerState, body: bytes, info: dict) -> dict | AsyncIterator:
    arrival = time.monotonic()
    prepared = await state.offload.run(len(body), _prepare, state, body)
    req, prompt = prepared.req, prepared.prompt
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    rid = "chatcmpl-" + info["id"]
    runs = start_chat(state, prepared, rid, arrival, info, logprobs)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": state.model_name}
    if req.stream:
        return _stream(state, req, prompt, runs, head, info)
    choices = await gather_all([_collect(state, req, prompt, run) for run in runs])
    note(info, runs)
    return {**head, "choices": choices, "usage": usage(len(prompt.token_ids), runs)}


def _prepare(state: ServerState, body: bytes) -> PreparedChat:
    """The request from its body, prepared (chat.prepare_chat; on a thread of mk.server.offload)."""
    req = parse_request(ChatRequest, parse_json(body), state)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    return prepare_chat(state, req)


async def _collect(state: ServerState, req: ChatRequest, prompt: ChatPrompt, run: ChoiceRun) -> dict[str, Any]:
    got = await collect(run)
    text, tokens, reason = got.text, got.tokens, got.finish_reason
    parsed = parse(text, prompt.thinking, prompt.policy.calls_allowed, complete=reason != "length")
    calls = parsed.calls  # (a call cut off by max_tokens comes back as far as it got, as streamed)
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
        yield with_usage(
            chunk(run.index, {"role": "assistant", "content": ""}), req.stream_options, len(prompt.token_ids), runs
        )
    events = [_choice_events(state, req, prompt, run, chunk) for run in runs]
    async for item in stream_choices(events, runs, head, req.stream_options, len(prompt.token_ids), info):
        yield item


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
            tail = parser.finish(complete=piece.finish_reason != "length")
            delta = Delta(
                delta.reasoning + tail.reasoning, delta.content + tail.content, delta.tool_calls + tail.tool_calls
            )
        try:
            for call in delta.tool_calls:
                if "id" in call:
                    prompt.policy.check_name(call["function"]["name"])
        except ToolCallError as e:
            yield error_body(str(e), "tool_call_generation_error")
            return
        fields: dict[str, Any] = {}
        if delta.reasoning and req.include_reasoning:
            fields["reasoning_content"] = delta.reasoning
        if delta.content:
            fields["content"] = delta.content
        if delta.tool_calls:
            fields["tool_calls"] = delta.tool_calls
        if not fields and run.every_token and piece.tokens and piece.finish_reason is None:
            fields["content"] = ""  # a token whose text is held or hidden: continuous usage counts it
        if fields:
            yield chunk(run.index, fields, logprobs=chat_logprobs(state.tokenizer, tokens) if req.logprobs else None)
            tokens = []
        reason = piece.finish_reason
        if reason is None:
            continue
        if reason == "error":
            yield error_body(f"generation failed: {piece.error}", "generation_error")
            return
        try:
            prompt.policy.check_final(parser)
        except ToolCallError as e:
            yield error_body(str(e), "tool_call_generation_error")
            return
        yield chunk(run.index, {}, "tool_calls" if parser.calls and reason != "length" else reason)
