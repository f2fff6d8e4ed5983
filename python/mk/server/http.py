"""The little of ASGI HTTP the server needs: bounded body reads, JSON and SSE responses, disconnects."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from mk.server.errors import APIError

# Seconds a request's body may stall, nothing of it arriving, before the request is a 408 (the default
# of --body-timeout).
BODY_TIMEOUT_S = 60.0
# A body of this many bytes or more is a large one: it is parsed on a thread (never on the event
# loop), with a Python call per number and per object (`loads`: slower, but the thread then hands
# the GIL back between values, where the C decoder alone keeps it, and with it the event loop, for
# the whole parse), and it is prepared on one of the few threads kept for large requests
# (mk.server.offload).
LARGE_BODY_BYTES = 1 << 20
# The most strings, the most arrays and the most objects a large body may hold: far more than any
# request that fits a context uses, while the values whose parse has no Python hook (strings,
# arrays) and the freeing of the parsed objects stay short enough not to hold the event loop long.
MAX_VALUES = 1 << 19

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def compact(obj: Any) -> str:
    """`obj` as JSON without spaces, non-ASCII text as it is."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def dumps(obj: Any) -> bytes:
    return compact(obj).encode()


def header(scope: dict[str, Any], name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def read_body(scope: dict[str, Any], receive: Receive, limit: int, idle_timeout: float) -> bytes:
    """The whole request body; 413 as soon as it is known to exceed `limit` bytes, 408 where the client
    sends nothing of it for `idle_timeout` seconds."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"the request body has {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    while True:
        message = await receive_within(receive, idle_timeout)
        if message["type"] == "http.disconnect":
            raise ConnectionAbortedError
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def receive_within(receive: Receive, idle_timeout: float) -> dict[str, Any]:
    """The next ASGI message of a request's body, or a 408 where none comes within `idle_timeout`
    seconds: a client that stalls mid-body would otherwise hold its connection for good."""
    try:
        return await asyncio.wait_for(receive(), idle_timeout)
    except TimeoutError:
        raise APIError(
            408, f"the request body stalled: nothing of it came for {idle_timeout:g} s", code="request_timeout"
        ) from None


def require_json(scope: dict[str, Any]) -> None:
    """415 for a body declared as something other than JSON (no Content-Type at all is taken as JSON)."""
    declared = header(scope, b"content-type")
    if declared is None:
        return
    media = declared.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(
            415,
            f"the request body must be JSON (Content-Type: application/json), not {media!r}",
            code="unsupported_media_type",
        )


class TooManyValues(ValueError):
    """A large body with more strings, arrays or objects than any request needs (`MAX_VALUES`)."""


def loads(body: bytes, **hooks: Any) -> Any:
    """`json.loads(body)`, which leaves the GIL to other threads now and then on a large body
    (`LARGE_BODY_BYTES`), and refuses one with more than `MAX_VALUES` strings, arrays or objects
    before parsing it (TooManyValues); to be called off the event loop."""
    if len(body) >= LARGE_BODY_BYTES:
        _check_values(body)
        hooks = {"parse_int": _int, "parse_float": _float, "object_hook": _object, **hooks}
    return json.loads(body, **hooks)


def _check_values(body: bytes) -> None:
    """Raises TooManyValues where the body's characters alone show more than MAX_VALUES strings
    (unescaped quotes, two each), arrays or objects (brackets, braces: text may hold some too)."""
    quotes = body.count(b'"') - body.count(b'\\"')
    counts = {
        "JSON strings": quotes // 2,
        "'[' (JSON arrays, or brackets in its text)": body.count(b"["),
        "'{' (JSON objects, or braces in its text)": body.count(b"{"),
    }
    for what, n in counts.items():
        if n > MAX_VALUES:
            raise TooManyValues(f"the request body holds about {n:,} {what}; at most {MAX_VALUES:,} are accepted")


# Python-level hooks: each call is a point where the interpreter may switch threads.
def _int(digits: str) -> int:
    return int(digits)


def _float(digits: str) -> float:
    return float(digits)


def _object(members: dict[str, Any]) -> dict[str, Any]:
    return members


def parse_json(body: bytes) -> Any:
    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        return loads(body, parse_constant=no_constants)
    except TooManyValues as e:
        raise APIError(413, str(e), code="request_too_large") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None


async def send_json(send: Send, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
    body = dumps(obj)
    await send_bytes(send, status, body, "application/json", headers)


async def send_bytes(send: Send, status: int, body: bytes, content_type: str, headers: dict[str, str] | None) -> None:
    raw = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def start_sse(send: Send) -> None:
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})


async def send_event(send: Send, data: Any, name: str | None = None) -> None:
    """One server-sent event; `name` gives it an `event:` line (the Anthropic API names every event)."""
    payload = data.encode() if isinstance(data, str) else dumps(data)
    head = b"event: " + name.encode() + b"\n" if name else b""
    await send({"type": "http.response.body", "body": head + b"data: " + payload + b"\n\n", "more_body": True})


async def end_sse(send: Send) -> None:
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client goes away (call once the body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def race_disconnect(work: Awaitable[Any], receive: Receive) -> Any:
    """Run `work`; if the client disconnects first, cancel it and raise ConnectionAbortedError."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # the cancellation we asked for, or what the cancelled work raised
                pass
        watcher.cancel()
    if task.cancelled():
        raise ConnectionAbortedError
    return task.result()
