"""The model's Cohere "cmd4" output as OpenAI chat fields: reasoning, content and tool calls.

The model writes `…thinking…<|END_THINKING|>` then either `<|START_RESPONSE|>answer<|END_RESPONSE|>` or
`<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "f", "parameters": {...}}, …]<|END_ACTION|>` (the
generation prompt opens the thinking block). Cohere's own parser, `cohere_melody`, splits the text; this
module turns its results into OpenAI-style deltas (a call's id and name first, then its argument
fragments) and checks the finished calls against the request's tools and tool_choice.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from cohere_melody import PyFilter, PyFilterOptions

START_THINKING = "<|START_THINKING|>"
END_THINKING = "<|END_THINKING|>"
START_ACTION = "<|START_ACTION|>"
END_ACTION = "<|END_ACTION|>"
ANSWER_STARTS = ("<|START_RESPONSE|>", "<|START_TEXT|>")
ANSWER_ENDS = ("<|END_RESPONSE|>", "<|END_TEXT|>")
# The special tokens that mark the sections of an answer: the only ones whose text a chat keeps.
MARKERS = (START_THINKING, END_THINKING, START_ACTION, END_ACTION, *ANSWER_STARTS, *ANSWER_ENDS)


class ToolCallError(ValueError):
    """The model's tool calls are malformed or break the request's tool_choice."""


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""


@dataclass(slots=True)
class Delta:
    """What one piece of model text added. tool_calls holds OpenAI delta objects."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class Cmd4Stream:
    """Incremental parser: `feed` decoded text (with the MARKERS' texts) as it is generated, `finish` at the end.

    `thinking=False` when the prompt already closed the thinking block (the model starts in the answer).
    `tools=False` drops tool calls (no tools offered, or tool_choice "none").
    """

    def __init__(self, thinking: bool = True, tools: bool = True) -> None:
        options = PyFilterOptions().cmd4().stream_tool_actions()
        if not thinking:
            options = options.start_in_answer()
        self._filter = PyFilter(options)
        self._thinking = thinking
        self._tools = tools
        self.reasoning = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self.action_problem: str | None = None  # why the raw tool-call block is malformed, if it is
        self.complete = True  # False once `finish` was told the output was cut off
        self._raw = ""  # all text fed: melody skips malformed calls silently, so the block is checked again
        self._by_melody: dict[int, int] = {}  # melody's call index -> ours, once the name is known
        self._pending: dict[int, list[str]] = {}  # melody index -> [id, arguments so far] before the name

    def feed(self, text: str) -> Delta:
        self._raw += text
        return self._take(self._filter.write_decoded(text)) if text else Delta()

    def finish(self, complete: bool = True) -> Delta:
        """The rest, at the end of the output; `complete=False`: cut off (max_tokens), so a call with no
        arguments yet stays without them."""
        self.complete = complete
        delta = self._take(self._filter.flush_partials())
        # melody right-trims the answer; the text the model wrote ends as it ends (as completions do).
        kept = _trailing_whitespace(_answer_text(self._raw, self._thinking))
        missing = next(kept[j:] for j in range(len(kept), -1, -1) if self.content.endswith(kept[:j]))
        self.content += missing
        delta.content += missing
        if START_ACTION in self._raw:
            self.action_problem = _check_action(self._raw.split(START_ACTION, 1)[1].split(END_ACTION, 1)[0])
        for i, call in enumerate(self.calls if complete else ()):
            if not call.arguments.strip():  # `"parameters": {}` comes through as no arguments at all
                call.arguments = "{}"
                delta.tool_calls.append({"index": i, "function": {"arguments": "{}"}})
        return delta

    def _take(self, result: Any) -> Delta:
        delta = Delta(reasoning=result.reasoning or "", content=result.content or "")
        self.reasoning += delta.reasoning
        self.content += delta.content
        for piece in result.tool_calls:
            if not self._tools:
                continue
            ours = self._by_melody.get(piece.index)
            if ours is None:
                pending = self._pending.setdefault(piece.index, ["", ""])
                pending[0] = pending[0] or piece.id
                pending[1] += piece.arguments
                if not piece.name:
                    continue
                ours = len(self.calls)
                self._by_melody[piece.index] = ours
                del self._pending[piece.index]
                call = ToolCall(new_call_id(), piece.name, pending[1])
                self.calls.append(call)
                function = {"name": call.name, "arguments": call.arguments}
                delta.tool_calls.append({"index": ours, "id": call.id, "type": "function", "function": function})
            elif piece.arguments:
                self.calls[ours].arguments += piece.arguments
                delta.tool_calls.append({"index": ours, "function": {"arguments": piece.arguments}})
        return delta


def _answer_text(raw: str, thinking: bool) -> str:
    """The answer section of the model's raw output: after the thinking block, inside the response
    markers when there are any, before an action block."""
    if thinking:
        _, sep, raw = raw.partition(END_THINKING)
        if not sep:
            return ""
    for marker in ANSWER_STARTS:
        if marker in raw:
            raw = raw.split(marker, 1)[1]
            break
    for marker in (*ANSWER_ENDS, START_ACTION):
        raw = raw.split(marker, 1)[0]
    return raw


def _trailing_whitespace(text: str) -> str:
    return text[len(text.rstrip()) :]


class ContentTokens:
    """Which generated tokens are the answer's text, fed in order: the ones chat logprobs list, so
    that their texts join to `content` (no thinking, no action block, no control tokens)."""

    def __init__(self, tokenizer: Any, thinking: bool) -> None:
        self._tokenizer = tokenizer
        self._section = "thinking" if thinking else "answer"

    def take(self, tokens: list) -> list:
        """The content tokens among `tokens` ((id, ...) tuples)."""
        out = []
        for token in tokens:
            token_id = token[0]
            if token_id in self._tokenizer.special_ids:
                marker = self._tokenizer.hf.id_to_token(token_id)
                if marker == START_THINKING:
                    self._section = "thinking"
                elif marker == END_THINKING or marker in ANSWER_STARTS:
                    self._section = "answer"
                elif marker == START_ACTION:
                    self._section = "action"
                elif marker in ANSWER_ENDS or marker == END_ACTION:
                    self._section = "after"
            elif self._section == "answer":
                out.append(token)
        return out


def _check_action(block: str) -> str | None:
    try:
        calls = json.loads(block)
    except json.JSONDecodeError:
        return "the model wrote a tool-call block that is not valid JSON"
    if not isinstance(calls, list) or not calls:
        return "the model's tool-call block is not a non-empty list of calls"
    for call in calls:
        if not isinstance(call, dict) or not isinstance(call.get("tool_name"), str):
            return "a tool call of the model has no tool_name"
        if not isinstance(call.get("tool_call_id"), str | int):
            return f"the model's call to {call['tool_name']!r} has no tool_call_id"
        if not isinstance(call.get("parameters", {}), dict):
            return f"the parameters of the model's call to {call['tool_name']!r} are not a JSON object"
    return None


def parse(text: str, thinking: bool = True, tools: bool = True, complete: bool = True) -> Cmd4Stream:
    """A whole generation at once (what a non-streaming response needs); `complete` as `finish`'s."""
    stream = Cmd4Stream(thinking, tools)
    stream.feed(text)
    stream.finish(complete)
    return stream


class ToolPolicy:
    """The request's offer: which tool names exist and what tool_choice demands
    ("auto", "none", "required", or the name of one function)."""

    def __init__(self, tool_names: list[str], choice: str = "auto", function: str | None = None) -> None:
        self.names = set(tool_names)
        self.choice = choice
        self.function = function

    @property
    def calls_allowed(self) -> bool:
        return bool(self.names) and self.choice != "none"

    def check_name(self, name: str) -> None:
        if name not in self.names:
            raise ToolCallError(f"the model called {name!r}, which is not among the request's tools")
        if self.function is not None and name != self.function:
            raise ToolCallError(f"the model called {name!r} but tool_choice requires {self.function!r}")

    def check_final(self, stream: Cmd4Stream) -> None:
        """Raise ToolCallError for malformed calls or a tool_choice the output does not meet; for an
        output cut off by max_tokens (`stream.complete` False), only for a call's name."""
        if not self.calls_allowed:
            return
        if not stream.complete:
            for call in stream.calls:
                self.check_name(call.name)
            return
        if stream.action_problem:
            raise ToolCallError(stream.action_problem)
        for call in stream.calls:
            self.check_name(call.name)
            try:
                args = json.loads(call.arguments)
            except json.JSONDecodeError:
                raise ToolCallError(f"the arguments of the model's call to {call.name!r} are not valid JSON") from None
            if not isinstance(args, dict):
                raise ToolCallError(f"the arguments of the model's call to {call.name!r} are not a JSON object")
        if self.choice in ("required", "function") and not stream.calls:
            raise ToolCallError(f"tool_choice is {self.choice!r} but the model called no tool")
        if self.function is not None and len(stream.calls) != 1:
            raise ToolCallError(f"tool_choice names {self.function!r}: expected one call, got {len(stream.calls)}")
