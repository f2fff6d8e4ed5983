"""An Anthropic Messages request as the chat request mk already serves (mk.server.schemas.ChatRequest),
so that /v1/messages goes through the chat route's template, tool-call grammar and sampling.

The mapping: `system` is a system message. An assistant message's text blocks are its content, its
thinking blocks its reasoning_content, its tool_use blocks its tool_calls (`input` as the arguments).
A user message's tool_result blocks become tool messages answering those calls, in their order, then its
text (if any) a user message; a failed call's result (`is_error`) is marked by TOOL_ERROR_PREFIX, since
the template has no place of its own for it. Tools are function tools (`input_schema` as parameters);
tool_choice auto, any, tool and none are "auto", "required", the named function and "none", and
`disable_parallel_tool_use` is parallel_tool_calls: false. Thinking is off unless the request turns it
on, as in Anthropic's API: off, the template's generation prompt closes the thinking block.

The tool_use/tool_result linkage is checked here, in Anthropic's terms (every tool_use answered by a
tool_result in the very next message). A last message from the assistant is a prefilled answer: the
model continues its text (the chat request's `continue_final_message`), and the answer leaves it out,
as in Anthropic's API; one that is empty asks for an answer as if it were not there, and one with a
tool_use block, or beside thinking, is refused.
"""

from __future__ import annotations

from typing import Any

from mk.server.anthropic_schemas import AnthropicMessage, CountTokensRequest, MessagesRequest, TextBlock
from mk.server.errors import bad_request
from mk.server.schemas import ChatRequest

# Between the text blocks of one message (and of a system prompt or a tool result): separate blocks
# stay separate paragraphs.
BLOCK_SEPARATOR = "\n\n"
# Put before the text of a tool_result whose `is_error` is true.
TOOL_ERROR_PREFIX = "Error: "


def chat_request(req: CountTokensRequest) -> ChatRequest:
    """The chat request that means what `req` means (a MessagesRequest brings its sampling settings);
    400 naming the Anthropic field for a conversation the chat route could not take."""
    tool_names = {t.name for t in req.tools or []}
    messages = [{"role": "system", "content": _text(req.system)}] if req.system else []
    messages += _conversation(req.messages, tool_names if req.tools else None)
    thinking = req.thinking is not None and req.thinking.type != "disabled"
    prefilled = messages[-1]["role"] == "assistant"
    if prefilled and thinking:
        raise bad_request("a prefilled answer (a last message from the assistant) cannot go with thinking", "thinking")
    chat: dict[str, Any] = {
        "messages": messages,
        "include_reasoning": thinking,
        "chat_template_kwargs": {} if thinking else {"enable_thinking": False},
        "continue_final_message": prefilled,
    }
    if req.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.input_schema},
            }
            for t in req.tools
        ]
    if req.tool_choice is not None:
        chat.update(_tool_choice(req, tool_names))
    if isinstance(req, MessagesRequest):
        chat.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
        )
        if (answer := req.answer_format()) is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"schema": answer.json_schema}}
    return ChatRequest.model_validate(chat)


def _tool_choice(req: CountTokensRequest, tool_names: set[str]) -> dict[str, Any]:
    choice = req.tool_choice
    if choice.type in ("any", "tool") and not tool_names:
        raise bad_request(f"tool_choice is {choice.type!r} but the request has no tools", "tool_choice")
    out: dict[str, Any] = {"parallel_tool_calls": not choice.disable_parallel_tool_use}
    if choice.type == "tool":
        if choice.name is None:
            raise bad_request("a tool_choice of type 'tool' needs the 'name' of a tool", "tool_choice.name")
        if choice.name not in tool_names:
            raise bad_request(f"tool_choice names {choice.name!r}, which is not among tools", "tool_choice.name")
        out["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return out


def _text(blocks: list[TextBlock]) -> str:
    return BLOCK_SEPARATOR.join(b.text for b in blocks)


def _conversation(messages: list[AnthropicMessage], tool_names: set[str] | None) -> list[dict[str, Any]]:
    """Chat messages of the Anthropic ones (an empty final assistant message left out); 400 for a
    block in the wrong role, a tool_use of no offered tool, a tool_use left unanswered by the next
    message, a tool_result that answers none of the previous message's, or a final assistant message
    that is not text alone."""
    out: list[dict[str, Any]] = []
    unanswered: list[str] = []  # tool_use ids of the previous assistant message not yet answered
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.role == "assistant":
            message = _assistant(m, where, tool_names)
            if i == len(messages) - 1:
                if set(message) != {"role", "content"}:
                    raise bad_request(f"{where}: a prefilled answer (the last message) holds text blocks only", where)
                if not message["content"]:
                    continue
            out.append(message)
            unanswered = [c["id"] for c in out[-1].get("tool_calls", [])]
            continue
        texts = []
        for j, block in enumerate(m.content):
            if block.type == "tool_result":
                if block.tool_use_id not in unanswered:
                    raise bad_request(
                        f"{where}.content[{j}]: tool_use_id {block.tool_use_id!r} answers no tool_use block of "
                        "the previous message, or one already answered",
                        f"{where}.content[{j}].tool_use_id",
                    )
                unanswered.remove(block.tool_use_id)
                text = _text(block.content)
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id,
                        "content": TOOL_ERROR_PREFIX + text if block.is_error else text,
                    }
                )
            elif block.type == "text":
                texts.append(block)
            else:
                at = f"{where}.content[{j}]"
                raise bad_request(f"{at}: a user message cannot hold a {block.type} block", at)
        if unanswered:
            raise bad_request(
                f"{where}: the tool_use blocks {unanswered} of messages[{i - 1}] have no tool_result block here; "
                "each tool_use must be answered in the next message",
                where,
            )
        if texts or not out or out[-1]["role"] != "tool":
            out.append({"role": "user", "content": _text(texts)})
    return out


def _assistant(m: AnthropicMessage, where: str, tool_names: set[str] | None) -> dict[str, Any]:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(m.content):
        at = f"{where}.content[{j}]"
        if block.type == "text":
            texts.append(block)
        elif block.type == "thinking":
            thoughts.append(block.thinking)
        elif block.type == "tool_use":
            if tool_names is not None and block.name not in tool_names:
                raise bad_request(f"{at}: tool_use {block.name!r} names no tool of the request", f"{at}.name")
            if any(c["id"] == block.id for c in calls):
                raise bad_request(f"{at}: tool_use id {block.id!r} appears twice", f"{at}.id")
            function = {"name": block.name, "arguments": block.input}
            calls.append({"id": block.id, "type": "function", "function": function})
        else:
            raise bad_request(f"{at}: an assistant message cannot hold a {block.type} block", at)
    message: dict[str, Any] = {"role": "assistant", "content": _text(texts)}
    if thoughts:
        message["reasoning_content"] = BLOCK_SEPARATOR.join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message
