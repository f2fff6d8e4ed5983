"""What the engine hands back: per-token events while streaming, finished results offline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# stop: EOS or a stop token/string; length: max_tokens or the context limit; cancelled: the
# client went away or asked; error: the engine failed this request (the message says why).
FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass(slots=True, frozen=True)
class TokenEvent:
    """One generated token of one request, in order. The last event of a request carries its
    finish_reason (and may carry no token: token_id is None for cancel/error endings)."""

    token_id: int | None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None
    # On a request's first token: prompt tokens served from the prefix cache (None elsewhere).
    cached_tokens: int | None = None
    # On a request's first token: seconds from submission to its admission by the scheduler.
    queue_time: float | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[float] | None = None
    top_logprobs: list[tuple[tuple[int, float], ...]] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    # Prompt tokens served from the prefix cache instead of being prefilled.
    cached_tokens: int = 0
