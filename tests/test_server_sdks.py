"""The official SDKs against `python -m mk.server` on the built-in model (CPU, loopback, greedy decoding,
an API key): the `anthropic` SDK on /v1/messages (create, its raw stream and its stream helper, a forced
tool's round trip, count_tokens, errors as the SDK's own error classes) and the OpenAI Agents SDK
(`agents`) running a two-tool agent loop, and an agent's structured output, on /v1/responses. The `openai`
SDK's own Responses calls are tested in test_server_responses.py."""

import asyncio
import json
from typing import Literal

import anthropic
import jsonschema
import pytest
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    StopAtTools,
    ToolCallItem,
    ToolCallOutputItem,
    function_tool,
    set_tracing_disabled,
)
from anthropic.types import Message, TextBlock, ToolUseBlock
from openai import AsyncOpenAI, OpenAI
from openai.types.shared import Reasoning
from pydantic import BaseModel
from server_util import ServerProcess

from mk.default_model import NAME

pytestmark = pytest.mark.slow  # (starts python -m mk.server)

KEY = "sdk-test-key"
# The anthropic SDK (2.x) has no temperature parameter: greedy decoding goes in the body.
GREEDY = {"model": NAME, "extra_body": {"temperature": 0}}
WRITE = [{"role": "user", "content": "Write a loop."}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [{"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER_SCHEMA}]
FORCED = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
# Past the server's --max-body-mb.
TOO_LARGE = 2 * 2**20
# The prompt tokens a prefix-cache page holds at most: a cached prefix is whole pages.
PAGE = 64


@pytest.fixture(scope="module")
def server():
    """The built-in model behind an API key, with a 1 MiB body limit (for the 413)."""
    s = ServerProcess(
        "--device", "cpu", "--max-batch", "8", "--max-context", "1024", "--api-key", KEY, "--max-body-mb", "1"
    ).wait_ready()
    yield s
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module", autouse=True)
def _no_tracing():
    """The Agents SDK would otherwise export its traces to OpenAI."""
    set_tracing_disabled(True)
    yield
    set_tracing_disabled(False)


# ---- the anthropic SDK ---------------------------------------------------------------------------


def test_messages_create_its_stream_and_the_stream_helper(claude):
    """A whole answer, the raw stream and the SDK's accumulating helper are the same greedy message."""
    body = {**GREEDY, "max_tokens": 40, "messages": WRITE}
    whole = claude.messages.create(**body)
    assert isinstance(whole, Message) and whole.id.startswith("msg_")
    assert (whole.model, whole.role, whole.type) == (NAME, "assistant", "message")
    (block,) = whole.content
    assert isinstance(block, TextBlock) and block.text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert 0 < whole.usage.output_tokens <= 40 and whole.usage.input_tokens > 0

    events = list(claude.messages.create(**body, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == block.text
    end = events[-2]
    assert (end.delta.stop_reason, end.usage.output_tokens) == (whole.stop_reason, whole.usage.output_tokens)

    with claude.messages.stream(**body) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == block.text and final.id != whole.id
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


def test_a_forced_tool_use_round_trip(claude):
    """tool_choice "tool" makes the answer one call whose input follows the tool's schema (the SDK's
    stream helper parses the same input from its input_json_delta events); its content and a
    tool_result go back, and the model answers in text; count_tokens counts that conversation."""
    body = {**GREEDY, "max_tokens": 120, "tools": TOOLS, "tool_choice": FORCED, "messages": WEATHER}
    first = claude.messages.create(**body)
    assert first.stop_reason == "tool_use", first
    (call,) = first.content
    assert isinstance(call, ToolUseBlock) and call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    with claude.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_weather", call.input)]
    assert final.stop_reason == "tool_use"

    result = {"type": "tool_result", "tool_use_id": call.id, "content": "Sunny, 24 C"}
    messages = [*WEATHER, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    then = {"tools": TOOLS, "tool_choice": {"type": "none"}, "messages": messages}
    answer = claude.messages.create(**GREEDY, max_tokens=60, **then)
    assert [b.type for b in answer.content] == ["text"] and answer.content[0].text
    assert answer.stop_reason in ("end_turn", "max_tokens")
    counted = claude.messages.count_tokens(model=NAME, **then)
    assert counted.input_tokens == answer.usage.input_tokens > first.usage.input_tokens


def test_count_tokens_is_the_usage_of_the_same_request(claude):
    plain = {"messages": WRITE}
    tooled = {"messages": WRITE, "system": "You write Python.", "tools": TOOLS}
    counts = []
    for conversation in (plain, tooled):
        counted = claude.messages.count_tokens(model=NAME, **conversation).input_tokens
        assert counted == claude.messages.create(**GREEDY, max_tokens=1, **conversation).usage.input_tokens
        counts.append(counted)
    assert counts[1] > counts[0]  # the template lists the tools


def test_top_level_cache_control_is_accepted_and_changes_nothing(claude):
    """The SDK's automatic prompt caching (a top-level cache_control) asks for what the prefix cache
    does anyway: the same answer and counts, not a 400."""
    body = {**GREEDY, "max_tokens": 8, "messages": WRITE}
    cached = {"cache_control": {"type": "ephemeral"}}
    plain = claude.messages.create(**body)
    assert claude.messages.create(**body, **cached).model_dump(exclude={"id"}) == plain.model_dump(exclude={"id"})
    counted = claude.messages.count_tokens(model=NAME, messages=WRITE, **cached).input_tokens
    assert counted == plain.usage.input_tokens


def assert_error(e: pytest.ExceptionInfo, kind: str, says: str) -> None:
    """The SDK's exception carries the server's Anthropic error body and its message."""
    body = e.value.body
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}
    assert says in body["error"]["message"] and body["error"]["message"] in e.value.message


def test_errors_are_the_sdks_error_classes_with_the_servers_message(claude):
    short = {**GREEDY, "max_tokens": 8, "messages": WRITE}
    other = {**short, "model": "claude-sonnet-4-5"}
    for stream in (False, True):
        with pytest.raises(anthropic.NotFoundError) as e:
            claude.messages.create(**other, stream=stream)
        assert_error(e, "not_found_error", "'claude-sonnet-4-5' is not served here")
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.count_tokens(model="claude-sonnet-4-5", messages=WRITE)
    assert_error(e, "not_found_error", "not served here")

    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(**{**short, "max_tokens": 0})
    assert_error(e, "invalid_request_error", "max_tokens")
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(**short, tools=TOOLS, tool_choice={"type": "tool", "name": "get_time"})
    assert_error(e, "invalid_request_error", "tool_choice names 'get_time'")
    unanswered = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "?"}]}]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(**{**short, "messages": unanswered})
    assert_error(e, "invalid_request_error", "toolu_x")
    with pytest.raises(anthropic.RequestTooLargeError) as e:
        claude.messages.create(**{**short, "messages": [{"role": "user", "content": "x" * TOO_LARGE}]})
    assert_error(e, "request_too_large", "limit")


def test_a_wrong_or_missing_api_key_is_an_authentication_error(server, monkeypatch):
    for name in ("ANTHROPIC_API_KEY", "ANTHROPIC_AUTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    no_key = {"Authorization": anthropic.Omit()}  # else the SDK refuses to send a request without one
    clients = [
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0),  # as x-api-key
        anthropic.Anthropic(base_url=server.url, auth_token="wrong", max_retries=0),  # as a bearer token
        anthropic.Anthropic(base_url=server.url, max_retries=0, default_headers=no_key),
    ]
    for client in clients:
        with pytest.raises(anthropic.AuthenticationError) as e:
            client.messages.create(**GREEDY, max_tokens=8, messages=WRITE)
        assert_error(e, "authentication_error", "missing or wrong API key")
        with pytest.raises(anthropic.AuthenticationError):
            client.messages.count_tokens(model=NAME, messages=WRITE)
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=NAME, messages=WRITE).input_tokens > 0


# ---- the OpenAI Agents SDK -----------------------------------------------------------------------

# Thinking off: the tiny model's reasoning would spend the output budget before the call.
NO_THINKING = Reasoning(effort="none")


def agent_model(server) -> OpenAIResponsesModel:
    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    return OpenAIResponsesModel(NAME, client)


async def run(agent: Agent, prompt: str, streamed: bool, **kwargs):
    """The agent's run, through Runner.run or Runner.run_streamed (and the names of its stream's events)."""
    if not streamed:
        return await Runner.run(agent, prompt, **kwargs), []
    result = Runner.run_streamed(agent, prompt, **kwargs)
    events = [e async for e in result.stream_events()]
    return result, [e.data.type if e.type == "raw_response_event" else getattr(e, "name", e.type) for e in events]


def two_tools(called: list[str]) -> list[FunctionTool]:
    """get_time, then get_weather: each enabled in its turn alone (get_time until it is called,
    get_weather after), so that tool_choice "required" forces the one call the loop needs next."""

    @function_tool(is_enabled=lambda ctx, agent: "get_time" not in called)
    def get_time(timezone: Literal["UTC", "CET"]) -> str:
        """The time in a timezone."""
        called.append("get_time")
        return "12:00"

    @function_tool(is_enabled=lambda ctx, agent: "get_time" in called and "get_weather" not in called)
    def get_weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather of a city."""
        called.append("get_weather")
        return f"Sunny in {city}"

    return [get_time, get_weather]


@pytest.mark.parametrize("streamed,chained", [(False, False), (True, True)], ids=["run", "streamed-chained"])
def test_a_two_tool_agent_loop_runs_to_completion(server, streamed, chained):
    """Two model turns, each a forced call (one at a time) whose output goes back to the model; the run
    stops at get_weather with its output as the final output. `chained`: the SDK sends each turn by
    previous_response_id (the stored response) rather than the whole conversation, and the second
    turn's prompt is served from the prefix cache."""
    called: list[str] = []
    tools = two_tools(called)
    agent = Agent(
        name="weather",
        instructions="Answer with the tools.",
        model=agent_model(server),
        tools=tools,
        model_settings=ModelSettings(
            tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=100, reasoning=NO_THINKING
        ),
        reset_tool_choice=False,  # "required" every turn; is_enabled and StopAtTools end the loop
        tool_use_behavior=StopAtTools(stop_at_tool_names=["get_weather"]),
    )
    prompt = "What time is it in UTC, and the weather in Paris?"
    result, events = asyncio.run(run(agent, prompt, streamed, max_turns=3, auto_previous_response_id=chained))

    assert called == ["get_time", "get_weather"]
    calls = [item.raw_item for item in result.new_items if isinstance(item, ToolCallItem)]
    assert [c.name for c in calls] == called
    schemas = {t.name: t.params_json_schema for t in tools}
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), schemas[c.name])
    city = json.loads(calls[1].arguments)["city"]
    outputs = [item.output for item in result.new_items if isinstance(item, ToolCallOutputItem)]
    assert outputs == ["12:00", f"Sunny in {city}"] and result.final_output == f"Sunny in {city}"

    first, second = result.raw_responses
    stored = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).responses.retrieve(second.response_id)
    assert stored.previous_response_id == (first.response_id if chained else None)
    assert [(o.type, o.name) for o in stored.output] == [("function_call", "get_weather")]
    if chained:
        cached = second.usage.input_tokens_details.cached_tokens
        assert cached > first.usage.input_tokens - PAGE, (cached, first.usage)
    if streamed:
        assert events.count("response.completed") == 2
        assert [e for e in events if e in ("tool_called", "tool_output")] == ["tool_called", "tool_output"] * 2


class Verdict(BaseModel):
    language: Literal["python", "rust"]
    lines: int


def test_an_agents_structured_output(server):
    """An agent's output_type is a strict json_schema text format; the grammar holds the answer to it,
    so the one turn ends in a final output the SDK parses."""
    agent = Agent(
        name="judge",
        instructions="Answer in JSON.",
        model=agent_model(server),
        output_type=Verdict,
        model_settings=ModelSettings(temperature=0, max_tokens=200, reasoning=NO_THINKING),
    )
    result, _ = asyncio.run(run(agent, "Which language is this loop in: for x in y: pass", False, max_turns=1))
    assert isinstance(result.final_output, Verdict)
    (response,) = result.raw_responses
    stored = OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0).responses.retrieve(response.response_id)
    assert stored.text.format.type == "json_schema" and stored.text.format.strict is True
    assert Verdict.model_validate_json(stored.output_text) == result.final_output
