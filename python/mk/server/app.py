"""The ASGI application: routing, the API key, bounded bodies, errors as OpenAI bodies, one log line per
request, a periodic engine-status line, and draining for shutdown."""

from __future__ import annotations

import asyncio
import difflib
import hmac
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from mk.engine_api import AsyncEngine
from mk.server import http
from mk.server.errors import APIError, bad_request, error_body
from mk.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mk.server.metrics import Metrics
from mk.server.schemas import IGNORED_FIELDS, REFUSED_FIELDS
from mk.tokenizer import Tokenizer

log = logging.getLogger("mk.server")


@dataclass
class ServerState:
    """What every route handler may use."""

    engine: AsyncEngine
    tokenizer: Tokenizer
    model_name: str
    api_key: str | None = None
    protect_metrics: bool = False  # /metrics needs the API key too (by default scrapers need none)
    max_body_bytes: int = 32 * 2**20
    stats_interval: float = 5.0
    metrics: Metrics = field(init=False)
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.model_name, lambda: self.engine.stats())

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                400,
                f"model {model!r} is not served here; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )


def validate(model: type, obj: Any) -> Any:
    """A pydantic model of the body, or 400 naming the first offending field (a string that is not valid
    Unicode, a refused or unknown top-level field, a bad value)."""
    if not isinstance(obj, dict):
        raise bad_request("the request body must be a JSON object")
    where = _lone_surrogate(obj)
    if where is not None:
        raise bad_request(f"{where or 'the body'}: a string holds a lone UTF-16 surrogate (not valid Unicode)", where)
    for name in obj:
        if name in REFUSED_FIELDS:
            raise bad_request(REFUSED_FIELDS[name], name)
    unknown = [n for n in obj if n not in model.model_fields and n not in IGNORED_FIELDS]
    if unknown:
        name = unknown[0]
        close = difflib.get_close_matches(name, list(model.model_fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise bad_request(f"unknown field {name!r}{hint}", name, "unknown_field")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"] if not _union_tag(p))
        loc = loc.lstrip(".")
        msg = err["msg"].removeprefix("Value error, ")
        raise bad_request(f"{loc}: {msg}" if loc else msg, loc or None) from None


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

MODEL_ROUTE = "/v1/models/"  # + a model id


class App:
    def __init__(self, state: ServerState) -> None:
        from mk.server.chat_completions import chat_completions
        from mk.server.completions import completions

        self.state = state
        self.active = 0  # HTTP requests in flight
        self._post = {"/v1/chat/completions": chat_completions, "/v1/completions": completions}
        self._get = {"/health": self._health, "/v1/models": self._models, "/metrics": self._metrics}
        self._stats_task: asyncio.Task | None = None

    async def __call__(self, scope: dict[str, Any], receive: http.Receive, send: http.Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            self.active += 1
            try:
                await self._http(scope, receive, send)
            finally:
                self.active -= 1

    async def drain(self, timeout: float) -> None:
        """Refuse new work, let running requests finish (at most `timeout` s), then let their responses flush."""
        self.state.draining = True
        log.info("draining: %d requests in flight, waiting up to %.0f s", self.active, timeout)
        await self.state.engine.drain(timeout)
        deadline = time.monotonic() + 5.0
        while self.active and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    # ---- lifecycle ----------------------------------------------------------------------------
    async def _lifespan(self, receive: http.Receive, send: http.Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._stats_task = asyncio.create_task(self._log_stats())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._stats_task:
                    self._stats_task.cancel()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _log_stats(self) -> None:
        m, last = self.state.metrics, (0, 0, time.monotonic())
        while True:
            await asyncio.sleep(self.state.stats_interval)
            s = self.state.engine.stats()
            now = time.monotonic()
            prompt_rate = (m.prompt_tokens - last[0]) / (now - last[2])
            gen_rate = (m.generation_tokens - last[1]) / (now - last[2])
            if prompt_rate or gen_rate or s.running or s.waiting:
                hits = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
                log.info(
                    "throughput: prompt %.1f tok/s, generation %.1f tok/s | running %d, waiting %d | "
                    "KV %.1f%% (%d/%d blocks) | prefix-cache hits %.1f%%",
                    prompt_rate,
                    gen_rate,
                    s.running,
                    s.waiting,
                    100 * s.kv_usage,
                    s.kv_blocks_used,
                    s.kv_blocks_total,
                    100 * hits,
                )
            last = (m.prompt_tokens, m.generation_tokens, now)

    # ---- requests -----------------------------------------------------------------------------
    async def _http(self, scope: dict[str, Any], receive: http.Receive, send: http.Send) -> None:
        start = time.monotonic()
        info: dict[str, Any] = {"id": uuid.uuid4().hex[:24]}
        status = 500
        started = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
            await send(message)

        try:
            await self._route(scope, receive, tracked_send, info)
        except APIError as e:
            if not started:
                await http.send_json(tracked_send, e.status, e.body(), e.headers)
        except ConnectionAbortedError:
            status = 499  # nginx's "client closed request", for the log line only
        except Exception:
            log.exception("request %s failed", info["id"])
            if not started:
                body = error_body(f"internal error (request {info['id']}; see the server log)", "server_error")
                await http.send_json(tracked_send, 500, body)
        finally:
            self.state.metrics.response(status)
            if scope["path"] != "/metrics" and scope["path"] != "/health":
                self._log_request(scope, status, time.monotonic() - start, info)

    async def _route(self, scope: dict[str, Any], receive: http.Receive, send: http.Send, info: dict) -> None:
        path, method = scope["path"], scope["method"]
        model_id = path.removeprefix(MODEL_ROUTE) if path.startswith(MODEL_ROUTE) else None
        known = path in self._get or path in self._post or model_id is not None
        if not known:
            raise APIError(404, f"no route {path}", code="not_found")
        open_route = path == "/health" or (path == "/metrics" and not self.state.protect_metrics)
        if not open_route and self.state.api_key is not None:
            self._authorize(scope)
        if method == "HEAD" and path == "/health":  # load balancers' probe: the status, no body
            await http.send_bytes(send, 503 if self.state.draining else 200, b"", "application/json", None)
            return
        if method == "GET" and model_id is not None:
            await self._model(send, model_id)
            return
        if method == "GET" and path in self._get:
            await self._get[path](send)
            return
        if method != "POST" or path not in self._post:
            raise APIError(405, f"{method} is not allowed on {path}", code="method_not_allowed")
        if self.state.draining:
            raise APIError(503, "the server is shutting down", headers={"Retry-After": "5"})
        http.require_json(scope)
        obj = http.parse_json(await http.read_body(scope, receive, self.state.max_body_bytes))
        await http.race_disconnect(self._respond(self._post[path], obj, send, info), receive)

    async def _respond(self, handler: Any, obj: Any, send: http.Send, info: dict) -> None:
        result = await handler(self.state, obj, info)
        if isinstance(result, dict):
            await http.send_json(send, 200, result)
            return
        await http.start_sse(send)
        try:
            async for event in result:
                await http.send_event(send, event)
        except Exception:  # headers are out: report in-band, never as a stack trace
            log.exception("stream of request %s failed", info["id"])
            message = f"internal error (request {info['id']}; see the server log)"
            await http.send_event(send, error_body(message, "server_error"))
            await http.send_event(send, "[DONE]")
        finally:
            await result.aclose()  # on a disconnect this cancels the engine requests at once
        await http.end_sse(send)

    def _authorize(self, scope: dict[str, Any]) -> None:
        given = http.header(scope, b"authorization") or ""
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self.state.api_key.encode()):
            raise APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')", code="invalid_api_key")

    async def _health(self, send: http.Send) -> None:
        if self.state.draining:
            await http.send_json(send, 503, {"status": "draining"})
        else:
            await http.send_json(send, 200, {"status": "ok"})

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.state.model_name,
            "object": "model",
            "created": self.state.created,
            "owned_by": "mk",
            "max_model_len": self.state.engine.max_context,
        }

    async def _models(self, send: http.Send) -> None:
        await http.send_json(send, 200, {"object": "list", "data": [self._model_card()]})

    async def _model(self, send: http.Send, model_id: str) -> None:
        """GET /v1/models/{id} (the client's models.retrieve)."""
        if model_id != self.state.model_name:
            raise APIError(404, f"model {model_id!r} is not served here", "model", "model_not_found")
        await http.send_json(send, 200, self._model_card())

    async def _metrics(self, send: http.Send) -> None:
        await http.send_bytes(send, 200, self.state.metrics.render(), METRICS_CONTENT_TYPE, None)

    def _log_request(self, scope: dict[str, Any], status: int, elapsed: float, info: dict) -> None:
        parts = [f"{scope['method']} {scope['path']} {status} {elapsed * 1000:.0f}ms"]
        for key in ("prompt_tokens", "completion_tokens", "finish", "ttft_ms"):
            if key in info:
                parts.append(f"{key}={info[key]}")
        log.info("%s %s", info["id"], " ".join(parts))
