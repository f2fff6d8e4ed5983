"""`python -m mk.server --data-parallel-size N`: CPU replicas behind sglang-router, on loopback.

One parent process (two CPU replicas of the built-in model and the router) serves the module's
tests in order; the last one kills a replica and then stops the parent with SIGTERM."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from mk.server import replicas
from mk.server.__main__ import parse_args

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


def test_the_router_gets_cache_aware_routing_loopback_metrics_and_the_keys():
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    argv = replicas.router_argv(urls, "0.0.0.0", 80, 90, "k", "adm", 30.0)
    text = " ".join(argv)
    assert "--worker-urls http://127.0.0.1:1 http://127.0.0.1:2 --policy cache_aware" in text
    assert "--host 0.0.0.0 --port 80" in text and "--prometheus-host 127.0.0.1 --prometheus-port 90" in text
    assert "--control-plane-api-keys mk:mk-parent:admin:adm" in text
    assert argv[-2:] == ["--api-key", "k"]
    assert "--api-key" not in replicas.router_argv(["u"], "h", 1, 2, None, "adm", 30.0)


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


def test_a_missing_router_says_what_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "sglang_router" else real(name))
    with pytest.raises(replicas.ReplicaError, match="pip install 'sglang-router==0.3.2'"):
        replicas.check_router_installed()


# ---- two CPU replicas behind the router ------------------------------------------------------------
def free_ports(n: int) -> int:
    """The first of `n` consecutive free loopback ports."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no run of free ports")


class Parent:
    """The data-parallel parent process and what its log says about its children."""

    def __init__(self) -> None:
        self.base = free_ports(3)
        self.port = free_ports(1)
        while self.base <= self.port < self.base + 3:
            self.port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="mk-replicas-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "mk.server", "--data-parallel-size", "2", "--device", "cpu"]
        cmd += ["--port", str(self.port), "--replica-base-port", str(self.base), "--api-key", KEY]
        cmd += ["--max-batch", "8", "--max-context", "2048", "--drain-timeout", "10", "--stats-interval", "60"]
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
        """The latest pid of each child the log names ('replica 0', 'replica 1', 'router')."""
        out = {}
        for m in re.finditer(r"INFO mk\.server: (replica \d+|router): .* \(pid (\d+)\)", self.output()):
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
def parent():
    p = Parent()
    try:
        p.wait_for(r"serving on http://127\.0\.0\.1:\d+: 2 replicas behind sglang-router", 180)
        yield p
    finally:
        p.stop()
        for pid in p.pids().values():  # nothing left behind, whatever the tests did
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        Path(p.log.name).unlink(missing_ok=True)


@pytest.fixture(scope="module")
def client(parent):
    import openai

    return openai.OpenAI(base_url=parent.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


MODEL = "mk-embedded"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_the_openai_client_works_through_the_public_port(client, parent):
    assert [m.id for m in client.models.list().data] == [MODEL]
    # Without the thinking section, so that the 12 tokens are the answer's content.
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=12,
        temperature=0,
        extra_body=no_thinking,
    )
    assert chat.choices[0].message.content and chat.usage.completion_tokens == 12
    text = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=8, temperature=0)
    assert text.choices[0].finish_reason in ("length", "stop") and text.usage.prompt_tokens > 0
    pieces = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=no_thinking,
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


def test_the_public_port_wants_the_key(parent):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert httpx.post(parent.url + "/v1/completions", json=body, timeout=30).status_code == 401
    wrong = {"Authorization": "Bearer nope"}
    assert httpx.post(parent.url + "/v1/completions", json=body, headers=wrong, timeout=30).status_code == 401
    assert httpx.get(parent.url + "/health", timeout=30).status_code == 200  # probes need no key


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


def test_the_router_merges_every_replicas_metrics(parent):
    text = httpx.get(parent.url + "/engine_metrics", timeout=30).text
    workers = set(re.findall(r'worker_addr="([^"]+)"', text))
    assert workers == {parent.replica_url(0), parent.replica_url(1)}, text[:2000]
    assert "mk_requests_total" in text


def test_the_worker_list_is_not_the_clients_to_change(parent):
    for key in (None, KEY):  # neither no key nor the serving key reaches the router's admin routes
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        assert httpx.get(parent.url + "/workers", headers=headers, timeout=10).status_code in (401, 403)


def test_a_killed_replica_is_routed_around_restarted_and_sigterm_stops_everything(client, parent):
    pids = parent.pids()
    mark = len(parent.output())
    os.kill(pids["replica 1"], signal.SIGKILL)
    # Once the parent has taken it out of the router's list, every request succeeds (one the router
    # sent it before that fails with the router's 500).
    parent.wait_for(r"replica 1 \(http://127\.0\.0\.1:\d+\) exited with status -9; routing around it", 30, mark)
    deadline = time.monotonic() + 30
    while httpx.get(parent.url + "/readiness", timeout=10).json().get("total_workers") != 1:
        assert time.monotonic() < deadline, "the router still lists the dead replica"
        time.sleep(0.1)
    for i in range(6):
        r = client.completions.create(model=MODEL, prompt=f"x = {i}", max_tokens=2, temperature=0)
        assert r.choices[0].text is not None
    parent.wait_for(r"INFO mk\.server: replica 1: .*\(pid \d+\)", 30, mark)  # started again
    parent.wait_for(r"replica 1 is back in the router's list", 120, mark)
    before = replica_metric(parent, 1, "mk_requests_total")
    deadline = time.monotonic() + 60
    while replica_metric(parent, 1, "mk_requests_total") == before:  # the router sends it work again
        assert time.monotonic() < deadline, parent.output()[-4000:]
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            prompts = [f"z{i} = {time.monotonic()}" for i in range(8)]
            for r in pool.map(lambda p: client.completions.create(model=MODEL, prompt=p, max_tokens=4), prompts):
                assert r.choices[0].text is not None

    children = parent.pids()
    assert parent.stop() == 0, parent.output()[-4000:]
    for name, pid in children.items():
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"{name} (pid {pid}) outlived the parent"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
