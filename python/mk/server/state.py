"""What every route handler may use: the engine, the tokenizer, the model's name, limits, metrics, the
threads that prepare requests, the stored responses of /v1/responses."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from mk.engine.api import AsyncEngine
from mk.server.errors import APIError
from mk.server.http import BODY_TIMEOUT_S
from mk.server.metrics import Metrics
from mk.server.offload import Offload
from mk.server.responses_store import ResponseStore
from mk.text.tokenizer import Tokenizer


@dataclass
class ServerState:
    """What every route handler may use."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    api_key: str | None = None
    protect_metrics: bool = False  # /metrics needs the API key too (by default scrapers need none)
    max_body_bytes: int = 32 * 2**20
    body_timeout: float = BODY_TIMEOUT_S
    # Browser origins allowed to call the API (CORS; "*" allows any); empty: no CORS headers at all.
    allowed_origins: frozenset[str] = frozenset()
    stats_interval: float = 5.0
    # Heal text prompts of /v1/completions (mk.text.healing) unless a request's `token_healing` says otherwise,
    # and prefilled chat answers (`continue_final_message`, a Messages request's last assistant message).
    token_healing: bool = True
    metrics: Metrics = field(init=False)
    offload: Offload = field(init=False, default_factory=Offload)  # parsing, templating, tokenizing
    responses: ResponseStore = field(init=False, default_factory=ResponseStore)  # previous_response_id's
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.model_name, lambda: self.engine.stats())

    def check_model(self, model: str | None) -> None:
        """Another model's name is a 404 `model_not_found`, as OpenAI and vLLM answer it (the Anthropic
        routes turn it into Anthropic's `not_found_error`)."""
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"model {model!r} is not served here; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
                type="invalid_request_error",
            )
