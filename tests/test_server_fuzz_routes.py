"""Property-based fuzzing of the routes beyond chat and completions (test_server_fuzz.py has those):
the Anthropic Messages API and its token count, the Responses API and its input-token count, and
/tokenize and /detokenize. Against a real server on the built-in model: no body, however odd, gets a
5xx; an error has its route's error shape; a stream that starts ends as its API ends one."""

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from preparing import json_any, json_leaf, mostly
from server_util import ServerProcess

from mk.default_model import NAME

pytestmark = pytest.mark.slow  # (starts python -m mk.server)

schema = st.sampled_from([{"type": "object", "properties": {"x": {"type": "integer"}}}, {"type": "object"}])
schema = schema | json_any

# The Anthropic Messages API.
block = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": mostly(st.text(max_size=12))}),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_use"),
            "id": mostly(st.sampled_from(["t1", "t2"])),
            "name": mostly(st.just("get")),
            "input": mostly(st.just({"x": 1}), json_any),
        }  # fmt: skip
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("tool_result"),
            "tool_use_id": mostly(st.sampled_from(["t1", "t9"])),
            "content": mostly(st.text(max_size=8), json_any),
        }  # fmt: skip
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["thinking", "image", "document", "nope"])},
        optional={"thinking": json_leaf, "signature": json_leaf, "source": json_any},
    ),  # fmt: skip
    json_leaf,
)
anthropic_message = st.fixed_dictionaries(
    {"role": mostly(st.sampled_from(["user", "assistant"]), st.sampled_from(["system", "tool", ""]))},
    optional={"content": mostly(st.text(max_size=16) | st.lists(block, max_size=3), json_any)},
)
anthropic_tool = st.fixed_dictionaries(
    {"name": mostly(st.sampled_from(["get", "put"]), st.sampled_from(["bad name!", ""]))},
    optional={"input_schema": schema, "description": json_leaf},
)
messages_optional = {
    "model": mostly(st.just(NAME), st.sampled_from(["other", 3])),
    "max_tokens": mostly(st.integers(1, 6), st.integers(-2, 10**12) | json_leaf),
    "system": mostly(st.text(max_size=12) | st.lists(block, max_size=2), json_any),
    "tools": mostly(st.lists(anthropic_tool, max_size=2), json_any),
    "tool_choice": mostly(
        st.sampled_from(
            [
                {"type": "auto"},
                {"type": "any"},
                {"type": "none"},
                {"type": "tool", "name": "get"},
                {"type": "tool", "name": "nope"},
            ]
        ),  # fmt: skip
        json_any,
    ),
    "stop_sequences": mostly(st.lists(st.text(min_size=1, max_size=3), max_size=3), json_any),
    "temperature": mostly(st.floats(0, 1), st.floats(-1, 3) | json_leaf),
    "top_p": mostly(st.floats(0.01, 1), json_leaf),
    "top_k": mostly(st.integers(0, 50), st.sampled_from([2**32, 2**64, -1])),
    "thinking": mostly(st.sampled_from([{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}])),
    "stream": mostly(st.booleans()),
    "metadata": json_any,
    "unknown_field": json_any,
}
messages_fields = st.fixed_dictionaries(
    {"messages": mostly(st.lists(anthropic_message, min_size=1, max_size=3), json_any)}, optional=messages_optional
)

# The OpenAI Responses API.
item = st.one_of(
    st.fixed_dictionaries(
        {"role": mostly(st.sampled_from(["user", "assistant", "system", "developer"]), json_leaf)},
        optional={"content": mostly(st.text(max_size=12), json_any), "type": st.just("message")},
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call"),
            "call_id": mostly(st.sampled_from(["c1", "c2"])),
            "name": mostly(st.just("get")),
            "arguments": mostly(st.sampled_from(["{}", '{"x": 1}', "[", "3"])),
        }  # fmt: skip
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("function_call_output"),
            "call_id": mostly(st.sampled_from(["c1", "c9"])),
            "output": mostly(st.text(max_size=8), json_any),
        }  # fmt: skip
    ),
    st.fixed_dictionaries(
        {"type": st.sampled_from(["reasoning", "item_reference", "web_search_call", "nope"])},
        optional={"summary": json_any, "id": json_leaf},
    ),  # fmt: skip
    json_leaf,
)
response_tool = st.fixed_dictionaries(
    {
        "type": mostly(st.just("function"), st.sampled_from(["web_search", "custom"])),
        "name": mostly(st.sampled_from(["get", "put"]), st.just("bad name!")),
    },  # fmt: skip
    optional={"parameters": schema, "strict": json_leaf},
)
text_format = st.one_of(
    st.just({"type": "text"}),
    st.just({"type": "json_object"}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "name": mostly(st.just("out")), "schema": schema}),
    json_any,
)
responses_optional = {
    "model": mostly(st.just(NAME), st.sampled_from(["other", 3])),
    "instructions": mostly(st.text(max_size=12), json_any),
    "max_output_tokens": mostly(st.integers(1, 6), st.integers(-2, 10**12) | json_leaf),
    "tools": mostly(st.lists(response_tool, max_size=2), json_any),
    "tool_choice": mostly(
        st.sampled_from(["auto", "none", "required", {"type": "function", "name": "get"}]), json_any
    ),  # fmt: skip
    "parallel_tool_calls": json_leaf,
    "text": mostly(st.fixed_dictionaries({"format": text_format}), json_any),
    "temperature": mostly(st.floats(0, 2), json_leaf),
    "top_p": mostly(st.floats(0.01, 1), json_leaf),
    "stream": mostly(st.booleans()),
    "store": json_leaf,
    "previous_response_id": st.sampled_from(["resp_nope", ""]) | json_leaf,
    "reasoning": json_any,
    "unknown_field": json_any,
}
responses_fields = st.fixed_dictionaries(
    {"input": mostly(st.text(max_size=16) | st.lists(item, min_size=1, max_size=3), json_any)},
    optional=responses_optional,
)

tokenize_fields = st.fixed_dictionaries(
    {},
    optional={
        "model": mostly(st.just(NAME), st.sampled_from(["other", 3])),
        "prompt": mostly(st.text(max_size=20), json_any),
        "messages": mostly(
            st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "x"]), "content": json_leaf}), max_size=2),
            json_any,
        ),  # fmt: skip
        "add_special_tokens": json_leaf,
        "add_generation_prompt": json_leaf,
    },
)
detokenize_fields = st.fixed_dictionaries(
    {
        "tokens": mostly(
            st.lists(st.integers(-3, 20_000), max_size=6), st.lists(st.integers(-(2**70), 2**70)) | json_any
        )
    },
    optional={"model": mostly(st.just(NAME), st.sampled_from(["other", 3]))},
)

# Valid bodies of each route, for bodies with one fuzzed field (that reach generation far more often).
USER = [{"role": "user", "content": "def add(a, b):"}]
VALID = {
    "messages": ({"model": NAME, "max_tokens": 4, "messages": USER}, messages_optional),
    "count_tokens": ({"model": NAME, "messages": USER}, messages_optional),
    "responses": ({"model": NAME, "input": "def add(a, b):", "max_output_tokens": 4}, responses_optional),
    "input_tokens": ({"model": NAME, "input": "def add(a, b):"}, responses_optional),
}


def one_fuzzed_field(route: str) -> st.SearchStrategy:
    base, optional = VALID[route]
    field = st.sampled_from(sorted(optional)).flatmap(lambda k: optional[k].map(lambda v: {k: v}))
    return field.map(lambda f: {**base, **f})


ROUTES = {
    "messages": ("/v1/messages", messages_fields),
    "count_tokens": ("/v1/messages/count_tokens", messages_fields),
    "responses": ("/v1/responses", responses_fields),
    "input_tokens": ("/v1/responses/input_tokens", responses_fields),
    "tokenize": ("/tokenize", tokenize_fields),
    "detokenize": ("/detokenize", detokenize_fields),
}


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--device", "cpu", "--max-context", "512").wait_ready()
    yield s
    assert s.stop() == 0, s.output()


@settings(max_examples=240, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from(sorted(ROUTES)), st.data())
def test_every_route_answers_fuzzed_bodies_in_its_own_shape_without_5xx(server, route, data):
    path, fields = ROUTES[route]
    body = data.draw(one_fuzzed_field(route) if route in VALID and data.draw(st.booleans()) else fields)
    for budget in ("max_tokens", "max_output_tokens"):
        if isinstance(body.get(budget), int) and body[budget] > 8:
            body[budget] = 8  # keep generations short; the schema still sees odd types and values
    r = asyncio.run(_post(server.url + path, body))
    event(f"{route} {r.status_code}")
    assert r.status_code < 500, (route, body, r.text)
    anthropic = route in ("messages", "count_tokens")
    if r.status_code >= 400:
        error = r.json()
        if anthropic:
            assert error["type"] == "error" and set(error["error"]) >= {"type", "message"}, (body, error)
        else:
            assert set(error["error"]) == {"message", "type", "param", "code"}, (body, error)
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        names = [line.removeprefix("event: ") for e in events for line in e.split("\n") if line.startswith("event: ")]
        last = {"messages": ("message_stop", "error"), "responses": ("response.completed", "response.incomplete",
                                                                     "response.failed", "error")}[route]  # fmt: skip
        assert names and names[-1] in last, (body, r.text[-300:])
        for e in events:
            data_line = next(line for line in e.split("\n") if line.startswith("data: "))
            json.loads(data_line.removeprefix("data: "))
    else:
        json.loads(r.text)


async def _post(url: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.post(url, json=body)
