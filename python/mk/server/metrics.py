"""Prometheus text exposition of the server's latencies and counters and the engine's gauges.

Everything is updated from the event loop thread only, so nothing here locks.
"""

from __future__ import annotations

import math

from mk.engine_api import EngineStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class Histogram:
    def __init__(self, name: str, help: str, buckets: tuple[float, ...]) -> None:  # noqa: A002
        self.name, self.help, self.buckets = name, help, buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.sum += value
        self.count += 1
        for i, edge in enumerate(self.buckets):
            if value <= edge:
                self.counts[i] += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for edge, n in zip(self.buckets, self.counts, strict=True):
            lines.append(f'{self.name}_bucket{{le="{edge}"}} {n}')
        lines += [f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum}"]
        lines.append(f"{self.name}_count {self.count}")
        return lines


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.model = model_name
        self.ttft = Histogram("mk_time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = Histogram(
            "mk_inter_token_latency_seconds", "Time between two tokens of a request.", _LATENCY_BUCKETS
        )
        self.e2e = Histogram("mk_e2e_request_latency_seconds", "Request latency, arrival to last token.", _E2E_BUCKETS)
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.requests: dict[str, int] = {}  # by finish reason
        self.http: dict[int, int] = {}  # responses by status

    def finished(self, reason: str) -> None:
        self.requests[reason] = self.requests.get(reason, 0) + 1

    def render(self, stats: EngineStats) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:  # noqa: A002
            lines.extend([f"# HELP {name} {help}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

        metric("mk_prompt_tokens_total", "counter", "Prompt tokens submitted.", [("", self.prompt_tokens)])
        metric("mk_generation_tokens_total", "counter", "Tokens generated.", [("", self.generation_tokens)])
        metric(
            "mk_requests_total",
            "counter",
            "Finished generations by finish reason.",
            [(f'{{finish_reason="{r}"}}', n) for r, n in sorted(self.requests.items())],
        )
        metric(
            "mk_http_responses_total",
            "counter",
            "HTTP responses by status.",
            [(f'{{status="{s}"}}', n) for s, n in sorted(self.http.items())],
        )
        metric("mk_num_requests_running", "gauge", "Requests in the running batch.", [("", stats.running)])
        metric("mk_num_requests_waiting", "gauge", "Requests waiting for admission.", [("", stats.waiting)])
        metric("mk_kv_cache_usage_ratio", "gauge", "Fraction of KV blocks in use.", [("", stats.kv_usage)])
        metric("mk_kv_cache_blocks_used", "gauge", "KV blocks in use.", [("", stats.kv_blocks_used)])
        metric("mk_kv_cache_blocks_total", "gauge", "KV blocks in the pool.", [("", stats.kv_blocks_total)])
        metric("mk_prefix_cache_queries_total", "counter", "Prefix-cache lookups.", [("", stats.prefix_cache_queries)])
        metric("mk_prefix_cache_hits_total", "counter", "Prefix-cache hits.", [("", stats.prefix_cache_hits)])
        metric(
            "mk_prefix_cache_hit_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            [("", stats.prefix_cache_hit_tokens)],
        )
        metric("mk_preemptions_total", "counter", "Sequences preempted.", [("", stats.preemptions)])
        for h in (self.ttft, self.itl, self.e2e):
            lines.extend(h.render())
        return "\n".join(lines) + "\n"


def _num(v: float) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN"
    return str(v)
