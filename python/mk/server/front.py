"""The public port of a data-parallel server (mk.server.replicas): an ASGI reverse proxy before the replicas.

Each replica is a whole `python -m mk.server`, which already does everything one server does at its edge
(the API key, CORS, body limits, the routes, OpenAI- and Anthropic-shaped errors, the default model), so
the front passes each request through to one replica as it came and the replica's answer back as it
comes (streams included): the client gets one server's answers. The front itself only chooses the replica
(mk.server.balancer: by the prompt's prefix, or the replica that stored the response a request names),
tries another when one cannot be reached, and merges the replicas' /metrics pages. It replaces
sglang-router, which has a fixed table of routes (no /v1/messages, /tokenize, ...) and checks keys and
parses bodies itself, with errors of its own: it could not be made transparent.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import httpx

from mk.server import http
from mk.server.app import ANTHROPIC_ROUTE, ANY_ORIGIN, RESPONSES_ROUTE, anthropic_route
from mk.server.balancer import Balancer
from mk.server.errors import APIError
from mk.server.merged_metrics import merge_pages

log = logging.getLogger("mk.server")

# Headers of one connection, not of the request or answer (RFC 9110 7.6.1).
HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer", b"transfer-encoding", b"upgrade"}
)
# Request headers the front does not pass on: the body it sends is whole (httpx sizes it) and goes to
# another host.
NOT_FORWARDED = HOP_BY_HOP | {b"host", b"content-length", b"expect"}
# The routes whose prompts are routed by their prefix, and the fields a prompt is made of, in the
# order a prompt renders them.
GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", ANTHROPIC_ROUTE, RESPONSES_ROUTE})
PROMPT_FIELDS = ("instructions", "system", "tools", "messages", "prompt", "input")
# The most characters of a prompt's text the router reads: a conversation is known by its first
# hundreds of thousands of tokens, and a larger request costs the router no more than this.
ROUTED_CHARS = 1 << 20
# Items of a list written at once while reading a prompt's start.
LIST_SLICE = 4096
# A Responses answer names its id first: `{"id":"resp_...` whole, in its first event streamed.
RESPONSE_ID = re.compile(rb'"id":"(resp_[A-Za-z0-9_-]+)"')
ID_SCAN_BYTES = 8192
RETRY_AFTER = {"Retry-After": "5"}


class Unreachable(Exception):
    """A replica gave no answer (it is down, or went down before answering)."""


def prompt_of(path: str, body: bytes) -> tuple[str | None, str | None]:
    """The text a request's prompt starts with (for prefix routing: at most `ROUTED_CHARS`), and the
    previous_response_id it names; (None, None) for a body that is no JSON object (the replica it
    goes to says what is wrong with it)."""
    try:
        obj = http.loads(body)
        if not isinstance(obj, dict):
            return None, None
        text = _leading_text([obj[f] for f in PROMPT_FIELDS if f in obj], ROUTED_CHARS)
    except (ValueError, RecursionError):
        return None, None
    previous = obj.get("previous_response_id") if path == RESPONSES_ROUTE else None
    return text or None, previous if isinstance(previous, str) else None


def _leading_text(values: list[Any], budget: int) -> str:
    """The first `budget` characters of the values written as compact JSON one after the other."""
    parts: list[str] = []
    for value in values:
        if budget <= 0:
            break
        parts.append((_list_start(value, budget) if isinstance(value, list) else http.compact(value))[:budget])
        budget -= len(parts[-1])
    return "".join(parts)


def _list_start(items: list[Any], budget: int) -> str:
    """`items` written as compact JSON, or where that is longer than `budget` characters, a start
    of it at least that long: written `LIST_SLICE` items at a time, so that a huge list costs no
    more than its first items."""
    parts, size = ["["], 1
    for start in range(0, len(items), LIST_SLICE):
        if size >= budget:
            return "".join(parts)
        parts.append(("," if start else "") + http.compact(items[start : start + LIST_SLICE])[1:-1])
        size += len(parts[-1])
    return "".join(parts) + "]"


class Front:
    """The ASGI app of the public port: every request to the replica the balancer chooses."""

    def __init__(
        self,
        urls: list[str],
        balancer: Balancer,
        client: httpx.AsyncClient,
        max_body_bytes: int,
        body_timeout: float,
        allowed_origins: frozenset[str] = frozenset(),
    ) -> None:
        self.urls, self.balancer, self.client = urls, balancer, client
        self.max_body_bytes, self.body_timeout = max_body_bytes, body_timeout
        self.allowed_origins = allowed_origins
        self.stopping = False  # the replicas are draining: a request none can take is refused as by one

    async def __call__(self, scope: dict[str, Any], receive: http.Receive, send: http.Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elif scope["type"] == "http":
            await self._http(scope, receive, send)

    async def _http(self, scope: dict[str, Any], receive: http.Receive, send: http.Send) -> None:
        started = False

        async def tracked_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._forward(scope, receive, tracked_send)
        except APIError as e:
            if not started:
                await self._error(scope, send, e)
        except ConnectionAbortedError:
            pass
        except Exception:
            log.exception("%s %s failed at the front", scope["method"], scope["path"])
            if not started:
                await self._error(scope, send, APIError(500, "internal error (see the server log)"))

    async def _forward(self, scope: dict[str, Any], receive: http.Receive, send: http.Send) -> None:
        path, method = scope["path"], scope["method"]
        headers = [(k, v) for k, v in scope["headers"] if k.lower() not in NOT_FORWARDED]
        body = await self._read(scope, receive)
        if body is None:
            await self._too_large(scope, headers, send)
            return
        if method == "GET" and path == "/metrics":
            await self._metrics(scope, headers, send)
            return
        text, named = None, None  # the prompt, and the stored response the request names
        if method == "POST" and path in GENERATION_ROUTES:
            parse = asyncio.to_thread if len(body) >= http.LARGE_BODY_BYTES else _now
            text, named = await parse(prompt_of, path, body)
        elif path.startswith(RESPONSES_ROUTE + "/") and path.count("/") == 3:  # GET or DELETE of a stored one
            named = path.removeprefix(RESPONSES_ROUTE + "/")
        owner = self.balancer.owner(named) if named else None
        work = self._to_any(scope, headers, body or None, send, text, owner, spread=method == "POST")
        await http.race_disconnect(work, receive)

    async def _to_any(
        self,
        scope: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
        content: bytes | None,
        send: http.Send,
        text: str | None,
        owner: int | None,
        spread: bool,
    ) -> None:
        """The request to the replica that holds what it names (`owner`), or else to the balancer's choice
        for its prompt `text`; to another when that one gives no answer."""
        tried: set[int] = set()
        learn = scope["method"] == "POST" and scope["path"] == RESPONSES_ROUTE
        while True:
            if owner is not None and owner not in tried and self.balancer.live[owner]:
                i = owner
            else:
                i = self.balancer.choose(text, frozenset(tried), spread)
            if i is None:
                raise self._unavailable()
            try:
                await self._relay(i, scope, headers, content, send, learn)
                return
            except Unreachable as e:
                log.warning(
                    "replica %d did not answer %s %s (%s); trying another", i, scope["method"], scope["path"], e
                )
                tried.add(i)

    async def _relay(
        self,
        i: int,
        scope: dict[str, Any],
        headers: list[tuple[bytes, bytes]],
        content: bytes | None,
        send: http.Send,
        learn: bool,
    ) -> None:
        """The request to replica `i`, and its answer back as it comes. Unreachable when the replica gives
        none; `learn`: a Responses answer's id is noted as this replica's."""
        request = self.client.build_request(scope["method"], self._url(i, scope), headers=headers, content=content)
        self.balancer.load[i] += 1
        try:
            try:
                response = await self.client.send(request, stream=True)
            except httpx.TransportError as e:
                raise Unreachable(str(e) or type(e).__name__) from None
            try:
                raw = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
                await send({"type": "http.response.start", "status": response.status_code, "headers": raw})
                seen = b"" if learn and response.status_code == 200 else None
                try:
                    async for chunk in response.aiter_raw():
                        if seen is not None:
                            seen += chunk
                            found = RESPONSE_ID.search(seen)
                            if found:
                                self.balancer.stored(found.group(1).decode(), i)
                            if found or len(seen) > ID_SCAN_BYTES:
                                seen = None
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except httpx.TransportError as e:  # the answer is cut off, as the replica's own would be
                    log.warning("replica %d broke off its answer to %s %s: %r", i, scope["method"], scope["path"], e)
                    raise ConnectionAbortedError from None
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                await response.aclose()
        finally:
            self.balancer.load[i] -= 1

    async def _metrics(self, scope: dict[str, Any], headers: list[tuple[bytes, bytes]], send: http.Send) -> None:
        """GET /metrics: every live replica's page merged; a replica's refusal (--protect-metrics) as it is."""
        live = [i for i, up in enumerate(self.balancer.live) if up]
        answers = await asyncio.gather(
            *(self.client.get(self.urls[i] + "/metrics", headers=headers) for i in live), return_exceptions=True
        )
        pages: dict[str, str] = {}
        first = None
        for i, answer in zip(live, answers, strict=True):
            if isinstance(answer, BaseException):
                continue  # gone in the meantime: its page is left out
            if answer.status_code != 200:
                await _send(send, answer.status_code, answer.headers.raw, answer.content)
                return
            pages[str(i)] = answer.text
            first = first or answer
        if first is None:
            raise self._unavailable()
        await _send(send, 200, first.headers.raw, merge_pages(pages))

    async def _read(self, scope: dict[str, Any], receive: http.Receive) -> bytes | None:
        """The request's whole body; None (the rest unread) once it is known to exceed the limit."""
        if self._declared_too_large(scope):
            return None
        chunks, size, more = [], 0, True
        while more:
            message = await http.receive_within(receive, self.body_timeout)
            if message["type"] == "http.disconnect":
                raise ConnectionAbortedError
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _declared_too_large(self, scope: dict[str, Any]) -> str | None:
        declared = http.header(scope, b"content-length")
        return declared if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes else None

    async def _too_large(self, scope: dict[str, Any], headers: list[tuple[bytes, bytes]], send: http.Send) -> None:
        """A body over the limit. One server answers what does not depend on the body (the route, the key,
        the method, the media type) before it reads any, then says 413 (mk.server.http.read_body); a replica
        answers the request without its body here, its 400 about that empty body standing for the 413."""
        tried: set[int] = set()
        while True:
            i = self.balancer.choose(None, frozenset(tried), spread=False)
            if i is None:
                raise self._unavailable()
            content = b"" if scope["method"] not in ("GET", "HEAD") else None
            try:
                answer = await self.client.request(
                    scope["method"], self._url(i, scope), headers=headers, content=content
                )
                break
            except httpx.TransportError:
                tried.add(i)
        if answer.status_code != 400:
            await _send(send, answer.status_code, answer.headers.raw, answer.content)
            return
        declared, limit = self._declared_too_large(scope), self.max_body_bytes
        if declared is not None:
            raise APIError(413, f"the request body has {declared} bytes; the limit is {limit}")
        raise APIError(413, f"the request body exceeds the limit of {limit} bytes")

    def _url(self, i: int, scope: dict[str, Any]) -> str:
        """The request's path and query on replica `i`."""
        target = scope.get("raw_path") or scope["path"].encode()
        if scope.get("query_string"):
            target += b"?" + scope["query_string"]
        return self.urls[i] + target.decode("latin-1")

    def _unavailable(self) -> APIError:
        if self.stopping:
            return APIError(503, "the server is shutting down", headers=RETRY_AFTER)
        return APIError(503, "no replica can take requests now (they are starting or restarting)", headers=RETRY_AFTER)

    async def _error(self, scope: dict[str, Any], send: http.Send, e: APIError) -> None:
        """An error of the front's own, shaped and with CORS headers as a replica's would be."""
        status, body = e.anthropic() if anthropic_route(scope["path"]) else (e.status, e.body())
        await http.send_json(send, status, body, {**e.headers, **self._cors(scope)})

    def _cors(self, scope: dict[str, Any]) -> dict[str, str]:
        """The CORS headers App gives a response (mk.server.app)."""
        allowed, origin = self.allowed_origins, http.header(scope, b"origin")
        if origin is None or not (ANY_ORIGIN in allowed or origin in allowed):
            return {}
        if ANY_ORIGIN in allowed:
            return {"access-control-allow-origin": ANY_ORIGIN}
        return {"access-control-allow-origin": origin, "vary": "Origin"}


async def _now(f, *args):
    return f(*args)


async def _send(send: http.Send, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """A whole answer, with `headers` but those of a connection and the length (the body's own)."""
    raw = [(k.lower(), v) for k, v in headers if k.lower() not in HOP_BY_HOP | {b"content-length"}]
    raw.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
