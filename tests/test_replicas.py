"""`python -m mk.server --data-parallel-size N`: CPU replicas behind the front, on loopback.

The replica choice and the metrics merge without processes; then one parent process (two CPU replicas of
the built-in model and the front) serves the module's tests in order, beside one server of the same
options that it must answer like (statuses, headers, error bodies word for word, other bodies' shapes);
the last test kills a replica and then stops the parent with SIGTERM while a stream is in flight."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jsonschema
import pytest
from server_util import ServerProcess, free_ports

from mk.server import replicas
from mk.server.__main__ import parse_args
from mk.server.balancer import BALANCE_ABS, BLOCK_CHARS, Balancer, prefix_blocks
from mk.server.front import ROUTED_CHARS, prompt_of
from mk.server.merged_metrics import merge_pages

pytestmark = pytest.mark.slow  # (starts data-parallel servers and single servers)

KEY = "replica-test-key"
ROOT = Path(__file__).resolve().parent.parent


# ---- the parts, without processes ----------------------------------------------------------------
def test_a_replica_gets_the_parents_options_but_its_own_loopback_address():
    argv = ["--data-parallel-size", "2", "--device", "cpu", "--host=0.0.0.0", "--port=9000"]
    argv += ["--replica-base-port=9100", "--api-key", "k", "--max-batch", "4"]
    child = replicas.child_argv(argv, 9101)
    assert child[:3] == [sys.executable, "-m", "mk.server"]
    assert child[3:] == [
        "--device",
        "cpu",
        "--api-key",
        "k",
        "--max-batch",
        "4",
        "--host",
        "127.0.0.1",
        "--port",
        "9101",
    ]


def test_each_replica_gets_one_gpu_or_none():
    assert replicas.replica_devices(3, "cpu", ["0", "1"]) == ["", "", ""]
    assert replicas.replica_devices(2, "auto", []) == ["", ""]
    assert replicas.replica_devices(2, "auto", ["3", "5", "6"]) == ["3", "5"]
    with pytest.raises(replicas.ReplicaError, match="one replica per GPU, and 1 is visible"):
        replicas.replica_devices(2, "cuda", ["0"])
    with pytest.raises(replicas.ReplicaError, match="2 are visible"):
        replicas.replica_devices(4, "auto", ["0", "1"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--replica-base-port", "9000"], "is for --data-parallel-size 2 or more"),
        (["--data-parallel-size", "0"], "must be at least 1"),
        (["--data-par", "2"], "unrecognized arguments"),  # no abbreviations: they would reach the replicas
    ],
)
def test_bad_data_parallel_options_are_one_line_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_a_missing_httpx_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "httpx" else real(name))
    with pytest.raises(replicas.ReplicaError, match=r"pip install 'httpx>=0.27' \(or pip install 'mk\[replicas\]'\)"):
        replicas.check_installed()


# ---- choosing the replica ----------------------------------------------------------------------------
def live_balancer(n: int = 2, **kwargs) -> Balancer:
    b = Balancer(n, **kwargs)
    b.live = [True] * n
    return b


def prompt(tag: str, blocks: int) -> str:
    """A text of `blocks` whole blocks, `tag` in the first."""
    return (tag * BLOCK_CHARS)[:BLOCK_CHARS] + "x" * BLOCK_CHARS * (blocks - 1)


def test_a_prompt_goes_where_its_prefix_went_and_a_new_one_to_the_emptiest_replica():
    b = live_balancer(3)
    shared = prompt("s", 10)
    assert b.choose(shared + "tail one") == 0  # all alike: the first
    assert b.choose(shared + "y" * 200) == 0  # 10 of its 13 blocks are replica 0's
    assert b.choose(prompt("t", 4)) == 1  # nothing held anywhere: the emptiest table
    assert b.choose(prompt("u", 4)) == 2
    assert b.choose(prompt("t", 4) + "more" * 100) == 1
    # A prefix below the threshold's share of the prompt does not hold it (the emptiest table gets it).
    assert b.choose(prompt("s", 2) + "q" * BLOCK_CHARS * 8) == 2
    assert b.choose(prompt("s", 3) + "r" * BLOCK_CHARS * 7) == 0
    # Shorter than a block: no prefix to follow; the least loaded, then the emptiest, replica.
    b.load = [0, 0, 0]
    assert b.choose("short") == min(range(3), key=lambda i: (len(b._tables[i]), i))


def test_load_decides_between_equals_and_overrides_a_prefix_when_unbalanced():
    b = live_balancer(2)
    text = prompt("a", 8)
    assert b.choose(text) == 0
    b.load = [3, 0]
    assert b.choose(text) == 0  # its prefix is there: load within the bounds
    assert b.choose(prompt("b", 8)) == 1  # a new prefix: the least loaded
    b.load = [BALANCE_ABS + 10, 1]
    assert b.choose(text) == 1  # too unbalanced: the least loaded
    assert b.choose(None) == 1 and b.choose(None, spread=False) == 0


def test_only_live_replicas_not_excluded_are_chosen():
    b = live_balancer(3)
    text = prompt("a", 8)
    assert b.choose(text) == 0
    assert b.choose(text, exclude=frozenset({0})) in (1, 2)
    b.live = [False, False, True]
    assert b.choose(text) == 2 and b.choose(None, spread=False) == 2
    b.live = [False] * 3
    assert b.choose(text) is None and b.choose(None) is None


def test_a_prompts_leading_blocks_are_forgotten_last():
    b = live_balancer(2, table_blocks=12)
    first = prompt("a", 8)
    assert b.choose(first) == 0
    b.load = [1, 0]  # (otherwise replica 0 would take the rest too)
    assert b.choose(prompt("b", 8)) == 1
    b.load = [0, 0]
    assert b.choose(prompt("c", 6)) == 0  # the emptiest: 6 of "c" evict 2 of "a"'s, its last ones
    assert b._held(0, prefix_blocks(first)) == 6
    assert b.choose(first) == 0  # still enough of it held


def test_a_stored_response_is_its_replicas_until_that_replica_exits():
    b = live_balancer(2)
    b.stored("resp_a", 1)
    b.stored("resp_b", 0)
    assert b.owner("resp_a") == 1 and b.owner("resp_b") == 0 and b.owner("resp_c") is None
    b.live[1] = False  # routed around: not its owner meanwhile
    assert b.owner("resp_a") is None
    b.live[1] = True
    assert b.owner("resp_a") == 1
    b.forget(1)  # exited: its store is gone
    assert b.owner("resp_a") is None and b.owner("resp_b") == 0


def test_the_prompt_is_read_from_the_fields_that_make_it():
    chat = {"model": "m", "max_tokens": 5, "tools": [{"type": "function"}], "messages": [{"role": "user"}]}
    text, previous = prompt_of("/v1/chat/completions", json.dumps(chat).encode())
    assert text == '[{"type":"function"}][{"role":"user"}]' and previous is None
    longer = {**chat, "max_tokens": 9, "messages": [{"role": "user"}, {"role": "assistant"}]}
    assert prompt_of("/v1/chat/completions", json.dumps(longer).encode())[0].startswith(text[:-1])
    body = json.dumps({"input": "hi", "previous_response_id": "resp_1", "instructions": "be"}).encode()
    assert prompt_of("/v1/responses", body) == ('"be""hi"', "resp_1")
    assert prompt_of("/v1/completions", b'{"prompt": "def f(x):"}') == ('"def f(x):"', None)
    assert prompt_of("/v1/completions", b"not json") == (None, None)
    assert prompt_of("/v1/completions", b"[1, 2]") == (None, None)
    assert prompt_of("/v1/completions", b'{"max_tokens": 1}') == (None, None)


def test_the_router_reads_only_the_start_of_a_huge_prompt():
    """A prompt of millions of token ids gives the router its first ROUTED_CHARS characters, the
    same ones a whole dump would start with; a short prompt's text is whole."""
    ids = list(range(200_000, 200_000 + 400_000))
    body = json.dumps({"prompt": ids, "max_tokens": 1, "system": "s"}).encode()
    text, _ = prompt_of("/v1/completions", body)
    whole = '"s"' + json.dumps(ids, separators=(",", ":"))
    assert len(whole) > ROUTED_CHARS and text == whole[:ROUTED_CHARS]
    nested = {"messages": [{"role": "user", "content": "x" * 50}] * 3, "tools": [[1], "t"]}
    text, _ = prompt_of("/v1/chat/completions", json.dumps(nested).encode())
    assert text == json.dumps(nested["tools"], separators=(",", ":")) + json.dumps(
        nested["messages"], separators=(",", ":")
    )


def test_the_metrics_pages_merge_into_one_family_each_with_the_replica_as_a_label():
    from prometheus_client.parser import text_string_to_metric_families

    from mk.server.metrics import Metrics

    pages = {}
    for i in range(2):
        m = Metrics("mk-x")
        for _ in range(i + 1):
            m.response(404)
        pages[str(i)] = m.render().decode()
    merged = merge_pages(pages).decode()
    families = {f.name: f for f in text_string_to_metric_families(merged)}
    assert set(families) == {f.name for f in text_string_to_metric_families(pages["0"])}
    assert merged.count("# TYPE mk_http_responses_total counter") == 1
    got = {(s.labels["replica"], s.labels["status"]): s.value for s in families["mk_http_responses"].samples}
    assert got[("0", "404")] == 1 and got[("1", "404")] == 2


# ---- the data-parallel server, and one server to compare it with ------------------------------------
ORIGIN = "https://app.example"
# Both servers' options: a small body limit, so that a body over it is cheap to send.
COMMON = ["--device", "cpu", "--api-key", KEY, "--allowed-origins", ORIGIN, "--max-body-mb", "1"]
COMMON += ["--max-batch", "8", "--max-context", "2048", "--drain-timeout", "10", "--stats-interval", "60"]


class Parent:
    """The data-parallel parent process and what its log says about its children."""

    def __init__(self) -> None:
        self.base = free_ports(2)
        self.port = free_ports(1)
        while self.base <= self.port < self.base + 2:
            self.port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mk-replicas-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "mk.server", "--data-parallel-size", "2", *COMMON]
        cmd += ["--port", str(self.port), "--replica-base-port", str(self.base)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ))

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_for(self, pattern: str, timeout: float, after: int = 0) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.compile(pattern).search(self.output(), after)
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} in the log within {timeout} s:\n{self.output()[-6000:]}")

    def pids(self) -> dict[str, int]:
        """The latest pid of each replica the log names ('replica 0', 'replica 1')."""
        out = {}
        for m in re.finditer(r"INFO mk\.server: (replica \d+): .* \(pid (\d+)\)", self.output()):
            out[m.group(1)] = int(m.group(2))
        return out

    def replica_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.base + i}"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def servers():
    """The data-parallel server, and one server of the same options (started together)."""
    parent, single = Parent(), ServerProcess(*COMMON)
    try:
        parent.wait_for(r"serving on http://127\.0\.0\.1:\d+: 2 replicas \(cache-aware routing\)", 180)
        single.wait_ready(180)
        yield parent, single
    finally:
        single.stop()
        parent.stop()
        for pid in parent.pids().values():  # nothing left behind, whatever the tests did
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        Path(parent.log.name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def parent(servers):
    return servers[0]


@pytest.fixture(scope="module")
def client(parent):
    import openai

    return openai.OpenAI(base_url=parent.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


MODEL = "mk-embedded"
AUTH = {"Authorization": f"Bearer {KEY}"}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
# The headers one server's answers carry that a client or browser acts on.
COMPARED_HEADERS = ("content-type", "retry-after", "access-control-allow-origin", "vary", "cache-control")
COMPARED_HEADERS += ("access-control-allow-methods", "access-control-allow-headers", "access-control-max-age")


def shape(value):
    """A JSON value with every leaf replaced by its type's name."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    return type(value).__name__


def ask(server, method: str, path: str, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {**({"Authorization": f"Bearer {key}"} if key else {}), **kwargs.pop("headers", {})}
    return httpx.request(method, server.url + path, headers=headers, timeout=120, **kwargs)


def same(servers, method: str, path: str, exact: bool = False, **kwargs) -> tuple[httpx.Response, httpx.Response]:
    """The same request to both servers: the same status and headers, and the same body (`exact`) or a
    body of the same shape."""
    dp, one = (ask(s, method, path, **kwargs) for s in servers)
    where = f"{method} {path}: {dp.status_code} {dp.text[:500]!r} / {one.status_code} {one.text[:500]!r}"
    assert dp.status_code == one.status_code, where
    for h in COMPARED_HEADERS:
        assert dp.headers.get(h) == one.headers.get(h), f"{where}: {h}"
    if exact:
        assert dp.content == one.content, where
    elif dp.headers.get("content-type") == "application/json" and method != "HEAD":
        assert shape(dp.json()) == shape(one.json()), where
    return dp, one


def test_generation_without_a_model_answers_as_one_server(servers):
    dp, _ = same(servers, "POST", "/v1/completions", json={"prompt": "import os\n", "max_tokens": 4, "temperature": 0})
    assert dp.status_code == 200 and dp.json()["model"] == MODEL
    chat = {
        "messages": [{"role": "user", "content": "def add(a, b):"}],
        "max_tokens": 4,
        "temperature": 0,
        **NO_THINKING,
    }
    dp, _ = same(servers, "POST", "/v1/chat/completions", json=chat)
    assert dp.status_code == 200 and dp.json()["model"] == MODEL


def test_models_and_auth_answer_as_one_server(servers):
    for key in (KEY, None, "wrong"):
        dp, _ = same(servers, "GET", "/v1/models", key=key)
        assert dp.status_code == (200 if key == KEY else 401)
        dp, _ = same(servers, "GET", f"/v1/models/{MODEL}", key=key)
        assert dp.status_code == (200 if key == KEY else 401)
        if key != KEY:  # an error's body is the same, word for word
            same(servers, "GET", "/v1/models", key=key, exact=True)
    dp, _ = same(servers, "GET", "/v1/models/other", exact=True)
    assert dp.json()["error"]["code"] == "model_not_found"
    # Anthropic's clients send x-api-key, and get Anthropic's error bodies.
    body = {"max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    dp, _ = same(servers, "POST", "/v1/messages", key=None, headers={"x-api-key": "wrong"}, json=body, exact=True)
    assert dp.status_code == 401 and dp.json()["type"] == "error"
    same(servers, "POST", "/v1/messages", key=None, headers={"x-api-key": KEY}, json=body)
    for path in ("/v1/completions", "/v1/responses", "/tokenize", "/v1/responses/resp_x"):
        dp, _ = same(servers, "POST" if "resp_x" not in path else "GET", path, key=None, json={}, exact=True)
        assert dp.status_code == 401
    assert same(servers, "GET", "/health", key=None, exact=True)[0].status_code == 200  # probes need no key
    assert same(servers, "HEAD", "/health", key=None)[0].status_code == 200


def test_bad_requests_answer_as_one_server(servers):
    chat = {"messages": [{"role": "user", "content": "x"}]}
    cases = [
        ("POST", "/v1/completions", {"json": {"model": "other", "prompt": "x"}}),  # 404 model_not_found
        ("POST", "/v1/chat/completions", {"json": {**chat, "temperature": 5}}),
        ("POST", "/v1/chat/completions", {"json": {**chat, "max_token": 5}}),
        ("POST", "/v1/completions", {"content": b"{not json", "headers": {"Content-Type": "application/json"}}),
        ("POST", "/v1/completions", {"content": b"x", "headers": {"Content-Type": "text/plain"}}),  # 415
        ("POST", "/v1/messages", {"json": {"max_tokens": -1, "messages": []}}),
        ("POST", "/v1/responses", {"json": {"input": "x", "previous_response_id": "resp_nope"}}),
        ("POST", "/detokenize", {"json": {"tokens": [10**9]}}),
        ("GET", "/v1/completions", {}),  # 405
        ("GET", "/workers", {}),  # 404: no route, as on one server
        ("GET", "/v1/responses/resp_nope", {}),
        ("DELETE", "/v1/responses/resp_nope", {}),
    ]
    for method, path, kwargs in cases:
        dp, _ = same(servers, method, path, exact=True, **kwargs)
        assert 400 <= dp.status_code < 500, (path, dp.text)
        body = dp.json()
        assert set(body["error"]) == (
            {"type", "message"} if "messages" in path else {"message", "type", "param", "code"}
        )


def test_a_body_over_the_limit_answers_as_one_server(servers):
    big = b'{"prompt": "' + b"x" * (2 << 20) + b'"}'
    json_type = {"Content-Type": "application/json"}

    def chunked():  # no Content-Length: the limit is found while reading
        for i in range(0, len(big), 1 << 16):
            yield big[i : i + (1 << 16)]

    for path, key in [("/v1/completions", KEY), ("/v1/messages", KEY), ("/v1/completions", None), ("/nope", None)]:
        dp, _ = same(servers, "POST", path, key=key, content=big, headers=json_type, exact=True)
        assert dp.status_code == (413 if key else 401 if path != "/nope" else 404), dp.text
    dp, one = (ask(s, "POST", "/v1/completions", content=chunked(), headers=json_type) for s in servers)
    assert dp.status_code == one.status_code == 413 and dp.content == one.content


def test_cors_answers_as_one_server(servers):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
    preflight["Access-Control-Request-Headers"] = "authorization, content-type"
    dp, _ = same(servers, "OPTIONS", "/v1/chat/completions", key=None, headers=preflight, exact=True)
    assert dp.status_code == 204 and dp.headers["access-control-allow-origin"] == ORIGIN
    for origin in (ORIGIN, "https://elsewhere.example"):
        dp, _ = same(servers, "GET", "/v1/models", headers={"Origin": origin})
        assert dp.headers.get("access-control-allow-origin") == (ORIGIN if origin == ORIGIN else None)
        dp, _ = same(servers, "GET", "/v1/models", key=None, headers={"Origin": origin}, exact=True)
        assert dp.status_code == 401


def test_tokenize_and_count_tokens_answer_as_one_server(servers):
    dp, _ = same(servers, "POST", "/tokenize", json={"prompt": "def f(x):", "return_token_strs": True}, exact=True)
    tokens = dp.json()["tokens"]
    assert dp.status_code == 200 and tokens
    same(servers, "POST", "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, exact=True)
    assert same(servers, "POST", "/detokenize", json={"tokens": tokens}, exact=True)[0].json()["prompt"]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert same(servers, "POST", "/v1/messages/count_tokens", json=body, exact=True)[0].status_code == 200
    same(servers, "POST", "/v1/responses/input_tokens", json={"input": "hi"}, exact=True)


def test_messages_answers_as_one_server(servers):
    body = {"max_tokens": 6, "temperature": 0, "messages": [{"role": "user", "content": "Write a sort function."}]}
    dp, _ = same(servers, "POST", "/v1/messages", json=body)
    assert dp.status_code == 200 and dp.json()["type"] == "message"


def sse(response: httpx.Response) -> list[tuple[str | None, str]]:
    """A stream's events as (name, data)."""
    out = []
    for block in response.text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines.get("event"), lines["data"]))
    return out


def test_streams_answer_as_one_server(servers):
    chat = {"messages": [{"role": "user", "content": "def add(a, b):"}], "max_tokens": 6, "stream": True}
    chat["temperature"] = 0
    chat |= {"stream_options": {"include_usage": True}, **NO_THINKING}
    dp, one = same(servers, "POST", "/v1/chat/completions", json=chat)
    assert dp.headers["content-type"] == "text/event-stream"
    events, expected = sse(dp), sse(one)
    assert events[-1] == (None, "[DONE]") and expected[-1] == (None, "[DONE]")
    assert shape(json.loads(events[0][1])) == shape(json.loads(expected[0][1]))
    assert json.loads(events[-2][1])["usage"]["completion_tokens"] == 6
    body = {"max_tokens": 6, "temperature": 0, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    dp, one = same(servers, "POST", "/v1/messages", json=body)
    names = [name for name, _ in sse(dp)]
    assert names[0] == "message_start" and names[-1] == "message_stop"
    assert names[0] == sse(one)[0][0] and names[-1] == sse(one)[-1][0]
    body = {"input": "hi", "max_output_tokens": 6, "temperature": 0, "stream": True}
    dp, one = same(servers, "POST", "/v1/responses", json=body)
    assert sse(dp)[0][0] == "response.created" and sse(dp)[-1][0] == sse(one)[-1][0] == "response.incomplete"


def test_chained_responses_reach_the_replica_that_stored_them(servers, parent):
    """Follow-ups name responses that each replica stored (their inputs were routed to both), and every
    one works, as on one server; so do GET and DELETE of a stored response."""
    no_reasoning = {"max_output_tokens": 4, "temperature": 0, "reasoning": {"effort": "none"}}
    chains: list[list[str]] = []  # each chain's latest response: [on the data-parallel server, on the one]
    for n in range(4):
        first = f"Chain {n}: " + f"write a function number {n} that adds its arguments. " * 3
        dp, one = same(servers, "POST", "/v1/responses", json={"input": first, **no_reasoning})
        assert dp.status_code == 200, dp.text
        chains.append([dp.json()["id"], one.json()["id"]])
    holders = set()
    for dp_id, _ in chains:
        at = [httpx.get(parent.replica_url(i) + f"/v1/responses/{dp_id}", headers=AUTH, timeout=30) for i in (0, 1)]
        assert [a.status_code for a in at].count(200) == 1
        holders.add(next(i for i in (0, 1) if at[i].status_code == 200))
    assert holders == {0, 1}  # both replicas hold some: the follow-ups must find theirs
    for turn in range(2):
        for chain in chains:
            follow = f"Turn {turn}: now " + "make it handle lists of numbers as well, please. " * 3
            answers = [
                ask(
                    server, "POST", "/v1/responses", json={"input": follow, "previous_response_id": rid, **no_reasoning}
                )
                for server, rid in zip(servers, chain, strict=True)
            ]
            assert [a.status_code for a in answers] == [200, 200], answers[0].text
            assert shape(answers[0].json()) == shape(answers[1].json())
            assert answers[0].json()["previous_response_id"] == chain[0]
            chain[:] = [a.json()["id"] for a in answers]
    for chain in chains:
        got = [ask(server, "GET", f"/v1/responses/{rid}") for server, rid in zip(servers, chain, strict=True)]
        assert [g.status_code for g in got] == [200, 200] and got[0].json()["id"] == chain[0]
        gone = [ask(server, "DELETE", f"/v1/responses/{rid}") for server, rid in zip(servers, chain, strict=True)]
        assert [g.status_code for g in gone] == [200, 200] and gone[0].json()["deleted"] is True
        again = [ask(server, "GET", f"/v1/responses/{rid}") for server, rid in zip(servers, chain, strict=True)]
        assert [a.status_code for a in again] == [404, 404]
        assert again[0].text.replace(chain[0], "ID") == again[1].text.replace(chain[1], "ID")


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_the_openai_client_works_through_the_public_port(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    # Without the thinking section, so that the 12 tokens are the answer's content.
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=12,
        temperature=0,
        extra_body=NO_THINKING,
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 12
    pieces = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINKING,
    )
    chunks = list(pieces)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    called = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice=named,
        temperature=0,
        max_tokens=160,
    )
    (call,) = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and called.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def test_32_concurrent_streams_give_the_solo_texts(client):
    prompts = [f"def f{i}(x):\n    return" for i in range(8)]

    def run(prompt: str) -> str:
        stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in stream if c.choices)

    solo = {p: run(p) for p in prompts}
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        jobs = [(p, pool.submit(run, p)) for p in prompts * 4]
        for p, job in jobs:
            assert job.result(timeout=300) == solo[p], p


def replica_metric(parent: Parent, i: int, name: str) -> float:
    text = httpx.get(parent.replica_url(i) + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + " ", name + "{")))


def test_requests_sharing_a_prefix_go_to_the_replica_that_has_it(client, parent):
    prefix = "".join(f"def helper_{i}(value):\n    return value * {i} + {i * 7}\n\n" for i in range(40))
    before = [replica_metric(parent, i, "mk_prefix_cache_hits_total") for i in (0, 1)]
    for suffix in ("first", "second", "third", "fourth", "fifth", "sixth"):
        client.completions.create(model=MODEL, prompt=prefix + f"# {suffix}\n", max_tokens=2, temperature=0)
    gained = [replica_metric(parent, i, "mk_prefix_cache_hits_total") - before[i] for i in (0, 1)]
    assert sorted(gained) == [0, 5], gained  # the first request fills one replica's cache, the rest hit it


def test_metrics_merge_every_replicas_page(servers, parent):
    dp, one = same(servers, "GET", "/metrics", key=None)
    assert dp.status_code == 200
    families = lambda text: set(re.findall(r"^# TYPE (\S+)", text, re.M))  # noqa: E731
    assert families(dp.text) == families(one.text)
    assert set(re.findall(r'replica="(\d)"', dp.text)) == {"0", "1"}
    requests = [replica_metric(parent, i, "mk_requests_total") for i in (0, 1)]
    merged = sum(float(line.rsplit(" ", 1)[1]) for line in dp.text.splitlines() if line.startswith("mk_requests_total"))
    assert merged == sum(requests) > 0


def test_a_killed_replica_is_routed_around_restarted_and_sigterm_drains(client, parent):
    pids = parent.pids()
    mark = len(parent.output())
    os.kill(pids["replica 1"], signal.SIGKILL)
    # Every request succeeds, during and after: one the front cannot get answered goes to the other.
    for i in range(6):
        r = client.completions.create(model=MODEL, prompt=f"x = {i}" + "y" * 100, max_tokens=2, temperature=0)
        assert r.choices[0].text is not None
    parent.wait_for(r"replica 1 \(http://127\.0\.0\.1:\d+\) exited with status -9; routing around it", 30, mark)
    parent.wait_for(r"INFO mk\.server: replica 1: .*\(pid \d+\)", 30, mark)  # started again
    parent.wait_for(r"replica 1 is back in the rotation", 120, mark)
    before = replica_metric(parent, 1, "mk_requests_total")
    for i in range(4):  # new prompts go to the replica with the emptiest cache: the restarted one
        r = client.completions.create(model=MODEL, prompt=f"z{i} = {time.monotonic()}" * 8, max_tokens=2)
        assert r.choices[0].text is not None
    assert replica_metric(parent, 1, "mk_requests_total") > before

    # SIGTERM: a stream in flight finishes; a new request gets one server's 503 while it drains.
    children = parent.pids()
    body = {"prompt": "def main():", "max_tokens": 96, "temperature": 0, "stream": True, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", parent.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        parent.proc.send_signal(signal.SIGTERM)
        parent.wait_for(r"SIGTERM: draining the replicas", 10, mark)
        # (the replicas were told at once; a request may still meet one in the instant before its
        # own signal handler has run, as with one server)
        deadline = time.monotonic() + 10
        small = {"prompt": "x", "max_tokens": 1}
        while (late := ask(parent, "POST", "/v1/completions", json=small)).status_code == 200:
            assert time.monotonic() < deadline, "no 503 while the replicas drain"
            time.sleep(0.05)
        assert late.status_code == 503 and late.json()["error"]["message"] == "the server is shutting down"
        assert late.headers["retry-after"] == "5"
        rest = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        assert rest[-1] == "[DONE]" and json.loads(rest[-2])["usage"]["completion_tokens"] == 96  # not cut short
    assert parent.proc.wait(60) == 0, parent.output()[-4000:]
    for name, pid in children.items():
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"{name} (pid {pid}) outlived the parent"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
