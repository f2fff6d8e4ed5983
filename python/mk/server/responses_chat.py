"""A Responses request, with the conversation its previous_response_id carries, as the chat request mk
already serves (mk.server.schemas.ChatRequest), so that /v1/responses goes through the chat route's
template, tool-call grammar and sampling.

The mapping: `instructions` is a first system message (it is not carried to the next turn, as in OpenAI's
API). User, system and developer messages are those messages. An assistant message, reasoning items and
function_call items that follow one another make one assistant turn: the message its content, the
reasoning its reasoning_content (a reasoning item's content, else its summary), the calls its tool_calls
(`call_id` as the id); a reasoning item or an assistant message after a turn's text or calls starts the
next turn. A function_call_output is the tool message answering its call. Tools are function tools;
tool_choice, parallel_tool_calls, max_output_tokens, temperature and top_p are the chat's fields of those
meanings, `text.format` its response_format, and `reasoning.effort` "none" turns thinking off.

The call/output linkage is checked here, in the Responses API's terms (each function_call answered by a
function_call_output before the next message), so that a 400 names the input item at fault; the calls
of earlier turns need not name a tool of this request (an agent may hand off to one with other tools).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import TypeAdapter

from mk.server.errors import APIError, bad_request
from mk.server.responses_schemas import (
    FunctionCallItem,
    FunctionToolChoice,
    InputItem,
    InputTokensRequest,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextFormat,
)
from mk.server.schemas import ChatRequest

# Between the summary parts of a reasoning item, and between the reasoning items of one turn.
REASONING_SEPARATOR = "\n\n"
# The chat request's fields that are the Responses request's of another name (an error from the chat
# route's checks names the field the client sent).
RESPONSES_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
}

_ITEMS = TypeAdapter(list[InputItem])


def chat_request(req: InputTokensRequest, earlier: tuple = ()) -> ChatRequest:
    """The chat request that means what `req` means after the `earlier` items (the conversation of the
    response it follows, that response's output included; a ResponsesRequest brings its sampling
    settings); 400 naming the Responses field for a conversation the chat route could not take."""
    if not earlier and not req.input:
        raise bad_request("input is empty: send at least one input item, or a previous_response_id", "input")
    messages: list[dict[str, Any]] = [{"role": "system", "content": req.instructions}] if req.instructions else []
    messages += _conversation([*earlier, *req.input], len(earlier))
    chat: dict[str, Any] = {
        "messages": messages,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "include_reasoning": True,
    }
    if isinstance(req, ResponsesRequest):
        chat.update(max_tokens=req.max_output_tokens, temperature=req.temperature, top_p=req.top_p)
    if req.reasoning is not None and req.reasoning.effort == "none":
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    if req.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in req.tools
        ]
    if isinstance(req.tool_choice, FunctionToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": req.tool_choice.name}}
    elif req.tool_choice is not None:
        chat["tool_choice"] = req.tool_choice
    if req.text is not None:
        chat["response_format"] = _response_format(req.text.format)
    return ChatRequest.model_validate(chat)


def in_responses_terms(e: APIError) -> APIError:
    """`e`, raised by the chat route's checks, naming the Responses field instead of the chat's."""
    head = re.split(r"[.\[]", e.param or "", maxsplit=1)[0]
    if head not in RESPONSES_FIELDS:
        return e
    field = RESPONSES_FIELDS[head]
    message = field + e.message.removeprefix(e.param) if e.message.startswith(e.param) else e.message
    return APIError(e.status, message, field, e.code, e.headers, e.type)


def carried_output(output: list[dict[str, Any]]) -> tuple:
    """A response's output items as input items of the turn that follows it; a call cut off by
    max_output_tokens was never made (its arguments are not whole) and is left out."""
    items = _ITEMS.validate_python(output)
    return tuple(i for i in items if not (isinstance(i, FunctionCallItem) and i.status == "incomplete"))


def _response_format(fmt: TextFormat) -> dict[str, Any] | None:
    if fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}


def _parts(parts: list) -> list[dict[str, str]]:
    return [{"type": "text", "text": p.text} for p in parts]


def _reasoning(item: ReasoningItem) -> str:
    if item.content:
        return "".join(c.text for c in item.content)
    return REASONING_SEPARATOR.join(s.text for s in item.summary)


def _conversation(items: list, first_new: int) -> list[dict[str, Any]]:
    """Chat messages of the items (those before `first_new` are the earlier turns'); 400 for a
    function_call whose arguments are not a JSON object or whose call_id another call of its turn has,
    a function_call_output that answers no open call, or a call left unanswered."""

    def where(i: int) -> str:
        return f"input[{i - first_new}]" if i >= first_new else "previous_response_id"

    out: list[dict[str, Any]] = []
    turn: dict[str, Any] | None = None  # the assistant turn being built
    open_calls: list[str] = []  # call_ids of the last assistant turn not yet answered
    for i, item in enumerate(items):
        if item.type == "function_call_output":
            if item.call_id not in open_calls:
                raise bad_request(
                    f"{where(i)}: no function_call with call_id {item.call_id!r} awaits an output here",
                    f"{where(i)}.call_id",
                )
            open_calls.remove(item.call_id)
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _parts(item.output)})
            turn = None
            continue
        same_turn = turn is not None and item.type == "function_call"
        if open_calls and not same_turn:
            raise bad_request(
                f"{where(i)}: the function calls {open_calls} have no function_call_output before this item",
                where(i),
            )
        if isinstance(item, MessageItem) and item.role != "assistant":
            out.append({"role": item.role, "content": _parts(item.content)})
            turn = None
            continue
        if turn is None or (item.type != "function_call" and (turn["content"] or "tool_calls" in turn)):
            turn = {"role": "assistant", "content": []}
            out.append(turn)
        if isinstance(item, ReasoningItem):
            before = turn.get("reasoning_content")
            turn["reasoning_content"] = (
                _reasoning(item) if before is None else before + REASONING_SEPARATOR + _reasoning(item)
            )
        elif isinstance(item, MessageItem):
            turn["content"] = _parts(item.content)
        else:
            _check_call(item, where(i), open_calls)
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            turn.setdefault("tool_calls", []).append(call)
            open_calls.append(item.call_id)
    if open_calls:
        raise bad_request(f"the function calls {open_calls} have no function_call_output", "input")
    return out


def _check_call(item: FunctionCallItem, where: str, open_calls: list[str]) -> None:
    if item.call_id in open_calls:
        raise bad_request(f"{where}: call_id {item.call_id!r} appears twice in one turn", f"{where}.call_id")
    try:
        arguments = json.loads(item.arguments)
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        raise bad_request(f"{where}: the arguments of {item.name!r} are not a JSON object", f"{where}.arguments")
