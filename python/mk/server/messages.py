"""POST /v1/messages and /v1/messages/count_tokens: the Anthropic Messages API over the chat route's
pieces. The request becomes a chat request (mk.server.anthropic_chat) that is rendered by the same
template, held to the same tool-call grammar, sampled with the same settings and run as one engine
request; its answer comes back as Anthropic content blocks (thinking, text, tool_use), whole or as
Anthropic's stream events. Errors are Anthropic's bodies (mk.server.app, mk.server.errors).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from mk.server.anthropic_chat import chat_request
from mk.server.anthropic_schemas import IGNORED_FIELDS, CountTokensRequest, MessagesRequest
from mk.server.chat import ChatPrompt, PreparedChat, prepare_chat, render_prompt
from mk.server.errors import APIError, anthropic_error_body
from mk.server.generate import ChoiceRun, collect, note, start_chat
from mk.server.http import parse_json
from mk.server.params import check_grammars
from mk.server.schemas import validate
from mk.server.state import ServerState
from mk.text.toolcalls import Cmd4Stream, Delta, ToolCallError, parse

MESSAGE_ID_PREFIX = "msg_"
TOOL_USE_ID_PREFIX = "toolu_"  # in place of the chat route's "call_"


async def messages(state: ServerState, body: bytes, info: dict) -> dict | AsyncIterator:
    arrival = time.monotonic()
    req, prepared = await state.offload.run(len(body), _prepare, state, body)
    chat, prompt = prepared.req, prepared.prompt
    rid = MESSAGE_ID_PREFIX + info["id"]
    (run,) = start_chat(state, prepared, rid, arrival, info)
    head = {"id": rid, "type": "message", "role": "assistant", "model": state.model_name}
    if req.stream:
        return _stream(prompt, chat.include_reasoning, run, head, info)
    got = await collect(run)
    note(info, [run])
    parsed = parse(got.text, prompt.thinking, prompt.policy.calls_allowed, complete=got.finish_reason != "length")
    try:
        prompt.policy.check_final(parsed)
    except ToolCallError as e:
        raise APIError(502, str(e), type="tool_call_generation_error") from None
    content = _content(parsed, chat.include_reasoning)
    called = any(block["type"] == "tool_use" for block in content)
    return {
        **head,
        "content": content,
        **_stop(got.finish_reason, run.stops.matched, called),
        "usage": {"input_tokens": len(prompt.token_ids), "output_tokens": len(run.token_ids)},
    }


async def count_tokens(state: ServerState, body: bytes, info: dict) -> dict[str, int]:
    return await state.offload.run(len(body), _count_tokens, state, body)


def _parse(cls: type, state: ServerState, body: bytes) -> Any:
    """The body as `cls`; another model's name is a 404, as in Anthropic's API."""
    req = validate(cls, parse_json(body), IGNORED_FIELDS)
    state.check_model(req.model)
    return req


def _prepare(state: ServerState, body: bytes) -> tuple[MessagesRequest, PreparedChat]:
    """The request and its chat request prepared (chat.prepare_chat; on a thread of mk.server.offload,
    as the chat route's)."""
    req = _parse(MessagesRequest, state, body)
    chat = chat_request(req)
    check_grammars(chat)
    return req, prepare_chat(state, chat)


def _count_tokens(state: ServerState, body: bytes) -> dict[str, int]:
    """The prompt tokens /v1/messages would give the engine for this conversation (its usage's
    input_tokens), counted even where they pass the context."""
    text, _ = render_prompt(chat_request(_parse(CountTokensRequest, state, body)), state.tokenizer)
    return {"input_tokens": len(state.tokenizer.encode(text, add_special_tokens=False))}


def _tool_use_id(call_id: str) -> str:
    return TOOL_USE_ID_PREFIX + call_id.removeprefix("call_")


def _content(parsed: Cmd4Stream, thinking: bool) -> list[dict[str, Any]]:
    """The answer's content blocks: its reasoning (`thinking`: the request turned thinking on), its text,
    its tool calls. A call cut off by max_tokens has no input object yet and is left out."""
    blocks: list[dict[str, Any]] = []
    if thinking and parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning, "signature": ""})
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    for call in parsed.calls:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            continue
        blocks.append({"type": "tool_use", "id": _tool_use_id(call.id), "name": call.name, "input": arguments})
    return blocks


def _stop(finish: str | None, matched: str | None, called: bool) -> dict[str, str | None]:
    """stop_reason and stop_sequence of an answer that ended with the engine's `finish`, a stop sequence
    (`matched`) or not, with a tool call or not."""
    if finish == "length":
        reason = "max_tokens"
    elif called:
        reason = "tool_use"
    elif matched is not None:
        reason = "stop_sequence"
    else:
        reason = "end_turn"
    return {"stop_reason": reason, "stop_sequence": matched if reason == "stop_sequence" else None}


async def _stream(prompt: ChatPrompt, thinking: bool, run: ChoiceRun, head: dict, info: dict) -> AsyncIterator:
    """Anthropic's events: message_start, each block's start, deltas and stop, message_delta (the stop
    reason and output tokens) and message_stop; a failure is an `error` event that ends the stream."""
    usage = {"input_tokens": len(prompt.token_ids), "output_tokens": 0}
    message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield {"type": "message_start", "message": message}
    parser = Cmd4Stream(prompt.thinking, prompt.policy.calls_allowed)
    blocks = _BlockEvents(thinking)
    pieces = run.pieces()
    try:
        async for piece in pieces:
            reason = piece.finish_reason
            delta = parser.feed(piece.text)
            if reason is not None:
                tail = parser.finish(complete=reason != "length")
                delta = Delta(
                    delta.reasoning + tail.reasoning, delta.content + tail.content, delta.tool_calls + tail.tool_calls
                )
            try:
                for call in delta.tool_calls:
                    if "id" in call:
                        prompt.policy.check_name(call["function"]["name"])
                if reason not in (None, "error"):
                    prompt.policy.check_final(parser)
            except ToolCallError as e:
                yield anthropic_error_body(str(e), "api_error")
                return
            for event in blocks.feed(delta):
                yield event
            if reason is None:
                continue
            if reason == "error":
                yield anthropic_error_body(f"generation failed: {piece.error}", "api_error")
                return
            for event in blocks.close():
                yield event
            stop = _stop(reason, run.stops.matched, bool(parser.calls))
            yield {"type": "message_delta", "delta": stop, "usage": {"output_tokens": len(run.token_ids)}}
            yield {"type": "message_stop"}
    finally:
        await pieces.aclose()  # closed early (the client went away): the engine request is cancelled now
        note(info, [run])


class _BlockEvents:
    """A streamed answer's deltas as content-block events: a block starts where the kind of output
    changes (thinking, text, each tool call) and stops where the next starts or the answer ends. A
    call's arguments that come after its block has stopped can only be the "{}" of a call that has
    none (mk.text.toolcalls), which its start's empty input already says: they are dropped."""

    def __init__(self, thinking: bool) -> None:
        self.thinking = thinking  # the request turned thinking on: reasoning is shown
        self.index = -1  # of the last block started
        self.open: str | None = None  # the open block's kind: "thinking", "text", or "tool_use"
        self.call_blocks: dict[int, int] = {}  # a tool call's index -> its block's

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning and self.thinking:
            if self.open != "thinking":
                events += self._start({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._delta({"type": "thinking_delta", "thinking": delta.reasoning}))
        if delta.content:
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls:
            function = call["function"]
            if "id" in call:
                block = {"type": "tool_use", "id": _tool_use_id(call["id"]), "name": function["name"], "input": {}}
                events += self._start(block)
                self.call_blocks[call["index"]] = self.index
            arguments = function.get("arguments")
            if arguments and self.call_blocks.get(call["index"]) == self.index and self.open == "tool_use":
                events.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
        return events

    def close(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.index += 1
        self.open = block["type"]
        return [*events, {"type": "content_block_start", "index": self.index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}
