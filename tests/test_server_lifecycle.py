"""Start-up flags, serving a checkpoint folder, and SIGTERM draining."""

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from server_util import ServerProcess

from mk.config import ModelConfig
from mk.engine.options import CPU_MAX_BATCH, CPU_PREFILL_CHUNK
from mk.model import synthetic_weights, write_checkpoint
from mk.model.reference import Model
from mk.server.__main__ import parse_args
from mk.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # (starts and signals python -m mk.server)


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--max-batch", "0"], "--max-batch"),
        (["--port", "70000"], "--port"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
        (["--gpu-memory-utilization", "x"], "--gpu-memory-utilization"),
        (["--max-context", "1"], "--max-context"),
        (["--prefill-chunk", "4"], "--prefill-chunk"),
        (["--log-level", "loud"], "--log-level"),
        (["--model", "/no/such/folder"], "--model"),
        (["--api-key", ""], "--api-key"),
        (["--model", ".", "--synthetic"], "--synthetic"),
        (["--prefill", "flash"], "--prefill"),
        (["--prefill", "fast"], "--prefill"),
        (["--backend", "reference"], "--backend"),
        (["--launch-ahead", "maybe"], "--launch-ahead"),
        (["--speculative", "sometimes"], "--speculative"),
        (["--decode-prefill-budget", "0"], "--decode-prefill-budget"),
        (["--sliced-prefill", "sometimes"], "--sliced-prefill"),
        (["--sliced-prefill", "--prefill", "plain"], "--sliced-prefill"),
        (["--allowed-origins", "example.com"], "--allowed-origins"),
        (["--allowed-origins", "https://a.example/path"], "--allowed-origins"),
    ],
)
def test_bad_flags_are_refused_with_one_line(argv, flag, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err


def test_help_documents_every_flag():
    out = subprocess.run([sys.executable, "-m", "mk.server", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--host", "--port", "--model", "--synthetic", "--served-model-name", "--max-batch", "--max-context",
                 "--gpu-memory-utilization", "--prefill-chunk", "--api-key", "--log-level", "--drain-timeout",
                 "--backend", "--prefill", "--launch-ahead", "--prefill-graphs", "--prefix-graphs",
                 "--decode-prefill-budget", "--sliced-prefill", "--whole-chunk-tokens", "--kernel-masks",
                 "--late-masks", "--speculative", "--allowed-origins"):  # fmt: skip
        assert flag in out.stdout
    assert "site-packages" in out.stdout and "trained on the Python standard library" not in out.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_synthetic_needs_a_gpu():
    out = subprocess.run([sys.executable, "-m", "mk.server", "--synthetic"], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "no GPU" in out.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("flag", [["--kernel-masks"], ["--kernel-masks", "on"]])
def test_kernel_masks_need_the_megakernel(flag):
    argv = [sys.executable, "-m", "mk.server", "--device", "cpu", *flag]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "needs the megakernel backend" in out.stderr.strip().splitlines()[-1]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("replica", [None, "1"])
def test_replicas_draw_no_progress_bars(monkeypatch, replica):
    """Data-parallel replicas write to the parent's terminal, where their bars would overwrite one
    another: a replica's engine starts without one, a lone server's with."""
    import mk.engine.engine
    from mk.server.__main__ import build_state

    seen = {}

    def engine(model, options):
        seen.update(vars(options))
        raise _Stop

    monkeypatch.setattr(mk.engine.engine, "Engine", engine)
    if replica is None:
        monkeypatch.delenv("MK_REPLICA", raising=False)
    else:
        monkeypatch.setenv("MK_REPLICA", replica)
    with pytest.raises(_Stop):
        build_state(parse_args(["--device", "cpu"]))
    assert seen["progress"] is (replica is None)


@pytest.mark.parametrize("flag", [[], ["--speculative", "off"], ["--speculative"]])
def test_the_speculative_flag_reaches_the_engine(monkeypatch, flag):
    import mk.engine.engine
    from mk.server.__main__ import build_state

    seen = {}

    def engine(model, options):
        seen.update(vars(options))
        raise _Stop

    monkeypatch.setattr(mk.engine.engine, "Engine", engine)
    with pytest.raises(_Stop):
        build_state(parse_args(["--device", "cpu", *flag]))
    assert seen["speculative"] is (None if not flag else flag[-1] == "--speculative")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("nmc-tiny")
    cfg = ModelConfig.tiny()
    weights = synthetic_weights(cfg, seed=3, dtype=torch.float32, std=0.1)
    write_checkpoint(path, cfg, weights)
    return path, Model(cfg, weights)


def test_packed_prefill_serves_on_the_cpu_too():
    server = ServerProcess("--device", "cpu", "--prefill", "packed", "--max-context", "1024").wait_ready()
    try:
        out = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "def add(a, b):\n" * 20, "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            timeout=60,
        ).json()
        assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["text"]
    finally:
        assert server.stop() == 0
    # auto: launch-ahead off on this backend, no CUDA graphs on the CPU; the CPU's prefill chunk
    # whole chunks while streams decode too (sliced prefill is a GPU default)
    chunks = (
        f"chunks of {CPU_PREFILL_CHUNK} tokens, CUDA graphs off, {CPU_PREFILL_CHUNK} tokens an iteration while streams "
        "decode"
    )
    assert f"pytorch decode, packed prefill ({chunks}), launch-ahead off, max batch {CPU_MAX_BATCH}" in server.output()


def test_serves_a_checkpoint_folder_and_drains_on_sigterm(checkpoint):
    path, model = checkpoint
    # A drain timeout far beyond the stream below (a clean-clone run once saw that stream aborted
    # under the default 30 s): this test is about a stream that ends on its own while draining.
    server = ServerProcess(
        "--model", str(path), "--device", "cpu", "--max-context", "2048", "--drain-timeout", "300"
    ).wait_ready()
    try:
        models = httpx.get(server.url + "/v1/models").json()["data"]
        assert [m["id"] for m in models] == [path.name]
        tok = Tokenizer.from_dir(path)
        ids = tok.encode("print(")
        out = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": ids, "max_tokens": 5, "temperature": 0, "ignore_eos": True},
            timeout=30,
        ).json()
        expected = list(ids)
        for _ in range(5):
            expected.append(int(model.logits(expected)[-1].argmax()))
        assert out["choices"][0]["text"] == tok.decode(expected[len(ids) :], skip_special_tokens=True)

        # A long stream is running when SIGTERM arrives: it finishes, new work is refused, exit 0.
        # Long enough that draining is still under way when the probes below arrive (the engine
        # streams the tiny model at several hundred tokens/s).
        body = {"prompt": "x", "max_tokens": 800, "temperature": 0, "ignore_eos": True, "stream": True}
        events, started = [], threading.Event()

        def stream():
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        started.set()

        t = threading.Thread(target=stream)
        t.start()
        assert started.wait(30)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        refused = httpx.post(server.url + "/v1/completions", json={"prompt": "y", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert httpx.get(server.url + "/health").status_code == 503
        t.join(300)
        assert events[-1] == "data: [DONE]"
        last = json.loads(events[-2][6:])
        assert last["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(60) == 0
    finally:
        server.stop()


def test_drain_timeout_cuts_long_requests_and_still_exits_0():
    server = ServerProcess("--device", "cpu", "--drain-timeout", "0.5").wait_ready()
    try:
        body = {"prompt": "x", "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)
            server.proc.send_signal(signal.SIGTERM)
            events = [line for line in lines if line]
        assert events[-1] == "data: [DONE]"
        # An OpenAI value: the answer was cut short, as max_tokens cuts one (README "Serving").
        assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert server.proc.wait(30) == 0
    finally:
        server.stop()


def test_a_port_in_use_is_one_line_and_a_non_zero_exit():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "mk.server", "--device", "cpu", "--port", str(port)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert f"cannot listen on 127.0.0.1:{port}" in out and "Traceback" not in out, out
    assert "serving" not in out and "engine ready" not in out, out


def test_allowed_origins_answer_preflights_and_mark_responses():
    origin, other = "https://app.example.com", "https://evil.example"
    assert parse_args(["--allowed-origins", f"{origin}/, *"]).allowed_origins == {origin, "*"}
    s = ServerProcess("--device", "cpu", "--api-key", "k1", "--allowed-origins", origin).wait_ready()
    try:
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        r = httpx.options(s.url + "/v1/chat/completions", headers={"Origin": origin, **ask}, timeout=5)
        assert r.status_code == 204, r.text  # no key: browsers send none on a preflight
        assert r.headers["access-control-allow-origin"] == origin
        assert "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"] == "authorization,content-type"
        r = httpx.get(s.url + "/v1/models", headers={"Origin": origin, "Authorization": "Bearer k1"}, timeout=5)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        assert (
            httpx.get(s.url + "/v1/models", headers={"Origin": origin}, timeout=5).headers[
                "access-control-allow-origin"
            ]
            == origin
        )  # the 401 too, so that the page can read why
        # Another origin gets no CORS headers, and its preflight is refused as any OPTIONS is.
        r = httpx.options(s.url + "/v1/chat/completions", headers={"Origin": other, **ask}, timeout=5)
        assert r.status_code != 204 and "access-control-allow-origin" not in r.headers
        r = httpx.get(s.url + "/health", headers={"Origin": other}, timeout=5)
        assert "access-control-allow-origin" not in r.headers
    finally:
        assert s.stop() == 0, s.output()


def test_without_allowed_origins_there_are_no_cors_headers(server):
    ask = {"Origin": "https://app.example.com", "Access-Control-Request-Method": "POST"}
    r = httpx.options(server.url + "/v1/chat/completions", headers=ask, timeout=5)
    assert r.status_code == 405 and "access-control-allow-origin" not in r.headers


def test_protect_metrics_puts_metrics_behind_the_key():
    s = ServerProcess("--device", "cpu", "--api-key", "k1", "--protect-metrics").wait_ready()
    try:
        assert httpx.get(s.url + "/metrics", timeout=5).status_code == 401
        r = httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer k1"}, timeout=5)
        assert r.status_code == 200 and "mk_generation_tokens_total" in r.text
    finally:
        assert s.stop() == 0, s.output()
