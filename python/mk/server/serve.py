"""Run an App under granian (embedded, in this process: the engine thread and the ASGI app share it).

SIGTERM or SIGINT drains: new requests get 503, running ones finish (up to `drain_timeout` s, then
they are cancelled), then the server stops and `serve` returns.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

from granian.constants import Interfaces
from granian.log import LogLevels
from granian.server.embed import Server

from mk.server.app import App

log = logging.getLogger("mk.server")


def check_port(host: str, port: int) -> None:
    """OSError naming the address when nothing could listen on it (in use, not ours, bad host)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(address)
    except OSError as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


async def serve(app: App, host: str, port: int, drain_timeout: float, debug: bool = False) -> None:
    server = Server(
        app,
        address=host,
        port=port,
        interface=Interfaces.ASGI,
        backlog=4096,
        backpressure=4096,
        log_level=LogLevels.debug if debug else LogLevels.error,
    )
    loop = asyncio.get_running_loop()
    stopping: list[asyncio.Task] = []

    async def shutdown(name: str) -> None:
        log.info("%s: draining (up to %.0f s), then stopping", name, drain_timeout)
        await app.drain(drain_timeout)
        server.stop()

    def on_signal(sig: signal.Signals) -> None:
        if stopping:  # a second signal: stop now
            server.stop()
            return
        stopping.append(loop.create_task(shutdown(sig.name)))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    log.info("serving %r on http://%s:%d", app.state.model_name, host, port)
    await server.serve()
    app.state.offload.close()
    app.state.engine.close()
    log.info("stopped")


def run(app: App, host: str, port: int, drain_timeout: float, debug: bool = False) -> None:
    """`serve` to its end, then the process ends at once, status 0. Not through the interpreter's
    shutdown: granian's Rust threads may still release Python objects of connections that ended
    with the server (a client's stalled body, say), and doing that while the interpreter
    finalizes aborts the process."""
    asyncio.run(serve(app, host, port, drain_timeout, debug))
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
