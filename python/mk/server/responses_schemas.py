"""Request bodies of the OpenAI Responses API (POST /v1/responses and /v1/responses/input_tokens), as
strict as the chat route's (mk.server.schemas): an unknown top-level field is a 400 naming it, and what
mk cannot honour (image or file parts, OpenAI's built-in tools, background mode, conversations) is
refused rather than dropped.

`input` given as a string is one user message, and a message's content or a function call's output given
as a string is one text part, so every item here holds a list of parts. Fields an item may carry that
change nothing for this engine (an output item's `id` and `status`, a text part's `annotations`, a
reasoning item's `encrypted_content`) are accepted and ignored, so that a response's output items can be
sent back as input.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from mk.server.schemas import _Body

# Top-level fields accepted and ignored: they change nothing a self-hosted engine computes.
IGNORED_FIELDS = frozenset(
    {"service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "stream_options"}
)
# Top-level fields refused with a reason of their own.
REFUSED_FIELDS = {
    "conversation": "the Conversations API is not supported; chain turns with previous_response_id",
    "prompt": "stored prompt templates ('prompt') are not supported; send instructions and input",
    "top_logprobs": "logprobs are not supported on /v1/responses",
    "max_tool_calls": "max_tool_calls is not supported; use tool_choice and parallel_tool_calls",
}
# The one `include` value accepted: reasoning comes back in the clear anyway (its `content`), so there
# is nothing to encrypt.
INCLUDABLE = ("reasoning.encrypted_content",)
# The input items mk reads, each by its pydantic model's name (capitalized, so that an error's location
# names the item by its index alone: mk.server.schemas.validate). An item with no `type` is a message.
_ITEM_MODELS = {
    "message": "MessageItem",
    "function_call": "FunctionCallItem",
    "function_call_output": "FunctionCallOutputItem",
    "reasoning": "ReasoningItem",
}
TEXT_PARTS = ("input_text", "output_text")


class TextPart(_Body):
    """Text of a message or of a function's output (a user's `input_text`, an assistant's `output_text`)."""

    type: Literal["input_text", "output_text"]
    text: str


def _text_parts(v: Any) -> Any:
    """Content as a list of text parts: a string is one part, a refusal part is read as text; a part of
    any other kind is a ValueError that names it."""
    if isinstance(v, str):
        return [{"type": "input_text", "text": v}]
    if not isinstance(v, list):
        raise ValueError("must be a string or a list of content parts")
    parts = []
    for i, part in enumerate(v):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            part = {"type": "output_text", "text": part["refusal"]}
        elif kind not in TEXT_PARTS:
            raise ValueError(f"part {i} is {kind!r}: only text parts ({', '.join(TEXT_PARTS)}) are supported")
        parts.append(part)
    return parts


class MessageItem(_Body):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        return _text_parts(v)


class FunctionCallItem(_Body):
    """A call the model made in an earlier turn; `status` "incomplete": cut off by max_output_tokens."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(_Body):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: list[TextPart]

    @field_validator("output", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        return _text_parts(v)


class SummaryText(_Body):
    type: Literal["summary_text"]
    text: str


class ReasoningText(_Body):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_Body):
    """The model's reasoning in an earlier turn: its `content` (mk's), else its `summary` (another
    server's), goes back to the template as that turn's thinking."""

    type: Literal["reasoning"]
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None


def _item_model(v: Any) -> str | None:
    return _ITEM_MODELS.get(v.get("type", "message")) if isinstance(v, dict) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("MessageItem")]
    | Annotated[FunctionCallItem, Tag("FunctionCallItem")]
    | Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")]
    | Annotated[ReasoningItem, Tag("ReasoningItem")],
    Discriminator(_item_model),
]


class FunctionTool(_Body):
    """A function tool. OpenAI's built-in tools (web_search, file_search, computer_use, mcp, ...) run on
    OpenAI's side and are refused. Arguments always follow `parameters` (the grammar holds them to it),
    strict or not."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _function_tool(cls, v: Any) -> Any:
        kind = v.get("type") if isinstance(v, dict) else None
        if kind != "function":
            raise ValueError(f"{kind!r} is not a function tool; only function tools (type 'function') run here")
        return v


class FunctionToolChoice(_Body):
    type: Literal["function"]
    name: str


class TextFormat(_Body):
    """`text.format`: plain text, any JSON object, or JSON that follows `schema` (held to it by the
    grammar, strict or not)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_\-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _json_schema_fields(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("a json_schema format needs a 'name' and a 'schema'")
        return self


class TextConfig(_Body):
    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text"))
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted and ignored


class ReasoningConfig(_Body):
    """`effort` "none" turns the model's thinking off (the prompt closes its thinking block); any other
    effort leaves it to the template. `summary` is accepted, but no summary is written: the reasoning
    comes back whole, as the reasoning item's content."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class InputTokensRequest(_Body):
    """The conversation part of a request: what POST /v1/responses/input_tokens counts."""

    model: str | None = None
    input: list[InputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None: true
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    previous_response_id: str | None = Field(None, min_length=1)
    truncation: Literal["disabled"] | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _items(cls, v: Any) -> Any:
        if isinstance(v, str):
            return [{"type": "message", "role": "user", "content": v}]
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of input items")
        for i, item in enumerate(v):
            kind = item.get("type", "message") if isinstance(item, dict) else type(item).__name__
            if kind not in _ITEM_MODELS:
                raise ValueError(f"item {i} is {kind!r}: only {', '.join(_ITEM_MODELS)} items are supported")
        return v

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _choice(cls, v: Any) -> Any:
        if isinstance(v, dict) and v.get("type") != "function":
            raise ValueError(f"a tool_choice of type {v.get('type')!r} is not supported (only 'function')")
        return v


class ResponsesRequest(InputTokensRequest):
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    store: bool | None = None  # None: true
    stream: bool = False
    include: list[str] | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None  # echoed, else ignored
    user: str | None = None  # echoed, else ignored

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        for name in v or []:
            if name not in INCLUDABLE:
                raise ValueError(f"{name!r} cannot be included (only {', '.join(INCLUDABLE)})")
        return v

    @field_validator("background")
    @classmethod
    def _foreground(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("background mode is not supported; every response runs while its request waits")
        return v
