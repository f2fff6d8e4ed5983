"""Request bodies of the OpenAI routes (pydantic v2, strict types: "1" is not a number, true is not 1).

Fields mk honours are typed here. At the top level of a request, the few fields that change nothing
for this engine (IGNORED_FIELDS: `user`, `metadata`, `store`, ...) are accepted and ignored; any other
unknown field is refused with a 400 that names it (a typo such as `max_token` must not silently run
the default), and fields mk cannot honour are refused in `params.py` rather than ignored.
"""

from __future__ import annotations

import difflib
import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from mk.server.errors import bad_request

MAX_N = 32
MAX_STOPS = 16
# The engine's integer widths (rust/python/engine.rs, `submit`): top_k and token ids are u32; a seed
# is 64 bits, signed or not (mk.engine.engine takes it modulo 2**64).
U32_MAX = 2**32 - 1
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

# Top-level fields accepted and ignored: they change nothing a self-hosted engine computes.
IGNORED_FIELDS = frozenset(
    {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key", "parallel_tool_calls"}
)  # (parallel_tool_calls: a chat's own field; accepted and ignored on completions)
# SGLang's extensions, which its routers add to every request they forward (one may stand in front of
# mk): accepted at the value that means what mk does anyway, refused at any other.
NEUTRAL_EXTENSIONS = {
    "no_stop_trim": False,
    "continue_final_message": False,  # (a chat request's own field: ChatRequest)
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "separate_reasoning": True,
    "stream_reasoning": True,
    "return_hidden_states": False,
}
# Top-level fields refused with a reason of their own.
REFUSED_FIELDS = {
    "functions": "the legacy 'functions' field is not supported; send 'tools'",
    "function_call": "the legacy 'function_call' field is not supported; send 'tool_choice'",
    "modalities": "only text output is supported; leave 'modalities' out",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs ('prediction') are not supported",
}


# Fields the OpenAI API defines inside a chat message that mk refuses, with the reason.
REFUSED_MESSAGE_FIELDS = {
    "function_call": "the legacy 'function_call' is not supported; send 'tool_calls'",
    "audio": "audio is not supported",
}
# The pydantic error types of a refused or unknown field inside a body (`validate` names its path).
_REFUSED, _UNKNOWN = "refused_field", "unknown_field"


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class _Closed(_Body):
    """A part of a body whose every field must be known (a chat message, its content parts and tool
    calls): an unknown one is a 400 naming its path (`messages[0].foo`), as at the top level, so that a
    typo inside a message is not dropped silently."""

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, v: Any) -> Any:
        if isinstance(v, dict):
            for name in v:
                if name in REFUSED_MESSAGE_FIELDS and name not in cls.model_fields:
                    raise PydanticCustomError(
                        _REFUSED, "{message}", {"message": REFUSED_MESSAGE_FIELDS[name], "field": name}
                    )
                if name not in cls.model_fields:
                    message = _unknown_field(name, cls.model_fields)
                    raise PydanticCustomError(_UNKNOWN, "{message}", {"message": message, "field": name})
        return v


class StreamOptions(_Body):
    include_usage: bool = False
    # vLLM's extension: usage so far in every chunk, and a chunk for every token, even one whose
    # text is still held (a partial character): a client counts tokens without asking logprobs.
    continuous_usage_stats: bool = False


class _Sampling(_Body):
    """Fields shared by completions and chat."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1, le=U32_MAX)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = Field(None, validate_default=True)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's structured-output extensions (at most one, and not with response_format).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None  # llguidance's Lark dialect (in a chat: the answer's grammar)
    guided_choice: list[str] | None = Field(None, min_length=1)
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, allow_inf_nan=False)
    min_p: float | None = Field(None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: list[int] | None) -> list[int] | None:
        for i, t in enumerate(v or []):
            if not 0 <= t <= U32_MAX:
                raise ValueError(f"[{i}] = {t} is not a token id (0 to {U32_MAX})")
        return v


class CompletionRequest(_Sampling):
    # Checked whole by `_prompt` (pydantic would check a list of token ids again, slowly, holding the GIL).
    prompt: SkipValidation[str | list[str] | list[int] | list[list[int]]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    # Token healing of text prompts (mk.text.healing); None: the server's --token-healing.
    token_healing: bool | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        # Checked by hand: a union's own errors name its members, not the problem.
        if isinstance(v, str):
            return v
        if not isinstance(v, list) or not v:
            raise ValueError("must be a string, a non-empty list of strings, or token ids")
        if all(isinstance(x, str) for x in v):
            return v
        if all(_is_int(x) for x in v):
            return v
        if all(isinstance(x, list) and x and all(_is_int(t) for t in x) for x in v):
            return v
        raise ValueError("must be a string, a list of strings, a list of token ids, or a list of such lists")


class FunctionDef(_Body):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class _FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: _FunctionName


class TextPart(_Closed):
    type: Literal["text"]
    text: str


class CallFunction(_Closed):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any]


class AssistantToolCall(_Closed):
    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: CallFunction


class Message(_Closed):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # vLLM's name for an earlier turn's reasoning
    reasoning: str | None = None
    refusal: str | None = None  # an earlier assistant turn's refusal: accepted, not shown to the model

    @field_validator("content", mode="before")
    @classmethod
    def _parts(cls, v: Any) -> Any:
        # Bare strings inside the list are text parts too; anything but text (images, audio) is refused.
        if isinstance(v, list):
            parts = []
            for i, p in enumerate(v):
                if isinstance(p, str):
                    p = {"type": "text", "text": p}
                if not isinstance(p, dict) or p.get("type") != "text":
                    kind = p.get("type") if isinstance(p, dict) else type(p).__name__
                    raise ValueError(f"part {i} is {kind!r}: only text content parts are supported")
                parts.append(p)
            return parts
        return v


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True  # False: at most one call (the grammar's); None: True
    include_reasoning: bool = True
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's: the last message is the assistant's and the answer continues it (a prefilled answer)
    # instead of starting a new one; the answer's text leaves the prefill out.
    continue_final_message: bool = False


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a `prompt`, or `messages` (with their `tools`) rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_generation_prompt: bool = True
    # None: a prompt gets the tokenizer's BOS, messages none (their template writes its own), as in vLLM.
    add_special_tokens: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    """vLLM's /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate(model: type, obj: Any, ignored: frozenset[str] = IGNORED_FIELDS) -> Any:
    """A pydantic model of the body, or 400 naming the first offending field (a string that is not valid
    Unicode, a refused or unknown top-level field, a bad value); the top-level fields in `ignored` (by
    default the OpenAI routes') are accepted and dropped."""
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    where = _lone_surrogate(obj)
    if where is not None:
        raise bad_request(f"{where or 'the body'}: a string holds a lone UTF-16 surrogate (not valid Unicode)", where)
    for name in obj:
        if name in REFUSED_FIELDS:
            raise bad_request(REFUSED_FIELDS[name], name)
        if name in NEUTRAL_EXTENSIONS and name not in model.model_fields and obj[name] is not NEUTRAL_EXTENSIONS[name]:
            raise bad_request(
                f"{name}={json.dumps(obj[name])} is not supported (only {json.dumps(NEUTRAL_EXTENSIONS[name])})", name
            )
    known = model.model_fields.keys() | ignored | NEUTRAL_EXTENSIONS.keys()
    unknown = [n for n in obj if n not in known]
    if unknown:
        raise bad_request(_unknown_field(unknown[0], model.model_fields), unknown[0], _UNKNOWN)
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # A field refused inside a union member (a content part) comes first, not the other members' errors.
        err = next((x for x in errors if x["type"] in (_REFUSED, _UNKNOWN)), errors[0])
        path = [*err["loc"], err["ctx"]["field"]] if err["type"] in (_REFUSED, _UNKNOWN) else err["loc"]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path if not _union_tag(p))
        loc = loc.lstrip(".")
        msg = err["msg"].removeprefix("Value error, ")
        code = _UNKNOWN if err["type"] == _UNKNOWN else None
        raise bad_request(f"{loc}: {msg}" if loc else msg, loc or None, code) from None


def _unknown_field(name: str, fields: Any) -> str:
    """ "unknown field 'x'", with the closest known field as a suggestion (a typo such as `max_token`)."""
    close = difflib.get_close_matches(name, list(fields), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"unknown field {name!r}{hint}"


def _lone_surrogate(obj: Any, where: str = "") -> str | None:
    """The location of the first string (value or key) the JSON decoder made from a lone \\uD800-style
    escape: such text cannot be encoded, so the tokenizer would fail on it."""
    if isinstance(obj, str):
        try:
            obj.encode("utf-8")
        except UnicodeEncodeError:
            return where
        return None
    if isinstance(obj, dict):
        for k, v in obj.items():
            at = f"{where}.{k}".lstrip(".") if isinstance(k, str) and k.isprintable() else where
            found = _lone_surrogate(k, at) if isinstance(k, str) else None
            if found is None:
                found = _lone_surrogate(v, at)
            if found is not None:
                return found
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            found = _lone_surrogate(v, f"{where}[{i}]")
            if found is not None:
                return found
    return None


def _union_tag(part: str | int) -> bool:
    """pydantic names the union member in an error's location ('str', 'list[TextPart]', 'NamedToolChoice');
    field names are lowercase identifiers."""
    return isinstance(part, str) and (not part.isidentifier() or part[0].isupper() or part in _TYPE_NAMES)


_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none"}
