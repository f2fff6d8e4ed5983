"""The OpenAI Responses API (/v1/responses) through the official `openai` client: against a server whose
scripted "model" writes what a test asks for (exact output items, stream events, usage, the store and
previous_response_id, errors), and against `python -m mk.server` on the built-in model (a function call
forced by the grammar and its output sent back by previous_response_id, json_schema output, the prefix
cache across turns, max_output_tokens)."""

import asyncio
import copy
import json
import re
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from preparing import preparing_state
from pydantic import BaseModel
from server_util import ServerProcess

from mk.config import ModelConfig
from mk.default_model import NAME
from mk.server.errors import APIError
from mk.server.generate import Piece
from mk.server.responses import _Answer, _prepare
from mk.server.responses_chat import carried_output, chat_request, in_responses_terms
from mk.server.responses_schemas import ResponsesRequest
from mk.server.responses_store import ResponseStore, StoredResponse
from mk.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # (starts python -m mk.server)

SCRIPTED_TOK = Tokenizer.builtin(ModelConfig.tiny().vocab_size)  # the scripted server's
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Weather of a city", "parameters": WEATHER_SCHEMA},
    {"type": "function", "name": "now", "description": "The time", "parameters": {"type": "object"}, "strict": False},
]
# What the scripted model writes (the prompt has opened the thinking block unless reasoning is off).
THOUGHT = "Hm.<|END_THINKING|>"
TEXT = THOUGHT + "<|START_RESPONSE|>Hello there.<|END_RESPONSE|>"
CALLS = THOUGHT + (
    '<|START_ACTION|>[{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"tool_call_id": "1", "tool_name": "now", "parameters": {}}]<|END_ACTION|>'
)
NO_THINKING = {"effort": "none"}


def tokens(text: str) -> list[int]:
    return SCRIPTED_TOK.encode(text, add_special_tokens=False)


def cut_inside(text: str, inside: str) -> int:
    """The fewest tokens of `text` whose text holds `inside`: a max_output_tokens that cuts there."""
    ids = tokens(text)
    return next(n for n in range(1, len(ids)) if inside in SCRIPTED_TOK.decode(ids[:n]))


@pytest.fixture(scope="module")
def scripted():
    s = ServerProcess(module="scripted_engine", env={"PYTHONPATH": "tests:python"}).wait_ready()
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def sc(scripted):
    """The official client on the scripted server."""
    return openai.OpenAI(base_url=scripted.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def say(text: str) -> str:
    return "SCRIPT:" + text


def create(client, **body) -> dict:
    """A whole response as the JSON the server sent (the client's object, less the fields it did not send)."""
    return client.responses.create(**{"model": "scripted", **body}).to_dict()


def stream(client, **body) -> list[dict]:
    """A streamed response's events as the server sent them, read by the client."""
    with client.responses.create(**{"model": "scripted", **body}, stream=True) as events:
        return [event.to_dict() for event in events]


# The events of one output item, in the API's order, each kind by a letter.
_LETTERS = {
    "response.output_item.added": "A",
    "response.content_part.added": "P",
    "response.output_text.delta": "t",
    "response.reasoning_text.delta": "r",
    "response.function_call_arguments.delta": "f",
    "response.output_text.done": "T",
    "response.reasoning_text.done": "R",
    "response.function_call_arguments.done": "F",
    "response.content_part.done": "Q",
    "response.output_item.done": "D",
}
_ITEM_EVENTS = {"message": "APt*TQD", "reasoning": "APr*RQD", "function_call": "Af*FD"}


def assemble(events: list[dict]) -> dict:
    """The response a stream adds up to, its events checked to come in the API's order: numbered from 0,
    response.created and .in_progress, then one output item at a time (added, its part, deltas of its
    own kind, done), then response.completed or .incomplete, whose output is what the deltas built."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created, in_progress, *middle, last = events
    assert (created["type"], in_progress["type"]) == ("response.created", "response.in_progress")
    for head in (created["response"], in_progress["response"]):
        assert (head["status"], head["output"], head["usage"]) == ("in_progress", [], None)
    items: list[dict] = []
    letters: list[str] = []
    for e in middle:
        letter = _LETTERS[e["type"]]
        if letter == "A":
            assert e["output_index"] == len(items) and e["item"]["status"] == "in_progress"
            items.append(copy.deepcopy(e["item"]))
            letters.append("")
        item = items[-1]
        assert e["output_index"] == len(items) - 1
        if letter != "A" and letter != "D":
            assert e["item_id"] == item["id"]
        letters[-1] += letter
        if letter == "P":
            assert e["content_index"] == 0 and e["part"]["text"] == ""
            item["content"].append(e["part"])
        elif letter in "tr":
            item["content"][0]["text"] += e["delta"]
        elif letter in "TR":
            assert e["text"] == item["content"][0]["text"]
        elif letter == "Q":
            assert e["part"] == item["content"][0]
        elif letter == "f":
            item["arguments"] += e["delta"]
        elif letter == "F":
            assert (e["name"], e["arguments"]) == (item["name"], item["arguments"])
        elif letter == "D":
            assert e["item"] == {**item, "status": e["item"]["status"]}
            items[-1] = e["item"]
    for item, seen in zip(items, letters, strict=True):
        assert re.fullmatch(_ITEM_EVENTS[item["type"]], seen), (item["type"], seen)
    response = last["response"]
    assert last["type"] == "response." + response["status"]
    assert response["output"] == items
    return response


def without_ids(response: dict) -> dict:
    """The response less what differs between two runs of one request: ids, call ids, its time, and the
    prompt tokens the prefix cache held."""
    drop = {"id", "call_id", "created_at"}
    output = [{k: v for k, v in item.items() if k not in drop} for item in response["output"]]
    usage = response["usage"] and {k: v for k, v in response["usage"].items() if k != "input_tokens_details"}
    return {**{k: v for k, v in response.items() if k not in drop}, "output": output, "usage": usage}


def prompt_tokens(server, messages: list[dict], tools: list[dict] | None = None, thinking: bool = True) -> int:
    """The prompt tokens of the chat conversation `messages`, as /tokenize counts them."""
    body: dict = {"messages": messages, "chat_template_kwargs": {} if thinking else {"enable_thinking": False}}
    if tools:
        body["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in tools]
    r = httpx.post(server.url + "/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def message(text: str, status: str = "completed") -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {"type": "message", "role": "assistant", "content": [part], "status": status}


def reasoning(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": text}], "status": status}


def function_call(name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "name": name, "arguments": arguments, "status": status}


# ---- the scripted model: exact shapes ------------------------------------------------------------


def test_a_text_answer_with_its_reasoning(sc, scripted):
    settings = {
        "instructions": "Be brief.",
        "max_output_tokens": 64,
        "temperature": 0.5,
        "top_p": 0.9,
        "metadata": {"k": "v"},
        "user": "u1",
    }
    out = create(sc, input=say(TEXT), **settings)
    assert out["id"].startswith("resp_") and out["output"][0]["id"].startswith("rs_")
    assert out["output"][1]["id"].startswith("msg_")
    assert without_ids(out)["output"] == [reasoning("Hm."), message("Hello there.")]
    assert {k: out[k] for k in settings} == settings
    assert {
        k: out[k] for k in ("object", "model", "status", "incomplete_details", "error", "previous_response_id")
    } == {
        "object": "response",
        "model": "scripted",
        "status": "completed",
        "incomplete_details": None,
        "error": None,
        "previous_response_id": None,
    }
    assert (out["tools"], out["tool_choice"], out["parallel_tool_calls"]) == ([], "auto", True)
    assert (out["text"], out["store"], out["truncation"]) == ({"format": {"type": "text"}}, True, "disabled")
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": say(TEXT)}]
    input_tokens, output_tokens = prompt_tokens(scripted, conversation), len(tokens(TEXT)) + 1  # and EOS
    assert out["usage"] == {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": len(tokens(THOUGHT))},
        "total_tokens": input_tokens + output_tokens,
    }
    assert sc.responses.create(model="scripted", input=say(TEXT)).output_text == "Hello there."


def test_reasoning_effort_none_closes_the_thinking_block(sc, scripted):
    out = create(sc, input=say("<|START_RESPONSE|>Hi.<|END_RESPONSE|>"), reasoning=NO_THINKING)
    assert without_ids(out)["output"] == [message("Hi.")]
    assert out["reasoning"] == {"effort": "none", "summary": None}
    assert out["usage"]["output_tokens_details"] == {"reasoning_tokens": 0}
    user = [{"role": "user", "content": say("<|START_RESPONSE|>Hi.<|END_RESPONSE|>")}]
    assert out["usage"]["input_tokens"] == prompt_tokens(scripted, user, thinking=False)


def test_function_calls_are_function_call_items(sc):
    out = create(sc, input=say(CALLS), tools=TOOLS)
    _, weather, now = out["output"]
    assert weather["id"].startswith("fc_") and weather["call_id"].startswith("call_")
    assert len({weather["id"], now["id"], weather["call_id"], now["call_id"]}) == 4
    assert without_ids(out)["output"] == [
        reasoning("Hm."),
        function_call("get_weather", '{"city": "Paris"}'),
        function_call("now", "{}"),
    ]
    assert out["tools"] == [
        {**TOOLS[0], "strict": True},
        {**TOOLS[1], "strict": False},
    ]


def test_a_function_call_round_trip_by_previous_response_id(sc, scripted):
    """The outputs go back as function_call_output items after the stored response; the prompt is the
    chat conversation of its input, its output and the new input, and the same when the client sends
    the whole conversation itself (store: false, as Codex does)."""
    first = create(sc, input=say(CALLS), tools=TOOLS)
    weather, now = (item for item in first["output"] if item["type"] == "function_call")
    answer = say("Done.<|END_THINKING|><|START_RESPONSE|>Sunny at noon.<|END_RESPONSE|>")
    sunny = [{"type": "input_text", "text": "sunny"}]
    new_input = [
        {"type": "function_call_output", "call_id": now["call_id"], "output": "noon"},
        {"type": "function_call_output", "call_id": weather["call_id"], "output": sunny},
        {"role": "user", "content": answer},
    ]
    second = create(sc, previous_response_id=first["id"], input=new_input, tools=TOOLS)
    assert without_ids(second)["output"] == [reasoning("Done."), message("Sunny at noon.")]
    assert second["previous_response_id"] == first["id"]
    calls = [
        {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
        for c in (weather, now)
    ]
    chat = [
        {"role": "user", "content": say(CALLS)},
        {"role": "assistant", "content": "", "reasoning_content": "Hm.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": now["call_id"], "content": "noon"},
        {"role": "tool", "tool_call_id": weather["call_id"], "content": "sunny"},
        {"role": "user", "content": answer},
    ]
    assert second["usage"]["input_tokens"] == prompt_tokens(scripted, chat, TOOLS)
    counted = sc.responses.input_tokens.count(previous_response_id=first["id"], input=new_input, tools=TOOLS)
    assert (counted.object, counted.input_tokens) == ("response.input_tokens", second["usage"]["input_tokens"])
    whole = [{"role": "user", "content": say(CALLS)}, *first["output"], *new_input]
    stateless = create(sc, input=whole, tools=TOOLS, store=False)
    assert without_ids(stateless)["output"] == without_ids(second)["output"]
    assert stateless["usage"] == second["usage"]


def test_earlier_calls_need_not_name_a_tool_of_this_request(sc):
    """An agent that hands off to another has other tools by the next turn."""
    handoff = [
        {"role": "user", "content": "hi"},
        {"type": "function_call", "call_id": "c1", "name": "transfer_to_coder", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "{}"},
        {"role": "user", "content": say(TEXT)},
    ]
    assert create(sc, input=handoff, tools=TOOLS)["output"][-1]["content"][0]["text"] == "Hello there."


@pytest.mark.parametrize(
    "body",
    [
        {"input": say(TEXT)},
        {"input": say("<|START_RESPONSE|>Hi.<|END_RESPONSE|>"), "reasoning": NO_THINKING},
        {"input": say(CALLS), "tools": TOOLS},
        {"input": say(THOUGHT)},  # neither text nor calls: an empty message
        {"input": say(CALLS), "tools": TOOLS, "max_output_tokens": cut_inside(CALLS, '"city": "P')},
        {"input": say(TEXT), "max_output_tokens": cut_inside(TEXT, "Hel")},
        {"input": say(TEXT), "max_output_tokens": 1},  # cut inside the reasoning
    ],
)
def test_a_stream_adds_up_to_the_whole_response(sc, body):
    whole = create(sc, **body)
    streamed = assemble(stream(sc, **body))
    assert without_ids(streamed) == without_ids(whole)
    if body.get("max_output_tokens", 100) < 100:
        assert streamed["status"] == "incomplete" and streamed["output"][-1]["status"] == "incomplete"


def test_the_empty_answer_and_the_cut_answers_are_as_the_api_says(sc):
    assert without_ids(create(sc, input=say(THOUGHT)))["output"] == [reasoning("Hm."), message("")]
    cut = cut_inside(TEXT, "Hel")
    out = create(sc, input=say(TEXT), max_output_tokens=cut)
    assert (out["status"], out["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
    assert out["usage"]["output_tokens"] == cut == out["max_output_tokens"]
    (_, text) = out["output"]
    assert text["status"] == "incomplete" and "Hello there.".startswith(text["content"][0]["text"])
    out = create(sc, input=say(CALLS), tools=TOOLS, max_output_tokens=cut_inside(CALLS, '"city": "P'))
    (_, call) = out["output"]
    assert call["status"] == "incomplete" and call["arguments"].startswith('{"city": "P')


def test_events_are_named_by_their_type(scripted):
    body = {"input": say(TEXT), "stream": True}
    names = []
    with httpx.stream("POST", scripted.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream"
        for line in r.iter_lines():
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
            elif line.startswith("data: "):
                assert json.loads(line.removeprefix("data: "))["type"] == names[-1]
    assert names[0] == "response.created" and names[-1] == "response.completed" and "[DONE]" not in names


def test_output_that_breaks_the_tool_choice_fails(sc):
    body = {"input": say(CALLS), "tools": TOOLS, "tool_choice": {"type": "function", "name": "now"}}
    with pytest.raises(openai.InternalServerError) as e:
        create(sc, **body)
    assert e.value.status_code == 502 and "tool_choice requires 'now'" in e.value.message
    events = stream(sc, **body)
    error, failed = events[-2:]
    assert error["type"] == "error" and error["code"] == "tool_call_generation_error"
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"] == {"code": error["code"], "message": error["message"]}
    assert not any(e["type"] == "response.completed" for e in events)


def test_stored_responses_are_retrieved_and_deleted(sc):
    out = create(sc, input=say(TEXT))
    assert sc.responses.retrieve(out["id"]).to_dict() == out
    streamed = stream(sc, input=say(TEXT))[-1]["response"]
    assert sc.responses.retrieve(streamed["id"]).to_dict() == streamed
    sc.responses.delete(out["id"])
    with pytest.raises(openai.NotFoundError):
        sc.responses.retrieve(out["id"])
    with pytest.raises(openai.NotFoundError):
        sc.responses.delete(out["id"])


def test_a_response_not_stored_is_not_retrievable_nor_continued(sc):
    out = create(sc, input=say(TEXT), store=False)
    assert out["store"] is False
    with pytest.raises(openai.NotFoundError):
        sc.responses.retrieve(out["id"])
    with pytest.raises(openai.NotFoundError) as e:
        create(sc, input="more", previous_response_id=out["id"])
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"


def test_an_unknown_previous_response_id_is_not_found(sc, scripted):
    with pytest.raises(openai.NotFoundError) as e:
        create(sc, input="more", previous_response_id="resp_nope")
    assert "resp_nope" in e.value.message and e.value.body["param"] == "previous_response_id"
    r = httpx.get(scripted.url + "/v1/responses/resp_nope/input_items")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"  # no route
    assert httpx.put(scripted.url + "/v1/responses/resp_nope").status_code == 405


def cancelled_requests(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    lines = [line for line in text.splitlines() if line.startswith("mk_requests_total{")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if 'finish_reason="cancelled"' in line)


def test_a_client_that_goes_away_cancels_its_request(scripted):
    before = cancelled_requests(scripted)
    long = THOUGHT + "<|START_RESPONSE|>" + "word " * 400 + "<|END_RESPONSE|>"  # seconds of scripted tokens
    with httpx.stream("POST", scripted.url + "/v1/responses", json={"input": say(long), "stream": True}) as r:
        lines = r.iter_lines()
        for _ in range(20):  # created, in_progress, the reasoning item, a few deltas
            next(lines)
    for _ in range(100):  # closing the stream is the disconnect
        if cancelled_requests(scripted) > before:
            break
        time.sleep(0.02)
    assert cancelled_requests(scripted) == before + 1


# ---- errors ------------------------------------------------------------------------------------

CALL = {"type": "function_call", "call_id": "c1", "name": "now", "arguments": "{}"}
USER = {"role": "user", "content": "hi"}


@pytest.mark.parametrize(
    "body,param,contains",
    [
        ({"input": 3}, "input", "string or a list"),
        ({"input": []}, "input", "empty"),
        ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input", "'web_search_call'"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "'item_reference'"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content", "'input_image'"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "'user'"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text", "required"),
        ({"input": [{"type": "function_call_output", "call_id": "c1", "output": "x"}]}, "input[0].call_id", "'c1'"),
        ({"input": [CALL, USER]}, "input[1]", "no function_call_output"),
        ({"input": [CALL]}, "input", "no function_call_output"),
        ({"input": [{**CALL, "arguments": "[1"}, USER]}, "input[0].arguments", "JSON object"),
        ({"input": [CALL, CALL]}, "input[1].call_id", "twice"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", "'web_search'"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name!"}]}, "tools[0].name", "pattern"),
        ({"input": "x", "tools": [TOOLS[1], TOOLS[1]]}, "tools", "same name"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "no tools"),
        ({"input": "x", "tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "'nope'"),
        ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "only 'function'"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "'schema'"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type", "json_schema"),
        ({"input": "x", "temperature": 3}, "temperature", "2"),
        ({"input": "x", "top_p": 0}, "top_p", "0"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "1"),
        ({"input": "x", "max_output_tokens": 10**6}, "max_output_tokens", "context limit"),
        ({"input": "word " * 5000}, "input", "context limit"),
        ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort", "'none'"),
        ({"input": "x", "background": True}, "background", "background mode"),
        ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "cannot be included"),
        ({"input": "x", "truncation": "auto"}, "truncation", "'disabled'"),
        ({"input": "x", "max_output_token": 5}, "max_output_token", "did you mean 'max_output_tokens'"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(scripted, body, param, contains):
    assert_400(httpx.post(scripted.url + "/v1/responses", json=body, timeout=30), param, contains)


def assert_400(r: httpx.Response, param: str, contains: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error
    assert contains in error["message"] and "Traceback" not in error["message"]


def test_input_tokens_takes_the_conversation_alone(scripted):
    r = httpx.post(scripted.url + "/v1/responses/input_tokens", json={"input": "x", "max_output_tokens": 5})
    assert_400(r, "max_output_tokens", "unknown field")
    r = httpx.post(scripted.url + "/v1/responses/input_tokens", json={"input": [CALL]})
    assert_400(r, "input", "no function_call_output")
    r = httpx.post(scripted.url + "/v1/responses/input_tokens", json={"input": "word " * 5000})
    assert r.status_code == 200 and r.json()["input_tokens"] > 5000  # counted past the context


def test_accepted_fields_that_change_nothing(sc):
    out = create(
        sc,
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be kind."}]},
            {"role": "user", "content": say(TEXT)},
        ],
        include=["reasoning.encrypted_content"],
        reasoning={"effort": "high", "summary": "auto"},
        text={"format": {"type": "text"}, "verbosity": "low"},
        prompt_cache_key="k",
        truncation="disabled",
        background=False,
        parallel_tool_calls=False,
    )
    assert out["status"] == "completed" and out["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert out["parallel_tool_calls"] is False


# ---- in-process: the mapping, the store, odd bodies ------------------------------------------


def test_the_conversation_maps_onto_the_chat_request():
    req = ResponsesRequest.model_validate(
        {
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use Python."},
                {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
                {"type": "reasoning", "summary": [{"type": "summary_text", "text": t} for t in ("s1", "s2")]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
                {**CALL, "call_id": "c1"},
                {**CALL, "call_id": "c2", "arguments": '{"tz": "UTC"}'},
                {"type": "function_call_output", "call_id": "c2", "output": "noon"},
                {"type": "function_call_output", "call_id": "c1", "output": "1pm"},
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
                {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
                {"role": "assistant", "content": "Then again."},
                {"role": "user", "content": "q"},
            ],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "now"},
            "parallel_tool_calls": False,
            "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
            "reasoning": NO_THINKING,
            "max_output_tokens": 9,
        }
    )
    chat = chat_request(req)
    messages = [m.model_dump(exclude_none=True) for m in chat.messages]
    for m in messages:  # parts, as the chat route joins them
        m["content"] = "".join(p["text"] for p in m["content"]) if isinstance(m["content"], list) else m["content"]
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "now", "arguments": "{}"}},
        {"id": "c2", "type": "function", "function": {"name": "now", "arguments": '{"tz": "UTC"}'}},
    ]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": "Use Python."},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "s1\n\ns2", "tool_calls": calls},
        {"role": "tool", "content": "noon", "tool_call_id": "c2"},
        {"role": "tool", "content": "1pm", "tool_call_id": "c1"},
        {"role": "assistant", "content": "No.", "reasoning_content": "t"},
        {"role": "assistant", "content": "Then again."},
        {"role": "user", "content": "q"},
    ]
    assert chat.tool_choice.function.name == "now" and chat.parallel_tool_calls is False
    assert chat.response_format == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    assert (chat.max_tokens, chat.chat_template_kwargs, chat.include_reasoning) == (9, {"enable_thinking": False}, True)
    assert [t.function.parameters for t in chat.tools] == [t["parameters"] for t in TOOLS]


def test_chat_errors_name_the_responses_field():
    renamed = in_responses_terms(APIError(400, "messages[3].tool_calls: bad", "messages[3].tool_calls"))
    assert (renamed.param, renamed.message) == ("input", "input: bad")
    renamed = in_responses_terms(APIError(400, "context limit", "max_tokens", "context_length_exceeded"))
    assert (renamed.param, renamed.message, renamed.code) == (
        "max_output_tokens",
        "context limit",
        "context_length_exceeded",
    )
    renamed = in_responses_terms(APIError(400, "response_format: invalid json_schema", "response_format"))
    assert (renamed.param, renamed.message) == ("text.format", "text.format: invalid json_schema")
    same = APIError(400, "bad", "tools")
    assert in_responses_terms(same) is same


def stored(rid: str, size: int = 1) -> StoredResponse:
    return StoredResponse({"id": rid}, (), (), size)


def test_the_store_forgets_the_least_recently_used_first():
    store = ResponseStore(max_responses=3, max_bytes=100)
    for rid in "abc":
        store.put(stored(rid))
    assert store.get("a") is not None  # now the most recently used
    store.put(stored("d"))
    assert [rid for rid in "abcd" if store.get(rid)] == ["a", "c", "d"]
    store.put(stored("e", 99))  # past the bytes: the least recently used go until it fits
    assert [rid for rid in "acde" if store.get(rid)] == ["d", "e"]
    store.put(stored("f", 101))  # alone past the bytes: not kept at all
    assert len(store) == 0
    store.put(stored("g"))
    assert store.delete("g") and not store.delete("g") and store.get("g") is None


STATE = preparing_state()
STATE.responses.put(  # "resp_x": a user's message and the answer, for bodies that follow it
    StoredResponse(
        {"id": "resp_x"}, carried_output([{"role": "user", "content": "hi"}]), carried_output([message("Hello.")]), 1
    )
)
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=6))
text_part = st.fixed_dictionaries(
    {"type": st.sampled_from(["input_text", "output_text", "refusal", "input_image"])},
    optional={"text": json_leaf, "refusal": json_leaf},
)
content = st.one_of(st.text(max_size=8), st.lists(text_part, max_size=2), json_leaf)
item = st.one_of(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"])},
        optional={"type": st.sampled_from(["message", "nope"]), "content": content},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call"), "call_id": st.sampled_from(["a", "b", ""])},
        optional={"name": st.sampled_from(["now", ""]), "arguments": st.sampled_from(["{}", "[", "3", ""]) | json_leaf},
    ),
    st.fixed_dictionaries(
        {"type": st.just("function_call_output"), "call_id": st.sampled_from(["a", "b"])}, optional={"output": content}
    ),
    st.fixed_dictionaries({"type": st.just("reasoning")}, optional={"summary": json_leaf, "content": json_leaf}),
    json_leaf,
)
text_format = st.fixed_dictionaries(
    {"type": st.sampled_from(["json_schema", "json_object", "x"])},
    optional={"name": json_leaf, "schema": st.just({"type": "object"}) | json_leaf},
)
body = st.fixed_dictionaries(
    {"input": st.lists(item, max_size=5) | st.text(max_size=6) | json_leaf},
    optional={
        "tools": st.lists(st.sampled_from([TOOLS[1], {"type": "web_search"}, {"type": "function"}]), max_size=2),
        "tool_choice": st.sampled_from(["auto", "required", {"type": "function", "name": "now"}]) | json_leaf,
        "text": st.fixed_dictionaries({"format": text_format}),
        "max_output_tokens": st.integers(-1, 600) | json_leaf,
        "previous_response_id": st.just("resp_x") | json_leaf,
        "instructions": json_leaf,
    },
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body)
def test_request_preparation_raises_only_api_errors(body):
    try:
        _prepare(STATE, json.dumps(body).encode())
    except APIError as e:
        assert e.status in (400, 404) and e.message and (e.param is None or not e.param.startswith("messages"))


class _FailingRun:
    """A ChoiceRun whose generation writes `text`, then fails: as the engine says (`raises` False) or by
    an exception."""

    def __init__(self, text: str, raises: bool) -> None:
        self.text, self.raises = text, raises
        self.token_ids, self.cached_tokens, self.arrival, self.first_token_at = [1, 2], 0, 0.0, None
        self.finish_reason = None

    async def pieces(self):
        yield Piece(self.text, [(1, None, None)])
        if self.raises:
            raise RuntimeError("boom")
        self.finish_reason = "error"
        yield Piece("", [(2, None, None)], "error", "boom")


@pytest.mark.parametrize("raises,code,says", [(False, "generation_error", "generation failed: boom"),
                                               (True, "server_error", "internal error (request r1")])  # fmt: skip
def test_a_failure_mid_stream_is_an_error_event_then_response_failed(raises, code, says):
    prepared = _prepare(STATE, json.dumps({"input": "hi"}).encode())
    answer = _Answer(STATE, prepared, "resp_r1", _FailingRun("Hm.<|END_THINKING|><|START_RESPONSE|>Hel", raises), 1)

    async def read() -> list[dict]:
        return [event async for event in answer.events({"id": "r1"})]

    events = asyncio.run(read())
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    error, failed = events[-2:]
    assert (error["type"], error["code"], failed["type"]) == ("error", code, "response.failed")
    assert error["message"].startswith(says) and failed["response"]["error"]["message"] == error["message"]
    assert failed["response"]["status"] == "failed" and STATE.responses.get("resp_r1") is None
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == ["Hel"] and not any(e["type"] == "response.completed" for e in events)


# ---- the built-in model ------------------------------------------------------------------------

GREEDY = {"model": NAME, "temperature": 0, "max_output_tokens": 120}
WEATHER = "What is the weather in Paris?"


def test_text_and_its_stream_on_the_model(client):
    body = {**GREEDY, "input": "Write a loop.", "max_output_tokens": 60}
    whole = client.responses.create(**body)
    assert whole.model == NAME and whole.output_text and whole.status in ("completed", "incomplete")
    with client.responses.create(**body, stream=True) as events:
        events = [e.to_dict() for e in events]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == whole.output_text
    assert without_ids(assemble(events)) == without_ids(whole.to_dict())


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_a_forced_function_call_and_its_output_by_previous_response_id(client, choice):
    """The grammar makes the answer a call whose arguments follow the tool's schema; streamed, the same;
    with the output sent back after the stored response (and tool_choice none) the model answers in text."""
    body = {**GREEDY, "input": WEATHER, "tools": TOOLS, "tool_choice": choice}
    first = client.responses.create(**body)
    assert first.status == "completed", first
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(call.name in ("get_weather", "now") for call in calls)
    if choice != "required":
        assert [call.name for call in calls] == ["get_weather"]
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), next(t["parameters"] for t in TOOLS if t["name"] == call.name))
    with client.responses.create(**body, stream=True) as events:
        assert without_ids(assemble([e.to_dict() for e in events])) == without_ids(first.to_dict())
    with client.responses.stream(**body) as helper:  # the client's own accumulation of the events
        final = helper.get_final_response()
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    outputs = [{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 24 C"} for call in calls]
    answer = client.responses.create(
        **GREEDY, previous_response_id=first.id, input=outputs, tools=TOOLS, tool_choice="none"
    )
    assert [item.type for item in answer.output if item.type != "reasoning"] == ["message"] and answer.output_text
    assert answer.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 10


def test_the_next_turn_reuses_the_cached_prefix(client, server):
    """The follow-up's prompt begins with the first turn's prompt and answer, which the prefix cache holds."""
    instructions = "You are a careful Python programmer who writes short answers. " * 6  # past a few KV pages
    first = client.responses.create(
        **{**GREEDY, "max_output_tokens": 30}, instructions=instructions, input="Write a loop."
    )
    hits = server.metric("mk_prefix_cache_hit_tokens_total")
    second = client.responses.create(
        **{**GREEDY, "max_output_tokens": 8},
        instructions=instructions,
        previous_response_id=first.id,
        input="Now test it.",
    )
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 64, (cached, first.usage)
    assert server.metric("mk_prefix_cache_hit_tokens_total") == hits + cached


def test_json_schema_output_on_the_model(client):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    out = client.responses.create(**{**GREEDY, "max_output_tokens": 200}, input="Give a person.", text={"format": fmt})
    assert out.status == "completed"
    jsonschema.validate(json.loads(out.output_text), schema)
    assert out.text.format.name == "person"
    out = client.responses.create(**GREEDY, input="Give a person.", text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(out.output_text), dict)


class Person(BaseModel):
    name: str
    age: int
    language: Literal["python", "rust"]


def test_the_clients_parse_and_stream_helpers_on_the_model(client):
    """The client's typed structured output: responses.parse and responses.stream with a pydantic
    text_format (a strict json_schema the grammar holds the answer to) parse the same object, and the
    stream helper's text deltas add up to its final response's text."""
    body = {**GREEDY, "max_output_tokens": 200, "input": "Give a person.", "reasoning": {"effort": "none"}}
    parsed = client.responses.parse(**body, text_format=Person)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    assert parsed.output_parsed == Person.model_validate_json(parsed.output_text)
    assert (parsed.text.format.type, parsed.text.format.strict) == ("json_schema", True)
    with client.responses.stream(**body, text_format=Person) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed and deltas == final.output_text == parsed.output_text


def test_max_output_tokens_on_the_model(client):
    body = {**GREEDY, "input": "Write a long story.", "max_output_tokens": 5}
    out = client.responses.create(**body)
    assert (out.status, out.incomplete_details.reason, out.usage.output_tokens) == (
        "incomplete",
        "max_output_tokens",
        5,
    )
    with client.responses.create(**body, stream=True) as events:
        assert [e.type for e in events][-1] == "response.incomplete"


def test_a_schema_the_grammar_engine_refuses_names_text_format(client):
    fmt = {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**GREEDY, input="x", text={"format": fmt})
    assert e.value.body["param"] == "text.format" and e.value.message.count("text.format")
