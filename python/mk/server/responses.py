"""POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/input_tokens: the OpenAI
Responses API over the chat route's pieces. The request, after the conversation of the response its
previous_response_id names, becomes a chat request (mk.server.responses_chat) that is rendered by the
same template, held to the same tool-call grammar, sampled with the same settings and run as one engine
request. Its answer comes back as output items (the model's reasoning, its message, its function calls),
whole or as the API's typed stream events, and is stored (mk.server.responses_store) unless the request
says `store: false`.

A streamed and a whole answer are built by the same code (_Output), so they are the same items.
"""

from __future__ import annotations

import copy
import itertools
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from mk.server.chat import PreparedChat, prepare_chat, render_prompt
from mk.server.errors import APIError, bad_request
from mk.server.generate import ChoiceRun, collect, note, start_chat
from mk.server.http import dumps, parse_json
from mk.server.params import check_grammars
from mk.server.responses_chat import carried_output, chat_request, in_responses_terms
from mk.server.responses_schemas import (
    IGNORED_FIELDS,
    REFUSED_FIELDS,
    FunctionToolChoice,
    InputTokensRequest,
    ResponsesRequest,
)
from mk.server.responses_store import MAX_RESPONSES, StoredResponse
from mk.server.schemas import validate
from mk.server.state import ServerState
from mk.text.toolcalls import END_THINKING, Cmd4Stream, Delta, ToolCallError

log = logging.getLogger("mk.server")
R = TypeVar("R", bound=InputTokensRequest)

RESPONSE_ID_PREFIX = "resp_"
# An output item's id starts with its kind's prefix, as in OpenAI's API.
ITEM_ID_PREFIXES = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_"}
# What a response echoes of the settings a request left out.
DEFAULT_TEMPERATURE = DEFAULT_TOP_P = 1.0


@dataclass(slots=True)
class _Prepared:
    req: ResponsesRequest
    chat: PreparedChat
    conversation: tuple  # the input items of the whole conversation, the earlier turns' included


async def responses(state: ServerState, body: bytes, info: dict) -> dict | AsyncIterator:
    arrival = time.monotonic()
    prepared = await state.offload.run(len(body), _prepare, state, body)
    rid = RESPONSE_ID_PREFIX + info["id"]
    try:
        (run,) = start_chat(state, prepared.chat, rid, arrival, info)
    except APIError as e:
        raise in_responses_terms(e) from None
    answer = _Answer(state, prepared, rid, run, len(body))
    if prepared.req.stream:
        return answer.events(info)
    return await answer.whole(info)


async def input_tokens(state: ServerState, body: bytes, info: dict) -> dict[str, Any]:
    """POST /v1/responses/input_tokens: the prompt tokens of a request's conversation."""
    return await state.offload.run(len(body), _count_input_tokens, state, body)


def stored_response(state: ServerState, method: str, response_id: str) -> dict[str, Any]:
    """GET /v1/responses/{id} (the stored response) and DELETE (forget it); 404 for one not stored."""
    if method == "GET":
        stored = state.responses.get(response_id)
        if stored is None:
            raise _not_stored(response_id)
        return stored.response
    if method == "DELETE":
        if not state.responses.delete(response_id):
            raise _not_stored(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
    raise APIError(405, f"{method} is not allowed on /v1/responses/{{id}}", code="method_not_allowed")


def _not_stored(response_id: str, param: str | None = None, code: str | None = None) -> APIError:
    """The 404 of a response id the store does not hold."""
    why = f"it was made with store false, or is gone: the server keeps the last {MAX_RESPONSES} at most"
    what = "previous response" if param else "response"
    return APIError(404, f"{what} with id {response_id!r} not found ({why})", param, code, type="invalid_request_error")


def _prepare(state: ServerState, body: bytes) -> _Prepared:
    """The request, its conversation (after the previous response's) rendered and tokenized as a chat,
    its budget and grammar (on a thread of mk.server.offload, as the chat route's)."""
    req, earlier = _parse(ResponsesRequest, state, body)
    try:
        chat = chat_request(req, earlier)
        check_grammars(chat)
        prepared = prepare_chat(state, chat, past_calls_need_tools=False)
    except APIError as e:
        raise in_responses_terms(e) from None
    return _Prepared(req, prepared, (*earlier, *req.input))


def _count_input_tokens(state: ServerState, body: bytes) -> dict[str, Any]:
    """The prompt tokens /v1/responses would give the engine for this conversation (its usage's
    input_tokens), counted even where they pass the context."""
    req, earlier = _parse(InputTokensRequest, state, body)
    try:
        text, _ = render_prompt(chat_request(req, earlier), state.tokenizer, past_calls_need_tools=False)
    except APIError as e:
        raise in_responses_terms(e) from None
    return {
        "object": "response.input_tokens",
        "input_tokens": len(state.tokenizer.encode(text, add_special_tokens=False)),
    }


def _parse(cls: type[R], state: ServerState, body: bytes) -> tuple[R, tuple]:
    """The body as `cls`, and the conversation of the stored response its previous_response_id names
    (input and output items; none without one)."""
    obj = parse_json(body)
    refused = [name for name in REFUSED_FIELDS if isinstance(obj, dict) and obj.get(name) is not None]
    if refused:
        raise bad_request(REFUSED_FIELDS[refused[0]], refused[0])
    req = validate(cls, obj, IGNORED_FIELDS)
    state.check_model(req.model)
    if req.previous_response_id is None:
        return req, ()
    previous = state.responses.get(req.previous_response_id)
    if previous is None:
        raise _not_stored(req.previous_response_id, "previous_response_id", "previous_response_not_found")
    return req, previous.conversation + previous.output


class _Answer:
    """One response: the engine request's output as output items, the response object around them,
    whole or as events, and its storing."""

    def __init__(self, state: ServerState, prepared: _Prepared, rid: str, run: ChoiceRun, body_bytes: int) -> None:
        self.state = state
        self.prepared = prepared
        self.rid = rid
        self.run = run
        self.body_bytes = body_bytes
        self.created_at = int(time.time())
        self.parser = Cmd4Stream(prepared.chat.prompt.thinking, prepared.chat.prompt.policy.calls_allowed)
        self.output = _Output()

    async def whole(self, info: dict) -> dict[str, Any]:
        """The finished response (a failed generation is a 500, output that breaks the tool_choice a 502)."""
        got = await collect(self.run)
        note(info, [self.run])
        complete = got.finish_reason != "length"
        delta = _joined(self.parser.feed(got.text), self.parser.finish(complete))
        try:
            self.prepared.chat.prompt.policy.check_final(self.parser)
        except ToolCallError as e:
            raise APIError(502, str(e), type="tool_call_generation_error") from None
        self.output.feed(delta)
        self.output.finish(complete)
        return self._finished(complete)

    async def events(self, info: dict) -> AsyncIterator[dict[str, Any]]:
        """The API's stream: response.created and .in_progress, each output item's events as the model
        writes it, then response.completed (response.incomplete where max_output_tokens cut it). A
        failure is an `error` event then response.failed."""
        numbers = itertools.count()

        def numbered(event: dict[str, Any]) -> dict[str, Any]:
            return {**event, "sequence_number": next(numbers)}

        policy = self.prepared.chat.prompt.policy
        started = self._response("in_progress", None)
        yield numbered({"type": "response.created", "response": started})
        yield numbered({"type": "response.in_progress", "response": started})
        pieces = self.run.pieces()
        try:
            async for piece in pieces:
                reason = piece.finish_reason
                delta = self.parser.feed(piece.text)
                if reason is not None:
                    delta = _joined(delta, self.parser.finish(complete=reason != "length"))
                try:
                    for call in delta.tool_calls:
                        if "id" in call:
                            policy.check_name(call["function"]["name"])
                    if reason not in (None, "error"):
                        policy.check_final(self.parser)
                except ToolCallError as e:
                    for event in self._failed(str(e), "tool_call_generation_error"):
                        yield numbered(event)
                    return
                for event in self.output.feed(delta):
                    yield numbered(event)
                if reason == "error":
                    for event in self._failed(f"generation failed: {piece.error}", "generation_error"):
                        yield numbered(event)
                    return
                if reason is not None:
                    for event in self.output.finish(reason != "length"):
                        yield numbered(event)
                    response = self._finished(reason != "length")
                    yield numbered({"type": f"response.{response['status']}", "response": response})
        except Exception:  # the stream has started: the failure is told in-band
            log.exception("stream of request %s failed", info["id"])
            for event in self._failed(f"internal error (request {info['id']}; see the server log)", "server_error"):
                yield numbered(event)
        finally:
            await pieces.aclose()  # closed early (the client went away): the engine request is cancelled now
            note(info, [self.run])

    def _finished(self, complete: bool) -> dict[str, Any]:
        """The response object of the finished output, stored unless the request said not to."""
        response = self._response("completed" if complete else "incomplete", self._usage())
        if self.prepared.req.store is not False:
            stored = StoredResponse(
                response,
                self.prepared.conversation,
                carried_output(response["output"]),
                self.body_bytes + len(dumps(response)),
            )
            self.state.responses.put(stored)
        return response

    def _failed(self, message: str, code: str) -> list[dict[str, Any]]:
        error = {"code": code, "message": message}
        response = {**self._response("failed", self._usage()), "error": error}
        return [{"type": "error", **error, "param": None}, {"type": "response.failed", "response": response}]

    def _usage(self) -> dict[str, Any]:
        prompt_tokens, output_tokens = len(self.prepared.chat.prompt.token_ids), len(self.run.token_ids)
        return {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": self.run.cached_tokens},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": self._reasoning_tokens()},
            "total_tokens": prompt_tokens + output_tokens,
        }

    def _reasoning_tokens(self) -> int:
        """Tokens the model wrote inside the thinking block the prompt opened (its end marker included)."""
        if not self.prepared.chat.prompt.thinking:
            return 0
        end = self.state.tokenizer.hf.token_to_id(END_THINKING)
        ids = self.run.token_ids
        return ids.index(end) + 1 if end in ids else len(ids)

    def _response(self, status: str, usage: dict[str, Any] | None) -> dict[str, Any]:
        """The response object: the output so far and the settings it ran with, as the request gave them
        or as the defaults that applied."""
        req = self.prepared.req
        text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text else {"format": {"type": "text"}}
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.state.model_name,
            "output": copy.deepcopy(self.output.items),
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
            "store": req.store is not False,
            "temperature": DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
            "text": text,
            "tool_choice": _tool_choice(req),
            "tools": [
                {
                    "type": "function",
                    "name": t.name,
                    "description": t.description,
                    "parameters": t.parameters,
                    "strict": t.strict is not False,
                }
                for t in req.tools or []
            ],
            "top_p": DEFAULT_TOP_P if req.top_p is None else req.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": req.user,
        }


def _tool_choice(req: ResponsesRequest) -> str | dict[str, str]:
    if isinstance(req.tool_choice, FunctionToolChoice):
        return {"type": "function", "name": req.tool_choice.name}
    return req.tool_choice or "auto"


def _joined(first: Delta, then: Delta) -> Delta:
    return Delta(first.reasoning + then.reasoning, first.content + then.content, first.tool_calls + then.tool_calls)


def _item_id(kind: str) -> str:
    return ITEM_ID_PREFIXES[kind] + secrets.token_hex(12)


class _Output:
    """The answer's output items, built from the parser's deltas as they come, and the stream events
    that tell each step: an item starts where the kind of output changes (reasoning, the message, each
    function call) and is done where the next starts or the answer ends.

    A call whose arguments are still empty when the next item starts has none: its arguments are "{}"
    (the parser says so only at the end of the answer, where that call's item is done already)."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written, the last of `items`
        self.calls: dict[int, dict[str, Any]] = {}  # a tool call's index (the parser's) -> its item

    def feed(self, delta: Delta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            if not self._writing("reasoning"):
                part = {"type": "reasoning_text", "text": ""}
                item = {"type": "reasoning", "id": _item_id("reasoning"), "summary": [], "content": [part]}
                events += self._start(item)
            events.append(self._text("response.reasoning_text.delta", delta.reasoning))
        if delta.content:
            if not self._writing("message"):
                part = {"type": "output_text", "text": "", "annotations": []}
                events += self._start(_message([part]))
            events.append({**self._text("response.output_text.delta", delta.content), "logprobs": []})
        for call in delta.tool_calls:
            function = call["function"]
            if "id" in call:
                item = {
                    "type": "function_call",
                    "id": _item_id("function_call"),
                    "call_id": call["id"],
                    "name": function["name"],
                    "arguments": "",
                }
                events += self._start(item)
                self.calls[call["index"]] = item
            arguments = function.get("arguments")
            if arguments and self.calls.get(call["index"]) is self.open:
                events.append(self._arguments(arguments))
        return events

    def finish(self, complete: bool) -> list[dict[str, Any]]:
        """The events that end the output (`complete`: not cut off by max_output_tokens). An answer with
        neither text nor calls still has its (empty) message."""
        events = self._done("completed" if complete else "incomplete")
        if complete and not any(item["type"] != "reasoning" for item in self.items):
            events += self._start(_message([{"type": "output_text", "text": "", "annotations": []}]))
            events += self._done("completed")
        return events

    def _writing(self, kind: str) -> bool:
        return self.open is not None and self.open["type"] == kind

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _start(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._done("completed")
        self.items.append(item)
        self.open = item
        added = {**item, "status": "in_progress"}
        if "content" in item:
            added["content"] = []
        if item["type"] == "function_call":
            added["arguments"] = ""
        events.append({"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": added})
        if "content" in item:
            part = copy.deepcopy(item["content"][0])
            events.append({"type": "response.content_part.added", **self._where(), "content_index": 0, "part": part})
        return events

    def _text(self, kind: str, text: str) -> dict[str, Any]:
        self.open["content"][0]["text"] += text
        return {"type": kind, **self._where(), "content_index": 0, "delta": text}

    def _arguments(self, arguments: str) -> dict[str, Any]:
        self.open["arguments"] += arguments
        return {"type": "response.function_call_arguments.delta", **self._where(), "delta": arguments}

    def _done(self, status: str) -> list[dict[str, Any]]:
        """The events that end the open item, now of `status`."""
        item = self.open
        if item is None:
            return []
        events = []
        if item["type"] == "function_call":
            if status == "completed" and not item["arguments"]:
                events.append(self._arguments("{}"))
            done = {"type": "response.function_call_arguments.done", **self._where(), "name": item["name"]}
            events.append({**done, "arguments": item["arguments"]})
        else:
            part = copy.deepcopy(item["content"][0])
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            text_done = {"type": kind, **self._where(), "content_index": 0, "text": part["text"]}
            events.append({**text_done, "logprobs": []} if item["type"] == "message" else text_done)
            events.append({"type": "response.content_part.done", **self._where(), "content_index": 0, "part": part})
        item["status"] = status
        events.append(
            {"type": "response.output_item.done", "output_index": len(self.items) - 1, "item": copy.deepcopy(item)}
        )
        self.open = None
        return events


def _message(content: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": _item_id("message"), "role": "assistant", "content": content}
