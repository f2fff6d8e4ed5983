"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) over raw HTTP, its events read as an
Anthropic client reads them (the `anthropic` SDK itself drives it in test_server_sdks.py): against a server whose
scripted "model" writes what a test asks for (exact blocks, stop reasons, errors, an API key sent as
`x-api-key`), and against `python -m mk.server` on the built-in model (a tool call forced by the
grammar, its result sent back, stop sequences, token counts)."""

import copy
import json
import time

import httpx
import jsonschema
import pytest
from server_util import ServerProcess

from mk.config import ModelConfig
from mk.default_model import NAME
from mk.server.anthropic_chat import TOOL_ERROR_PREFIX, chat_request
from mk.server.anthropic_schemas import MessagesRequest
from mk.server.errors import APIError
from mk.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # (starts python -m mk.server)

KEY = "test-key"
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
SCRIPTED_TOK = Tokenizer.builtin(ModelConfig.tiny().vocab_size)  # the scripted server's
TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather of a city",
        "input_schema": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    {"name": "now", "description": "The time", "input_schema": {"type": "object"}},
]
# What the scripted model writes (with thinking off the prompt has closed the thinking block).
TEXT = "<|START_RESPONSE|>Hello there.<|END_RESPONSE|>"
THOUGHT = "Let me see.<|END_THINKING|><|START_RESPONSE|>Hello there.<|END_RESPONSE|>"
CALLS = (
    '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"tool_call_id": "1", "tool_name": "now", "parameters": {}}]<|END_ACTION|>'
)
THINKING_ON = {"type": "enabled", "budget_tokens": 1024}
# Tokens of CALLS that end inside the first call's input, in "Paris".
CUT = next(
    n
    for n in range(1, 200)
    if '"city": "P' in SCRIPTED_TOK.decode(SCRIPTED_TOK.encode(CALLS, add_special_tokens=False)[:n])
)


@pytest.fixture(scope="module")
def scripted():
    s = ServerProcess("--api-key", KEY, module="scripted_engine", env={"PYTHONPATH": "tests:python"}).wait_ready()
    yield s
    assert s.stop() == 0, s.output()


def script(text: str) -> list[dict]:
    return [{"role": "user", "content": "SCRIPT:" + text}]


def post(server, body: dict, path: str = "/v1/messages", headers: dict | None = HEADERS) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=headers, timeout=120)


def create(server, **body) -> dict:
    r = post(server, body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, **body) -> list[dict]:
    """The events of a streamed request, each checked to be named by its type."""
    events, name = [], None
    with httpx.stream(
        "POST", server.url + "/v1/messages", json={**body, "stream": True}, headers=HEADERS, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == name, (name, data)
                events.append(data)
                name = None
    return events


def assemble(events: list[dict]) -> dict:
    """The message a stream adds up to, its events checked to come in the API's order: message_start,
    then each block's start, deltas of its own kind and stop, one block at a time, then message_delta
    and message_stop."""
    assert events[0]["type"] == "message_start" and events[-1] == {"type": "message_stop"}
    message, open_block, partial_json = copy.deepcopy(events[0]["message"]), None, ""
    assert message["content"] == [] and message["stop_reason"] is None
    for event in events[1:-2]:
        kind = event["type"]
        if kind == "content_block_start":
            assert open_block is None and event["index"] == len(message["content"])
            open_block, partial_json = dict(event["content_block"]), ""
            message["content"].append(open_block)
            continue
        assert open_block is not None and event["index"] == len(message["content"]) - 1
        if kind == "content_block_stop":
            if open_block["type"] == "tool_use" and partial_json:
                try:
                    open_block["input"] = json.loads(partial_json)
                except json.JSONDecodeError:  # cut off by max_tokens: kept as it came
                    open_block["partial_json"] = partial_json
            open_block = None
            continue
        assert kind == "content_block_delta", event
        delta = event["delta"]
        field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[delta["type"]]
        assert open_block["type"] == {"text": "text", "thinking": "thinking", "partial_json": "tool_use"}[field]
        if field == "partial_json":
            partial_json += delta["partial_json"]
        else:
            open_block[field] += delta[field]
    assert open_block is None
    end = events[-2]
    assert end["type"] == "message_delta" and set(end["delta"]) == {"stop_reason", "stop_sequence"}
    message.update(end["delta"])
    message["usage"]["output_tokens"] = end["usage"]["output_tokens"]
    return message


def without_ids(message: dict) -> dict:
    """The message less what differs between two runs of one request (its id, its calls' ids)."""
    content = [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]
    return {**{k: v for k, v in message.items() if k != "id"}, "content": content}


def output_tokens(text: str) -> int:
    return len(SCRIPTED_TOK.encode(text, add_special_tokens=False)) + 1  # and EOS


def count(server, **body) -> int:
    r = post(server, body, "/v1/messages/count_tokens")
    assert r.status_code == 200, r.text
    return r.json()["input_tokens"]


# ---- the scripted model: exact shapes ------------------------------------------------------------


def test_a_text_answer(scripted):
    out = create(scripted, model="scripted", max_tokens=64, messages=script(TEXT), metadata={"user_id": "u1"})
    assert set(out) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
    assert out["id"].startswith("msg_") and (out["type"], out["role"], out["model"]) == (
        "message",
        "assistant",
        "scripted",
    )
    assert out["content"] == [{"type": "text", "text": "Hello there."}]
    assert (out["stop_reason"], out["stop_sequence"]) == ("end_turn", None)
    assert out["usage"] == {
        "input_tokens": count(scripted, messages=script(TEXT)),
        "output_tokens": output_tokens(TEXT),
    }


def test_thinking_comes_back_as_thinking_blocks_when_turned_on(scripted):
    out = create(scripted, max_tokens=64, messages=script(THOUGHT), thinking=THINKING_ON)
    assert out["content"] == [
        {"type": "thinking", "thinking": "Let me see.", "signature": ""},
        {"type": "text", "text": "Hello there."},
    ]
    # Off (the default, and "disabled") the prompt closes the thinking block: one token more.
    for off in ({}, {"thinking": {"type": "disabled"}}):
        assert (
            count(scripted, messages=script(TEXT), **off)
            == count(scripted, messages=script(TEXT), thinking=THINKING_ON) + 1
        )
    assert count(scripted, messages=script(TEXT), thinking={"type": "adaptive"}) == count(
        scripted, messages=script(TEXT), thinking=THINKING_ON
    )


def test_tool_calls_are_tool_use_blocks_with_input_objects(scripted):
    out = create(scripted, max_tokens=200, messages=script(CALLS), tools=TOOLS)
    assert out["stop_reason"] == "tool_use"
    first, second = out["content"]
    assert first["id"].startswith("toolu_") and second["id"].startswith("toolu_") and first["id"] != second["id"]
    assert without_ids(out)["content"] == [
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "name": "now", "input": {}},
    ]


@pytest.mark.parametrize(
    "body",
    [
        {"messages": script(TEXT)},
        {"messages": script(THOUGHT), "thinking": THINKING_ON},
        {"messages": script(CALLS), "tools": TOOLS},
        {"messages": script("Hm.<|END_THINKING|>" + CALLS), "tools": TOOLS, "thinking": THINKING_ON},
        {"messages": script(TEXT), "stop_sequences": ["there"]},
        {"messages": script(CALLS), "tools": TOOLS, "max_tokens": CUT},  # cut off inside a call
    ],
)
def test_a_stream_adds_up_to_the_whole_answer(scripted, body):
    body = {"max_tokens": 200, **body}
    whole = create(scripted, **body)
    events = stream(scripted, **body)
    streamed = assemble(events)
    if whole["stop_reason"] == "max_tokens":  # a call cut off comes as far as it got streamed, not whole
        (call,) = streamed["content"]
        assert call["name"] == "get_weather" and call["partial_json"].startswith('{"city": "P')
        assert whole["content"] == []
        streamed["content"] = []
    assert without_ids(streamed) == without_ids(whole)
    assert events[0]["message"]["usage"] == {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}


def test_a_tool_use_round_trip(scripted):
    """The assistant's content goes back as it came (thinking and tool_use blocks), the results as
    tool_result blocks, and the model's next answer is read."""
    first = create(
        scripted, max_tokens=200, messages=script("Hm.<|END_THINKING|>" + CALLS), tools=TOOLS, thinking=THINKING_ON
    )
    weather, now = (b["id"] for b in first["content"] if b["type"] == "tool_use")
    results = [
        {"type": "tool_result", "tool_use_id": now, "content": "noon"},
        {"type": "tool_result", "tool_use_id": weather, "content": [{"type": "text", "text": "sunny"}]},
        {"type": "text", "text": "SCRIPT:Done.<|END_THINKING|><|START_RESPONSE|>Sunny at noon.<|END_RESPONSE|>"},
    ]
    messages = [
        *script(CALLS),
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": results},
    ]
    out = create(scripted, max_tokens=200, messages=messages, tools=TOOLS, thinking=THINKING_ON)
    assert out["content"][1:] == [{"type": "text", "text": "Sunny at noon."}]
    assert out["stop_reason"] == "end_turn"


def test_stop_sequences(scripted):
    text = "<|START_RESPONSE|>one two three<|END_RESPONSE|>"
    out = create(scripted, max_tokens=64, messages=script(text), stop_sequences=["three", "two"])
    assert out["content"] == [{"type": "text", "text": "one "}]
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", "two")
    streamed = assemble(stream(scripted, max_tokens=64, messages=script(text), stop_sequences=["three", "two"]))
    assert (streamed["stop_reason"], streamed["stop_sequence"]) == ("stop_sequence", "two")


def test_max_tokens_ends_an_answer(scripted):
    out = create(scripted, max_tokens=3, messages=script(TEXT))
    assert (out["stop_reason"], out["usage"]["output_tokens"]) == ("max_tokens", 3)


def test_output_that_breaks_the_tool_choice_is_an_api_error(scripted):
    body = {
        "max_tokens": 200,
        "messages": script(CALLS),
        "tools": TOOLS,
        "tool_choice": {"type": "tool", "name": "now"},
    }
    r = post(scripted, body)
    assert r.status_code == 502
    assert r.json() == {"type": "error", "error": {"type": "api_error", "message": r.json()["error"]["message"]}}
    assert "tool_choice requires 'now'" in r.json()["error"]["message"]
    events = stream(scripted, **body)
    assert events[-1]["type"] == "error" and events[-1]["error"]["type"] == "api_error"
    assert not any(e["type"] == "message_stop" for e in events)


def cancelled_requests(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith("mk_requests_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'finish_reason="cancelled"' in line)


def test_a_client_that_goes_away_cancels_its_request(scripted):
    before = cancelled_requests(scripted)
    long = "<|START_RESPONSE|>" + "word " * 400 + "<|END_RESPONSE|>"  # seconds of scripted tokens
    body = {"max_tokens": 2000, "messages": script(long), "stream": True}
    with httpx.stream("POST", scripted.url + "/v1/messages", json=body, headers=HEADERS, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(12):  # message_start, the text block's start, a few deltas
            next(lines)
    for _ in range(100):  # closing the stream is the disconnect
        if cancelled_requests(scripted) > before:
            break
        time.sleep(0.02)
    assert cancelled_requests(scripted) == before + 1


# ---- errors ------------------------------------------------------------------------------------


def assert_anthropic_error(r: httpx.Response, status: int, kind: str, contains: str = "") -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}
    assert contains in body["error"]["message"] and "Traceback" not in body["error"]["message"]


USER = [{"role": "user", "content": "hi"}]
ASKED = [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "now", "input": {}}]}]


@pytest.mark.parametrize(
    "body,contains",
    [
        ({"messages": USER}, "max_tokens: Field required"),
        ({"max_tokens": 0, "messages": USER}, "max_tokens"),
        ({"max_tokens": 8, "messages": []}, "messages"),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "'image'"),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text",
        ),
        ({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "thinking", "thinking": "x"}]}]}, "user"),
        ({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"max_tokens": 8, "messages": USER, "system": [{"type": "image"}]}, "system"),
        ({"max_tokens": 8, "messages": [*ASKED, *USER], "tools": TOOLS}, "no tool_result"),
        (
            {
                "max_tokens": 8,
                "messages": [*USER, {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t9"}]}],
            },
            "t9",
        ),
        ({"max_tokens": 8, "messages": ASKED, "tools": TOOLS}, "prefilled answer"),
        (
            {"max_tokens": 8, "messages": [*USER, {"role": "assistant", "content": "Sure"}], "thinking": THINKING_ON},
            "prefilled answer",
        ),
        ({"max_tokens": 8, "messages": [*ASKED, *USER], "tools": TOOLS[:1]}, "'now' names no tool"),
        ({"max_tokens": 8, "messages": USER, "tool_choice": {"type": "any"}}, "no tools"),
        ({"max_tokens": 8, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice.name"),
        ({"max_tokens": 8, "messages": USER, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "x"}}, "'x'"),
        ({"max_tokens": 8, "messages": USER, "tools": [{"type": "web_search_20250305", "name": "web"}]}, "server tool"),
        ({"max_tokens": 8, "messages": USER, "tools": [TOOLS[1], TOOLS[1]]}, "same name"),
        ({"max_tokens": 8, "messages": USER, "temperature": 1.5}, "temperature"),
        ({"max_tokens": 8, "messages": USER, "top_k": -1}, "top_k"),
        ({"max_tokens": 8, "messages": USER, "stop_sequences": [""]}, "stop_sequences"),
        ({"max_tokens": 8, "messages": USER, "thinking": {"type": "on"}}, "thinking.type"),
        ({"max_tokens": 8, "messages": USER, "max_token": 8}, "did you mean 'max_tokens'"),
        ({"max_tokens": 10**6, "messages": USER}, "context limit"),
    ],
)
def test_bad_requests_are_anthropic_400s(scripted, body, contains):
    assert_anthropic_error(post(scripted, body), 400, "invalid_request_error", contains)


def test_count_tokens_refuses_what_it_does_not_take(scripted):
    r = post(scripted, {"messages": USER, "max_tokens": 8}, "/v1/messages/count_tokens")
    assert_anthropic_error(r, 400, "invalid_request_error", "max_tokens")


def test_another_model_and_other_routes_are_anthropic_not_found_errors(scripted):
    assert_anthropic_error(
        post(scripted, {"model": "claude-x", "max_tokens": 8, "messages": USER}), 404, "not_found_error"
    )
    assert_anthropic_error(post(scripted, {}, "/v1/messages/batches"), 404, "not_found_error")
    r = httpx.get(scripted.url + "/v1/messages", headers=HEADERS)
    assert_anthropic_error(r, 405, "invalid_request_error")


def test_the_api_key_as_x_api_key_or_bearer(scripted):
    body = {"max_tokens": 8, "messages": script(TEXT)}
    for headers in (
        {"x-api-key": "wrong"},
        {},
        {"Authorization": "Bearer wrong"},
        {"x-api-key": "", "Authorization": KEY},
    ):
        assert_anthropic_error(post(scripted, body, headers=headers), 401, "authentication_error", "API key")
        r = post(scripted, body, "/v1/messages/count_tokens", headers=headers)
        assert_anthropic_error(r, 401, "authentication_error")
    assert post(scripted, body, headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    assert post(scripted, body, headers={"x-api-key": KEY, "Authorization": "Bearer wrong"}).status_code == 200
    # The OpenAI routes take either header too, and keep their own error bodies.
    assert httpx.get(scripted.url + "/v1/models", headers={"x-api-key": KEY}).status_code == 200
    r = httpx.get(scripted.url + "/v1/models", headers={"x-api-key": "wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_a_busy_server_is_anthropic_overloaded():
    status, body = APIError(503, "the server is busy", headers={"Retry-After": "1"}).anthropic()
    assert (status, body["error"]["type"]) == (529, "overloaded_error")
    assert APIError(500, "x").anthropic()[1]["error"]["type"] == "api_error"
    assert APIError(413, "x").anthropic()[1]["error"]["type"] == "request_too_large"
    assert APIError(400, "too long", "messages").anthropic()[1]["error"]["message"] == "messages: too long"


def test_the_conversation_maps_onto_the_chat_request():
    req = MessagesRequest.model_validate(
        {
            "max_tokens": 8,
            "system": [
                {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Be kind."},
            ],
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "t", "signature": "sig"},
                        {"type": "text", "text": "a"},
                        {"type": "tool_use", "id": "t1", "name": "now", "input": {"tz": "UTC"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "boom", "is_error": True}],
                },
            ],
            "tools": TOOLS,
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "top_k": 5,
        }
    )
    chat = chat_request(req)
    dumped = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert dumped[0] == {"role": "system", "content": "Be brief.\n\nBe kind."}
    assert dumped[2]["reasoning_content"] == "t" and dumped[2]["content"] == "a"
    assert dumped[2]["tool_calls"][0]["function"] == {"name": "now", "arguments": {"tz": "UTC"}}
    assert dumped[3] == {"role": "tool", "tool_call_id": "t1", "content": TOOL_ERROR_PREFIX + "boom"}
    assert len(dumped) == 4  # no empty user turn after the results
    assert (chat.tool_choice, chat.parallel_tool_calls) == ("required", False)
    assert [t.function.parameters for t in chat.tools] == [t["input_schema"] for t in TOOLS]
    assert (chat.stop, chat.top_k, chat.max_tokens, chat.include_reasoning) == (["END"], 5, 8, False)
    assert chat.chat_template_kwargs == {"enable_thinking": False}


# ---- the built-in model ------------------------------------------------------------------------

GREEDY = {"temperature": 0, "max_tokens": 120}
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}])
def test_a_forced_tool_call_and_its_result(server, choice):
    """The grammar makes the answer a call whose input follows the tool's schema; streamed, the same;
    with the result sent back (and tool_choice none) the model answers in text."""
    body = {"messages": WEATHER, "tools": TOOLS, "tool_choice": choice, **GREEDY}
    out = create(server, **body)
    assert out["model"] == NAME and out["stop_reason"] == "tool_use", out
    calls = [b for b in out["content"] if b["type"] == "tool_use"]
    assert calls and all(b["name"] in ("get_weather", "now") for b in calls)
    if choice["type"] == "tool":
        assert [b["name"] for b in calls] == ["get_weather"]
    for call in calls:
        jsonschema.validate(call["input"], next(t["input_schema"] for t in TOOLS if t["name"] == call["name"]))
    assert without_ids(assemble(stream(server, **body))) == without_ids(out)
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "Sunny, 24 C"} for b in calls]
    messages = [*WEATHER, {"role": "assistant", "content": out["content"]}, {"role": "user", "content": results}]
    answer = create(server, messages=messages, tools=TOOLS, tool_choice={"type": "none"}, **GREEDY)
    assert [b["type"] for b in answer["content"]] == ["text"] and answer["content"][0]["text"]
    assert answer["stop_reason"] in ("end_turn", "max_tokens")
    assert answer["usage"]["input_tokens"] > out["usage"]["input_tokens"]


def test_stop_sequences_on_the_model(server):
    body = {"messages": [{"role": "user", "content": "Write a loop."}], "max_tokens": 40, "temperature": 0}
    text = create(server, **body)["content"][0]["text"]
    stop = text.split()[2]  # a word the greedy answer writes
    out = create(server, **body, stop_sequences=[stop])
    assert (out["stop_reason"], out["stop_sequence"]) == ("stop_sequence", stop)
    assert out["content"][0]["text"] == text[: text.index(stop)]


def test_thinking_on_the_model_streams_like_the_whole_answer(server):
    body = {"messages": [{"role": "user", "content": "Write a loop."}], "thinking": THINKING_ON, **GREEDY}
    whole = create(server, **body)
    assert whole["content"][0]["type"] == "thinking" and whole["content"][0]["thinking"]
    assert without_ids(assemble(stream(server, **body))) == without_ids(whole)


def test_count_tokens_is_what_tokenize_and_usage_count(server):
    system = "You write Python."
    anthropic = {"system": system, "messages": [{"role": "user", "content": "Write a loop."}]}
    openai = [{"role": "system", "content": system}, {"role": "user", "content": "Write a loop."}]
    for thinking, template_kwargs in ((None, {"enable_thinking": False}), (THINKING_ON, {})):
        extra = {"thinking": thinking} if thinking else {}
        counted = count(server, **anthropic, **extra)
        r = httpx.post(server.url + "/tokenize", json={"messages": openai, "chat_template_kwargs": template_kwargs})
        assert counted == r.json()["count"]
        assert counted == create(server, **anthropic, **extra, max_tokens=1)["usage"]["input_tokens"]
    with_tools = count(server, **anthropic, tools=TOOLS)
    assert with_tools > count(server, **anthropic)  # the template lists the tools


CITY = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}, "degrees": {"type": "integer"}},
    "required": ["city", "degrees"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_structured_output_is_json_that_its_schema_validates(server, field):
    """Anthropic's structured outputs (`output_config.format`, or the beta's `output_format`): the
    answer's text is JSON that the schema validates, held to it by the chat route's grammar, streamed
    as the whole answer."""
    answer_format = {"type": "json_schema", "schema": CITY}
    value = {"format": answer_format, "effort": "low"} if field == "output_config" else answer_format
    body = {"messages": WEATHER, field: value, **GREEDY}
    out = create(server, **body)
    assert [b["type"] for b in out["content"]] == ["text"] and out["stop_reason"] == "end_turn", out
    jsonschema.validate(json.loads(out["content"][0]["text"]), CITY)
    assert without_ids(assemble(stream(server, **body))) == without_ids(out)


def test_structured_output_takes_one_name_and_a_json_schema(scripted):
    one = {"type": "json_schema", "schema": CITY}
    both = {"max_tokens": 8, "messages": USER, "output_format": one, "output_config": {"format": one}}
    assert_anthropic_error(post(scripted, both), 400, "invalid_request_error", "not both")
    other = {"max_tokens": 8, "messages": USER, "output_config": {"format": {"type": "regex", "schema": {}}}}
    assert_anthropic_error(post(scripted, other), 400, "invalid_request_error", "output_config.format.type")
