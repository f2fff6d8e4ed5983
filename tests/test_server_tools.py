"""Tool calls end to end: a server process whose scripted "model" writes Cohere-format output, read back
through the openai client; and the chat prompt the template gets for a tool conversation."""

import json

import openai
import pytest
from server_util import ServerProcess

from mk.config import ModelConfig
from mk.server.chat import build_prompt
from mk.server.schemas import ChatRequest
from mk.text.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # (starts python -m mk.server)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}},
]
CALL_TEXT = (
    "I need the weather.<|END_THINKING|><|START_ACTION|>["
    '{"tool_call_id": "0", "tool_name": "get_weather", "parameters": {"city": "Paris", "when": ["today"]}}]'
    "<|END_ACTION|>"
)
ANSWER_TEXT = "Easy.<|END_THINKING|><|START_RESPONSE|>It is sunny.<|END_RESPONSE|>"


@pytest.fixture(scope="module")
def client():
    s = ServerProcess(module="scripted_engine", env={"PYTHONPATH": "tests:python"}).wait_ready()
    yield openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=30)
    assert s.stop() == 0, s.output()


def script(text: str) -> list[dict]:
    return [{"role": "user", "content": "SCRIPT:" + text}]


def test_a_tool_call_comes_back_as_openai_tool_calls(client):
    out = client.chat.completions.create(model="scripted", messages=script(CALL_TEXT), tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "I need the weather."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "when": ["today"]}


def test_streamed_tool_call_deltas(client):
    chunks = list(
        client.chat.completions.create(model="scripted", messages=script(CALL_TEXT), tools=TOOLS, stream=True)
    )
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id.startswith("call_") and first.function.name == "get_weather"
    assert rest and all(d.id is None and d.function.name is None for d in rest)
    arguments = first.function.arguments + "".join(d.function.arguments for d in rest)
    assert json.loads(arguments) == {"city": "Paris", "when": ["today"]}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    assert reasoning == "I need the weather."


def test_the_answer_to_a_tool_result_round_trip(client):
    first = client.chat.completions.create(model="scripted", messages=script(CALL_TEXT), tools=TOOLS)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *script(CALL_TEXT),
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
        *script(ANSWER_TEXT),
    ]
    out = client.chat.completions.create(model="scripted", messages=messages, tools=TOOLS)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].message.content == "It is sunny."
    assert out.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "text,tool_choice,message",
    [
        (ANSWER_TEXT, "required", "called no tool"),
        (CALL_TEXT, {"type": "function", "function": {"name": "now"}}, "requires 'now'"),
        (CALL_TEXT.replace("get_weather", "launch"), "auto", "not among the request's tools"),
        ("x<|END_THINKING|><|START_ACTION|>[{oops<|END_ACTION|>", "auto", "not valid JSON"),
    ],
)
def test_model_output_breaking_the_tool_policy_is_502(client, text, tool_choice, message):
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="scripted", messages=script(text), tools=TOOLS, tool_choice=tool_choice)
    assert e.value.status_code == 502
    assert message in e.value.body["message"] and e.value.body["type"] == "tool_call_generation_error"
    stream = client.chat.completions.create(
        model="scripted", messages=script(text), tools=TOOLS, tool_choice=tool_choice, stream=True
    )
    with pytest.raises(openai.APIError, match=message):
        list(stream)


def test_tool_choice_none_keeps_calls_out(client):
    out = client.chat.completions.create(model="scripted", messages=script(CALL_TEXT), tools=TOOLS, tool_choice="none")
    assert out.choices[0].message.tool_calls is None and out.choices[0].finish_reason == "stop"


def test_history_ids_are_renumbered_per_turn_for_the_model():
    tok = Tokenizer.builtin(512)
    req = ChatRequest.model_validate(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {
                    "role": "assistant",
                    "content": "plan",
                    "tool_calls": [
                        {"id": "call_abc", "type": "function", "function": {"name": "now", "arguments": {}}},
                        {"id": "call_def", "type": "function", "function": {"name": "now", "arguments": "{}"}},
                    ],
                },
                {"role": "tool", "tool_call_id": "call_def", "content": "2"},
                {"role": "tool", "tool_call_id": "call_abc", "content": "1"},
                {"role": "developer", "content": "be brief"},
            ],
            "tools": TOOLS,
            "tool_choice": "required",
        }
    )
    prompt = build_prompt(req, tok, max_context=4096)
    text = tok.decode(prompt.token_ids)
    assert "call_abc" not in text and "call_def" not in text
    assert '"tool_call_id": "1", "results": {"0": "2"}' in text
    assert '"tool_call_id": "0", "results": {"0": "1"}' in text
    assert "You must call at least one tool." in text and "be brief" in text
    assert prompt.thinking and prompt.policy.choice == "required"


SPACED = "Easy.<|END_THINKING|><|START_RESPONSE|>two  words \n  <|END_RESPONSE|>"


@pytest.mark.parametrize("text,content", [(SPACED, "two  words \n  "), ("x<|END_THINKING|>cut here  ", "cut here  ")])
def test_chat_content_keeps_its_trailing_whitespace(client, text, content):
    out = client.chat.completions.create(model="scripted", messages=script(text))
    assert out.choices[0].message.content == content
    chunks = list(client.chat.completions.create(model="scripted", messages=script(text), stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content


def test_chat_logprobs_are_the_content_tokens_only(client):
    out = client.chat.completions.create(model="scripted", messages=script(SPACED), logprobs=True, top_logprobs=1)
    choice = out.choices[0]
    tokens = [t.token for t in choice.logprobs.content]
    assert "".join(tokens) == choice.message.content == "two  words \n  "
    assert not any(t.startswith("<|") for t in tokens)
    chunks = list(client.chat.completions.create(model="scripted", messages=script(SPACED), logprobs=True, stream=True))
    streamed = [t.token for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert "".join(streamed) == "two  words \n  "
    # A tool call's tokens are no content either.
    out = client.chat.completions.create(model="scripted", messages=script(CALL_TEXT), tools=TOOLS, logprobs=True)
    assert out.choices[0].logprobs.content == []


def test_completion_logprobs_are_the_text_tokens_only(client):
    """Special tokens (EOS, a marker) add no text and no logprob entry: the tokens join to the text and
    text_offset indexes into it, streamed or not."""
    tok = Tokenizer.builtin(ModelConfig.tiny().vocab_size)  # the scripted server's
    prompt = tok.encode("SCRIPT:two words<|START_RESPONSE|> more", add_special_tokens=False)
    choice = client.completions.create(model="scripted", prompt=prompt, logprobs=0).choices[0]
    lp = choice.logprobs
    assert choice.text == "two words more" and "".join(lp.tokens) == choice.text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert all(choice.text.startswith(t, at) for t, at in zip(lp.tokens, lp.text_offset, strict=True))
    chunks = list(client.completions.create(model="scripted", prompt=prompt, logprobs=0, stream=True))
    streamed = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert streamed == lp.tokens


def test_a_call_cut_off_by_max_tokens_comes_back_as_far_as_it_got(client):
    """Streamed or not (as the OpenAI API does), with finish_reason "length"; nothing is dropped."""
    tok = Tokenizer.builtin(ModelConfig.tiny().vocab_size)  # the scripted server's
    ids = tok.encode(CALL_TEXT, add_special_tokens=False)
    cut = next(n for n in range(len(ids)) if '"city": "P' in tok.decode(ids[:n]))  # inside "Paris"
    kwargs = dict(model="scripted", messages=script(CALL_TEXT), tools=TOOLS, max_tokens=cut)
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "length"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments.startswith('{"city": "P')
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "length"


LEAKY = (
    "Let me<|START_OF_TURN_TOKEN|> think.<|END_THINKING|><|START_RESPONSE|>Hi<|SYSTEM_TOKEN|> there."
    "<|END_RESPONSE|><|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>"
)


def test_special_tokens_other_than_the_answer_markers_add_no_text(client):
    """A turn's control tokens the model writes (past an ignored EOS, say) stay out of the reasoning
    and the content, streamed or not (vLLM's skip_special_tokens, on by default)."""
    message = client.chat.completions.create(model="scripted", messages=script(LEAKY)).choices[0].message
    assert (message.reasoning_content, message.content) == ("Let me think.", "Hi there.")
    chunks = list(client.chat.completions.create(model="scripted", messages=script(LEAKY), stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Let me think."
    assert "".join(d.content or "" for d in deltas) == "Hi there."
