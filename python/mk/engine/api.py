"""The contract between the engine and its users (the `LLM` facade, the server, benchmarks).

The real engine (a Rust decode-loop thread behind `mk._native`) and any stand-in implement
`AsyncEngine`; users never reach past it. Token streams are awaited from asyncio without a thread
per request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from mk.config import ModelConfig
from mk.engine.outputs import TokenEvent
from mk.engine.sampling import ConstraintSpec, SamplingParams


class EngineError(RuntimeError):
    """Base of the errors `submit` raises for a request the engine will not take."""


class PromptTooLong(EngineError):
    """The prompt and its max_tokens do not fit the context (the engine core's rule, rust/sched)."""

    def __init__(self, message: str, prompt_tokens: int, max_tokens: int, max_context: int) -> None:
        super().__init__(message)
        self.prompt_tokens, self.max_tokens, self.max_context = prompt_tokens, max_tokens, max_context


class EngineFull(EngineError):
    """The waiting queue is full: retry later (the server answers 503 with Retry-After)."""


class EngineClosed(EngineError):
    """The engine is draining or shut down and takes no new requests."""


@dataclass(slots=True)
class EngineStats:
    running: int = 0
    waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    preemptions: int = 0
    # Prompt tokens actually computed (cache hits excluded, recomputation after preemption included).
    prefill_tokens: int = 0
    # Speculative decoding: draft tokens verified, and those of them accepted (each accepted one is
    # a token gained without a step of its own).
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class RequestStream(Protocol):
    """One submitted request. Iterate it (async) for its TokenEvents; the last one carries the
    finish reason. `cancel()` ends it within one decode step and frees its KV blocks."""

    request_id: str
    prompt_token_ids: list[int]

    def cancel(self) -> None: ...

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...


class AsyncEngine(Protocol):
    config: ModelConfig
    max_context: int
    max_batch: int

    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request. Raises PromptTooLong, EngineFull, EngineClosed or SamplingError;
        never blocks on the decode loop."""
        ...

    def prepare_constraint(self, spec: ConstraintSpec | None) -> None:
        """Compiles a request's grammar ahead of its `submit`, which then finds it compiled; from any
        thread (the server calls it while it prepares the request, off its event loop). One that
        does not compile is left for `submit` to report."""
        ...

    def stats(self) -> EngineStats: ...

    async def drain(self, timeout: float) -> None:
        """Stop admitting; wait up to `timeout` s for running requests, then cancel the rest."""
        ...

    def close(self) -> None: ...
