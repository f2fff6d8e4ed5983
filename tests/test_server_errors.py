"""Bad input gets its status and an OpenAI error body (never a 500), on a server with an API key and small
limits (one sequence at a time, one waiting, 2048-token context, 1 MiB bodies)."""

import json
import threading
import time

import httpx
import openai
import pytest
from server_util import ServerProcess

from mk.default_model import NAME
from mk.server.params import MAX_GRAMMAR_BYTES, MAX_GUIDED_CHOICES
from mk.server.schemas import SEED_MAX, SEED_MIN, U32_MAX

pytestmark = pytest.mark.slow  # (starts python -m mk.server)

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
# Options that all begin alike, so that the grammar engine follows every one of them at once.
CHOICES = [f"c{i:05d}" for i in range(MAX_GUIDED_CHOICES)]
TOO_MANY_CHOICES = [*CHOICES, "c99999"]
BIG_SCHEMA = {"type": "object", "description": "x" * MAX_GRAMMAR_BYTES}
# Client input that once got a 500 (or, streamed, a 200 and then an error event): each is a 400 naming
# its field on both routes.
BAD_ON_BOTH_ROUTES = [
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": ""}, "guided_json"),
    ({"guided_json": "x"}, "guided_json"),
    ({"guided_json": "\u0000"}, "guided_json"),
    ({"guided_json": "[" * 10_000}, "guided_json"),
    ({"top_k": U32_MAX + 1}, "top_k"),
    ({"stop_token_ids": [U32_MAX + 1]}, "stop_token_ids"),
    ({"stop_token_ids": [1, 2**64]}, "stop_token_ids"),
    ({"seed": SEED_MAX + 1}, "seed"),
    ({"seed": SEED_MIN - 1}, "seed"),
    ({"guided_choice": TOO_MANY_CHOICES}, "guided_choice"),
    ({"guided_choice": TOO_MANY_CHOICES, "stream": True}, "guided_choice"),
    ({"guided_regex": "x" * (MAX_GRAMMAR_BYTES + 1)}, "guided_regex"),
    ({"guided_grammar": 'start: "' + "x" * MAX_GRAMMAR_BYTES + '"'}, "guided_grammar"),
    ({"guided_json": BIG_SCHEMA}, "guided_json"),
]


# The module's server answers a body that stalls this long with a 408.
BODY_TIMEOUT_S = 2


@pytest.fixture(scope="module")
def server():
    s = ServerProcess(
        "--device", "cpu", "--api-key", KEY, "--max-batch", "1", "--max-waiting", "1",
        "--max-context", "2048", "--max-body-mb", "1", "--body-timeout", str(BODY_TIMEOUT_S),
    ).wait_ready()  # fmt: skip
    yield s
    assert s.stop() == 0, s.output()


def post(server, path, body=None, content=None, headers=AUTH):
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=30)


def assert_error(r, status, param=None, contains=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    if contains is not None:
        assert contains in err["message"], err
    return err


def test_api_key_is_required_everywhere_but_health_and_metrics(server):
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 200  # scrapers carry no key (--protect-metrics)
    for method, path in [("GET", "/v1/models"), ("POST", CHAT), ("POST", COMP)]:
        r = httpx.request(method, server.url + path, json={"messages": USER})
        assert_error(r, 401)
        r = httpx.request(method, server.url + path, headers={"Authorization": "Bearer wrong"})
        assert_error(r, 401)
    assert httpx.get(server.url + "/v1/models", headers=AUTH).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_unknown_fields_inside_messages_are_refused_by_path_and_known_ones_accepted(server):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}", "argument": "{}"}}
    bad = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ]
    err = assert_error(
        post(server, CHAT, {"messages": [*USER, *bad]}), 400, "messages[1].tool_calls[0].function.argument"
    )
    assert "did you mean 'arguments'" in err["message"] and err["code"] == "unknown_field"
    # The fields the OpenAI API (and vLLM: reasoning_content) defines inside a message are accepted.
    known = [
        {"role": "system", "content": "be brief", "name": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}], "name": "ann"},
        {"role": "assistant", "content": "no", "refusal": None, "reasoning_content": "thought"},
        {"role": "user", "content": "hi"},
    ]
    assert post(server, CHAT, {"messages": known, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(
    "path,body",
    [
        (CHAT, {"messages": USER}),
        (COMP, {"prompt": "x"}),
        ("/v1/responses", {"input": "x"}),
        ("/tokenize", {"prompt": "x"}),
    ],
)
def test_another_model_is_a_404_model_not_found(server, path, body):
    # As OpenAI and vLLM answer it: the client's NotFoundError, not a BadRequestError.
    err = assert_error(post(server, path, {**body, "model": "gpt-4"}), 404, "model", "not served")
    assert (err["type"], err["code"]) == ("invalid_request_error", "model_not_found")


def test_invalid_json_and_non_object_bodies(server):
    assert_error(post(server, CHAT, content=b"{not json"), 400, contains="not valid JSON")
    assert_error(post(server, CHAT, content=b'{"temperature": NaN}'), 400, contains="not valid JSON")
    assert_error(post(server, CHAT, content=b"\xff\xfe"), 400)
    assert_error(post(server, CHAT, body=[1, 2]), 400, contains="JSON object")
    assert_error(post(server, CHAT, content=b""), 400)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": USER, "temperature": "hot"}, "temperature"),
        ({"messages": USER, "max_tokens": 1.5}, "max_tokens"),
        ({"messages": USER, "stream": 1}, "stream"),
        ({"messages": "hi"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, None),
        ({"messages": USER, "temperature": -1}, "temperature"),
        ({"messages": USER, "top_p": 0}, "top_p"),
        ({"messages": USER, "top_p": 1.5}, "top_p"),
        ({"messages": USER, "top_k": -3}, "top_k"),
        ({"messages": USER, "n": 0}, "n"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": USER, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"messages": USER, "stop": [""]}, "stop"),
        ({"messages": USER, "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"messages": USER, "presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": USER, "frequency_penalty": -1.0}, "frequency_penalty"),
        ({"messages": USER, "logit_bias": {"5": 10}}, "logit_bias"),
        ({"messages": USER, "response_format": {"type": "yaml"}}, "response_format"),
        ({"messages": USER, "max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
        ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"messages": USER, "tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x", "nmae": "a"}]}, "messages[0].nmae"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache": 1}]}]},
            "messages[0].content[0].cache",
        ),
        (
            {"messages": [{"role": "assistant", "content": "x", "function_call": {}}, *USER]},
            "messages[0].function_call",
        ),
        ({"messages": [*USER, {"role": "system", "content": None}]}, "messages[1].content"),
    ],
)
def test_bad_chat_fields_name_the_field(server, body, param):
    err = assert_error(post(server, CHAT, body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "body,param",
    [
        ({}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": [99999]}, "prompt"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "presence_penalty": 1}, "presence_penalty"),
    ],
)
def test_bad_completion_fields_name_the_field(server, body, param):
    assert_error(post(server, COMP, body), 400, param)


@pytest.mark.parametrize("fields,param", BAD_ON_BOTH_ROUTES)
@pytest.mark.parametrize("path", [CHAT, COMP])
def test_out_of_range_integers_and_bad_or_oversized_grammars_are_400s(server, path, fields, param):
    start = {"messages": USER} if path == CHAT else {"prompt": "x"}
    err = assert_error(post(server, path, {**start, "max_tokens": 4, **fields}), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": BIG_SCHEMA}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BIG_SCHEMA}}]}, "tools"),
    ],
)
def test_oversized_chat_grammars_are_400s(server, fields, param):
    assert_error(post(server, CHAT, {"messages": USER, **fields}), 400, param)


def test_integers_at_the_engines_limits_and_the_most_choices_are_served(server):
    edges = {"top_k": U32_MAX, "stop_token_ids": [U32_MAX], "max_tokens": 2}
    for seed in (SEED_MIN, SEED_MAX):
        for path, start in [(CHAT, {"messages": USER}), (COMP, {"prompt": "x"})]:
            r = post(server, path, {**start, **edges, "seed": seed})
            assert r.status_code == 200, r.text
    # As many options as are allowed, all open together after their first character: the answer is one.
    r = post(server, COMP, {"prompt": "x", "guided_choice": CHOICES, "max_tokens": 16, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] in CHOICES
    body = {"messages": USER, "guided_choice": CHOICES, "max_tokens": 32, "temperature": 0}
    r = post(server, CHAT, {**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] in CHOICES


def test_a_prompt_too_large_for_the_context_is_refused_before_it_is_tokenized(server):
    """Its size alone (bytes / the tokenizer's longest token) proves it cannot fit: the 400 says so."""
    text = "a " * 200_000
    for path, body, param in [
        (COMP, {"prompt": text}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": text}]}, "messages"),
    ]:
        err = assert_error(post(server, path, body), 400, param, contains="has at least")
        assert err["code"] == "context_length_exceeded" and "bytes of text" in err["message"], err
        assert "2048" in err["message"]


TOOL = {"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages,tools,contains",
    [
        ([{"role": "tool", "tool_call_id": "c1", "content": "r"}], None, "does not answer"),
        ([*USER, {"role": "assistant", "tool_calls": [CALL]}], [TOOL], "have no tool message"),
        ([*USER, {"role": "assistant", "tool_calls": [CALL]}, *USER], [TOOL], "have no tool message"),
        (
            [*USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "r"}],
            [TOOL],
            "tool_call_id",
        ),
        (
            [*USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "tool_call_id": "zz", "content": ""}],
            [TOOL],
            "does not answer",
        ),
        ([*USER, {"role": "assistant", "tool_calls": [CALL]}], [{**TOOL, "function": {"name": "other"}}], "names no"),
        (
            [*USER, {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "get", "arguments": "{x"}}]}],
            [TOOL],
            "not valid JSON",
        ),
        ([*USER, {"role": "assistant", "tool_calls": [CALL, CALL]}], [TOOL], "appears twice"),
        (USER, [TOOL, TOOL], "same name"),
    ],
)
def test_bad_tool_linkage(server, messages, tools, contains):
    body = {"messages": messages, "max_tokens": 2}
    if tools:
        body["tools"] = tools
    assert_error(post(server, CHAT, body), 400, contains=contains)


def test_named_tool_choice_must_name_a_tool(server):
    body = {"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    assert_error(post(server, CHAT, body), 400, "tool_choice")


def test_prompt_longer_than_the_context_says_both_numbers(server):
    err = assert_error(post(server, COMP, {"prompt": "word " * 3000}), 400, "prompt", contains="2048")
    assert err["code"] == "context_length_exceeded"
    prompt_tokens = int(err["message"].split("has ")[1].split(" tokens")[0])
    assert prompt_tokens > 2048
    err = assert_error(post(server, COMP, {"prompt": "x", "max_tokens": 3000}), 400, "max_tokens", contains="2048")
    assert "300" in err["message"]
    with pytest.raises(openai.BadRequestError):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "y " * 3000}])


def test_oversized_body_is_413(server):
    big = b'{"prompt": "' + b"x" * (2 * 2**20) + b'"}'
    assert_error(post(server, COMP, content=big), 413)


def test_unknown_route_and_wrong_method(server):
    assert_error(httpx.get(server.url + "/v2/nothing", headers=AUTH), 404)
    assert_error(httpx.get(server.url + COMP, headers=AUTH), 405)
    assert_error(httpx.delete(server.url + "/v1/models", headers=AUTH), 405)


def test_full_waiting_queue_is_503_with_retry_after(server):
    """One running and one waiting request fill this server; the next one is turned away."""
    # Long enough to outlast the test on any CPU; the streams are closed (cancelled) once it has checked.
    long = {"prompt": "x", "max_tokens": 2000, "temperature": 0, "stream": True, "ignore_eos": True}
    opened = []
    release = threading.Event()

    def hold(ready, running):
        with httpx.stream("POST", server.url + COMP, json=long, headers=AUTH, timeout=60) as r:
            opened.append(r.status_code)
            if not running:  # headers: submitted (it waits behind the first)
                ready.set()
            for _ in r.iter_lines():
                ready.set()  # a token: admitted, so the queue is empty again
                if release.is_set():
                    break

    threads = []
    for running in (True, False):
        ready = threading.Event()
        t = threading.Thread(target=hold, args=(ready, running))
        t.start()
        # Each step must have happened before the next request: without it the probe below could
        # reach the queue before the waiting request (it failed so once in CI, on a loaded machine,
        # when a 30 s wait ran out unchecked).
        assert ready.wait(120), "the running request never streamed" if running else "the waiting one never queued"
        threads.append(t)
    r = post(server, COMP, {"prompt": "x", "max_tokens": 2})
    err = assert_error(r, 503)
    assert int(r.headers["retry-after"]) >= 1
    assert err["type"] == "server_overloaded"
    release.set()
    for t in threads:
        t.join(60)
    assert opened == [200, 200]
    # The server learns of the closed streams asynchronously (a disconnect cancels its request a
    # little later): the queue has room again once it has.
    deadline = time.monotonic() + 30
    while (status := post(server, COMP, {"prompt": "x", "max_tokens": 2}).status_code) == 503:
        assert time.monotonic() < deadline, "the closed streams never left the queue"
        time.sleep(0.05)
    assert status == 200


def test_unknown_and_refused_top_level_fields_are_named(server):
    err = assert_error(post(server, CHAT, {"messages": USER, "max_token": 5}), 400, param="max_token")
    assert "did you mean 'max_tokens'" in err["message"] and err["code"] == "unknown_field"
    assert_error(post(server, COMP, {"prompt": "x", "stream_option": {}}), 400, param="stream_option")
    for field, value in [("functions", []), ("function_call", "auto"), ("modalities", ["text"]), ("prediction", {})]:
        assert_error(post(server, CHAT, {"messages": USER, field: value}), 400, param=field)
    assert_error(post(server, CHAT, {"messages": USER, "temperature": 2.5}), 400, param="temperature")
    # The documented harmless ones are accepted (and change nothing).
    r = post(server, CHAT, {"messages": USER, "max_tokens": 1, "user": "u1", "metadata": {"k": "v"}, "store": False})
    assert r.status_code == 200, r.text


def test_sglangs_extensions_are_accepted_at_their_neutral_values_only(server):
    # What SGLang's routers add to every request they forward (one may stand in front of mk).
    neutral = {"no_stop_trim": False, "continue_final_message": False, "skip_special_tokens": True}
    neutral |= {"separate_reasoning": True, "stream_reasoning": True, "return_hidden_states": False}
    r = post(server, CHAT, {"messages": USER, "max_tokens": 1, **neutral})
    assert r.status_code == 200, r.text
    assert post(server, COMP, {"prompt": "x", "max_tokens": 1, **neutral}).status_code == 200
    for field, value in [("no_stop_trim", True), ("skip_special_tokens", False), ("return_hidden_states", 1)]:
        err = assert_error(post(server, CHAT, {"messages": USER, field: value}), 400, param=field)
        assert "is not supported" in err["message"]


def test_every_metric_family_has_samples_from_the_start():
    # A family without samples breaks readers that merge several servers' pages.
    from mk.server.metrics import Metrics

    text = Metrics("m").render().decode()
    for reason in ("stop", "length", "abort", "cancelled", "error"):
        assert f'finish_reason="{reason}"' in text, reason
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    sampled = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for family in families:
        assert any(s == family or s.startswith(family + "_") for s in sampled), family


def test_lone_surrogates_are_a_400_naming_the_field(server):
    raw = [
        (CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        (COMP, b'{"prompt": "x\\udfff"}', "prompt"),
        (COMP, b'{"prompt": ["ok", "\\ud83d"]}', "prompt[1]"),
        (
            CHAT,
            b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
            b'"function": {"name": "f", "description": "\\udc00"}}]}',
            "tools[0].function.description",
        ),
    ]
    for path, body, param in raw:
        assert_error(post(server, path, content=body), 400, param=param, contains="surrogate")
    # A proper pair (an emoji) is valid Unicode.
    ok = b'{"messages": [{"role": "user", "content": "\\ud83d\\ude00"}], "max_tokens": 1}'
    assert post(server, CHAT, content=ok).status_code == 200


def test_a_body_declared_as_not_json_is_415(server):
    body = b'{"prompt": "x", "max_tokens": 1}'
    for declared in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]:
        r = post(server, COMP, content=body, headers={**AUTH, "Content-Type": declared})
        assert_error(r, 415, contains="application/json")
    for declared in ["application/json", "application/json; charset=utf-8", "application/vnd.api+json"]:
        r = post(server, COMP, content=body, headers={**AUTH, "Content-Type": declared})
        assert r.status_code == 200, (declared, r.text)


def test_models_retrieve_and_head_health(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    model = client.models.retrieve(NAME)
    assert model.id == NAME and model.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    assert_error(httpx.get(server.url + "/v1/models/" + NAME), 401)  # the key is needed there too
    r = httpx.head(server.url + "/health")
    assert r.status_code == 200 and r.content == b""


def test_prompts_are_rendered_and_tokenized_and_grammars_compiled_off_the_event_loop():
    import asyncio
    from types import SimpleNamespace

    from mk.server.chat_completions import chat_completions
    from mk.server.completions import completions
    from mk.server.errors import APIError, bad_request
    from mk.server.state import ServerState
    from mk.text.tokenizer import Tokenizer

    threads = []
    tokenizer = Tokenizer.builtin(512)

    def encode(text, add_special_tokens=True, limit=None):
        threads.append(threading.get_ident())
        raise bad_request("stop before the engine")

    tokenizer.encode = encode

    compiled = []

    class NoEngine:
        max_context = 512
        config = SimpleNamespace(vocab_size=512)

        def prepare_constraint(self, spec):
            compiled.append((spec.kind, threading.get_ident()))

    state = ServerState(NoEngine(), tokenizer, NAME)
    regex = {"guided_regex": "[a-z]+"}

    async def run() -> int:
        for handler, body in [(chat_completions, {"messages": USER}), (completions, {"prompt": "x", **regex})]:
            with pytest.raises(APIError, match="stop before the engine"):
                await handler(state, json.dumps(body).encode(), {"id": "t"})
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    assert len(threads) == 2 and loop_thread not in threads
    assert [kind for kind, _ in compiled] == ["regex"] and compiled[0][1] != loop_thread


def test_a_body_that_stalls_is_a_408_and_its_connection_freed(server):
    """A client that sends part of its body and then nothing is answered 408 once --body-timeout has
    passed with nothing arriving, and the connection is closed; a whole body sent slowly in pieces,
    each well within that time, is served."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(server.url)
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nContent-Length: {n}\r\nConnection: close\r\n\r\n"
    )
    body = json.dumps({"prompt": "def f(", "max_tokens": 1}).encode()
    with socket.create_connection((url.hostname, url.port), timeout=BODY_TIMEOUT_S * 10) as stalled:
        stalled.sendall(head.format(n=len(body)).encode() + body[:5])
        started = time.monotonic()
        answer = b""
        while chunk := stalled.recv(65536):  # (until the server closes the connection)
            answer += chunk
        waited = time.monotonic() - started
    status, _, rest = answer.partition(b"\r\n")
    assert status.split()[1] == b"408", answer
    assert b"stalled" in rest and waited >= BODY_TIMEOUT_S * 0.9, (answer, waited)
    with socket.create_connection((url.hostname, url.port), timeout=BODY_TIMEOUT_S * 10) as slow:
        slow.sendall(head.format(n=len(body)).encode())
        for i in range(0, len(body), 8):
            time.sleep(BODY_TIMEOUT_S / 8)
            slow.sendall(body[i : i + 8])
        answer = b""
        while chunk := slow.recv(65536):
            answer += chunk
    assert answer.split()[1] == b"200", answer
