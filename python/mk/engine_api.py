"""The contract between the engine and its users (the `LLM` facade, the server, benchmarks).

The real engine (a Rust decode-loop thread behind `mk._native`) and any stand-in implement
`AsyncEngine`; users never reach past it. Token streams are awaited from asyncio without a thread
per request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from mk import _native
from mk.config import ModelConfig
from mk.outputs import TokenEvent
from mk.sampling import ConstraintSpec, SamplingParams

# Prompt tokens one loop iteration prefills on a GPU, unless told otherwise (the engine's and the
# server's default). A prefill call that does not replay a CUDA graph pays a fixed host cost of
# launches, so fewer, larger chunks win; the price is that a decoding stream waits up to one chunk's
# time while a long prompt is admitted (unless the sliced prefill cuts it). See docs/PERF.md,
# tuning decisions.
PREFILL_CHUNK = 8192
# On the CPU, where a chunk takes far longer and a decoding stream waits for it: smaller.
CPU_PREFILL_CHUNK = 512
# Prompt tokens through the whole model (tokens x layers / layers) one loop iteration prefills
# while some stream decodes, with the layer-sliced prefill that is on by default on a GPU: it bounds
# a decoding stream's pause while a long prompt is admitted, and each slice between decode steps
# delays that prompt's first token. The value keeps the pause well under a 50 ms target with the
# admitted prompt's first token within 1.3x its standalone prefill (docs/PERF.md, tuning decisions).
DECODE_PREFILL_BUDGET = 512
# With the sliced prefill and both kinds of prefill graph: a prefill call of one chunk of up to this
# many tokens (a next turn's new tokens, a short prompt, a long prompt's last chunk) runs whole
# while streams decode, one graph replay, instead of slices of the eager path, each of which
# carries its share of that path's fixed cost of launches: the streams pause once, and less, and
# the chunk's first token comes sooner. A limit of 512 would slice a next turn of ~1K tokens
# (docs/PERF.md, tuning decisions).
WHOLE_CHUNK_TOKENS = 1024
# Sequences decoded together on a GPU, unless told otherwise (the engine's and the server's
# default): the rows of one megakernel launch (16: its wide image), which decodes them faster than
# two launches of 8 (docs/PERF.md, tuning decisions), and a 9th concurrent request starts at once
# instead of waiting for a running one to finish.
MAX_BATCH = _native.STEP_MAX_BATCH
# On the CPU, whose KV pool is sized for a whole batch (mk.engine.Engine): a smaller batch.
CPU_MAX_BATCH = 8

# The values of an auto/on/off flag (the server's and the benchmarks' `--launch-ahead` and
# `--prefill-graphs`): the Engine argument, where None lets the engine choose.
AUTO_ON_OFF = {"auto": None, "on": True, "off": False}


class EngineError(RuntimeError):
    """Base of the errors `submit` raises for a request the engine will not take."""


class PromptTooLong(EngineError):
    def __init__(self, prompt_tokens: int, max_tokens: int, max_context: int) -> None:
        super().__init__(
            f"the prompt has {prompt_tokens} tokens and max_tokens asks for {max_tokens} more, "
            f"but the context limit is {max_context} tokens"
        )
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
