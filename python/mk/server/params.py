"""Request fields to engine SamplingParams; what mk cannot honour is refused, naming the field."""

from __future__ import annotations

from mk.sampling import SamplingError, SamplingParams
from mk.server.errors import APIError, bad_request
from mk.server.schemas import ChatRequest, CompletionRequest, _Sampling

# Field -> the value(s) that mean "off"; anything else is refused rather than silently ignored.
_OFF = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_p": (0, 0.0),
}


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
    if isinstance(req, ChatRequest):
        kind = (req.response_format or {}).get("type", "text")
        if kind != "text":
            raise bad_request(f"response_format {kind!r} is not supported (only 'text')", "response_format")


def max_new_tokens(req: _Sampling, prompt_len: int, max_context: int) -> int:
    """The generation budget: what the request asks for, or the rest of the context."""
    asked = req.max_tokens
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        if asked is not None and asked != req.max_completion_tokens:
            raise bad_request("max_tokens and max_completion_tokens differ; send one", "max_completion_tokens")
        asked = req.max_completion_tokens
    room = max_context - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt has {prompt_len} tokens but this model's context limit is {max_context} tokens",
            param="messages" if isinstance(req, ChatRequest) else "prompt",
            code="context_length_exceeded",
        )
    if asked is not None and asked > room:
        raise APIError(
            400,
            f"this model's context limit is {max_context} tokens, but {prompt_len + asked} were requested "
            f"({prompt_len} in the prompt, {asked} for the completion)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return asked if asked is not None else room


def sampling_params(req: _Sampling, max_tokens: int, choice: int, logprobs: int | None) -> SamplingParams:
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
        )
    except SamplingError as e:
        raise bad_request(str(e), e.field) from None
