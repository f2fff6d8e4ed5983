"""Per-request generation settings, validated with messages that name the field."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


class SamplingError(ValueError):
    """A sampling setting mk cannot honour; `field` names the offending setting."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


CONSTRAINT_KINDS = ("json_object", "json_schema", "regex", "lark", "prefix")
# New tokens when a request names no limit (vLLM's SamplingParams and the OpenAI completions API).
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """A grammar the output must follow, enforced token by token (llguidance in the engine,
    rust/grammar): `json_object` (any JSON object), `json_schema` (`value`: the schema as JSON
    text), `regex` (`value`: a regular expression the whole output matches), `lark` (`value`: a
    grammar in llguidance's Lark dialect) or `prefix` (`value`: text the output begins with, free
    after it: token healing's). `origin` names the request field it came from, for
    error messages; a grammar combined from several fields lists them in `parts` as (field, kind,
    value) constraints of their own, so that a failure is laid at the right one."""

    kind: str
    value: str = ""
    origin: str = "constraint"
    parts: tuple[tuple[str, str, str], ...] = ()


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded (the vLLM shape).

    temperature 0 is greedy; top_k 0 or -1 and top_p 1.0 disable those filters; `seed` makes a
    sampled request reproducible whatever else shares its batch; `logprobs` asks for the chosen
    token's log-probability plus that many top alternatives (0 = chosen token only).
    """

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    stop: list[str] = field(default_factory=list)
    constraint: ConstraintSpec | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    @property
    def greedy(self) -> bool:
        """Whether the engine draws this request's tokens greedily (its core's rule)."""
        from mk import _native  # (here: `import mk` needs no compiled extension, scripts/train_embedded.py)

        return _native.is_greedy(float(self.temperature), self.top_k)

    def validate(self) -> None:
        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise SamplingError(name, message)

        need(_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens!r}")
        need(_is_number(self.temperature), "temperature", f"must be a finite number, got {self.temperature!r}")
        need(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        need(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p!r}")
        need(_is_int(self.top_k) and self.top_k >= -1, "top_k", f"must be -1, 0 (off) or >= 1, got {self.top_k!r}")
        need(self.seed is None or _is_int(self.seed), "seed", f"must be an integer, got {self.seed!r}")
        need(_is_int(self.n) and self.n >= 1, "n", f"must be >= 1, got {self.n!r}")
        need(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative integers",
        )
        need(isinstance(self.ignore_eos, bool), "ignore_eos", "must be a boolean")
        need(
            self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= self.MAX_LOGPROBS),
            "logprobs",
            f"must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs!r}",
        )
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        c = self.constraint
        need(
            c is None or (isinstance(c, ConstraintSpec) and c.kind in CONSTRAINT_KINDS and isinstance(c.value, str)),
            "constraint",
            f"must be a ConstraintSpec of kind {', '.join(CONSTRAINT_KINDS)}",
        )


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
