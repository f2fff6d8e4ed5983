"""The server through the official `openai` client, against a real `python -m mk.server` process."""

import asyncio
import json
from pathlib import Path

import httpx
import openai
import pytest

from mk.default_model import NAME, load_default

pytestmark = pytest.mark.slow  # (starts python -m mk.server)

TOK = load_default()[1]  # the embedded model's tokenizer, or the built-in one of the fallback
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def greedy_reference(prompt_ids: list[int], n: int) -> list[int]:
    """Greedy tokens by full recomputation over the default model, outside the server."""
    model, _ = load_default()
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(model.logits(ids)[-1].argmax()))
    return ids[len(prompt_ids) :]


def healed_greedy_reference(prompt_ids: list[int], n: int) -> tuple[list[int], str]:
    """Greedy tokens of a text prompt's ids under token healing, outside the server: the prompt less
    its healed tail (mk.text.healing.back_up), each first token the most likely of the text tokens consistent
    with what is left of the tail (it starts with it, or is a start of it), then plain greedy; and the
    removed text."""
    from mk.text.healing import back_up

    model, _ = load_default()
    ids, removed = back_up(TOK, prompt_ids)
    left, out = removed.encode(), []
    while len(out) < n:
        logits = model.logits(ids + out)[-1]
        if left:
            for t in range(logits.shape[0]):
                piece = TOK.token_bytes(t) if t < TOK.vocab_size and t not in TOK.special_ids else b""
                if not piece or not (piece.startswith(left) or left.startswith(piece)):
                    logits[t] = float("-inf")
        out.append(int(logits.argmax()))
        left = left[len(TOK.token_bytes(out[-1])) :] if left else left
    return out, removed


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [NAME]


def test_greedy_completion_matches_the_reference_model(client):
    """Healing off, the prompt's own greedy continuation; on (the default), the healed one, whose text
    leaves out the healed tail ("):", which tokens such as "):\n" extend), counted as prompt."""
    prompt = "def fibonacci(n):"
    for healing in (False, True):
        out = client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, extra_body={"token_healing": healing}
        )
        if healing:
            expected, removed = healed_greedy_reference(TOK.encode(prompt), 12)
        else:
            expected, removed = greedy_reference(TOK.encode(prompt), 12), ""
        choice = out.choices[0]
        if TOK.eos_token_id in expected:  # the engine stops there
            expected = expected[: expected.index(TOK.eos_token_id) + 1]
        full = TOK.decode(expected, skip_special_tokens=True)
        assert full.startswith(removed) and choice.text == full[len(removed) :]
        assert out.usage.prompt_tokens == len(TOK.encode(prompt))
        assert out.usage.completion_tokens == len(expected)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_streamed_completion_equals_the_unstreamed_one(client):
    kwargs = dict(model=NAME, prompt="import os\n", max_tokens=20, temperature=0)
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [
        whole.choices[0].finish_reason
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_continuous_usage_stats_make_a_chunk_per_token(client):
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far and every
    token makes a chunk, held text or not, so a client counts tokens as they come without asking
    for logprobs (which would send the rows to the host sampler); the text is unchanged."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    # The built-in model ends this prompt at once (EOS, which has no text), and goes on past it.
    prompt = 'def one():\n    """Return one."""\n'
    kwargs = dict(model=NAME, prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options=options))
    tokens = [c.usage.completion_tokens for c in chunks if c.choices and c.choices[0].finish_reason is None]
    assert tokens == list(range(1, 21))
    assert all(c.usage.prompt_tokens == whole.usage.prompt_tokens for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    messages = [{"role": "user", "content": "Write a loop."}]
    chat = list(
        client.chat.completions.create(
            model=NAME,
            messages=messages,
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options=options,
            extra_body={**NO_THINKING, "ignore_eos": True},
        )
    )
    counted = [c.usage.completion_tokens for c in chat if c.choices and c.usage and c.choices[0].finish_reason is None]
    assert counted == list(range(0, 17))  # the role's chunk first, before any token (as vLLM's)


def test_several_prompts_token_ids_echo_and_n(client):
    ids = TOK.encode("x = 1")
    out = client.completions.create(model=NAME, prompt=[ids, ids], max_tokens=4, temperature=0, n=2, logprobs=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert len({c.text for c in out.choices}) == 1  # greedy: all four the same
    assert out.usage.prompt_tokens == 2 * len(ids)
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices)
    # Token ids are taken as given; the same prompt as text is healed (" 1" backed up), unless told not to.
    echoed = client.completions.create(
        model=NAME, prompt="x = 1", max_tokens=4, temperature=0, echo=True, extra_body={"token_healing": False}
    )
    assert echoed.choices[0].text == "x = 1" + out.choices[0].text
    texts = client.completions.create(model=NAME, prompt=["a", "bb"], max_tokens=3, temperature=0)
    assert [c.index for c in texts.choices] == [0, 1]


def test_chat_streamed_equals_unstreamed_and_usage_adds_up(client):
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "Write a loop."}], max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kwargs, extra_body=NO_THINKING)
    msg = whole.choices[0].message
    assert msg.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}, extra_body=NO_THINKING
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == msg.content
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    assert chunks[-1].usage == whole.usage
    prompt = TOK.apply_chat_template(kwargs["messages"], enable_thinking=False)
    assert whole.usage.prompt_tokens == len(TOK.encode(prompt, add_special_tokens=False))


def test_chat_reasoning_streams_like_the_whole_response(client):
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "Think."}], max_tokens=24, temperature=0)
    kwargs["extra_body"] = {"ignore_eos": True}  # greedy, this prompt's first token is EOS
    whole = client.chat.completions.create(**kwargs).choices[0].message
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert reasoning == (getattr(whole, "reasoning_content", None) or "")
    assert content == (whole.content or "")
    assert reasoning or content
    kwargs["extra_body"]["include_reasoning"] = False
    hidden = client.chat.completions.create(**kwargs).choices[0].message
    assert getattr(hidden, "reasoning_content", None) is None and hidden.content == whole.content


def test_n_choices(client):
    kwargs = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=5, n=3, seed=11)
    out = client.chat.completions.create(**kwargs, logprobs=True, extra_body=NO_THINKING)
    assert [c.index for c in out.choices] == [0, 1, 2]
    for c in out.choices:  # the content's tokens (no EOS, no control tokens), joining to the content
        assert b"".join(bytes(t.bytes) for t in c.logprobs.content).decode() == c.message.content
    assert out.usage.completion_tokens >= sum(len(c.logprobs.content) for c in out.choices)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, extra_body=NO_THINKING))
    streamed = {i: "" for i in range(3)}
    for c in chunks:
        streamed[c.choices[0].index] += c.choices[0].delta.content or ""
    assert [streamed[i] for i in range(3)] == [c.message.content for c in out.choices]
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert len(finishes) == 3


def test_seeded_sampling_reproduces_alone_and_under_load(client, server):
    kwargs = dict(model=NAME, prompt="class Tree:", max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    first = client.completions.create(**kwargs).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == first
    assert client.completions.create(**{**kwargs, "seed": 99}).choices[0].text != first

    async def crowd():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        others = [
            aclient.completions.create(model=NAME, prompt=f"noise {i}", max_tokens=16, temperature=1.0)
            for i in range(5)
        ]
        results = await asyncio.gather(aclient.completions.create(**kwargs), *others)
        return results[0].choices[0].text

    assert asyncio.run(crowd()) == first


def test_stop_strings_cut_and_never_leak(client):
    kwargs = dict(model=NAME, prompt="for i in", max_tokens=40, temperature=1.0, seed=7)
    full = client.completions.create(**kwargs).choices[0].text
    at = next(i for i in range(len(full) // 3, len(full) - 1) if full[i : i + 2].isalnum())
    stop = full[at : at + 2]
    cut = full[: full.find(stop)]
    out = client.completions.create(**kwargs, stop=[stop])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**kwargs, stop=[stop], stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert "".join(pieces) == cut
    assert [c.choices[0].finish_reason for c in chunks][-1] == "stop"


def test_logprobs(client):
    out = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_THINKING,
    )
    entries = out.choices[0].logprobs.content
    assert 0 < len(entries) <= out.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in entries).decode() == out.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.logprob == pytest.approx(e.top_logprobs[0].logprob)  # greedy picks the most likely token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob >= e.top_logprobs[2].logprob
    comp = client.completions.create(model=NAME, prompt="x", max_tokens=5, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == comp.usage.completion_tokens
    assert all(len(t) <= 3 for t in lp.top_logprobs)  # the two most likely and the sampled token
    assert all(token in t for t, token in zip(lp.top_logprobs, lp.tokens, strict=True))
    lp = client.completions.create(model=NAME, prompt="x", max_tokens=5, temperature=0.9, seed=1, logprobs=0)
    lp = lp.choices[0].logprobs
    assert lp.top_logprobs == [{token: token_lp} for token, token_lp in zip(lp.tokens, lp.token_logprobs, strict=True)]


def test_metrics_count_tokens_and_latencies(server, client):
    before = server.metric("mk_generation_tokens_total")
    out = client.completions.create(model=NAME, prompt="abc", max_tokens=7, temperature=0)
    assert server.metric("mk_generation_tokens_total") == before + out.usage.completion_tokens
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "mk_time_to_first_token_seconds_bucket",
        "mk_inter_token_latency_seconds_count",
        "mk_e2e_request_latency_seconds_sum",
        "mk_prompt_tokens_total",
        "mk_num_requests_running",
        "mk_num_requests_waiting",
        "mk_kv_cache_usage_ratio",
        "mk_prefix_cache_hits_total",
    ):
        assert name in text
    assert server.metric("mk_time_to_first_token_seconds_count") >= 1
    for name in ("mk_request_queue_time_seconds", "mk_request_prefill_time_seconds", "mk_request_decode_time_seconds"):
        assert server.metric(name + "_count") >= 1, name
    assert f'model_name="{NAME}"' in text


def test_every_metric_is_documented_in_the_readme(server):
    text = httpx.get(server.url + "/metrics").text
    names = {line.split()[2] for line in text.splitlines() if line.startswith("# HELP mk_")}
    assert len(names) >= 15
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    missing = sorted(n for n in names if f"`{n}`" not in readme)
    assert not missing, f"metrics missing from README.md: {missing}"


def test_a_disconnect_cancels_the_request_and_frees_its_blocks(server):
    body = {"model": NAME, "prompt": "while True:", "max_tokens": 900, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        assert server.metric("mk_kv_cache_blocks_used") > 0
        assert server.metric("mk_num_requests_running") == 1
    for _ in range(100):  # closing the stream is the disconnect
        if server.metric("mk_kv_cache_blocks_used") == 0 and server.metric("mk_num_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert server.metric("mk_kv_cache_blocks_used") == 0
    assert server.metric("mk_num_requests_running") == 0


def test_64_concurrent_streaming_clients_match_their_solo_runs(server, client):
    prompts = [f"def task_{i}(x):" for i in range(8)]
    solo = {
        p: client.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0).choices[0].text
        for p in prompts
    }

    async def crowd():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

        async def one(p):
            text = ""
            async for chunk in await aclient.completions.create(
                model=NAME, prompt=p, max_tokens=12, temperature=0, stream=True
            ):
                text += chunk.choices[0].text
            return p, text

        return await asyncio.gather(*(one(prompts[i % 8]) for i in range(64)))

    results = asyncio.run(crowd())
    assert len(results) == 64
    assert all(text == solo[p] for p, text in results)


def test_raw_sse_framing(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    ids = {json.loads(e[6:])["id"] for e in events[:-1]}
    assert len(ids) == 1


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_include_usage_sends_a_null_usage_until_the_usage_chunk(server, path):
    """The OpenAI API's shape: with stream_options.include_usage, every chunk but the last has
    `"usage": null`, and the last has the usage and no choices."""
    body = {"model": NAME, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}, "n": 2}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    r = httpx.post(server.url + path, json=body, timeout=30)
    chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e and e != "data: [DONE]"]
    assert len(chunks) > 2 and all("usage" in c and c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def test_a_completion_without_max_tokens_makes_16(client):
    """The OpenAI completions API's default, and vLLM's (a chat's is the rest of the context)."""
    out = client.completions.create(model=NAME, prompt="x = 1", temperature=0, extra_body={"ignore_eos": True})
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (16, "length")


def test_the_shipped_model_answers_a_chat(client):
    """The default model is the trained embedded one and its chat answer has text."""
    assert NAME == "mk-embedded", "python/mk/embedded/ is missing: the server fell back to random weights"
    out = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": 'def add(a, b):\n    """Return the sum of a and b."""'}],
        max_tokens=96,
        temperature=0,
        extra_body=NO_THINKING,
    )
    answer = out.choices[0].message.content
    assert answer and answer.strip(), out
