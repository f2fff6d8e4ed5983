"""Token healing on /v1/completions (mk.text.healing), through the official client against real server
processes on the built-in model (CPU): the default server heals text prompts, one started with
`--token-healing off` does not, and a request's `token_healing` field overrides either."""

from __future__ import annotations

import re

import pytest
from server_util import ServerProcess
from test_server import TOK, greedy_reference, healed_greedy_reference

from mk.default_model import NAME

pytestmark = pytest.mark.slow  # (starts python -m mk.server)

PROMPT = 'def add(a, b):\n    """Add two numbers."""\n'  # ends in a bare newline: healed


@pytest.fixture(scope="module")
def off_server():
    s = ServerProcess("--device", "cpu", "--max-batch", "8", "--max-context", "1024", "--token-healing", "off")
    yield s.wait_ready()
    assert s.stop() == 0, s.output()


@pytest.fixture(scope="module")
def off_client(off_server):
    import openai

    return openai.OpenAI(base_url=off_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client, prompt, **kw):
    kw.setdefault("max_tokens", 16)
    return client.completions.create(model=NAME, prompt=prompt, temperature=0, **kw)


def upto_eos(ids: list[int]) -> list[int]:
    """The tokens the engine makes of a greedy reference: it stops at EOS."""
    return ids[: ids.index(TOK.eos_token_id) + 1] if TOK.eos_token_id in ids else ids


def test_the_text_leaves_out_the_healed_tail_and_the_usage_counts_the_prompt_as_sent(client):
    out = complete(client, PROMPT, logprobs=1)
    expected, removed = healed_greedy_reference(TOK.encode(PROMPT), 16)
    expected = upto_eos(expected)
    assert removed == "\n"
    choice = out.choices[0]
    assert choice.text == TOK.decode(expected, skip_special_tokens=True)[len(removed) :]
    assert choice.text.startswith("    ") and not choice.text.startswith("```")
    assert out.usage.prompt_tokens == len(TOK.encode(PROMPT))
    assert out.usage.completion_tokens == len(expected)  # the healing token among them
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text  # the first token's text less the healed newline
    assert lp.tokens[0] == TOK.token_bytes(expected[0]).decode()[len(removed) :] and lp.text_offset[0] == 0
    assert lp.tokens[0] in lp.top_logprobs[0]
    assert len(lp.tokens) == len([t for t in expected if t not in TOK.special_ids])


def test_echo_gives_the_prompt_as_sent(client):
    plain = complete(client, [PROMPT, "import os\n"], n=2)
    echoed = complete(client, [PROMPT, "import os\n"], n=2, echo=True)
    prompts = [PROMPT, PROMPT, "import os\n", "import os\n"]
    assert [c.text for c in echoed.choices] == [p + c.text for p, c in zip(prompts, plain.choices, strict=True)]
    assert echoed.usage == plain.usage
    assert plain.usage.prompt_tokens == len(TOK.encode(PROMPT)) + len(TOK.encode("import os\n"))  # once each


def test_streamed_text_logprobs_and_usage_equal_the_whole_ones(client):
    for kw in ({}, {"logprobs": 2}):
        whole = complete(client, PROMPT, max_tokens=24, **kw)
        chunks = list(
            complete(client, PROMPT, max_tokens=24, stream=True, stream_options={"include_usage": True}, **kw)
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
        assert chunks[-1].usage == whole.usage
        if kw:
            streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
            assert sum((lp.tokens for lp in streamed), []) == whole.choices[0].logprobs.tokens
            assert sum((lp.text_offset for lp in streamed), []) == whole.choices[0].logprobs.text_offset


def test_token_id_prompts_are_not_healed(client, off_client):
    ids = TOK.encode(PROMPT)
    healed, given = complete(client, PROMPT), complete(client, ids)
    assert (
        given.choices[0].text
        == complete(off_client, ids).choices[0].text
        == complete(off_client, PROMPT).choices[0].text
    )
    assert given.choices[0].text != healed.choices[0].text  # (healing would have changed it)
    assert given.usage.prompt_tokens == len(ids)


def test_the_flag_off_gives_the_unhealed_output_and_the_request_field_overrides_the_flag(client, off_client):
    old = upto_eos(greedy_reference(TOK.encode(PROMPT), 16))
    off = complete(off_client, PROMPT)
    assert off.choices[0].text == TOK.decode(old, skip_special_tokens=True)  # the token-boundary artefact's code fence
    assert off.usage.completion_tokens == len(old)
    assert complete(client, PROMPT, extra_body={"token_healing": False}).choices[0].text == off.choices[0].text
    healed = complete(client, PROMPT).choices[0].text
    assert (
        complete(off_client, PROMPT, extra_body={"token_healing": True}).choices[0].text
        == healed
        != off.choices[0].text
    )


def test_stop_strings_and_max_tokens_act_on_the_healed_text(client):
    """A stop at "\\n" cuts the completion of "import os\\n" (whose newline is healed) at the end of its
    own first line, streamed or not; max_tokens 1 is the healing token alone, less the healed newline."""
    whole = complete(client, "import os\n", max_tokens=24).choices[0].text
    assert "\n" in whole.strip("\n")
    cut = complete(client, "import os\n", max_tokens=24, stop=["\n"]).choices[0]
    assert cut.finish_reason == "stop" and cut.text and cut.text == whole[: whole.index("\n")]
    chunks = list(complete(client, "import os\n", max_tokens=24, stop=["\n"], stream=True))
    assert "".join(c.choices[0].text for c in chunks) == cut.text
    one = complete(client, PROMPT, max_tokens=1, logprobs=0)
    first, _ = healed_greedy_reference(TOK.encode(PROMPT), 1)
    assert one.usage.completion_tokens == 1 and one.choices[0].finish_reason == "length"
    assert one.choices[0].text == TOK.decode(first)[1:] == one.choices[0].logprobs.tokens[0]


def test_a_request_with_its_own_grammar_is_not_healed(client):
    out = complete(client, PROMPT, extra_body={"guided_regex": "[a-z]{3}"})
    assert re.fullmatch("[a-z]{3}", out.choices[0].text)


def test_the_healing_grammar_is_compiled_off_the_event_loop_and_sent_with_the_shortened_prompt():
    """In process, over an engine that records what it gets: the healing grammar is compiled while the
    request is prepared, on a thread beside the event loop, and submitted with the prompt less its tail."""
    import asyncio
    import json
    import threading
    from types import SimpleNamespace

    from mk.engine.api import EngineClosed
    from mk.server.completions import completions
    from mk.server.errors import APIError
    from mk.server.state import ServerState

    prepared, submitted = [], []

    class RecordingEngine:
        max_context = 512
        config = SimpleNamespace(vocab_size=TOK.vocab_size)

        def prepare_constraint(self, spec):
            if spec is not None:
                prepared.append((spec, threading.get_ident()))

        def submit(self, ids, params, request_id):
            submitted.append((ids, params.constraint))
            raise EngineClosed("stop before generating")

    state = ServerState(RecordingEngine(), TOK, NAME)

    async def run() -> int:
        with pytest.raises(APIError):
            await completions(state, json.dumps({"prompt": PROMPT}).encode(), {"id": "t"})
        return threading.get_ident()

    loop_thread = asyncio.run(run())
    ((spec, thread),) = prepared
    assert spec.origin == "token healing" and thread != loop_thread
    assert submitted == [(TOK.encode(PROMPT)[:-1], spec)]


# A prefilled answer (chat's continue_final_message, a Messages request's last assistant message):
# the answer continues its text, healed where the text ends where a longer token could start.
PREFILL = "Here is the function:\n"  # ends in a bare newline: healed
ASK = [{"role": "user", "content": "Write add(a, b) in Python."}]


# What the built-in template writes between the generation prompt (thinking closed) and an answer's text.
START_RESPONSE = "<|START_RESPONSE|>"


def continued_prompt_ids() -> list[int]:
    """The prompt of ASK answered from PREFILL: the conversation's generation prompt (thinking
    closed, as both routes below send it), the response's start and the prefill's text."""
    from mk.server.chat import render_prompt
    from mk.server.schemas import ChatRequest

    plain = ChatRequest(messages=ASK, chat_template_kwargs={"enable_thinking": False})
    text, _ = render_prompt(plain, TOK)
    return TOK.encode(text + START_RESPONSE + PREFILL, add_special_tokens=False)


def prefilled_answer(server, prefill: str = PREFILL) -> dict:
    """/v1/messages' greedy answer (12 tokens) to ASK prefilled with `prefill`."""
    import httpx

    messages = [*ASK, {"role": "assistant", "content": prefill}]
    body = {"model": NAME, "max_tokens": 12, "temperature": 0, "messages": messages}
    r = httpx.post(server.url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_continued_message_renders_as_the_generation_prompt_and_its_text():
    from mk.server.chat import render_prompt
    from mk.server.errors import APIError
    from mk.server.schemas import ChatRequest

    kwargs = {"chat_template_kwargs": {"enable_thinking": False}, "continue_final_message": True}
    for prefill in (PREFILL, "N", "<|END_OF_TURN"):  # (text the template writes around it too)
        req = ChatRequest(messages=[*ASK, {"role": "assistant", "content": prefill}], **kwargs)
        plain = ChatRequest(messages=ASK, chat_template_kwargs={"enable_thinking": False})
        assert render_prompt(req, TOK)[0] == render_prompt(plain, TOK)[0] + START_RESPONSE + prefill
    for messages, says in [
        (ASK, "to be the assistant's"),
        ([*ASK, {"role": "assistant", "content": ""}], "to have text"),
        (
            [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]}],
            "calls tools",
        ),
    ]:
        with pytest.raises(APIError, match=says):
            render_prompt(ChatRequest(messages=messages, **kwargs), TOK)


def test_a_prefilled_answer_continues_its_text_healed_on_both_routes(server, client):
    expected, removed = healed_greedy_reference(continued_prompt_ids(), 12)
    assert removed == "\n"
    want = TOK.decode(upto_eos(expected), skip_special_tokens=True)[len(removed) :]
    out = prefilled_answer(server)
    assert "".join(b["text"] for b in out["content"] if b["type"] == "text") == want
    assert out["usage"]["input_tokens"] == len(continued_prompt_ids())
    chat = client.chat.completions.create(
        model=NAME,
        messages=[*ASK, {"role": "assistant", "content": PREFILL}],
        max_tokens=12,
        temperature=0,
        extra_body={"continue_final_message": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    assert chat.choices[0].message.content == want
    # An empty last assistant message asks for an answer as if it were not there.
    empty = prefilled_answer(server, "")
    assert empty["usage"]["input_tokens"] < len(continued_prompt_ids())


def test_a_prefilled_answer_is_not_healed_where_the_server_does_not_heal(off_server):
    want = TOK.decode(upto_eos(greedy_reference(continued_prompt_ids(), 12)), skip_special_tokens=True)
    out = prefilled_answer(off_server)
    assert "".join(b["text"] for b in out["content"] if b["type"] == "text") == want
