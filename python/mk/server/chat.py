"""A chat request to prompt tokens: message checks, tool-call linkage, the checkpoint's chat template.

Tool-call ids: clients get unique `call_…` ids, but the model learned per-turn ids ("0", "1", ...), so
each assistant message's calls are renumbered that way (and the tool results that answer them) before
the template sees the history.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from mk.engine.sampling import ConstraintSpec
from mk.server.errors import bad_request
from mk.server.params import encode_prompt, max_new_tokens, prepared_constraint
from mk.server.schemas import ChatRequest, Message, NamedToolChoice, Tool
from mk.server.state import ServerState
from mk.text.tokenizer import TemplateError, Tokenizer
from mk.text.toolcalls import START_THINKING, ToolPolicy


@dataclass(slots=True)
class ChatPrompt:
    token_ids: list[int]
    thinking: bool  # the prompt opened a thinking block: the model starts by reasoning
    policy: ToolPolicy


@dataclass(slots=True)
class PreparedChat:
    """A chat request ready for the engine (the chat, Messages and Responses routes each make one of
    theirs): its prompt, its token budget and its grammar (tool calls, structured output)."""

    req: ChatRequest
    prompt: ChatPrompt
    max_tokens: int
    grammar: ConstraintSpec | None


def prepare_chat(state: ServerState, req: ChatRequest, past_calls_need_tools: bool = True) -> PreparedChat:
    """`req` (whose grammar inputs were checked: params.check_grammars) rendered and tokenized, its
    budget and grammar; 400 for what cannot be (on a thread of mk.server.offload: for a long
    conversation this takes seconds). `past_calls_need_tools` as render_chat's."""
    prompt = build_prompt(req, state.tokenizer, state.engine.max_context, past_calls_need_tools)
    max_tokens = max_new_tokens(req, len(prompt.token_ids), state.engine.max_context)
    return PreparedChat(req, prompt, max_tokens, prepared_constraint(state, req, prompt.thinking))


def build_prompt(
    req: ChatRequest, tokenizer: Tokenizer, max_context: int, past_calls_need_tools: bool = True
) -> ChatPrompt:
    """The conversation's prompt; 400 for broken tool-call linkage, a template that refuses it, or a
    prompt that leaves no room in `max_context` (mk.server.params.encode_prompt). `past_calls_need_tools`
    as render_chat's."""
    text, policy = render_prompt(req, tokenizer, past_calls_need_tools)
    ids = encode_prompt(req, tokenizer, text, max_context, special=False)  # the template wrote its own BOS
    return ChatPrompt(ids, text.endswith(START_THINKING), policy)


def render_prompt(req: ChatRequest, tokenizer: Tokenizer, past_calls_need_tools: bool = True) -> tuple[str, ToolPolicy]:
    """The chat request's prompt text, not yet tokenized, and what its tools allow (render_chat). With
    `continue_final_message`, the text ends with the last (assistant) message's text: the answer
    continues it."""
    kwargs: dict[str, Any] = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort == "none":
        kwargs.setdefault("enable_thinking", False)
    if not req.continue_final_message:
        return render_chat(
            tokenizer, req.messages, req.tools, req.tool_choice, kwargs, past_calls_need_tools=past_calls_need_tools
        )
    prefill = continued_text(req.messages)
    text, policy = render_chat(
        tokenizer, req.messages, req.tools, req.tool_choice, kwargs, False, past_calls_need_tools
    )
    # Where the template writes the message's text: rendered once more with a marker for it (the
    # text itself may also occur in what the template writes around it).
    marked = [*req.messages[:-1], req.messages[-1].model_copy(update={"content": _CONTINUE_HERE})]
    at = render_chat(tokenizer, marked, req.tools, req.tool_choice, kwargs, False, past_calls_need_tools)[0].rfind(
        _CONTINUE_HERE
    )
    if at < 0 or text[at : at + len(prefill)] != prefill:
        raise bad_request("the chat template does not write the final message's text as it is", "messages")
    return text[: at + len(prefill)], policy


_CONTINUE_HERE = "\x00mk: the continued message's text\x00"


def continued_text(messages: list[Message]) -> str:
    """The text of the assistant message a continued answer starts from (`continue_final_message`);
    400 where the last message is not one the answer can continue."""
    last = messages[-1]
    where = f"messages[{len(messages) - 1}]"
    if last.role != "assistant":
        raise bad_request(
            f"continue_final_message needs the last message to be the assistant's, not {last.role!r}", where
        )
    if last.tool_calls:
        raise bad_request(f"{where}: an answer cannot continue an assistant message that calls tools", where)
    prefill = _text(last.content)
    if not prefill:
        raise bad_request(f"{where}: continue_final_message needs the assistant message to have text", where)
    return prefill


def render_chat(
    tokenizer: Tokenizer,
    messages: list[Message],
    tools: list[Tool] | None,
    tool_choice: Any = None,
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    past_calls_need_tools: bool = True,
) -> tuple[str, ToolPolicy]:
    """The conversation's prompt text (it carries its template's BOS) and what its tools allow: the one
    rendering every route shares (chat completions, messages, responses, tokenize). 400 for two tools of
    one name, a tool_choice the tools cannot meet, broken tool-call linkage, a past tool call that names
    none of the request's tools (unless not `past_calls_need_tools`: the Responses API lets an agent's
    tools change from turn to turn), or a template that refuses it."""
    names = [t.function.name for t in tools or []]
    if len(set(names)) != len(names):
        raise bad_request("two tools have the same name", "tools")
    policy = _policy(tool_choice, names)
    kwargs: dict[str, Any] = dict(template_kwargs or {})
    if isinstance(tool_choice, NamedToolChoice):
        kwargs["tool_choice"] = tool_choice.model_dump()
    elif tool_choice in ("none", "required"):
        kwargs["tool_choice"] = tool_choice
    schemas = [t.model_dump(exclude_none=True) for t in tools] if tools else None
    history = _history(messages, set(names) if tools and past_calls_need_tools else None)
    try:
        text = tokenizer.apply_chat_template(history, schemas, add_generation_prompt=add_generation_prompt, **kwargs)
    except TemplateError as e:
        raise bad_request(str(e), "messages") from None
    return text, policy


def _policy(choice: Any, names: list[str]) -> ToolPolicy:
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among tools", "tool_choice")
        return ToolPolicy(names, "function", choice.function.name)
    if choice == "required" and not names:
        raise bad_request("tool_choice is 'required' but the request has no tools", "tool_choice")
    return ToolPolicy(names, choice or ("auto" if names else "none"))


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def _history(messages: list[Message], tool_names: set[str] | None) -> list[dict[str, Any]]:
    """Template-ready messages; 400 for broken tool-call linkage."""
    out: list[dict[str, Any]] = []
    open_calls: dict[str, str] = {}  # client id -> per-turn id, for calls not yet answered
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if m.content is None and m.role != "assistant":
            raise bad_request(f"{where}: a {m.role} message needs content", f"{where}.content")
        if open_calls and m.role != "tool":
            raise bad_request(
                f"{where}: the tool calls {sorted(open_calls)} of the previous assistant message have no tool "
                "message answering them",
                "messages",
            )
        if m.role == "tool":
            if not m.tool_call_id:
                raise bad_request(f"{where}: a tool message needs a tool_call_id", f"{where}.tool_call_id")
            if m.tool_call_id not in open_calls:
                raise bad_request(
                    f"{where}: tool_call_id {m.tool_call_id!r} does not answer an open call of the preceding "
                    "assistant message",
                    f"{where}.tool_call_id",
                )
            msg = {"role": "tool", "tool_call_id": open_calls.pop(m.tool_call_id), "content": _text(m.content)}
            if m.name:
                msg["name"] = m.name
            out.append(msg)
        elif m.role == "assistant":
            out.append(_assistant(m, where, tool_names, open_calls))
        else:
            out.append({"role": "system" if m.role == "developer" else m.role, "content": _text(m.content)})
    if open_calls:
        raise bad_request(
            f"the tool calls {sorted(open_calls)} of the last assistant message have no tool message answering them",
            "messages",
        )
    return out


def _assistant(m: Message, where: str, tool_names: set[str] | None, open_calls: dict[str, str]) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": _text(m.content)}
    thinking = m.reasoning_content or m.reasoning
    if thinking:
        msg["reasoning_content"] = thinking
    calls = []
    for j, call in enumerate(m.tool_calls or []):
        f = call.function
        if tool_names is not None and f.name not in tool_names:
            raise bad_request(f"{where}: tool call {f.name!r} names no tool of the request", f"{where}.tool_calls")
        if call.id in open_calls:
            raise bad_request(f"{where}: tool call id {call.id!r} appears twice", f"{where}.tool_calls")
        args = f.arguments
        if isinstance(args, str):
            try:
                decoded = json.loads(args)
            except json.JSONDecodeError:
                raise bad_request(
                    f"{where}: the arguments of {f.name!r} are not valid JSON", f"{where}.tool_calls"
                ) from None
            if not isinstance(decoded, dict):
                raise bad_request(f"{where}: the arguments of {f.name!r} are not a JSON object", f"{where}.tool_calls")
        else:
            args = json.dumps(args, ensure_ascii=False)
        open_calls[call.id] = str(j)
        calls.append({"id": str(j), "type": "function", "function": {"name": f.name, "arguments": args}})
    if calls:
        msg["tool_calls"] = calls
    return msg
