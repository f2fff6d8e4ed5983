"""Request bodies of the Anthropic Messages API (/v1/messages and /v1/messages/count_tokens), as strict as
the OpenAI routes' (mk.server.schemas): an unknown top-level field is a 400 naming it, and what mk cannot
honour (image or document blocks, Anthropic's server tools) is refused rather than dropped.

Content given as a string is read as one text block, so every message, tool result and system prompt is
a list of blocks here. Fields a block may carry that change nothing for this engine (`cache_control`,
`citations`, a thinking block's `signature`) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from mk.server.schemas import MAX_STOPS, U32_MAX, _Body

# Top-level fields accepted and ignored: they change nothing a self-hosted engine computes. A top-level
# `cache_control` (the SDK's automatic prompt caching) asks for what the prefix cache does unasked.
IGNORED_FIELDS = frozenset({"metadata", "service_tier", "cache_control"})
# The content blocks mk reads, each by its pydantic model's name (capitalized, so that an error's
# location names the block by its index alone: mk.server.schemas.validate).
_BLOCK_MODELS = {
    "text": "TextBlock",
    "thinking": "ThinkingBlock",
    "tool_use": "ToolUseBlock",
    "tool_result": "ToolResultBlock",
}
BLOCK_TYPES = tuple(_BLOCK_MODELS)


class TextBlock(_Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(_Body):
    """The model's reasoning in an earlier assistant turn (mk signs nothing: `signature` is ignored)."""

    type: Literal["thinking"]
    thinking: str


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: list[TextBlock] = Field(default_factory=list)
    is_error: bool = False

    @field_validator("content", mode="before")
    @classmethod
    def _text_blocks(cls, v: Any) -> Any:
        return _blocks(v, ("text",))


def _block_model(v: Any) -> str | None:
    return _BLOCK_MODELS.get(v.get("type")) if isinstance(v, dict) else None


ContentBlock = Annotated[
    Annotated[TextBlock, Tag("TextBlock")]
    | Annotated[ThinkingBlock, Tag("ThinkingBlock")]
    | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
    | Annotated[ToolResultBlock, Tag("ToolResultBlock")],
    Discriminator(_block_model),
]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: list[ContentBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _content_blocks(cls, v: Any) -> Any:
        return _blocks(v, BLOCK_TYPES)


def _blocks(v: Any, kinds: tuple[str, ...]) -> Any:
    """Content as a list of blocks (a string is one text block); a block of a kind not in `kinds` is a
    ValueError that names it."""
    if isinstance(v, str):
        return [{"type": "text", "text": v}]
    if not isinstance(v, list):
        raise ValueError("must be a string or a list of content blocks")
    for i, block in enumerate(v):
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        if kind not in kinds:
            raise ValueError(f"block {i} is {kind!r}: only {', '.join(kinds)} blocks are supported here")
    return v


class AnthropicTool(_Body):
    """A client tool. Anthropic's server tools (a `type` such as "web_search_20250305") run on
    Anthropic's side and are refused."""

    type: Literal["custom"] | None = None
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, v: Any) -> Any:
        kind = v.get("type") if isinstance(v, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"{kind!r} is a server tool; only client tools (name, description, input_schema) run here")
        return v


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class ThinkingConfig(_Body):
    """Whether the model reasons first: type "enabled" or "adaptive" (its reasoning comes back as thinking
    blocks), or "disabled" (the prompt closes the thinking block). `budget_tokens` is accepted but not
    enforced: the reasoning counts against max_tokens, as in Anthropic's API."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1)


class OutputFormat(_Body):
    """Structured output: the answer's text is JSON that `schema` validates (held to it by the chat
    route's json_schema grammar)."""

    type: Literal["json_schema"]
    json_schema: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Body):
    """`format` as OutputFormat; `effort` is accepted and ignored (how long the model reasons is its
    own, as `thinking.budget_tokens` is)."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high"] | None = None


class CountTokensRequest(_Body):
    """The conversation part of a request: what /v1/messages/count_tokens counts."""

    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None

    @field_validator("system", mode="before")
    @classmethod
    def _system_blocks(cls, v: Any) -> Any:
        return None if v is None else _blocks(v, ("text",))


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=0, le=U32_MAX)
    stream: bool = False
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None  # the structured outputs beta's name for output_config.format

    @model_validator(mode="after")
    def _one_output_format(self) -> MessagesRequest:
        if self.output_format is not None and self.output_config is not None and self.output_config.format:
            raise ValueError("give output_config.format or output_format, not both")
        return self

    def answer_format(self) -> OutputFormat | None:
        """The structured output asked for, under either name."""
        return self.output_format or (self.output_config.format if self.output_config else None)

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop sequences")
        if v is not None and not all(v):
            raise ValueError("stop sequences must not be empty")
        return v
