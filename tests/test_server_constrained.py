"""Grammar-constrained output end to end: a server process on the built-in model (CPU) and the
official client. Whatever the model would say, `json_object` answers are JSON objects,
`json_schema` answers validate against their schema, regex completions match their regex, and
streamed answers equal the whole ones; a constraint that cannot be compiled is a 400 naming its
field. Answers cut off by max_tokens are only a prefix, so the checks apply to finished ones
(and most must finish)."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st


def chat(client, content: str, **kw):
    return client.chat.completions.create(
        model="mk-embedded", messages=[{"role": "user", "content": content}], temperature=0, max_tokens=160, **kw
    )


# Small schemas whose every value is short: objects of required booleans, enums and bounded integers.
VALUES = st.sampled_from(
    [
        {"type": "boolean"},
        {"enum": ["red", "green", "blue"]},
        {"type": "integer", "minimum": 0, "maximum": 99},
        {"type": "string", "enum": ["yes", "no"]},
        {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
    ]
)
SCHEMAS = st.dictionaries(st.from_regex(r"[a-z]{1,6}", fullmatch=True), VALUES, min_size=1, max_size=3).map(
    lambda props: {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS)
def test_json_schema_answers_validate(client, schema):
    rf = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    out = chat(client, "Describe the item as JSON.", response_format=rf)
    choice = out.choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_answers_parse_and_streaming_agrees(client):
    finished = 0
    for prompt in ("Give me a JSON object.", "Return the config as JSON", "Return a JSON object with a name."):
        whole = chat(client, prompt, response_format={"type": "json_object"}).choices[0]
        chunks = list(chat(client, prompt, response_format={"type": "json_object"}, stream=True))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.message.content
        if whole.finish_reason == "stop":
            finished += 1
            assert isinstance(json.loads(whole.message.content), dict)
    assert finished >= 2


def test_regex_completions_match(client):
    rx = r"(def [a-z_]{1,12}\(\):|class [A-Z][a-z]{1,10}:)"
    for prompt in ("import os\n", "# helpers\n", "x = 1\n"):
        out = client.completions.create(
            model="mk-embedded", prompt=prompt, max_tokens=40, temperature=0, extra_body={"guided_regex": rx}
        )
        c = out.choices[0]
        assert c.finish_reason == "stop" and re.fullmatch(rx, c.text), c


def test_a_lark_grammar_on_completions(client):
    grammar = 'start: "x = " NUMBER\nNUMBER: /[0-9]{1,3}/'
    out = client.completions.create(
        model="mk-embedded",
        prompt="# a constant\n",
        max_tokens=20,
        temperature=0,
        extra_body={"guided_grammar": grammar},
    )
    assert re.fullmatch(r"x = [0-9]{1,3}", out.choices[0].text), out


@pytest.mark.parametrize("thinking", [False, True])
def test_a_lark_grammar_in_a_chat_holds_the_answer_whole(client, thinking):
    grammar = 'start: "x = " NUMBER\nNUMBER: /[0-9]{1,3}/'
    out = chat(
        client,
        "Write a constant.",
        extra_body={"guided_grammar": grammar, "chat_template_kwargs": {"enable_thinking": thinking}},
    )
    c = out.choices[0]
    if c.finish_reason == "stop" or not thinking:  # a long reasoning may use up max_tokens
        assert c.finish_reason == "stop" and re.fullmatch(r"x = [0-9]{1,3}", c.message.content), c


@pytest.mark.parametrize(
    "body, field",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nonsense"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_grammar": "start: x"}, "guided_grammar"),  # an undefined rule, inside the chat's grammar
    ],
)
def test_bad_constraints_are_400s_naming_the_field(server, body, field):
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "mk-embedded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error", err


def test_a_bad_grammar_on_completions_is_a_400(server):
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": "mk-embedded", "prompt": "x", "max_tokens": 4, "guided_grammar": "start: undefined_rule"},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_grammar", r.text


WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "additionalProperties": False}}},
]
SCHEMAS_BY_NAME = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def checked_calls(choice) -> list:
    """The choice's tool calls, each named after a request tool with arguments its schema accepts
    (a call cut off by max_tokens: only as far as it got)."""
    for call in choice.message.tool_calls or []:
        assert call.function.name in SCHEMAS_BY_NAME, call
        if choice.finish_reason != "length":
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS_BY_NAME[call.function.name])
    return choice.message.tool_calls or []


@pytest.mark.parametrize("question", ["What is the weather in Paris?", "What time is it?", "Plan my week."])
def test_a_named_tool_choice_yields_that_call(client, question):
    named = {"type": "function", "function": {"name": "get_weather"}}
    choice = chat(client, question, tools=TOOLS, tool_choice=named).choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = checked_calls(choice)
    assert call.function.name == "get_weather"


@pytest.mark.parametrize("question", ["What is the weather in Paris?", "What time is it?"])
def test_required_and_auto_only_call_the_requests_tools(client, question):
    required = chat(client, question, tools=TOOLS, tool_choice="required").choices[0]
    assert checked_calls(required) or required.finish_reason == "length", required
    auto = chat(client, question, tools=TOOLS, tool_choice="auto").choices[0]
    checked_calls(auto)
    assert auto.finish_reason in ("stop", "tool_calls", "length"), auto


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_parallel_tool_calls_false_makes_one_call_at_most(client, choice):
    """The grammar's list of calls holds one (seeded draws at 0.7 make several calls without it)."""
    for seed in range(3):
        out = client.chat.completions.create(
            model="mk-embedded",
            messages=[{"role": "user", "content": "What's the weather in Paris, Rome and Oslo? Use the tools."}],
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=False,
            temperature=0.7,
            seed=seed,
            max_tokens=200,
        )
        assert len(checked_calls(out.choices[0])) <= 1, out.choices[0]


def test_a_tool_whose_schema_does_not_compile_is_a_400(server):
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": "mk-embedded", "messages": [{"role": "user", "content": "hi"}], "tools": bad, "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    # Beside a response_format that compiles, the tool is still the one named; and the other way round.
    good_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    good_tool = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for tools, response_format, field in ((bad, good_schema, "tools"), (good_tool, bad_schema, "response_format")):
        body = {"model": "mk-embedded", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        r = httpx.post(
            server.url + "/v1/chat/completions",
            json={**body, "tools": tools, "response_format": response_format},
            timeout=60,
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_guided_choice_answers_one_of_the_choices(client):
    choices = ["yes", "no", "it depends"]
    out = client.completions.create(
        model="mk-embedded", prompt="Is it?", max_tokens=10, temperature=0, extra_body={"guided_choice": choices}
    )
    assert out.choices[0].text in choices and out.choices[0].finish_reason == "stop", out
    answer = chat(client, "Is Python fun?", extra_body={"guided_choice": choices}).choices[0]
    assert answer.message.content in choices and answer.finish_reason == "stop", answer
