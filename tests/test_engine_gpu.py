"""The Rust engine over the reference model in bf16 on the GPU (GPU-test geometry: real widths, 5
layers, 32K vocabulary), with the KV pool sized from a fraction of free memory. In bf16 a batch's
logits may differ from a lone row's in the last bit, so equality with the reference loop is
checked where the shapes match (one request, one prefill chunk); batches are checked for
completeness, order and that every block comes back."""

from __future__ import annotations

import pytest
import torch
from test_engine import prompt, reference_greedy, run

from mk.config import ModelConfig
from mk.engine import Engine
from mk.model import synthetic_weights
from mk.model.reference import Model
from mk.sampling import SamplingParams

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model() -> Model:
    cfg = ModelConfig.gpu_test()
    return Model(cfg, synthetic_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16, std=0.02))


@pytest.fixture(scope="module")
def engine(model):
    e = Engine(
        model,
        backend="reference",  # the megakernel backend's own GPU tests: test_engine_megakernel_gpu.py
        max_batch=8,
        max_context=8192,
        prefill_chunk=512,
        kv_fraction=0.2,
        check_invariants=True,
    )
    yield e
    s = e.native_stats()
    e.close()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["kv_sequences"] == 0


def test_a_lone_greedy_request_matches_the_reference_loop(model, engine):
    p = prompt(300)
    tokens, finish, _ = run(engine, [(0, p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))])[0]
    assert tokens == reference_greedy(model, p, 16, ignore_eos=True)[0]
    assert finish == "length"
    # The pool came from kv_fraction of free memory: far more than the 8 × 8K-token minimum.
    assert engine.native_stats()["kv_blocks_total"] > 8 * 5 * 128


def test_a_mixed_batch_with_a_chunked_long_prompt(engine):
    reqs = [(0.002 * i, prompt(20 + 150 * i, i), SamplingParams(max_tokens=12 + i, temperature=0.0)) for i in range(7)]
    reqs.append((0.0, prompt(3000, 9), SamplingParams(max_tokens=8, temperature=0.7, seed=1, logprobs=2)))
    results = run(engine, reqs)
    for (_, _, params), (tokens, finish, _) in zip(reqs, results, strict=True):
        assert finish in ("stop", "length") and 1 <= len(tokens) <= params.max_tokens
    assert all(e.logprob is not None and len(e.top_logprobs) == 2 for e in results[-1][2])
    # The same seeded request alone: its first token comes from its own prefill (no batch
    # effects), later ones from bf16 batches whose logits may move by a bit.
    alone = run(engine, [reqs[-1]])[0][0]
    assert alone[0] == results[-1][0][0]
