"""The Rust engine over the reference model on the GPU (GPU-test geometry: real widths, 5 layers,
32K vocabulary), with the KV pool sized from a fraction of free memory. In fp32 a lone greedy
request equals the reference loop token for token. In bf16 the engine's prefill and the loop's
`Model.forward` round differently, so the two may part at a near-tie: the test measures the bf16
error of the loop's logits against fp32 on the same tokens and allows a divergence only where
the two candidates' fp32 logits lie within twice that error. Batches are checked for
completeness, order and that every block comes back."""

from __future__ import annotations

import pytest
import torch
from test_engine import common, prompt, reference_greedy, run

from mk.config import PAGE_SIZE, ModelConfig
from mk.engine.engine import Engine
from mk.engine.sampling import SamplingParams
from mk.model import PageAllocator, synthetic_weights
from mk.model.paged import pages_needed
from mk.model.reference import Model
from mk.prefill.prefixed import NEXT_TURN_BUCKETS

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model() -> Model:
    cfg = ModelConfig.gpu_test()
    return Model(cfg, synthetic_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16, std=0.02))


@pytest.fixture(scope="module")
def engine(model):
    e = make_engine(model)  # the PyTorch backend; the megakernel's own: test_engine_megakernel_gpu.py
    yield e
    s = e.native_stats()
    e.close()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["kv_sequences"] == 0


def make_engine(model: Model) -> Engine:
    return Engine(
        model,
        backend="pytorch",
        max_batch=8,
        max_context=8192,
        prefill_chunk=512,
        # A fifth of what is free (test_memory_gpu.py covers the memory plan): the rest stays free for
        # the tests' fp32 references.
        kv_bytes=int(0.2 * torch.cuda.mem_get_info()[0]),
        check_invariants=True,
    )


def teacher_forced_logits(model: Model, tokens: list[int], forced: list[int]) -> list[torch.Tensor]:
    """fp32 logits before each of `forced` and after the last: one prefill, then one decode per token."""
    cfg = model.config
    pages = pages_needed(len(tokens) + len(forced) + 1)
    alloc = PageAllocator(cfg.num_hidden_layers * pages)
    kv = model.new_kv(alloc.num_free)
    table = alloc.new_table(cfg, pages)
    alloc.ensure(table, len(tokens))
    out = [model.forward(torch.tensor(tokens), 0, kv, table, last_only=True)[-1].float()]
    for i, tok in enumerate(forced):
        pos = len(tokens) + i
        alloc.release_out_of_window(table, cfg, pos)
        alloc.ensure(table, pos + 1, from_pos=pos)
        out.append(model.decode(torch.tensor([tok]), torch.tensor([pos]), kv, [table])[0].float())
    return out


def test_a_lone_greedy_request_matches_the_reference_loop(model, engine):
    p = prompt(300)
    tokens, finish, _ = run(engine, [(0, p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))])[0]
    want = reference_greedy(model, p, 16, ignore_eos=True)[0]
    assert finish == "length" and len(tokens) == 16
    # The pool came from a fifth of the free memory: far more than the 8 × 8K-token minimum.
    assert engine.native_stats()["kv_blocks_total"] > 8 * 5 * 128
    i = common(tokens, want)
    if i == len(want):
        return
    # Parted at step i: both paths agree before it, so the loop's logits there are the bf16
    # model's on the shared prefix. Their error against fp32 bounds how far either bf16 path
    # may move a logit; the two choices must be that close in fp32.
    w32 = Model(model.config, {k: v.float() for k, v in model.weights.items()})
    exact = teacher_forced_logits(w32, p, want[:i])
    bf16 = teacher_forced_logits(model, p, want[:i])
    eps = max(float((b - e).abs().max()) for b, e in zip(bf16, exact, strict=True))
    gap = abs(float(exact[i][tokens[i]] - exact[i][want[i]]))
    print(f"parted at token {i}: fp32 gap of the two choices {gap:.4f}, bf16 error bound {eps:.4f}")
    assert gap <= 2 * eps, f"token {i}: {tokens[i]} vs {want[i]} are {gap:.4f} apart in fp32 (bf16 error {eps:.4f})"


def test_a_lone_greedy_request_matches_the_reference_loop_in_fp32(model):
    """Without bf16 rounding the engine's path (chunked prefill, paged decode) is the loop's."""
    w32 = Model(model.config, {k: v.float() for k, v in model.weights.items()})
    e = make_engine(w32)
    try:
        p = prompt(300)
        tokens, _, _ = run(e, [(0, p, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))])[0]
        assert tokens == reference_greedy(w32, p, 16, ignore_eos=True)[0]
    finally:
        e.close()


def test_the_warm_up_captures_every_next_turn_shape_and_a_next_turn_replays_one(engine):
    """Before serving, the engine captured the CUDA graph of every padded shape a chunk after a cached
    prefix can take (Prefill's default: the next turn's buckets); a conversation's next turn, its
    history from the prefix cache, replays one of them: no capture at its first use."""
    prefixed = engine._runner.packed_prefill.prefixed
    assert prefixed is not None and prefixed.buckets == NEXT_TURN_BUCKETS[:2]  # (the 512-token chunk)
    max_end = engine._runner.max_pages * PAGE_SIZE
    shapes = {prefixed.shape([chunk]) for chunk in prefixed.warm_up_chunks(max_end)}
    assert set(prefixed._buckets) == shapes and len(shapes) == 2 * 3  # keys: 2K, 4K, 8K
    assert prefixed.packed_shapes == shapes, "next turns packed together take only captured shapes"
    assert all(b.graph is not None for b in prefixed._buckets.values()), "a shape fell back to eager"
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = prompt(1000, 5)
    [(answer, _, _)] = run(engine, [(0, first, greedy)])
    hits = engine.native_stats()["prefix_hit_tokens"]
    [(tokens, finish, _)] = run(engine, [(0, first + answer + prompt(100, 6), greedy)])
    assert finish == "length" and len(tokens) == 4
    assert engine.native_stats()["prefix_hit_tokens"] - hits >= 960, "the history came from the prefix cache"
    assert engine._runner.packed_prefill.prefixed is prefixed, "the prefixed pass failed and fell back"
    assert set(prefixed._buckets) == shapes and all(b.graph is not None for b in prefixed._buckets.values())


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
