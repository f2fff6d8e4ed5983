"""How a choice's engine events become streamed pieces (mk.server.generate.ChoiceRun)."""

from __future__ import annotations

import asyncio
import time

from mk.config import ModelConfig
from mk.engine.outputs import TokenEvent
from mk.server.generate import ChoiceRun
from mk.server.metrics import Metrics
from mk.text.tokenizer import Tokenizer

TOK = Tokenizer.builtin(ModelConfig.tiny().vocab_size)


class _Events:
    def __init__(self, events: list[TokenEvent]) -> None:
        self.events = events

    def cancel(self) -> None:
        pass

    async def __aiter__(self):
        for e in self.events:
            yield e


def _pieces(tokens: list[int], logprobs: bool) -> list:
    events = [TokenEvent(t, -0.5 if logprobs else None) for t in tokens[:-1]]
    events.append(TokenEvent(tokens[-1], -0.5 if logprobs else None, finish_reason="length"))
    run = ChoiceRun(0, _Events(events), TOK, [], Metrics("m"), time.monotonic())

    async def collect():
        return [p async for p in run.pieces()]

    return asyncio.run(collect())


def test_a_token_whose_text_is_held_back_still_streams_when_logprobs_are_asked_for():
    # "é" is two byte-level tokens here: the first alone decodes to no text yet.
    ids = TOK.encode("aé b", add_special_tokens=False)
    assert len(ids) > len("aé b".split()) and any(TOK.decode([i]) == "\ufffd" for i in ids)
    with_logprobs = _pieces(ids, logprobs=True)
    assert [len(p.tokens) for p in with_logprobs] == [1] * len(ids)  # one piece per token, as sampled
    assert any(p.text == "" for p in with_logprobs)
    assert "".join(p.text for p in with_logprobs) == "aé b"
    # Without logprobs, a piece waits for text: the held token goes out with the next one.
    plain = _pieces(ids, logprobs=False)
    assert all(p.text for p in plain) and len(plain) < len(ids)
    assert "".join(p.text for p in plain) == "aé b"
    assert sum(len(p.tokens) for p in plain) == len(ids)
