"""Property-based fuzzing of the request schemas: no body, however odd, gets a 500.

In-process, many bodies go through the whole request preparation (validation, template, sampling
settings); against a real server, fewer go all the way through HTTP, generation included.
"""

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from preparing import json_any, json_leaf, mostly, preparing_state
from server_util import ServerProcess

from mk.default_model import NAME
from mk.server.chat_completions import _prepare as prepare_chat
from mk.server.completions import _prepare as prepare_completion
from mk.server.errors import APIError
from mk.server.params import MAX_GRAMMAR_BYTES, MAX_GUIDED_CHOICES, constraint, max_new_tokens, sampling_params
from mk.server.schemas import SEED_MAX, SEED_MIN, U32_MAX, ChatRequest, CompletionRequest

pytestmark = pytest.mark.slow  # (starts python -m mk.server)

small = st.one_of(st.integers(-2, 6), json_any)
role = st.sampled_from(["system", "developer", "user", "assistant", "tool", "robot"])
part = st.one_of(st.text(max_size=8), st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]),
                                                              "text": json_leaf}))  # fmt: skip
call = st.fixed_dictionaries(
    {
        "id": st.sampled_from(["a", "b", ""]) | json_leaf,
        "type": st.just("function"),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get", "nope"]), "arguments": st.sampled_from(["{}", '{"x": 1}', "[", "3"])}
        )
        | json_any,
    }
)
message = st.fixed_dictionaries(
    {"role": role},
    optional={
        "content": st.one_of(st.text(max_size=20), st.lists(part, max_size=3), json_leaf),
        "tool_calls": st.lists(call, max_size=2) | json_leaf,
        "tool_call_id": st.sampled_from(["a", "b", "zz"]) | json_leaf,
        "name": json_leaf,
        "reasoning_content": json_leaf,
    },
)
tool = st.fixed_dictionaries(
    {
        "type": st.sampled_from(["function", "code"]),
        "function": st.fixed_dictionaries(
            {"name": st.sampled_from(["get", "now", "bad name!"])}, optional={"parameters": json_any}
        ),
    }
)


# Integers at and past the edges of the engine's widths (u32 top_k and token ids, 64-bit seeds).
u32_edges = st.sampled_from([U32_MAX, U32_MAX + 1, 2**64, -(2**63)])
seed_edges = st.sampled_from([SEED_MIN, SEED_MIN - 1, SEED_MAX, SEED_MAX + 1])
# Grammar inputs: invalid, oversized (past MAX_GUIDED_CHOICES and MAX_GRAMMAR_BYTES) and a few valid ones.
bad_json_texts = st.sampled_from(["{not json", "", "x", "\u0000", "[" * 100_000, '{"type": "nope"}', "3"])
guided_json = st.one_of(bad_json_texts, st.just('{"type": "string"}'), st.just({"type": "integer"}), json_any)
many_choices = st.just([f"c{i:05d}" for i in range(MAX_GUIDED_CHOICES + 1)])
guided_choice = st.one_of(st.lists(st.text(max_size=4), min_size=1, max_size=3), many_choices, json_leaf)
long_regex = st.just("x" * (MAX_GRAMMAR_BYTES + 1))
guided_regex = st.one_of(st.sampled_from(["[a-z]+", "(", "a{2,1}", "\\"]), long_regex, json_leaf)

sampling = {
    "model": mostly(st.just(NAME), st.sampled_from(["other", 3])),
    "max_tokens": mostly(st.integers(1, 6), small),
    "temperature": mostly(st.floats(0, 2), st.floats(-1, 3) | json_leaf),
    "top_p": mostly(st.floats(0.01, 1), st.floats(-0.5, 1.5) | json_leaf),
    "top_k": mostly(st.integers(-1, 50), small | u32_edges),
    "seed": mostly(st.integers(-(2**70), 2**70), seed_edges),
    "n": mostly(st.integers(1, 3), small),
    "stop": mostly(st.lists(st.text(min_size=1, max_size=3), max_size=3), json_any),
    "stream": mostly(st.booleans()),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": mostly(st.booleans())}) | json_leaf,
    "presence_penalty": mostly(st.just(0), st.floats(-2, 2) | json_leaf),
    "frequency_penalty": mostly(st.just(0.0), st.floats(-2, 2) | json_leaf),
    "logit_bias": mostly(st.just({}), json_any),
    "stop_token_ids": mostly(
        st.lists(st.integers(0, 600), max_size=3), st.lists(st.integers(-3, 600) | u32_edges, max_size=3) | json_leaf
    ),
    "ignore_eos": mostly(st.booleans()),
    "unknown_field": json_any,
}
# One grammar field in about half the bodies (more than one is a 400 of its own).
grammar = st.one_of(
    st.just({}),
    st.just({}),
    st.just({}),
    st.fixed_dictionaries({"guided_json": guided_json}),
    st.fixed_dictionaries({"guided_choice": guided_choice}),
    st.fixed_dictionaries({"guided_regex": guided_regex}),
)


def with_grammar(body: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(lambda fields, extra: {**fields, **extra}, body, grammar)


chat_fields = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=4) | json_leaf},
    optional={
        **sampling,
        "max_completion_tokens": small,
        "logprobs": json_leaf,
        "top_logprobs": small,
        "tools": st.lists(tool, max_size=2) | json_leaf,
        "tool_choice": st.sampled_from(["none", "auto", "required", {"type": "function", "function": {"name": "get"}}])
        | json_any,
        "response_format": json_any,
        "chat_template_kwargs": st.fixed_dictionaries({}, optional={"enable_thinking": json_leaf}) | json_leaf,
    },
)
completion_fields = st.fixed_dictionaries(
    {"prompt": st.one_of(st.text(max_size=20), st.lists(st.integers(-2, 600), max_size=5), json_any)},
    optional={
        **sampling,
        "echo": json_leaf,
        "suffix": json_leaf,
        "logprobs": small,
        "best_of": small,
        "token_healing": mostly(st.booleans()),
    },
)
chat_body, completion_body = with_grammar(chat_fields), with_grammar(completion_fields)


STATE = preparing_state()


def prepare(kind: str, body: dict) -> None:
    """Everything a route does before it submits, minus the engine."""
    raw = json.dumps(body).encode()
    if kind == "chat":
        chat = prepare_chat(STATE, raw)
        sampling_params(chat.req, chat.max_tokens, 0, None, chat.grammar)
        return
    completion = prepare_completion(STATE, raw)
    for budget in completion.budgets:
        sampling_params(completion.req, budget, 0, completion.req.logprobs, completion.grammar)


@pytest.mark.parametrize("parallel,one", [(True, False), (None, False), (False, True)])
def test_parallel_tool_calls_false_lets_the_grammar_allow_one_call(parallel, one):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools, "parallel_tool_calls": parallel}
    grammar = constraint(ChatRequest.model_validate(body), thinking=True).value
    assert ('"maxItems": 1' in grammar) == one


def test_a_completion_asking_no_limit_gets_16_tokens_and_a_chat_the_rest_of_the_context():
    completion = CompletionRequest.model_validate({"prompt": "x"})
    chat = ChatRequest.model_validate({"messages": [{"role": "user", "content": "x"}]})
    assert max_new_tokens(completion, 10, 512) == 16
    assert max_new_tokens(completion, 507, 512) == 5  # what the context leaves
    assert max_new_tokens(chat, 10, 512) == 502


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["chat", "completion"]), st.data())
def test_request_preparation_raises_only_api_errors(kind, data):
    body = data.draw(chat_body if kind == "chat" else completion_body)
    try:
        prepare(kind, body)
        event("accepted")
    except APIError as e:
        assert e.status in (400, 404, 413) and e.message
        event(f"refused: {e.param}")


@pytest.fixture(scope="module")
def server():
    s = ServerProcess("--device", "cpu", "--max-context", "512").wait_ready()
    yield s
    assert s.stop() == 0, s.output()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.sampled_from(["chat", "completion"]), st.data())
def test_server_answers_fuzzed_bodies_without_500(server, kind, data):
    body = data.draw(chat_body if kind == "chat" else completion_body)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep generations short; the schema still sees odd types and values
    if isinstance(body.get("n"), int) and body["n"] > 4:
        body["n"] = 4
    body.setdefault("max_tokens", 4)
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    r = asyncio.run(_post(server.url + path, body))
    event(f"{kind} {r.status_code}")
    check_answer(r, body)


# One odd field in an otherwise valid body, so that it reaches the engine: integers past the engine's
# widths, grammars that are invalid or too large.
one_odd_field = st.one_of(
    st.fixed_dictionaries({"top_k": u32_edges}),
    st.fixed_dictionaries({"seed": seed_edges}),
    st.fixed_dictionaries({"stop_token_ids": st.lists(u32_edges, min_size=1, max_size=2)}),
    st.fixed_dictionaries({"guided_json": guided_json}),
    st.fixed_dictionaries({"guided_choice": guided_choice}),
    st.fixed_dictionaries({"guided_regex": guided_regex}),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["chat", "completion"]), st.booleans(), one_odd_field)
def test_server_answers_one_odd_field_with_a_400_or_a_whole_answer(server, kind, stream, field):
    """Never a 500, and streamed never a 200 that then reports an error."""
    start = {"messages": [{"role": "user", "content": "x"}]} if kind == "chat" else {"prompt": "x"}
    body = {**start, "max_tokens": 8, "stream": stream, **field}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    r = asyncio.run(_post(server.url + path, body))
    event(f"{kind} {r.status_code} {r.json()['error']['param'] if r.status_code == 400 else ''}")
    events = check_answer(r, body)
    assert not any("error" in e for e in events), (body, events)


def check_answer(r: httpx.Response, body: dict) -> list[dict]:
    """No 5xx; an error as an OpenAI error body; a stream that ends with [DONE]. The stream's events."""
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    elif r.headers["content-type"].startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]", r.text[-200:]
        return [json.loads(sse.removeprefix("data: ")) for sse in events[:-1]]
    return []


async def _post(url: str, body: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as c:
        return await c.post(url, json=body)
