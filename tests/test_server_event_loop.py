"""A large request holds up no other: its body is parsed and its prompt tokenized off the event loop
(mk.server.offload), so /health and a short completion answer while it is prepared, on one server and
through the data-parallel front."""

import asyncio
import json
import random
import threading
import time

import httpx
import pytest
from server_util import ServerProcess, free_ports

from mk.default_model import EMBEDDED_DIR
from mk.server import http
from mk.server.errors import APIError
from mk.server.http import LARGE_BODY_BYTES
from mk.server.offload import Offload
from mk.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # (starts python -m mk.server)

CONTEXT = 131072
# Eight tenths of the size past which a prompt's size alone refuses it at this context (megabytes):
# this one is tokenized, seconds of work, and then refused for its millions of tokens.
PROMPT_BYTES = CONTEXT * Tokenizer.from_dir(EMBEDDED_DIR).max_token_bytes * 8 // 10
BIG_PROMPT = "a " * (PROMPT_BYTES // 2)
# How much slower than when idle a request may answer while the big one is prepared: far less than
# the seconds the big one takes, with room for a loaded CI machine.
SLACK_S = 0.5


@pytest.fixture(scope="module", params=[1, 2], ids=["one-server", "two-replicas"])
def server(request):
    """One server, and two replicas behind the data-parallel front (which must not freeze either)."""
    n = request.param
    replicas = ["--data-parallel-size", str(n), "--replica-base-port", str(free_ports(n))] if n > 1 else []
    s = ServerProcess("--device", "cpu", "--max-context", str(CONTEXT), *replicas).wait_ready()
    yield s
    assert s.stop() == 0, s.output()


def timed(request) -> float:
    start = time.monotonic()
    r = request()
    assert r.status_code == 200, r.text
    return time.monotonic() - start


@pytest.mark.parametrize(
    "path,big_body",
    [
        ("/v1/completions", {"prompt": BIG_PROMPT, "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BIG_PROMPT}], "max_tokens": 2}),
    ],
)
def test_health_and_a_short_completion_answer_while_a_long_prompt_is_tokenized(server, path, big_body):
    def health():
        return httpx.get(server.url + "/health", timeout=60)

    def short():
        body = {"prompt": "def f(", "max_tokens": 2, "temperature": 0}
        return httpx.post(server.url + "/v1/completions", json=body, timeout=60)

    idle_health = max(timed(health) for _ in range(5))
    idle_short = max(timed(short) for _ in range(3))
    body = json.dumps(big_body).encode()
    big: dict = {}

    def send_big():
        start = time.monotonic()
        r = httpx.post(server.url + path, content=body, timeout=300)
        big.update(response=r, elapsed=time.monotonic() - start, done=time.monotonic())

    sender = threading.Thread(target=send_big)
    sender.start()
    time.sleep(0.5)  # the body is across (loopback) and being tokenized
    health_during, short_during = [], []
    while sender.is_alive():
        health_during.append((timed(health), time.monotonic()))
        if len(health_during) == 3:
            short_during.append((timed(short), time.monotonic()))
        time.sleep(0.05)
    sender.join()

    r = big["response"]
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "at least" not in message, "refused by its size: the test needs a prompt that is tokenized"
    assert int(message.split("has ")[1].split(" tokens")[0]) > CONTEXT
    # Long enough that a loop held by the tokenizer would have kept the probes waiting past the bound.
    assert big["elapsed"] > idle_health + SLACK_S + 1.0, big["elapsed"]
    in_flight = [t for t, at in health_during if at < big["done"]]
    assert max(in_flight, default=0.0) < idle_health + SLACK_S, (idle_health, in_flight)
    assert len(in_flight) >= 3, health_during
    assert short_during and short_during[0][1] < big["done"], "the short completion came after the big one"
    assert short_during[0][0] < idle_short + SLACK_S, (idle_short, short_during)


def test_large_jobs_leave_threads_to_small_ones_and_hold_theirs_until_they_end():
    started: list[str] = []
    gate = threading.Event()

    def job(name: str) -> str:
        started.append(name)
        assert gate.wait(30)
        return name

    async def run() -> None:
        offload = Offload(threads=3, large_jobs=1)
        first = asyncio.create_task(offload.run(LARGE_BODY_BYTES, job, "large 1"))
        second = asyncio.create_task(offload.run(LARGE_BODY_BYTES, job, "large 2"))
        assert await asyncio.wait_for(offload.run(LARGE_BODY_BYTES - 1, str, "small"), 10) == "small"
        while not started:
            await asyncio.sleep(0.01)
        first.cancel()  # its client went away; the job runs on, and keeps its thread and permit
        await asyncio.sleep(0.2)
        assert started == ["large 1"]
        gate.set()
        assert await asyncio.wait_for(second, 10) == "large 2"
        assert first.cancelled()
        offload.close()

    asyncio.run(run())


def tree_rss_bytes(pid: int) -> int:
    """Resident memory of a process and its descendants (Linux /proc)."""
    total = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) * 1024
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(c) for c in f.read().split()]
    except (FileNotFoundError, ProcessLookupError, StopIteration):
        return total
    return total + sum(tree_rss_bytes(c) for c in children)


def test_memory_goes_back_after_a_long_prompt(server):
    """The memory a long prompt's tokenization took is returned once it is refused: resident memory
    within a fifth of its size before, after two of them (a retained encoding or a C heap kept by the
    preparing thread would hold hundreds of megabytes each)."""
    short = {"prompt": "def f(", "max_tokens": 2, "temperature": 0}
    for _ in range(3):
        assert httpx.post(server.url + "/v1/completions", json=short, timeout=60).status_code == 200
    before = tree_rss_bytes(server.proc.pid)
    body = json.dumps({"prompt": BIG_PROMPT, "max_tokens": 2}).encode()
    for _ in range(2):
        r = httpx.post(server.url + "/v1/completions", content=body, timeout=300)
        assert r.status_code == 400 and "at least" not in r.text, r.text  # (tokenized, not refused by size)
    after = tree_rss_bytes(server.proc.pid)
    assert after < 1.2 * before, (before / 2**20, after / 2**20)


def test_a_large_body_is_parsed_with_python_hooks_and_to_the_same_values(monkeypatch):
    """From LARGE_BODY_BYTES on, every number and object of a body passes through a Python-level hook
    (where the parsing thread may hand the GIL to the event loop), and the values are json.loads'."""
    calls = {"int": 0, "float": 0, "object": 0}
    for name, hook in (("int", http._int), ("float", http._float), ("object", http._object)):
        monkeypatch.setattr(
            http, f"_{name}", lambda s, hook=hook, name=name: calls.__setitem__(name, calls[name] + 1) or hook(s)
        )
    rng = random.Random()
    small = {"prompt": [rng.randrange(1 << 20) for _ in range(100)], "temperature": rng.random(), "x": [{"a": -1e-3}]}
    assert http.parse_json(json.dumps(small).encode()) == small and calls == {"int": 0, "float": 0, "object": 0}
    ids = [rng.randrange(1 << 20) for _ in range(LARGE_BODY_BYTES // 4)]
    large = {**small, "prompt": ids, "logit": [rng.uniform(-1e6, 1e6) for _ in range(1000)], "n": -7}
    body = json.dumps(large).encode()
    assert len(body) >= LARGE_BODY_BYTES
    parsed = http.parse_json(body)
    assert parsed == json.loads(body) == large
    assert calls == {"int": len(ids) + 1, "float": 1000 + 2, "object": 2}


def test_a_large_body_with_too_many_values_is_refused_before_it_is_parsed(monkeypatch):
    """Strings and arrays parse with no Python hook, and millions of parsed values take long to free:
    a large body that holds more than MAX_VALUES of them is a 413 before the decoder runs. Escaped
    quotes in text are no strings, and a body at the limit parses."""
    at_limit = json.dumps({"prompt": ["ab"] * (http.MAX_VALUES - 1)}).encode()  # (+1: the key)
    assert len(at_limit) >= LARGE_BODY_BYTES
    assert len(http.parse_json(at_limit)["prompt"]) == http.MAX_VALUES - 1
    quoted = json.dumps({"prompt": '"' * (2 * http.MAX_VALUES)}).encode()
    assert http.parse_json(quoted)["prompt"].count('"') == 2 * http.MAX_VALUES
    parsed = []
    monkeypatch.setattr(http.json, "loads", lambda *a, **k: parsed.append(1))
    for body, what in [
        ({"prompt": ["ab"] * http.MAX_VALUES}, "JSON strings"),
        ({"prompt": [[1]] * (http.MAX_VALUES + 1)}, "JSON arrays"),
        ({"messages": [{}] * (http.MAX_VALUES + 1)}, "JSON objects"),
    ]:
        with pytest.raises(APIError) as refused:
            http.parse_json(json.dumps(body).encode())
        assert refused.value.status == 413 and what in str(refused.value), str(refused.value)
    assert not parsed
