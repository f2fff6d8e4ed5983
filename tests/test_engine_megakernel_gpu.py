"""The engine on the megakernel backend against the engine on the PyTorch backend, on the GPU at the
GPU-test geometry (synthetic bf16 weights): staggered greedy requests, a batch larger than one
launch, seeded sampling, a layer-sliced prefill beside a decoding stream, and the server end to end
with `--synthetic`.

Both backends prefill with the same PyTorch code, mk.prefill.packed (arrival timing may cut a prompt into different
chunks), and decode tokens agree until the first near-tie. With these random weights the logits
spread about 0.9, top-2 gaps are often a few bf16 steps (0.016 at |logit| ≈ 3.5), and an expert
choice that flips on a near-tie router logit moves the logits by up to about 1 (bf16 against fp32
on the CPU, measured). So the assertions are: (1) until the first divergence the tokens are the
reference's, and there are many such tokens in all; (2) the reference's top-2 gap at each first
divergence is small (reported per request: run with -s to read it); (3) where the tokens agree, the
kernel's log-probabilities (copied back for rows that ask) match the reference's. A wrong page,
row or position gives unrelated tokens at once, which (1) and (3) catch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import re
import statistics
import weakref
from pathlib import Path

import pytest
import torch
from test_engine import common, prompt, run

from mk.config import ModelConfig
from mk.engine.engine import Engine
from mk.engine.options import WHOLE_CHUNK_TOKENS
from mk.engine.sampling import ConstraintSpec, SamplingParams
from mk.megakernel.support import STEP_MAX_ROWS
from mk.model import synthetic_weights
from mk.model.reference import Model
from mk.text.tokenizer import Tokenizer

pytestmark = pytest.mark.gpu

MAX_CONTEXT = 4096
# A divergence where the reference's top-2 gap is larger than this fails: 32 bf16 steps at the
# logits' magnitude, room for an expert near-tie that flipped (see the module docstring).
GAP_TOL = 0.5
# Median |Δ logprob| of agreeing tokens (noise is ~0.02; a wrong input gives ~1).
LOGPROB_TOL = 0.1


@pytest.fixture(scope="module")
def model() -> Model:
    cfg = ModelConfig.gpu_test()
    return Model(cfg, synthetic_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16, std=0.02))


@contextlib.contextmanager
def engine(
    model,
    backend: str,
    max_batch: int = 8,
    prefill_chunk: int = 512,
    tokenizer_json: str | None = None,
    launch_ahead: bool | None = None,  # the engine's default: on with this backend
    kernel_masks: bool | None = None,  # likewise
    speculative: bool | None = False,  # (drafts: test_speculative_gpu.py and the embedded model's tests)
    **options,
):
    """A fresh engine (no prefix cache shared between the runs compared), checked for leaks."""
    e = Engine(
        model,
        backend=backend,
        max_batch=max_batch,
        max_context=MAX_CONTEXT,
        prefill_chunk=prefill_chunk,
        kv_blocks=4096,
        check_invariants=True,
        tokenizer_json=tokenizer_json,
        launch_ahead=launch_ahead,
        kernel_masks=kernel_masks,
        speculative=speculative,
        **options,
    )
    assert e.options.backend == backend and e.options.prefill == "packed"  # mk.prefill.packed on the GPU, by default
    try:
        yield e
    finally:
        s = e.native_stats()
        e.close()
    assert s["kv_blocks_free"] == s["kv_blocks_total"] and s["kv_sequences"] == 0


def tokens_of(result) -> list[int]:
    return result[0]


def compare(name: str, mk_results, ref_results, requests) -> int:
    """Checks (1) and (2) of the module docstring per request; returns the agreeing decode tokens."""
    agreed = 0
    for i, (mk, ref, (_, p, params)) in enumerate(zip(mk_results, ref_results, requests, strict=True)):
        mk_tokens, ref_tokens, ref_events = tokens_of(mk), tokens_of(ref), ref[2]
        assert mk[1] == ref[1] == "length", f"{name} request {i}: {mk[1]}, {ref[1]}"
        assert len(mk_tokens) == len(ref_tokens) == params.max_tokens
        d = common(mk_tokens, ref_tokens)
        if d == len(mk_tokens):
            print(f"{name} request {i} ({len(p)}-token prompt): all {len(mk_tokens)} tokens equal")
            agreed += len(mk_tokens) - 1
            continue
        top = ref_events[d].top_logprobs
        gap = top[0][1] - top[1][1]
        print(
            f"{name} request {i} ({len(p)}-token prompt): first divergence at token {d} of {len(mk_tokens)}, "
            f"reference top-2 gap {gap:.4f}"
        )
        assert gap <= GAP_TOL, f"{name} request {i}: diverged at token {d} where the reference's gap is {gap:.3f}"
        agreed += max(d - 1, 0)
    return agreed


def staggered() -> list[tuple[float, list[int], SamplingParams]]:
    """Five requests arriving while others decode; different lengths, so rows go idle (sparse
    batches) and are reused; prompts inside a page, across pages, on a page edge, and one longer
    than a prefill chunk."""
    lengths, tokens = [5, 70, 300, 1000, 60], [64, 40, 64, 24, 64]
    return [
        (0.05 * i, prompt(n, i), SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, logprobs=2))
        for i, (n, m) in enumerate(zip(lengths, tokens, strict=True))
    ]


@pytest.fixture(scope="module")
def reference(model):
    requests = staggered()
    with engine(model, "pytorch") as e:
        return requests, run(e, requests)


def test_a_closed_engine_lets_its_model_and_memory_go():
    """Once closed and no longer referenced, a megakernel engine (drafts on) holds no reference to its
    model and none of torch's memory: a process that makes engine after engine (a script, the GPU
    tests) must not run out of memory. A GPU run saw a module leave a model's weights on the card."""

    def allocated() -> int:
        # (torch keeps a cuBLAS workspace per stream that ran a matmul, for the process: not the engine's)
        gc.collect()
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()

    before = allocated()
    cfg = ModelConfig.gpu_test()
    weights = synthetic_weights(cfg, seed=1, device="cuda", dtype=torch.bfloat16, std=0.02)
    m = Model(cfg, weights)
    del weights
    gone = weakref.ref(m)
    # The memory plan's path (no kv_blocks): it builds, warms up and drops a runner of its own.
    with Engine(m, backend="megakernel", max_context=MAX_CONTEXT, speculative=True) as e:
        results = run(e, staggered()[:2])
    assert all(r[1] == "length" for r in results)
    del e, m, results
    grew = allocated() - before
    held = gone()
    assert held is None, f"the model is still referenced by {[type(r).__name__ for r in gc.get_referrers(held)]}"
    assert grew < 16 << 20, f"{grew >> 20} MiB of torch's memory still allocated"


def test_greedy_decode_follows_the_reference_until_a_near_tie(model, reference):
    requests, ref = reference
    # Greedy without logprobs: the kernel's own argmax picks every decode token.
    kernel_requests = [
        (t, p, SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True)) for t, p, s in requests
    ]
    with engine(model, "megakernel") as e:
        mk = run(e, kernel_requests)
    agreed = compare("greedy", mk, ref, requests)
    assert agreed >= 10, f"only {agreed} decode tokens agreed before the first divergences"


def test_logprobs_of_the_kernels_logits_match_the_reference(model, reference):
    requests, ref = reference
    # With logprobs the kernel's fp32 logits come back and the Rust sampler picks (the fallback).
    with engine(model, "megakernel") as e:
        mk = run(e, requests)
    compare("logprobs", mk, ref, requests)
    deltas = []
    for (mk_tokens, _, mk_events), (ref_tokens, _, ref_events) in zip(mk, ref, strict=True):
        for j in range(1, len(mk_tokens)):
            if mk_tokens[: j + 1] != ref_tokens[: j + 1]:
                break
            deltas.append(abs(mk_events[j].logprob - ref_events[j].logprob))
            assert [t for t, _ in mk_events[j].top_logprobs][0] == mk_tokens[j]
    assert len(deltas) >= 10, f"only {len(deltas)} decode tokens agreed"
    median = statistics.median(deltas)
    print(f"logprobs: median |Δ| {median:.4f}, max {max(deltas):.4f} over {len(deltas)} agreeing decode tokens")
    assert median <= LOGPROB_TOL


def test_a_batch_past_one_launch_runs_as_two_launches(model):
    # Two rows more than one launch takes: every step with more live rows than that is two launches.
    rows = STEP_MAX_ROWS + 2
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    requests = [(0.0, prompt(20 + 23 * (i % 8), 50 + i), params) for i in range(rows)]
    assert sum(len(p) for _, p, _ in requests) <= 2048
    with engine(model, "pytorch", max_batch=rows) as e:
        ref = run(e, requests)
    # One prefill chunk takes every prompt (submitted together: `run`), so the rows decode side by side.
    with engine(model, "megakernel", max_batch=rows, prefill_chunk=2048) as e:
        mk = run(e, [(t, p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)) for t, p, _ in requests])
        s = e.native_stats()
    # 23 decode rows each, in fewer steps than one launch's rows would need: some steps took two.
    assert s["decode_rows"] == 23 * rows and STEP_MAX_ROWS * s["decode_steps"] < s["decode_rows"], s
    agreed = compare(f"{rows} rows", mk, ref, requests)
    assert agreed >= 10


@pytest.mark.parametrize("rows", [6, STEP_MAX_ROWS + 2])
def test_launch_ahead_agrees_with_synchronous_steps(model, rows):
    """With launch-ahead the megakernel backend queues each greedy step of up to one launch's rows
    behind the step before on the GPU, its tokens forwarded on the device (6 rows); a batch of two
    launches steps one at a time until no more than one launch's rows are left, then queues. Against
    synchronous steps (whose rows ask for log-probabilities, so they are not queued) the tokens agree
    until the first near-tie, as in `compare` (the prompts are submitted together, so both engines
    cut the same prefill chunks; submitted apart, every request of the 10-row batch can diverge early,
    at top-2 gaps past 0.5), while a token forwarded to the wrong row or position
    would diverge at once. Every row ends with exactly its max_tokens, the rows
    that end early (their last token known a step ahead) included."""
    greedy = [SamplingParams(max_tokens=30 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(rows)]
    prompts = [prompt(20 + 37 * i, 70 + i) for i in range(rows)]
    requests = [(0.0, p, params) for p, params in zip(prompts, greedy, strict=True)]
    with engine(model, "megakernel", max_batch=rows, prefill_chunk=2048, launch_ahead=False) as e:
        sync = run(e, [(0.0, p, dataclasses.replace(params, logprobs=2)) for _, p, params in requests])
    with engine(model, "megakernel", max_batch=rows, prefill_chunk=2048, launch_ahead=True) as e:
        ahead = run(e, requests)
    assert compare(f"launch-ahead, {rows} rows", ahead, sync, requests) >= 10 * rows


def test_a_sliced_prefill_beside_a_decoding_stream_agrees(model):
    """sliced_prefill on the megakernel backend (mk.prefill.packed.SlicedPrefill on CUDA): a 1,500-token
    prompt submitted once a stream decodes goes in chunks of 640 tokens (budget 128 x 5 layers), a
    layer an iteration, a decode step between (whole_chunk_tokens=0); both requests' tokens agree
    with the same engine cutting that prompt into 128-token chunks instead, until the first
    near-tie, as in `compare` (the two chunkings round differently in bf16). By default those
    chunks of 640 (within WHOLE_CHUNK_TOKENS) run whole, as graph replays: no slices, and the
    same agreement."""
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2) for n in (160, 12)]
    prompts = [prompt(20, 31), prompt(1500, 32)]

    async def main(e: Engine):
        async def rest(stream, events):
            events += [ev async for ev in stream]
            return [ev.token_id for ev in events if ev.token_id is not None], events[-1].finish_reason, events

        first = aiter(e.submit(prompts[0], params[0]))
        head = [await anext(first)]  # the stream decodes from here on
        second = aiter(e.submit(prompts[1], params[1]))
        return await asyncio.gather(rest(first, head), rest(second, []))

    options = {"prefill_chunk": 1024, "decode_prefill_budget": 128}
    with engine(model, "megakernel", sliced_prefill=False, **options) as e:
        plain = asyncio.run(main(e))
        assert e.native_stats()["prefill_slices"] == 0
    with engine(model, "megakernel", sliced_prefill=True, whole_chunk_tokens=0, **options) as e:
        sliced = asyncio.run(main(e))
        assert e.native_stats()["prefill_slices"] >= model.config.num_hidden_layers
    with engine(model, "megakernel", sliced_prefill=True, **options) as e:
        assert e.options.whole_chunk_tokens == WHOLE_CHUNK_TOKENS
        whole = asyncio.run(main(e))
        assert e.native_stats()["prefill_slices"] == 0
    requests = list(zip([0.0, 0.0], prompts, params, strict=True))
    assert compare("sliced prefill", sliced, plain, requests) >= 40
    assert compare("whole chunks beside the stream", whole, plain, requests) >= 40


def test_temperature_rows_draw_on_the_gpu_as_the_host_sampler_would(model):
    """Rows with a temperature alone (no top-k or top-p, no logprobs) are drawn by the kernel's
    sample tasks and queue with launch-ahead; asking for logprobs sends the same rows back to the
    host sampler, synchronously. The draw is the same function of the logits on both sides, so the
    tokens are equal wherever the logits are: one request at a time (a batch's composition and a
    prompt's prefill chunks change the logits by bf16 roundings, and a seeded draw at these flat
    logits flips on such a change within a few tokens, as a first try with six rows together did)."""
    hot = [SamplingParams(max_tokens=40, temperature=0.5 + 0.3 * i, seed=1000 + i, ignore_eos=True) for i in range(6)]
    prompts = [prompt(20 + 37 * i, 90 + i) for i in range(len(hot))]
    with engine(model, "megakernel", max_batch=1) as e:
        kernel = run(e, [(0.0, p, params) for p, params in zip(prompts, hot, strict=True)])
        queued = e.native_stats()["queued_steps"]
    with engine(model, "megakernel", max_batch=1) as e:
        host = run(
            e, [(0.0, p, dataclasses.replace(params, logprobs=0)) for p, params in zip(prompts, hot, strict=True)]
        )
        assert e.native_stats()["queued_steps"] == 0, "rows asking logprobs were queued"
    assert queued > 0, "no step with temperature rows was queued"
    for i, params in enumerate(hot):
        a, b = tokens_of(kernel[i]), tokens_of(host[i])
        assert a == b, f"request {i} (T = {params.temperature}): first difference at token {common(a, b)}"


def test_seeded_sampling_reproduces(model):
    seeded = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    p = prompt(90, 7)
    runs = []
    for _ in range(2):
        with engine(model, "megakernel") as e:
            runs.append(tokens_of(run(e, [(0, p, seeded)])[0]))
    assert runs[0] == runs[1], "the same seed on the same inputs drew different tokens"
    # In a batch with greedy neighbours the seeded row takes the host sampler on its own logits row.
    noise = [(0.01 * i, prompt(30 + 40 * i, 20 + i), SamplingParams(max_tokens=20, temperature=0.0)) for i in range(4)]
    with engine(model, "megakernel") as e:
        crowd = run(e, [*noise[:2], (0.0, p, seeded), *noise[2:]])
    with engine(model, "pytorch") as e:
        ref = tokens_of(run(e, [(0, p, seeded)])[0])
    in_batch = tokens_of(crowd[2])
    # The first token comes from the same PyTorch prefill and the same Philox draw on every backend.
    assert in_batch[0] == runs[0][0] == ref[0]
    print(
        f"seeded: alone and in a batch agree for {common(runs[0], in_batch)} of 32 tokens, "
        f"megakernel and PyTorch for {common(runs[0], ref)}"
    )


@pytest.mark.parametrize("env,options", [({"MK_TASK_UPLOAD": "full"}, {}), ({}, {"dealing": "balanced"})])
def test_host_side_variants_give_the_same_tokens(model, monkeypatch, env, options):
    """MK_TASK_UPLOAD=full (an environment variable) uploads the whole task array every step (by
    default only the attention bands a patched step changed); Engine(dealing="balanced") deals the
    tasks by the cost model. Neither may change a result: a lone greedy request (one batch shape
    throughout, so the same kernel arithmetic) decodes the same tokens with the same
    log-probabilities as by default, across pages and split changes."""
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, logprobs=0)
    p = prompt(100, 11)
    with engine(model, "megakernel") as e:
        default = run(e, [(0, p, params)])[0]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with engine(model, "megakernel", **options) as e:
        variant = run(e, [(0, p, params)])[0]
    assert tokens_of(variant) == tokens_of(default)
    assert [ev.logprob for ev in variant[2]] == [ev.logprob for ev in default[2]]


def test_constrained_requests_on_the_megakernel_follow_their_grammar(model):
    """Rows under a grammar sample on the host from their copied-back logits with the mask applied,
    beside free rows that the kernel samples (the embedded model's tokenizer: ids past its 16,384
    are never allowed); with `kernel_masks` the kernel draws them among their masks' tokens, and
    with `late_masks` too their steps are queued and the masks reach the running kernel through
    mapped memory; every token is the same."""
    import mk

    tok = Tokenizer.from_dir(Path(mk.__file__).parent / "embedded")
    word, answer = r"[a-z]{3,8}", r"(yes|no)"
    reqs = [
        (0, prompt(40, 1), SamplingParams(max_tokens=24, temperature=0.0, constraint=ConstraintSpec("regex", word))),
        (0, prompt(50, 2), SamplingParams(max_tokens=12, temperature=0.0)),
        (
            0,
            prompt(60, 3),
            SamplingParams(max_tokens=60, temperature=0.7, seed=4, constraint=ConstraintSpec("json_object")),
        ),
        (0, prompt(70, 4), SamplingParams(max_tokens=8, temperature=0.0, constraint=ConstraintSpec("regex", answer))),
    ]
    with engine(model, "megakernel", tokenizer_json=tok.hf.to_str(), kernel_masks=False) as e:
        results = run(e, reqs)
    with engine(model, "megakernel", tokenizer_json=tok.hf.to_str(), kernel_masks=True, late_masks=False) as e:
        on_gpu = run(e, reqs)
    assert [r[0] for r in on_gpu] == [r[0] for r in results], "the kernel's masked draws are the host's"
    with engine(model, "megakernel", tokenizer_json=tok.hf.to_str()) as e:  # late masks: the default
        assert e.options.late_masks
        late = run(e, reqs)
        queued = e.native_stats()["queued_steps"]
    assert [r[0] for r in late] == [r[0] for r in results], "masks delivered while the step runs draw the same"
    assert queued > 20, f"only {queued} steps were queued"
    texts = [b"".join(tok.token_bytes(t) for t in r[0] if t != model.config.eos_token_id).decode() for r in results]
    print("constrained outputs:", [(t, r[1]) for t, r in zip(texts, results, strict=True)])
    assert results[0][1] == "stop" and re.fullmatch(word, texts[0]), texts[0]
    assert len(results[1][0]) == 12  # the free row
    if results[2][1] == "stop":
        assert isinstance(json.loads(texts[2]), dict), texts[2]
    else:
        assert texts[2].startswith("{"), texts[2]
    assert results[3][1] == "stop" and re.fullmatch(answer, texts[3]), texts[3]
