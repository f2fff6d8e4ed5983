"""The Rust engine end to end over the tiny reference model on the CPU (float64, so a batch and a
lone sequence agree to the last bit that matters): greedy output equals a plain token-by-token
loop; staggered, mixed-length batches of 1, 3 and 8 equal solo runs; a tiny arena preempts and
changes nothing; a prefix-cache hit skips its prefill; seeded sampling ignores the neighbours;
cancellation frees blocks. Every engine must give back every KV block (the `engine` fixture)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
import torch

from mk.config import ModelConfig
from mk.engine.api import EngineClosed, EngineFull, PromptTooLong
from mk.engine.engine import Engine
from mk.engine.sampling import SamplingParams
from mk.model import PageAllocator, synthetic_weights
from mk.model.paged import pages_needed
from mk.model.reference import Model

MAX_CONTEXT = 320


@pytest.fixture(scope="module")
def model() -> Model:
    cfg = ModelConfig.tiny()
    # std 0.3: varied greedy text (at 0.1 it soon repeats one token, which hides KV mistakes).
    return Model(cfg, synthetic_weights(cfg, seed=0, dtype=torch.float64, std=0.3))


@pytest.fixture
def engine(model):
    """Makes engines; after the test each must be idle with its whole pool free again."""
    made: list[tuple[Engine, int]] = []

    def make(**options) -> Engine:
        options = {"max_context": MAX_CONTEXT, "prefill_chunk": 64, "check_invariants": True, **options}
        e = Engine(model, **options)
        made.append((e, e.native_stats()["kv_blocks_free"]))
        return e

    yield make
    for e, initial in made:
        deadline = time.monotonic() + 10
        while e.active_requests and time.monotonic() < deadline:
            time.sleep(0.01)
        s = e.native_stats()
        e.close()
        assert (s["running"], s["waiting"], s["kv_sequences"]) == (0, 0, 0)
        assert s["kv_blocks_free"] == initial == s["kv_blocks_total"], "KV blocks leaked"


def prompt(n: int, salt: int = 0) -> list[int]:
    return [3 + (i * 37 + salt * 101) % 500 for i in range(n)]


def reference_greedy(model: Model, tokens: list[int], max_tokens: int, stop=(), ignore_eos: bool = False):
    """A plain loop: one prefill, then one decode call per token; EOS (unless ignored), a stop
    token or max_tokens ends it. Returns the tokens and each one's log-probability."""
    cfg = model.config
    pages = pages_needed(len(tokens) + max_tokens)
    alloc = PageAllocator(cfg.num_hidden_layers * pages)
    kv = model.new_kv(alloc.num_free)
    table = alloc.new_table(cfg, pages)
    alloc.ensure(table, len(tokens))
    logits = model.forward(torch.tensor(tokens), 0, kv, table, last_only=True)[-1]
    out, logprobs = [], []
    while True:
        out.append(int(logits.argmax()))
        logprobs.append(float(torch.log_softmax(logits, -1)[out[-1]]))
        if len(out) == max_tokens or (out[-1] == cfg.eos_token_id and not ignore_eos) or out[-1] in stop:
            return out, logprobs
        pos = len(tokens) + len(out) - 1
        alloc.release_out_of_window(table, cfg, pos)
        alloc.ensure(table, pos + 1, from_pos=pos)
        logits = model.decode(torch.tensor(out[-1:]), torch.tensor([pos]), kv, [table])[0]


def common(a: list[int], b: list[int]) -> int:
    """Length of the common prefix."""
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def run(engine: Engine, requests: list[tuple[float, list[int], SamplingParams]]):
    """Submits request i after a delay of requests[i][0] s (those of no delay together, so that
    they start in the same iteration); returns (tokens, finish, events) each."""

    async def one(delay, tokens, params, stream=None):
        if stream is None:
            await asyncio.sleep(delay)
            stream = engine.submit(tokens, params)
        events = [e async for e in stream]
        return [e.token_id for e in events if e.token_id is not None], events[-1].finish_reason, events

    async def main():
        with engine.together():
            streams = [engine.submit(t, p) if delay == 0 else None for delay, t, p in requests]
        return await asyncio.gather(*(one(*r, s) for r, s in zip(requests, streams, strict=True)))

    return asyncio.run(main())


def test_requests_submitted_together_start_in_the_same_iteration(engine):
    """Engine.together: requests submitted in the block, with pauses in which the loop would have
    started each alone, share one prefill iteration and every decode step; a cancel inside the
    block acts at once."""
    e = engine(max_batch=4)
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)

    async def main():
        with e.together():
            streams = []
            for i in range(4):
                streams.append(e.submit(prompt(8 + 5 * i, i), params))
                await asyncio.sleep(0.05)
            streams[3].cancel()
            cancelled = [ev async for ev in streams.pop()]
            assert e.native_stats()["prefill_chunks"] == 0
        return cancelled, [[ev async for ev in s] for s in streams]

    cancelled, results = asyncio.run(main())
    assert [ev.finish_reason for ev in cancelled] == ["cancelled"]
    assert all(len([ev for ev in r if ev.token_id is not None]) == 9 for r in results)
    s = e.native_stats()
    assert (s["decode_steps"], s["decode_rows"]) == (8, 24), s


GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


def test_greedy_matches_a_token_by_token_reference_loop(model, engine):
    prompts = [prompt(5), prompt(70, 1), prompt(130, 2)]  # inside a page, across pages and the window
    e = engine(max_batch=4)
    params = dataclasses.replace(GREEDY, logprobs=0)
    results = run(e, [(0, p, params) for p in prompts])
    for p, (tokens, finish, events) in zip(prompts, results, strict=True):
        want, logprobs = reference_greedy(model, p, GREEDY.max_tokens)
        assert tokens == want
        # Log-probabilities see every K/V the step read: a wrong page would show here first.
        assert [e.logprob for e in events] == pytest.approx(logprobs, abs=1e-5)  # float32 logits
        assert finish == ("stop" if want[-1] == model.config.eos_token_id else "length")
    # A stop token ends the stream on that token with "stop".
    want, _ = reference_greedy(model, prompts[1], GREEDY.max_tokens)
    stop = want[5]
    tokens, finish, _ = run(e, [(0, prompts[1], dataclasses.replace(GREEDY, stop_token_ids=[stop]))])[0]
    assert (tokens, finish) == (want[: want.index(stop) + 1], "stop")


def test_packed_prefill_path_gives_the_reference_tokens(model, engine):
    """`prefill="packed"` sends each Rust chunk through mk.prefill.packed (on the CPU: SDPA and the expert loop);
    prompts of several chunks, crossing pages and the sliding window, decode as the reference does."""
    e = engine(max_batch=4, prefill="packed")
    assert e.options.prefill == "packed" and engine(max_batch=1).options.prefill == "plain"  # auto on the CPU
    prompts = [prompt(5, 3), prompt(130, 4), prompt(200, 5)]
    params = dataclasses.replace(GREEDY, logprobs=0)
    packed, calls = e._runner.packed_prefill, []
    e._runner.packed_prefill = lambda requests, kv: (
        calls.append([len(r.tokens) for r in requests]) or packed(requests, kv)
    )
    try:
        results = run(e, [(0, p, params) for p in prompts])
    finally:
        e._runner.packed_prefill = packed
    # Every prompt token, in calls of at most one chunk (64 tokens) over all sequences; arriving
    # together, the prompts share calls (packed).
    assert sum(map(sum, calls)) == sum(map(len, prompts)) and max(map(sum, calls)) <= 64
    assert any(len(c) > 1 for c in calls), calls
    for p, (tokens, _, events) in zip(prompts, results, strict=True):
        want, logprobs = reference_greedy(model, p, GREEDY.max_tokens)
        assert tokens == want
        assert [e.logprob for e in events] == pytest.approx(logprobs, abs=1e-5)


def test_the_fresh_prompt_pass_gives_the_reference_tokens_and_close_releases_it(model, engine):
    """`prefill_graphs=True` on the CPU runs a fresh prompt's static, padded pass eagerly (what a
    GPU captures as a CUDA graph); the tokens are the reference's, and closing the engine drops
    the pass's buffers (on a GPU: the graphs and the memory they keep)."""
    e = engine(max_batch=2, prefill="packed", prefill_graphs=True)
    fresh = e._runner.packed_prefill.fresh
    assert fresh is not None and not e.options.prefill_graphs  # nothing to capture on the CPU
    p = prompt(40, 6)
    [(tokens, _, _)] = run(e, [(0, p, GREEDY)])
    assert tokens == reference_greedy(model, p, GREEDY.max_tokens)[0]
    assert fresh._buckets, "the fresh prompt took the static pass"
    e.close()
    assert not fresh._buckets


def test_the_prefixed_chunk_pass_gives_the_reference_tokens_and_close_releases_it(model, engine):
    """`prefix_graphs=True` on the CPU runs a long prompt's chunks after the first (a cached prefix)
    through their static, padded pass eagerly (what a GPU captures): the tokens are the reference's,
    and closing the engine drops the pass's buffers."""
    e = engine(max_batch=2, prefill="packed", prefill_chunk=256, prefix_graphs=True)
    prefixed = e._runner.packed_prefill.prefixed
    assert prefixed is not None
    p = prompt(280, 7)  # chunks of 256 and 24 tokens, the second after a cached prefix
    [(tokens, _, _)] = run(e, [(0, p, GREEDY)])
    assert tokens == reference_greedy(model, p, GREEDY.max_tokens)[0]
    assert list(prefixed._buckets) == [(256, 2048)], "the second chunk took the static pass"
    e.close()
    assert not prefixed._buckets


def test_next_turns_arriving_together_share_one_static_pass_and_give_the_reference_tokens(model, engine):
    """Three conversations, then their next turns submitted together: the engine's one prefill call
    holds the three chunks after their cached prefixes (from the prefix cache, not page-aligned
    at the end), and `prefix_graphs=True` on the CPU runs them as one packed static pass, eagerly
    (what a GPU replays as one graph); each conversation's tokens are the reference's."""
    e = engine(max_batch=4, prefill="packed", prefill_chunk=256, prefix_graphs=True)
    prefixed = e._runner.packed_prefill.prefixed
    histories = [prompt(70 + 30 * i, 20 + i) for i in range(3)]
    run(e, [(0, h, GREEDY) for h in histories])
    turns = [h + prompt(15 + 5 * i, 30 + i) for i, h in enumerate(histories)]
    calls = []
    run_pass = prefixed._run
    prefixed._run = lambda b, kv: calls.append(b.n) or run_pass(b, kv)
    hits = e.native_stats()["prefix_hit_tokens"]
    results = run(e, [(0, t, GREEDY) for t in turns])
    assert e.native_stats()["prefix_hit_tokens"] - hits >= 64 * 3, "the histories came from the prefix cache"
    assert calls == [256], f"one packed pass of the three next turns: {calls}"
    for t, (tokens, _, _) in zip(turns, results, strict=True):
        assert tokens == reference_greedy(model, t, GREEDY.max_tokens)[0]


def test_a_failing_prefill_ends_only_its_own_request(model, engine):
    """The runner raises on one of three prompts that arrive together (one packed call): the packed
    call fails, each prompt is retried alone, and only the bad one ends with an error."""
    e = engine(max_batch=4)
    packed, calls = e._runner.prefill, []

    def prefill(pieces, dirty):
        poisoned = any(POISON in tokens for _, tokens, _, _ in pieces)
        calls.append((len(pieces), poisoned))
        if len(calls) == 1:
            time.sleep(0.3)  # the other prompts arrive meanwhile and are packed into the next call
        if poisoned:
            raise RuntimeError("poisoned prompt")
        return packed(pieces, dirty)

    e._runner.prefill = prefill
    prompts = [prompt(20, 1), [POISON, *prompt(19, 2)], prompt(20, 3)]
    results = run(e, [(0.05 * bool(i), p, GREEDY) for i, p in enumerate(prompts)])
    assert [finish for _, finish, _ in results] == ["length", "error", "length"]
    for p, (tokens, _, _) in zip(prompts[::2], results[::2], strict=True):
        assert tokens == reference_greedy(model, p, GREEDY.max_tokens)[0]
    # The failed packed call is followed by one call per chunk it held.
    failed = next(i for i, (n, poisoned) in enumerate(calls) if poisoned and n > 1)
    n = calls[failed][0]
    assert [size for size, _ in calls[failed + 1 : failed + 1 + n]] == [1] * n, calls


POISON = 2  # a token id the prompts above never use


def test_unknown_prefill_mode_is_refused(model):
    with pytest.raises(ValueError, match="prefill must be"):
        Engine(model, prefill="flash")


def admitted_beside_a_stream(e: Engine, stat: str) -> tuple[list[list[int]], int]:
    """A 150-token prompt submitted once a 200-token greedy stream decodes: both requests' tokens,
    and the engine's counter `stat` at the end."""
    greedy = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def main():
        first = aiter(e.submit(prompt(10), greedy))
        events = [await anext(first)]  # a token: the first stream decodes from here on
        second = e.submit(prompt(150, 1), dataclasses.replace(greedy, max_tokens=5))
        events += [ev async for ev in first]
        later = [ev async for ev in second]
        return [[ev.token_id for ev in evs if ev.token_id is not None] for evs in (events, later)]

    tokens = asyncio.run(main())
    return tokens, e.native_stats()[stat]


def test_a_smaller_prefill_budget_while_streams_decode_changes_no_token(model, engine):
    """decode_prefill_budget cuts a prompt admitted beside a decoding stream into more, smaller chunks
    (rust/engine/proptests.rs checks the budget per call); both requests' tokens are what a default
    engine gives, and a budget below 1 is refused."""
    runs = [admitted_beside_a_stream(engine(decode_prefill_budget=b), "prefill_chunks") for b in (None, 8)]
    assert runs[0][0] == runs[1][0]
    assert runs[1][1] >= runs[0][1] + 10, f"the budget did not cut the long prompt finer: {runs[0][1]}, {runs[1][1]}"
    for bad in (0, -1):
        with pytest.raises(ValueError, match="decode_prefill_budget must be at least 1"):
            Engine(model, max_context=256, decode_prefill_budget=bad)


def test_a_sliced_prefill_changes_no_token(model, engine):
    """sliced_prefill runs a prompt admitted beside a decoding stream in chunks of up to 24 tokens
    (budget 8 x 3 layers) instead of 8, a layer an iteration (rust/engine/tests.rs checks the slices
    and the budget): both requests' tokens are
    what an engine without it gives, the prompt went in slices, and without the packed prefill or a
    budget the option is refused."""
    whole = admitted_beside_a_stream(engine(prefill="packed"), "prefill_slices")
    sliced = admitted_beside_a_stream(
        engine(prefill="packed", decode_prefill_budget=8, sliced_prefill=True), "prefill_slices"
    )
    assert whole[0] == sliced[0]
    assert whole[1] == 0 and sliced[1] >= model.config.num_hidden_layers, (whole[1], sliced[1])
    with pytest.raises(ValueError, match="sliced_prefill needs"):
        Engine(model, max_context=256, sliced_prefill=True, prefill="plain", decode_prefill_budget=8)


def test_sliced_prefill_and_its_budget_default_to_on_only_where_the_packed_prefill_runs_on_a_gpu(model):
    """On the CPU (plain prefill, or the packed one asked for) the defaults stay off: whole
    chunks. Asked for, sliced prefill takes DECODE_PREFILL_BUDGET (at most the chunk)."""
    from mk.engine.options import DECODE_PREFILL_BUDGET

    def settings(**options):
        e = Engine(model, max_context=256, **options)
        try:
            return e.options.sliced_prefill, e.options.decode_prefill_budget
        finally:
            e.close()

    assert settings(prefill_chunk=64) == (False, 64)
    assert settings(prefill="packed", prefill_chunk=64) == (False, 64)
    assert settings(prefill="packed", prefill_chunk=4096, sliced_prefill=True) == (True, DECODE_PREFILL_BUDGET)
    assert settings(prefill="packed", prefill_chunk=64, sliced_prefill=True) == (True, 64)
    assert settings(prefill="packed", decode_prefill_budget=8, sliced_prefill=True) == (True, 8)


def test_late_masks_need_the_kernels_masks(model):
    # (what they do is the megakernel's: rust/engine/tests.rs and the engine's GPU tests)
    with pytest.raises(ValueError, match="late_masks needs kernel_masks"):
        Engine(model, max_context=256, late_masks=True)
    # By default, on only where the kernel draws masked rows and steps launch ahead.
    assert Engine(model, max_context=256).options.late_masks is False


def test_an_engine_that_fails_to_start_drops_its_prefill_graphs(model, monkeypatch):
    """When the native engine refuses its settings after the runner's warm-up (which captures the
    prefill's CUDA graphs on a GPU), the graphs are released at once, not left to the garbage
    collector (which could free them during another engine's capture)."""
    import mk
    from mk.engine.runner import PrefillRunner
    from mk.text.tokenizer import Tokenizer

    released = []
    monkeypatch.setattr(PrefillRunner, "release_graphs", lambda self: released.append(self))
    tok = Tokenizer.from_dir(Path(mk.__file__).parent / "embedded")  # 16,384 tokens: the model has 512
    with pytest.raises(ValueError, match="tokenizer_json"):
        Engine(model, max_context=256, tokenizer_json=tok.hf.to_str())
    assert len(released) == 1


def test_the_cpu_runner_runs_short_calls_on_one_thread(model, monkeypatch):
    """On the CPU, decode steps and prefill calls of fewer than mk.engine.runner.SERIAL_TOKENS tokens run on
    one intra-op thread (the loop thread's OpenMP workers sleep between a step's small ops), longer
    calls on the threads set, and the count set comes back after every call, one that raises too."""
    import mk.engine.runner
    from mk.engine.runner import PytorchRunner

    seen: list[tuple[str, int]] = []

    def spy(name, real):
        def call(self, *args, **kwargs):
            seen.append((name, torch.get_num_threads()))
            if args[0].numel() == 3:  # (the call that fails)
                raise RuntimeError("the model failed")
            return real(self, *args, **kwargs)

        return call

    monkeypatch.setattr(Model, "decode", spy("decode", Model.decode))
    monkeypatch.setattr(Model, "forward", spy("forward", Model.forward))
    monkeypatch.setattr(mk.engine.runner, "SERIAL_TOKENS", 8)
    layers = model.config.num_hidden_layers
    runner = PytorchRunner(model, 4 * layers, 2, 256)
    table = torch.full((layers, runner.max_pages), -1, dtype=torch.int32)
    table[:, 0] = torch.arange(layers, dtype=torch.int32)
    dirty = [(0, table.numpy().tobytes())]
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runner.prefill([(0, prompt(12), 0, False)], dirty)  # 12 tokens: past the limit
        runner.prefill([(0, prompt(4), 12, True)], [])
        runner.decode([0], [5], [16], [])
        with pytest.raises(RuntimeError, match="the model failed"):
            runner.prefill([(0, prompt(3), 17, True)], [])
        assert torch.get_num_threads() == 2, "the count set comes back after a call that raised"
    finally:
        torch.set_num_threads(before)
    assert seen == [("forward", 2), ("forward", 1), ("decode", 1), ("forward", 1)]


def test_the_warm_up_runs_a_chunk_after_a_cached_prefix(model, monkeypatch):
    """The prefill's warm-up compiles every shape a server meets before its first request: fresh
    prompts (as many keys as rows), two packed ones, and a chunk after a cached prefix (more keys
    than rows: unseen, its compilation would stall the first long prompt's admission for seconds),
    all on scratch blocks (for the prefixed chunk, five pages a layer)."""
    import mk.engine.runner
    from mk.engine.runner import PytorchRunner
    from mk.prefill.packed import Prefill

    calls = []
    real = Prefill.__call__

    def spy(self, requests, kv, *args, **kwargs):
        calls.append([(len(r.tokens), r.start, r.block_table.clone()) for r in requests])
        return real(self, requests, kv, *args, **kwargs)

    class Bar:  # the progress bar, as on a terminal
        def __init__(self, total: int, disable=False, **kwargs) -> None:
            assert disable is None, "a bar where stderr is a terminal (tqdm's disable=None)"
            self.total, self.n, self.disable = total, 0, False
            bars.append(self)

        def update(self, n: int = 1) -> None:
            self.n += n

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            pass

    bars: list[Bar] = []
    monkeypatch.setattr(Prefill, "__call__", spy)
    monkeypatch.setattr(mk.engine.runner, "tqdm", Bar)
    layers = model.config.num_hidden_layers
    runner = PytorchRunner(model, 5 * layers, 2, 512, packed_prefill=Prefill(model, chunk=256))
    runner.warm_up()
    assert [(b.total, b.n) for b in bars] == [(len(calls), len(calls))], "the bar counts every pass once"
    starts = [[(n, start) for n, start, _ in call] for call in calls]
    assert [(16, 0)] in starts and [(16, 0), (32, 0)] in starts
    assert [(16, 256)] in starts  # 272 keys: 3 flex blocks of 128, its rows 2
    for call in calls:
        for n, start, table in call:
            mapped = table[:, : -(-(start + n) // 64)]
            assert int(mapped.min()) >= 0 and int(table.max()) < 5 * layers
            assert len(set(mapped.flatten().tolist())) == mapped.numel()  # distinct blocks


@pytest.fixture(scope="module")
def workload(model):
    """Eight requests of mixed lengths (greedy and seeded) and what each produces alone."""
    reqs = []
    for i in range(8):
        if i % 3 == 2:
            params = SamplingParams(max_tokens=10 + i, temperature=0.9, top_p=0.95, top_k=40, seed=100 + i)
        else:
            params = SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=i % 2 == 0)
        reqs.append((prompt(1 + (i * 41) % 180, i), params))
    solo = Engine(model, max_batch=1, max_context=MAX_CONTEXT, prefill_chunk=64)
    alone = [run(solo, [(0, p, params)])[0][0] for p, params in reqs]
    solo.close()
    for (p, params), out in zip(reqs, alone, strict=True):
        if params.greedy:
            assert out == reference_greedy(model, p, params.max_tokens, ignore_eos=params.ignore_eos)[0]
    return reqs, alone


@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_staggered_mixed_batches_equal_solo_runs(engine, workload, max_batch):
    reqs, alone = workload
    e = engine(max_batch=max_batch)
    results = run(e, [(0.004 * (i % 4), p, params) for i, (p, params) in enumerate(reqs)])
    assert [r[0] for r in results] == alone
    assert e.stats().preemptions == 0


def test_a_tiny_arena_preempts_and_changes_nothing(model, engine):
    # 256 tokens in 64-token chunks need 2·4 + 3·4 = 20 blocks to prefill; a 140-token sequence
    # holds 2·3 + 3·3 = 15 blocks, so 28 blocks serve one or two of these six at a time.
    e = engine(max_batch=6, max_context=256, kv_blocks=28)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    prompts = [prompt(40, i) for i in range(6)]
    results = run(e, [(0, p, params) for p in prompts])
    for p, (tokens, finish, _) in zip(prompts, results, strict=True):
        assert tokens == reference_greedy(model, p, 100, ignore_eos=True)[0]
        assert finish == "length"
    s = e.stats()
    assert s.preemptions > 0
    assert s.generated_tokens == 600
    assert s.prefill_tokens > s.prompt_tokens  # recomputation, never re-emission


def test_a_prefix_cache_hit_skips_its_prefill(engine):
    e = engine(max_batch=2)
    p = prompt(150, 9)
    first = run(e, [(0, p, GREEDY)])[0]
    before = e.stats()
    second = run(e, [(0, p, GREEDY)])[0]
    after = e.stats()
    assert second[0] == first[0]
    assert first[2][0].cached_tokens == 0
    assert second[2][0].cached_tokens == 128  # two full pages; the last token's page is recomputed
    assert after.prefill_tokens - before.prefill_tokens == 150 - 128
    assert after.prefix_cache_hits == before.prefix_cache_hits + 1


def test_seeded_sampling_ignores_the_rest_of_the_batch(engine):
    params = SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    e = engine(max_batch=8)
    alone = run(e, [(0, prompt(33), params)])[0][0]
    noise = [(0.002 * i, prompt(10 + 20 * i, i), SamplingParams(max_tokens=15, temperature=1.0)) for i in range(5)]
    crowd = run(e, [*noise[:3], (0.001, prompt(33), params), *noise[3:]])
    assert crowd[3][0] == alone
    other = run(e, [(0, prompt(33), dataclasses.replace(params, seed=8))])[0][0]
    assert other != alone


def test_logprobs_are_log_softmax_of_the_models_logits(model, engine):
    e = engine()
    p = prompt(20, 3)
    (tokens, _, events) = run(e, [(0, p, SamplingParams(max_tokens=3, temperature=0.0, logprobs=4))])[0]
    logits = model.logits(torch.tensor(p + tokens[:2]))
    for i, event in enumerate(events):
        lp = torch.log_softmax(logits[len(p) - 1 + i], -1)
        assert event.logprob == pytest.approx(float(lp[event.token_id]), abs=1e-5)
        values, ids = torch.topk(lp, 4)
        assert [t for t, _ in event.top_logprobs] == ids.tolist()
        assert [v for _, v in event.top_logprobs] == pytest.approx(values.tolist(), abs=1e-5)


def test_cancellation_frees_blocks_within_a_step(engine):
    e = engine(max_batch=2)

    async def main():
        stream = e.submit(prompt(100), SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        got = []
        async for event in stream:
            got.append(event)
            if len(got) == 3:
                stream.cancel()
        return got

    events = asyncio.run(main())
    assert events[-1].finish_reason == "cancelled" and events[-1].token_id is None
    assert len(events) < 10  # at most a step or two between cancel() and its effect
    s = e.native_stats()  # published before the cancelled event was delivered
    assert s["kv_sequences"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"]


def test_leaving_a_stream_early_cancels_it(engine):
    e = engine(max_batch=2)

    async def main():
        stream = e.submit(prompt(10), SamplingParams(max_tokens=250, temperature=0.0, ignore_eos=True))
        async for _ in stream:
            break
        for _ in range(500):
            if not e.active_requests:
                return True
            await asyncio.sleep(0.01)
        return False

    assert asyncio.run(main())


def test_submission_errors(engine):
    e = engine(max_batch=1, max_waiting=1)
    with pytest.raises(PromptTooLong, match="300 tokens and max_tokens asks for 21 more") as too_long:
        e.submit_callback(prompt(300), SamplingParams(max_tokens=21), print)
    refused = too_long.value
    assert (refused.prompt_tokens, refused.max_tokens, refused.max_context) == (300, 21, MAX_CONTEXT)
    with pytest.raises(ValueError, match="no tokens"):
        e.submit_callback([], GREEDY, print)
    with pytest.raises(ValueError, match="vocabulary"):
        e.submit_callback([3, 600], GREEDY, print)
    # One running (max_batch 1) and one waiting fill it; a third is refused.
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    streams = []
    with pytest.raises(EngineFull):
        for i in range(3):
            streams.append(e.submit_callback(prompt(5, i), long, lambda ev: None))
            time.sleep(0.05)
    for s in streams:
        s.cancel()


def test_drain_finishes_or_cancels_then_refuses(engine):
    e = engine(max_batch=2)

    async def last(stream):
        return [event async for event in stream][-1].finish_reason

    async def main():
        short = e.submit(prompt(8), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        long = e.submit(prompt(8, 1), SamplingParams(max_tokens=280, temperature=0.0, ignore_eos=True))
        ends = asyncio.gather(last(short), last(long))
        await e.drain(0.2)
        with pytest.raises(EngineClosed):
            e.submit(prompt(3), GREEDY)
        return await ends

    assert asyncio.run(main()) == ["length", "cancelled"]


def test_many_concurrent_streams_share_one_pump(engine):
    e = engine(max_batch=8)
    reqs = [
        (0.001 * i, prompt(3 + i, i), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)) for i in range(24)
    ]
    results = run(e, reqs)
    assert all(len(tokens) == 6 and finish == "length" for tokens, finish, _ in results)
    assert e.stats().generated_tokens == 24 * 6


def test_cpu_defaults_prefill_in_small_chunks_one_step_at_a_time(model):
    from mk.engine.options import CPU_MAX_BATCH, CPU_PREFILL_CHUNK

    e = Engine(model, max_context=MAX_CONTEXT)
    try:
        assert (
            e.options.prefill_chunk == CPU_PREFILL_CHUNK
            and not e.options.launch_ahead
            and e.options.backend == "pytorch"
        )
        assert e.max_batch == CPU_MAX_BATCH
        assert e.native_stats()["kv_blocks_free"] > 0
    finally:
        e.close()


def test_launch_ahead_streams_equal_synchronous_steps(model, engine, workload):
    """Launch-ahead asked of the PyTorch backend, which cannot queue a step, so each step runs at
    once (rust/engine/tests.rs runs the queued path over a mock that queues): the same tokens,
    finish reasons and logprobs as synchronous steps, the same usage, and the pool comes back whole
    (the fixture)."""
    reqs, alone = workload
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    stop_at = reference_greedy(model, prompt(25, 5), 12, ignore_eos=True)[0][4]
    extra = [
        (prompt(20, 3), SamplingParams(max_tokens=6, temperature=0.0, logprobs=3)),
        (prompt(25, 5), dataclasses.replace(greedy, stop_token_ids=[stop_at])),
        (prompt(30, 6), SamplingParams(max_tokens=9, temperature=0.7, seed=3, logprobs=1)),
    ]
    jobs = [(0.004 * (i % 4), p, params) for i, (p, params) in enumerate(reqs + extra)]
    sync, ahead = engine(max_batch=4), engine(max_batch=4, launch_ahead=True)
    assert not sync.options.launch_ahead and ahead.options.launch_ahead  # the default is off with the PyTorch backend
    want, got = run(sync, jobs), run(ahead, jobs)
    assert [r[0] for r in got[: len(reqs)]] == alone
    for (w_tokens, w_finish, w_events), (tokens, finish, events) in zip(want, got, strict=True):
        assert (tokens, finish) == (w_tokens, w_finish)
        assert [e.logprob for e in events] == pytest.approx([e.logprob for e in w_events], abs=1e-9)
        assert [[t for t, _ in e.top_logprobs or []] for e in events] == [
            [t for t, _ in e.top_logprobs or []] for e in w_events
        ]
    assert got[len(reqs) + 1][0][-1] == stop_at and got[len(reqs) + 1][1] == "stop"
    assert ahead.stats().generated_tokens == sync.stats().generated_tokens == sum(len(r[0]) for r in got)


def test_a_grammar_compiled_while_a_request_is_prepared_is_followed_and_a_bad_one_reported_at_submit():
    """The server compiles a request's grammar on a preparing thread (`prepare_constraint`), off its
    event loop; the submission then follows it, and one that does not compile is still refused at
    submission, naming its field."""
    import queue
    import threading

    from mk.engine.sampling import ConstraintSpec, SamplingError
    from mk.llm import default_model

    model, tok = default_model()
    with Engine(model, max_context=512, tokenizer_json=tok.hf.to_str()) as engine:
        spec = ConstraintSpec("regex", "(yes|no)!", origin="guided_regex")
        preparing = threading.Thread(target=engine.prepare_constraint, args=(spec,))
        preparing.start()
        preparing.join()
        events: queue.SimpleQueue = queue.SimpleQueue()
        params = SamplingParams(max_tokens=8, temperature=0.0, constraint=spec)
        engine.submit_callback(tok.encode("Answer:"), params, events.put)
        tokens = []
        while True:
            event = events.get(timeout=60)
            tokens += [] if event.token_id in (None, model.config.eos_token_id) else [event.token_id]
            if event.finish_reason is not None:
                break
        assert event.finish_reason == "stop" and tok.decode(tokens) in ("yes!", "no!"), (event, tokens)
        bad = ConstraintSpec("regex", "(", origin="guided_regex")
        engine.prepare_constraint(bad)  # (left for the submission to report)
        with pytest.raises(SamplingError) as refused:
            engine.submit_callback(tok.encode("x"), SamplingParams(max_tokens=2, constraint=bad), events.put)
        assert refused.value.field == "guided_regex"
