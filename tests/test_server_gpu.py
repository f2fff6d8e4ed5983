"""The server on the GPU as a user starts it, `python -m mk.server --synthetic` (full-size synthetic
weights on the megakernel): a streamed chat completion, and with no other flag, on whatever card the
tests run on, 16 concurrent 8K-token prompts and a 32K-token one beside them, each to its
`max_tokens`, with no error (the memory plan leaves the scheduler to queue or preempt what the KV
pool cannot hold at once)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from server_util import ServerProcess

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
# The GPU machine may lack the server's packages (carry their wheels: scripts/server-wheels.sh).
for _name in ("pydantic", "granian", "cohere_melody"):
    pytest.importorskip(_name)


def test_the_server_streams_a_chat_completion_on_the_megakernel():
    server = ServerProcess("--synthetic", "--backend", "megakernel", "--max-context", "4096").wait_ready(timeout=600)
    try:
        body = {
            "model": "north-mini-code-synthetic",
            "messages": [{"role": "user", "content": "Write a haiku about GPUs."}],
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
        }
        chunks, finish = [], None
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                for choice in event.get("choices", []):
                    chunks.append(choice.get("delta", {}))
                    finish = choice.get("finish_reason") or finish
        assert finish in ("stop", "length"), chunks
        assert len(chunks) >= 2
        assert "megakernel decode" in server.output()
    finally:
        code = server.stop()
    assert code == 0, server.output()


def test_the_default_server_serves_sixteen_8k_prompts_and_a_32k_one_beside_them():
    server = ServerProcess("--synthetic").wait_ready(timeout=600)
    try:
        served = httpx.get(server.url + "/v1/models", timeout=10).json()["data"][0]
        context, max_tokens = served["max_model_len"], 32
        long = context - 2 * max_tokens
        assert long >= 32000, f"the default context {context} holds no 32K-token prompt"
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(1000, 100_000, (n,), generator=gen).tolist() for n in [8192] * 16 + [long]]

        def complete(ids: list[int]) -> dict:
            body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=600)
            assert r.status_code == 200, r.text
            return r.json()

        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
        for ids, answer in zip(prompts, answers, strict=True):
            assert answer["choices"][0]["finish_reason"] == "length", answer
            usage = answer["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (len(ids), max_tokens), usage
        log = server.output()
        assert "out of memory" not in log.lower() and "Traceback" not in log, log[-4000:]
        print(next((line for line in log.splitlines() if "memory plan" in line), "(no memory plan line)"))
    finally:
        code = server.stop()
    assert code == 0, server.output()
