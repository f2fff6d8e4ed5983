"""Request preparation off the event loop: parsing a body, rendering a chat, tokenizing prompts and
building grammars run on a few threads, so that the loop only moves bytes and /health and running
streams answer while a large request is prepared.

This works because that work leaves the GIL to the loop: the tokenizer's batch calls release it while
they encode, Python code yields it every few milliseconds, and a large body is parsed with Python
hooks between its values (mk.server.http.loads). A single C call that keeps it (the JSON decoder on
one long array of strings) still holds the loop for as long as it runs.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from mk.server.http import LARGE_BODY_BYTES

T = TypeVar("T")

# Threads preparing requests.
THREADS = 4
# Of them, at most this many prepare a large request at once, so that small requests always find a
# thread: a few multi-megabyte prompts cannot queue a short one behind seconds of tokenizing.
LARGE_JOBS = 2


class Offload:
    """A bounded thread pool for request preparation (one per server)."""

    def __init__(self, threads: int = THREADS, large_jobs: int = LARGE_JOBS) -> None:
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="mk-prepare")
        self._large = asyncio.Semaphore(large_jobs)

    async def run(self, body_bytes: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a pool thread, for a request of `body_bytes` bytes. Cancelling the caller
        drops a job that has not started; one that has runs to its end."""
        if body_bytes < LARGE_BODY_BYTES:
            return await asyncio.wrap_future(self._pool.submit(fn, *args))
        loop = asyncio.get_running_loop()
        await self._large.acquire()
        try:
            job = self._pool.submit(_then_trim, fn, *args)
        except BaseException:
            self._large.release()
            raise
        # The permit comes back when the job ends, not when its caller does: a request abandoned
        # mid-job (its client went away) still holds a thread until then.
        job.add_done_callback(lambda _: _on_loop(loop, self._large.release))
        return await asyncio.wrap_future(job)

    def close(self) -> None:
        """Drop the jobs not started; those running finish on their threads."""
        self._pool.shutdown(wait=False, cancel_futures=True)


def _then_trim(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, then the C heap's free memory handed back to the system: a large request's
    tokenization leaves hundreds of megabytes free in the preparing thread's malloc arena, which glibc
    keeps for that thread otherwise (the process would stay that much larger for good)."""
    try:
        return fn(*args)
    finally:
        if _malloc_trim is not None:
            _malloc_trim(0)


def _libc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, where the C library has it."""
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc_malloc_trim()


def _on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], Any]) -> None:
    """Call `fn` on `loop` from any thread (nothing once the loop is closed: the server has stopped)."""
    try:
        loop.call_soon_threadsafe(fn)
    except RuntimeError:
        pass
