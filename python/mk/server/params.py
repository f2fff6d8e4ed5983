"""Request fields to engine SamplingParams, prompts to token ids within the context; what mk cannot
honour is refused, naming the field."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from mk import _native
from mk.engine.sampling import DEFAULT_MAX_TOKENS, ConstraintSpec, SamplingError, SamplingParams
from mk.server.errors import APIError, bad_request
from mk.server.schemas import ChatRequest, CompletionRequest, NamedToolChoice, _Sampling, validate
from mk.server.state import ServerState
from mk.text.tokenizer import Tokenizer, TooManyTokens

R = TypeVar("R", ChatRequest, CompletionRequest)

# Field -> the value(s) that mean "off"; anything else is refused rather than silently ignored.
_OFF = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_p": (0, 0.0),
}
# guided_choice's options at most. The grammar engine follows at most 2,000 alternatives at one place
# (llguidance's ParserLimits.max_items_in_row) and options that begin alike all stay open together:
# past that a request fails mid-generation. (OpenAI's structured outputs allow 1,000 enum values.)
MAX_GUIDED_CHOICES = 1000
# Bytes of one field's grammar at most (a schema as JSON, a regex, a Lark grammar, the choices; in a
# chat, all tools' parameter schemas together): the engine compiles it as the request is submitted, in
# time that grows faster than its size.
MAX_GRAMMAR_BYTES = 128 * 1024


def parse_request(cls: type[R], obj: Any, state: ServerState) -> R:
    """The body as `cls` (ChatRequest or CompletionRequest), or a 400 naming the first problem: a
    bad or unknown field, another model's name, a setting mk cannot honour."""
    req = validate(cls, obj)
    state.check_model(req.model)
    refuse_unsupported(req)
    check_grammars(req)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options needs stream: true", "stream_options")
    return req


def refuse_unsupported(req: _Sampling) -> None:
    for name, off in _OFF.items():
        value = getattr(req, name)
        if value is not None and value not in off:
            raise bad_request(f"{name} is not supported by this server; leave it out or set it to {off[0]}", name)
    if req.logit_bias:
        raise bad_request("logit_bias is not supported by this server", "logit_bias")
    if req.best_of is not None and req.best_of not in (1, req.n):
        raise bad_request("best_of is not supported by this server (use n)", "best_of")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise bad_request("suffix (fill-in-the-middle) is not supported by this model", "suffix")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo together with logprobs is not supported (no prompt logprobs)", "echo")


def max_new_tokens(req: _Sampling, prompt_len: int, max_context: int) -> int:
    """The generation budget: what the request asks for, else for a completion DEFAULT_MAX_TOKENS (the
    OpenAI API's and vLLM's default) and for a chat the rest of the context (at most)."""
    asked = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        if asked is not None and asked != req.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens differ; send one", "max_completion_tokens")
        asked = req.max_completion_tokens
    room = max_context - prompt_len
    if room < 1:
        raise context_exceeded(req, f"{prompt_len} tokens", max_context)
    if asked is not None and asked > room:
        raise APIError(
            400,
            f"this model's context limit is {max_context} tokens, but {prompt_len + asked} were requested "
            f"({prompt_len} in the prompt, {asked} for the completion)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    if asked is None:
        return min(DEFAULT_MAX_TOKENS, room) if isinstance(req, CompletionRequest) else room
    return asked


def context_exceeded(req: _Sampling, prompt_tokens: str, max_context: int) -> APIError:
    """The 400 of a prompt that leaves no room in the context; `prompt_tokens` says how many tokens it
    has ("3001 tokens", "at least 3001 tokens (why)")."""
    return APIError(
        400,
        f"the prompt has {prompt_tokens} but this model's context limit is {max_context} tokens",
        param="messages" if isinstance(req, ChatRequest) else "prompt",
        code="context_length_exceeded",
    )


def encode_prompt(req: _Sampling, tokenizer: Tokenizer, text: str, max_context: int, special: bool) -> list[int]:
    """The token ids of a prompt text (`special`: with the tokenizer's BOS), or the 400 of one that
    leaves no room in `max_context`: refused from its size alone, untokenized, where the tokenizer
    bounds its token count from below; else as soon as its count is known, before a list of its ids
    is made."""
    fewest = tokenizer.fewest_tokens(text)
    if fewest >= max_context:
        size = len(text.encode("utf-8", "surrogatepass"))
        why = f"{size} bytes of text, at most {tokenizer.max_token_bytes} bytes a token"
        raise context_exceeded(req, f"at least {fewest} tokens ({why})", max_context)
    try:
        return tokenizer.encode(text, add_special_tokens=special, limit=max_context - 1)
    except TooManyTokens as e:
        raise context_exceeded(req, f"{e.count} tokens", max_context) from None


def check_grammars(req: _Sampling) -> None:
    """400 for a grammar input that could not be compiled or followed, before any work on the request:
    a guided_json that is not JSON, guided_choice options that are empty or too many, a grammar past
    MAX_GRAMMAR_BYTES."""
    if isinstance(req.guided_json, str):
        try:
            json.loads(req.guided_json)
        except (ValueError, RecursionError) as e:
            raise bad_request(f"guided_json is not valid JSON: {e}", "guided_json") from None
    if req.guided_choice is not None:
        if not all(req.guided_choice):
            raise bad_request("guided_choice entries must be non-empty strings", "guided_choice")
        if len(req.guided_choice) > MAX_GUIDED_CHOICES:
            raise bad_request(
                f"guided_choice has {len(req.guided_choice)} options; at most {MAX_GUIDED_CHOICES} are supported",
                "guided_choice",
            )
    for field, text in _grammar_texts(req):
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > MAX_GRAMMAR_BYTES:
            raise bad_request(f"{field} is {size} bytes of grammar; at most {MAX_GRAMMAR_BYTES} are supported", field)


def _grammar_texts(req: _Sampling) -> list[tuple[str, str]]:
    """(field, text) of every grammar input of the request."""
    found = []
    if req.guided_json is not None:
        found.append(
            ("guided_json", req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json))
        )
    if req.guided_regex is not None:
        found.append(("guided_regex", req.guided_regex))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", req.guided_grammar))
    if req.guided_choice is not None:
        found.append(("guided_choice", _alternatives(req.guided_choice)))
    if isinstance(req, ChatRequest):
        if req.response_format is not None:
            found.append(("response_format", json.dumps(req.response_format)))
        if req.tools and req.tool_choice != "none":
            found.append(("tools", json.dumps([t.function.parameters for t in req.tools])))
    return found


def prepared_constraint(state: ServerState, req: _Sampling, thinking: bool | None = None) -> ConstraintSpec | None:
    """`constraint(req, thinking)`, compiled ahead of the request's submission: every route calls this
    while it prepares a request, on a thread of mk.server.offload, so grammars compile off the loop."""
    grammar = constraint(req, thinking)
    state.engine.prepare_constraint(grammar)
    return grammar


def constraint(req: _Sampling, thinking: bool | None = None) -> ConstraintSpec | None:
    """The grammar the output must follow: chat's `response_format` (`json_object`, `json_schema`) or
    one of vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, and in a chat
    with tools the action block. A chat's grammar covers the answer the template expects: the
    reasoning the prompt opened (`thinking`: free text up to its end marker), then either
    `<|START_RESPONSE|>` body `<|END_RESPONSE|>` (body: the constrained one, else any text) or,
    where tools may be called, `<|START_ACTION|>` and a JSON list of calls whose names are the
    request's tools (tool_choice's one, once, for a named function; one call at most without
    parallel_tool_calls) and whose parameters follow
    each tool's schema. tool_choice "required" or a named function allows only the action."""
    tools = _tool_calls(req) if isinstance(req, ChatRequest) else None
    found: list[tuple[str, str, str]] = []  # (field, kind, value); kind "choice": a Lark rule body of alternatives
    if isinstance(req, ChatRequest) and req.response_format is not None:
        found += _response_format(req.response_format)
    if req.guided_json is not None:
        schema = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        found.append(("guided_json", "json_schema", schema))
    if req.guided_regex is not None:
        found.append(("guided_regex", "regex", req.guided_regex))
    if req.guided_choice is not None:
        found.append(("guided_choice", "choice", _alternatives(req.guided_choice)))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", "lark", req.guided_grammar))
    if len(found) > 1:
        raise bad_request(f"send one of {' and '.join(f[0] for f in found)}", found[1][0])
    if not found and tools is None:
        return None
    origin, kind, value = found[0] if found else ("tools", "text", "")
    if thinking is None:
        return (
            ConstraintSpec("lark", f"start: {value}", origin)
            if kind == "choice"
            else ConstraintSpec(kind, value, origin)
        )
    chat = _chat_grammar(kind, value, thinking, tools)
    parts = _parts(req, found[0] if found else None, tools is not None)
    if kind == "lark":  # the user's grammar stays whole: a grammar of its own that the answer names
        grammars = [{"name": "chat", "lark_grammar": chat}, {"name": "user", "lark_grammar": value}]
        return ConstraintSpec("lark", json.dumps({"grammars": grammars}), origin, parts)
    return ConstraintSpec("lark", chat, origin, parts)


def _parts(req: ChatRequest, found: tuple[str, str, str] | None, with_tools: bool) -> tuple[tuple[str, str, str], ...]:
    """The fields a chat grammar combines, each as a constraint of its own (field, kind, value):
    the answer's constraint and (`with_tools`: the tools may be called) every tool's parameters
    schema, so that a grammar that does not compile is blamed on the field at fault."""
    parts: list[tuple[str, str, str]] = []
    if found is not None:
        origin, kind, value = found
        parts.append((origin, "lark", f"start: {value}") if kind == "choice" else found)
    for t in req.tools if with_tools and req.tools else []:
        parts.append(("tools", "json_schema", json.dumps(t.function.parameters or {"type": "object"})))
    return tuple(parts)


def _tool_calls(req: ChatRequest) -> tuple[dict[str, Any], bool] | None:
    """The JSON schema of the action block's list of calls, and whether the answer must be one; None
    where no tool may be called."""
    if not req.tools or req.tool_choice == "none":
        return None
    named = req.tool_choice.function.name if isinstance(req.tool_choice, NamedToolChoice) else None
    calls = [
        {
            "type": "object",
            "properties": {
                "tool_call_id": {"type": "string", "maxLength": 16},
                "tool_name": {"const": t.function.name},
                "parameters": t.function.parameters or {"type": "object"},
            },
            "required": ["tool_call_id", "tool_name", "parameters"],
            "additionalProperties": False,
        }
        for t in req.tools
        if named in (None, t.function.name)
    ]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if named is not None or req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema, named is not None or req.tool_choice == "required"


def _response_format(rf: dict[str, Any]) -> list[tuple[str, str, str]]:
    kind = rf.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", "")]
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict | bool):
            raise bad_request("response_format.json_schema must be an object with a 'schema'", "response_format")
        return [("response_format", "json_schema", json.dumps(spec.get("schema", {})))]
    raise bad_request(
        f"response_format type {kind!r} is not supported (text, json_object or json_schema)", "response_format"
    )


def _alternatives(choices: list[str]) -> str:
    """A Lark rule body matching exactly one of `choices` (JSON string syntax is Lark's)."""
    return " | ".join(json.dumps(c) for c in choices)


def _json_rule(schema: Any) -> str:
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": schema.get("x-guidance", json.loads(_native.JSON_LAYOUT))}
    return f"%json {json.dumps(schema)}"  # laid out as the engine lays out JSON


def _chat_grammar(kind: str, value: str, thinking: bool, tools: tuple[dict[str, Any], bool] | None) -> str:
    if kind == "json_object":
        body = _json_rule({"type": "object"})
    elif kind == "json_schema":
        body = _json_rule(json.loads(value))
    elif kind == "regex":
        body = "/" + value.replace("/", "\\/") + "/"
    elif kind == "choice":  # guided_choice's alternatives, a Lark rule body
        body = value
    elif kind == "lark":  # guided_grammar: the grammar named "user" beside this one
        body = "@user"
    else:  # any text
        body = "/(?s:.*)/"
    answers = ["response"]
    rules = ["response: <|START_RESPONSE|> body <|END_RESPONSE|>", f"body: {body}"]
    if tools is not None:
        schema, only = tools
        answers = ["action"] if only else ["action", "response"]
        rules += ["action: <|START_ACTION|> calls <|END_ACTION|>", f"calls: {_json_rule(schema)}"]
    head = "reasoning <|END_THINKING|> " if thinking else ""
    rules.insert(0, f"start: {head}answer")
    rules.insert(1, "answer: " + " | ".join(answers))
    if thinking:
        rules.append("reasoning: /(?s:.*)/")
    return "\n".join(rules)


def sampling_params(
    req: _Sampling, max_tokens: int, choice: int, logprobs: int | None, grammar: ConstraintSpec | None = None
) -> SamplingParams:
    """Engine settings for choice `choice` of the request (choice i of a seeded request uses seed + i)."""
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=0 if req.top_k in (None, -1) else req.top_k,
            seed=None if req.seed is None else req.seed + choice,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            logprobs=logprobs,
            constraint=grammar,
        )
    except SamplingError as e:
        raise bad_request(str(e), e.field) from None
