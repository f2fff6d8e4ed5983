"""`mk.LLM` over the embedded default model: the vLLM-shaped offline `generate` and async
`stream`, text and ids agreeing, per-prompt parameters, n, stop strings."""

from __future__ import annotations

import asyncio
import time

import pytest

import mk
from mk import SamplingParams


@pytest.fixture(scope="module")
def llm():
    with mk.LLM(device="cpu", max_batch=4, max_context=256, prefill_chunk=64) as llm:
        yield llm
        s = llm.engine.native_stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"]


def test_exports():
    assert mk.SamplingParams is SamplingParams
    assert "LLM" in mk.__all__ and mk.LLM.__name__ == "LLM"
    with pytest.raises(AttributeError):
        mk.NoSuchThing  # noqa: B018


def test_generate_shapes_and_greedy_determinism(llm):
    prompts = ["def fibonacci(n):", "import os", "x"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params)
    assert [o.prompt for o in outs] == prompts
    for o in outs:
        c = o.outputs[0]
        assert len(c.token_ids) == 12 and c.finish_reason == "length"
        assert c.text == llm.tokenizer.decode(c.token_ids)
        assert o.prompt_token_ids == llm.tokenizer.encode(o.prompt).ids
    # Same prompt alone, as token ids: the same tokens (greedy does not depend on the batch).
    alone = llm.generate(outs[1].prompt_token_ids, params, use_tqdm=False)
    assert alone[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert alone[0].prompt is None


def test_a_prompt_that_cannot_be_submitted_starts_none_of_the_batch(llm):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    before = llm.engine.native_stats()["prefill_chunks"]
    with pytest.raises(mk.engine.api.PromptTooLong):
        llm.generate(["import os", "def f(x):", "x " * 400], params, use_tqdm=False)
    deadline = time.monotonic() + 10
    while llm.engine.active_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert llm.engine.active_requests == 0
    assert llm.engine.native_stats()["prefill_chunks"] == before  # cancelled while held


def test_per_prompt_params_n_and_seeds(llm):
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=3, n=3, ignore_eos=True)
    outs = llm.generate(["a", "b"], [SamplingParams(max_tokens=2, temperature=0), seeded], use_tqdm=False)
    assert len(outs[0].outputs) == 1 and len(outs[0].outputs[0].token_ids) <= 2
    choices = [c.token_ids for c in outs[1].outputs]
    assert [c.index for c in outs[1].outputs] == [0, 1, 2]
    assert len({tuple(c) for c in choices}) > 1  # seed + j per choice
    again = llm.generate("b", seeded, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == choices
    with pytest.raises(ValueError, match="2 prompts"):
        llm.generate(["a", "b"], [seeded], use_tqdm=False)


def test_stop_strings_cut_the_text_and_stop_the_request(llm):
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    full = llm.generate("hello", params, use_tqdm=False)[0].outputs[0]
    stop = full.text[6:9]
    assert stop and stop in full.text
    cut = llm.generate("hello", SamplingParams(**{**_as_dict(params), "stop": [stop]}), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.token_ids) < 40


def _as_dict(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in ("max_tokens", "temperature", "ignore_eos")}


def test_logprobs_fields(llm):
    # Token ids, which are not healed: under healing the first token is the best of those that begin with
    # the healed text, while its logprobs are the model's own (mk.text.healing; tests/test_healing.py).
    params = SamplingParams(max_tokens=3, temperature=0, logprobs=2)
    out = llm.generate(llm.encode("q"), params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == len(out.top_logprobs)
    assert all(len(t) == 2 and t[0][1] >= t[1][1] for t in out.top_logprobs)
    assert all(out.top_logprobs[i][0][0] == tok for i, tok in enumerate(out.token_ids))  # greedy = the best


def test_stream_yields_cumulative_outputs(llm):
    async def main():
        return [o async for o in llm.stream("def f(x):", SamplingParams(max_tokens=5, temperature=0))]

    outs = asyncio.run(main())
    ids = [o.outputs[0].token_ids for o in outs]
    assert all(len(b) == len(a) + 1 and b[: len(a)] == a for a, b in zip(ids, ids[1:], strict=False))
    assert outs[-1].outputs[0].finish_reason is not None
    assert all(o.outputs[0].finish_reason is None for o in outs[:-1])
    batch = llm.generate("def f(x):", SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert batch[0].outputs[0].token_ids == ids[-1]


def test_launch_ahead_gives_the_same_text_stops_and_logprobs(llm):
    """The engine launching each decode step before the previous one's tokens are handed over:
    stop strings (which end a request from Python, one step behind), n with seeds, logprobs and
    EOS give what synchronous steps give, and the pool comes back whole."""
    prompts = ["hello", "def fibonacci(n):", "import os"]
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    stop = llm.generate("hello", greedy, use_tqdm=False)[0].outputs[0].text[6:9]
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop]),
        SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=2, logprobs=2),
        SamplingParams(max_tokens=30, temperature=0),
    ]
    with mk.LLM(device="cpu", max_batch=4, max_context=256, prefill_chunk=64, launch_ahead=True) as ahead:
        got = ahead.generate(prompts, params, use_tqdm=False)
        deadline = time.monotonic() + 10  # a stop string's cancel reaches the loop after the text
        while ahead.engine.active_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        s = ahead.engine.native_stats()
        assert s["kv_blocks_free"] == s["kv_blocks_total"]
    want = llm.generate(prompts, params, use_tqdm=False)
    assert got[0].outputs[0].finish_reason == "stop"
    # Logprobs to 1e-5: the fp32 model's batched products round differently when a step holds one
    # more row (the step launched behind a row's last token still carries it); measured 1.9e-6.
    for g, w in zip(got, want, strict=True):
        for a, b in zip(g.outputs, w.outputs, strict=True):
            assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
            assert (a.logprobs is None) == (b.logprobs is None)
            if b.logprobs is not None:
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
