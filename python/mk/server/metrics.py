"""The server's Prometheus metrics (prometheus-client): request latencies, token and response counters,
and the engine's gauges, read from the engine when /metrics is scraped. Every metric carries the
served model's name as `model_name`; README "Metrics" lists them all.

Everything is updated from the event loop thread; each server has its own registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import get_args

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mk.engine.api import EngineStats
from mk.engine.outputs import FinishReason

# No `*_created` series beside every counter and histogram: nothing reads them, and they double the page.
disable_created_metrics()

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

# The finish reason the metrics count for a generation the engine cancelled (the drain timeout; clients
# see "length", generate.CUT_SHORT; "cancelled" is a client that went away); with the engine's own, the
# values of mk_requests_total's finish_reason.
ABORT = "abort"
FINISH_REASONS = (*get_args(FinishReason), ABORT)

CONTENT_TYPE = CONTENT_TYPE_LATEST
MODEL = ["model_name"]


class Metrics:
    def __init__(self, model_name: str, engine_stats: Callable[[], EngineStats] | None = None) -> None:
        self.registry = CollectorRegistry()
        r, m = self.registry, model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(name, doc, MODEL, buckets=buckets, registry=r).labels(m)

        self.ttft = histogram("mk_time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram(
            "mk_inter_token_latency_seconds", "Time between two tokens of a request.", _LATENCY_BUCKETS
        )
        self.e2e = histogram("mk_e2e_request_latency_seconds", "Request latency, arrival to last token.", _E2E_BUCKETS)
        self.queue = histogram(
            "mk_request_queue_time_seconds", "Submission to the scheduler's first admission.", _QUEUE_BUCKETS
        )
        self.prefill = histogram(
            "mk_request_prefill_time_seconds", "First admission to the first token (prefill).", _E2E_BUCKETS
        )
        self.decode = histogram("mk_request_decode_time_seconds", "First token to the last (decode).", _E2E_BUCKETS)
        self._prompt = Counter("mk_prompt_tokens", "Prompt tokens submitted.", MODEL, registry=r).labels(m)
        self._generated = Counter("mk_generation_tokens", "Tokens generated.", MODEL, registry=r).labels(m)
        self._requests = Counter(
            "mk_requests", "Finished generations by finish reason.", [*MODEL, "finish_reason"], registry=r
        )
        self._http = Counter("mk_http_responses", "HTTP responses by status.", [*MODEL, "status"], registry=r)
        # Every labelled family shows a sample from the start: a family with none breaks readers
        # that merge several servers' pages.
        for reason in FINISH_REASONS:
            self._requests.labels(m, reason)
        self._http.labels(m, "200")
        self.model_name = m
        # Plain totals for the periodic log line's rates.
        self.prompt_tokens = 0
        self.generation_tokens = 0
        if engine_stats is not None:
            r.register(_EngineCollector(m, engine_stats))

    def count_prompt(self, tokens: int) -> None:
        self.prompt_tokens += tokens
        self._prompt.inc(tokens)

    def count_generated(self, tokens: int) -> None:
        self.generation_tokens += tokens
        self._generated.inc(tokens)

    def finished(self, reason: str) -> None:
        self._requests.labels(self.model_name, reason).inc()

    def response(self, status: int) -> None:
        self._http.labels(self.model_name, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector:
    """The engine's state at scrape time."""

    def __init__(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        self.model_name, self.stats = model_name, stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        gauges = [
            ("mk_num_requests_running", "Requests in the running batch.", s.running),
            ("mk_num_requests_waiting", "Requests waiting for admission.", s.waiting),
            ("mk_kv_cache_usage_ratio", "Fraction of KV blocks in use.", s.kv_usage),
            ("mk_kv_cache_blocks_used", "KV blocks in use.", s.kv_blocks_used),
            ("mk_kv_cache_blocks_total", "KV blocks in the pool.", s.kv_blocks_total),
        ]
        counters = [
            ("mk_prefix_cache_queries", "Prefix-cache lookups.", s.prefix_cache_queries),
            ("mk_prefix_cache_hits", "Prefix-cache hits.", s.prefix_cache_hits),
            ("mk_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache.", s.prefix_cache_hit_tokens),
            (
                "mk_prefill_tokens",
                "Prompt tokens computed (cache hits excluded, recomputation included).",
                s.prefill_tokens,
            ),
            ("mk_preemptions", "Sequences preempted.", s.preemptions),
            ("mk_spec_decode_num_draft_tokens", "Draft tokens verified (speculative decoding).", s.draft_tokens),
            ("mk_spec_decode_num_accepted_tokens", "Draft tokens accepted (speculative decoding).", s.accepted_tokens),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc, labels=MODEL)
            g.add_metric([self.model_name], value)
            yield g
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=MODEL)
            c.add_metric([self.model_name], value)
            yield c
