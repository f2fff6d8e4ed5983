"""The ASGI application: routing, the API key, bounded bodies, errors as OpenAI bodies (Anthropic's on
the Anthropic routes), stream events named by their type where the API names them (Anthropic's, the
Responses API's), one log line per request, a periodic engine-status line, and draining for shutdown."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from typing import Any

from mk.server import http
from mk.server.chat_completions import chat_completions
from mk.server.completions import completions
from mk.server.errors import APIError, anthropic_error_body, error_body
from mk.server.messages import count_tokens, messages
from mk.server.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mk.server.responses import input_tokens, responses, stored_response
from mk.server.state import ServerState
from mk.server.tokenization import detokenize, tokenize

__all__ = ["App", "ServerState"]

log = logging.getLogger("mk.server")


MODEL_ROUTE = "/v1/models/"  # + a model id
# The Anthropic Messages API's routes, and every path under them: their errors and events are Anthropic's.
ANTHROPIC_ROUTE = "/v1/messages"
# The Responses API's route; a stored response is at RESPONSES_ROUTE + "/" + its id.
RESPONSES_ROUTE = "/v1/responses"


# A CORS preflight's answer: the methods the routes take, and how long a browser may cache it.
CORS_METHODS = "GET, POST, HEAD, OPTIONS"
CORS_MAX_AGE_S = 600
ANY_ORIGIN = "*"


def anthropic_route(path: str) -> bool:
    return path == ANTHROPIC_ROUTE or path.startswith(ANTHROPIC_ROUTE + "/")


class App:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.active = 0  # HTTP requests in flight
        self._post = {
            "/v1/chat/completions": chat_completions,
            "/v1/completions": completions,
            ANTHROPIC_ROUTE: messages,
            ANTHROPIC_ROUTE + "/count_tokens": count_tokens,
            RESPONSES_ROUTE: responses,
            RESPONSES_ROUTE + "/input_tokens": input_tokens,
            "/tokenize": tokenize,
            "/detokenize": detokenize,
        }
        self._get = {
            "/health": self._health,
            "/v1/models": self._models,
            "/metrics": self._metrics,
        }
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
        cors = self._cors_headers(scope)

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = message["status"], True
                if cors:
                    message = {**message, "headers": [*message["headers"], *cors]}
            await send(message)

        try:
            if cors and scope["method"] == "OPTIONS" and http.header(scope, b"access-control-request-method"):
                await self._preflight(scope, tracked_send)
                return
            await self._route(scope, receive, tracked_send, info)
        except APIError as e:
            if not started:
                code, body = e.anthropic() if anthropic_route(scope["path"]) else (e.status, e.body())
                await http.send_json(tracked_send, code, body, e.headers)
        except ConnectionAbortedError:
            status = 499  # nginx's "client closed request", for the log line only
        except Exception:
            log.exception("request %s failed", info["id"])
            if not started:
                message = f"internal error (request {info['id']}; see the server log)"
                anthropic = anthropic_route(scope["path"])
                body = anthropic_error_body(message, "api_error") if anthropic else error_body(message, "server_error")
                await http.send_json(tracked_send, 500, body)
        finally:
            self.state.metrics.response(status)
            if scope["path"] != "/metrics" and scope["path"] != "/health":
                self._log_request(scope, status, time.monotonic() - start, info)

    async def _route(self, scope: dict[str, Any], receive: http.Receive, send: http.Send, info: dict) -> None:
        path, method = scope["path"], scope["method"]
        model_id = path.removeprefix(MODEL_ROUTE) if path.startswith(MODEL_ROUTE) else None
        response_id = None  # of a stored response (the input_items, cancel and compact routes are not served)
        if path.startswith(RESPONSES_ROUTE + "/") and path not in self._post and path.count("/") == 3:
            response_id = path.removeprefix(RESPONSES_ROUTE + "/") or None
        known = path in self._get or path in self._post or model_id is not None or response_id is not None
        if not known:
            raise APIError(404, f"no route {path}", code="not_found")
        open_route = path == "/health" or (path == "/metrics" and not self.state.protect_metrics)
        if not open_route and self.state.api_key is not None:
            self._authorize(scope)
        if method == "HEAD" and path == "/health":  # load balancers' probe: the status, no body
            await http.send_bytes(send, 503 if self.state.draining else 200, b"", "application/json", None)
            return
        if response_id is not None:
            await http.send_json(send, 200, stored_response(self.state, method, response_id))
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
        body = await http.read_body(scope, receive, self.state.max_body_bytes, self.state.body_timeout)
        respond = self._respond(self._post[path], body, send, info, anthropic_route(path), path == RESPONSES_ROUTE)
        await http.race_disconnect(respond, receive)

    async def _respond(
        self, handler: Any, body: bytes, send: http.Send, info: dict, anthropic: bool, named: bool
    ) -> None:
        """The handler's answer: a JSON body, or its events as a stream (`anthropic` or `named`: each
        event named by its "type", as the Anthropic and Responses APIs name them; a Responses stream
        tells its own failures, as events of its own)."""
        # The handler parses the body itself, on the threads that prepare requests (mk.server.offload).
        result = await handler(self.state, body, info)
        if isinstance(result, dict):
            await http.send_json(send, 200, result)
            return
        await http.start_sse(send)
        try:
            async for event in result:
                await http.send_event(send, event, event["type"] if anthropic or named else None)
        except Exception:  # headers are out: report in-band, never as a stack trace
            log.exception("stream of request %s failed", info["id"])
            message = f"internal error (request {info['id']}; see the server log)"
            if anthropic:
                await http.send_event(send, anthropic_error_body(message, "api_error"), "error")
            else:
                await http.send_event(send, error_body(message, "server_error"))
                await http.send_event(send, "[DONE]")
        finally:
            await result.aclose()  # on a disconnect this cancels the engine requests at once
        await http.end_sse(send)

    def _cors_headers(self, scope: dict[str, Any]) -> list[tuple[bytes, bytes]]:
        """The CORS headers of a response to a browser whose Origin --allowed-origins lists (or any,
        with "*"); none for another origin or without the flag, so the browser keeps the answer from
        the page."""
        allowed, origin = self.state.allowed_origins, http.header(scope, b"origin")
        if origin is None or not (ANY_ORIGIN in allowed or origin in allowed):
            return []
        if ANY_ORIGIN in allowed:
            return [(b"access-control-allow-origin", ANY_ORIGIN.encode())]
        return [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]

    async def _preflight(self, scope: dict[str, Any], send: http.Send) -> None:
        """A CORS preflight (OPTIONS with Access-Control-Request-Method) from an allowed origin: 204 with
        the methods and the headers it asks for (an API key among them). Browsers send it without the
        key, so it needs none."""
        headers = {
            "access-control-allow-methods": CORS_METHODS,
            "access-control-allow-headers": http.header(scope, b"access-control-request-headers") or "",
            "access-control-max-age": str(CORS_MAX_AGE_S),
        }
        raw = [(k.encode(), v.encode("latin-1")) for k, v in headers.items() if v]
        await send({"type": "http.response.start", "status": 204, "headers": raw})
        await send({"type": "http.response.body", "body": b""})

    def _authorize(self, scope: dict[str, Any]) -> None:
        """The API key as a bearer token (OpenAI's clients) or in `x-api-key` (Anthropic's), on any route."""
        key = self.state.api_key.encode()
        scheme, _, token = (http.header(scope, b"authorization") or "").partition(" ")
        offered = [token.strip()] if scheme.lower() == "bearer" else []
        offered.append(http.header(scope, b"x-api-key") or "")
        if not any(hmac.compare_digest(k.encode(), key) for k in offered if k):
            raise APIError(
                401,
                "missing or wrong API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                code="invalid_api_key",
            )

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
