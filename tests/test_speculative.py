"""Speculative decoding's verification rows on the reference model (CPU, float64): a sequence's
next token and its draft verified in one call give the logits of decoding them one step at a
time, beside sequences without a draft; and the longest-prefix acceptance over such calls yields
exactly the tokens of plain greedy decoding, whatever share of the drafts is right (the drafts
here come from a recorded plain run, so which are right is controlled).

Then the engine's (`Engine(speculative=...)`): the PyTorch runner verifies a step's repeated
rows as one-token steps would decode them, and the built-in model (float64, where a step's row
count cannot flip a greedy choice) gives the same text, tokens, finish reasons and logprobs with
drafts and without, greedy and seeded, with stop strings, stop tokens and short max_tokens, beside
grammar-held requests (which do not draft) and through preemption; the counters say drafts ran."""

from __future__ import annotations

import os
import time

import pytest
import torch

import mk
from mk import _native
from mk.config import ModelConfig
from mk.engine.api import EngineStats
from mk.engine.engine import Engine
from mk.engine.options import AUTO_ON_OFF, EngineOptions
from mk.engine.runner import PytorchRunner
from mk.engine.sampling import ConstraintSpec, SamplingParams
from mk.model.names import expected_shapes
from mk.model.paged import PageAllocator
from mk.model.reference import Model

torch.set_num_threads(1)

SEED = int(os.environ.get("MK_TEST_SEED", str(int.from_bytes(os.urandom(4), "little") % 2**31)))
CFG = ModelConfig.tiny()
MAX_PAGES = 8
BLOCKS = 128


def make_model() -> Model:
    g = torch.Generator().manual_seed(SEED)
    weights = {}
    for name, shape in expected_shapes(CFG).items():
        base = 1.0 if name.endswith("norm.weight") else 0.0
        std = 0.3 if any(k in name for k in ("q_proj", "k_proj", "mlp.gate.weight")) else 0.1
        weights[name] = (base + std * torch.randn(shape, generator=g)).to(torch.float64)
    return Model(CFG, weights)


def tokens_of(n: int, salt: int) -> list[int]:
    g = torch.Generator().manual_seed(SEED + salt)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


class Stream:
    """One sequence over a shared pool: prefilled, then driven a step at a time or verified."""

    def __init__(self, model: Model, kv, alloc: PageAllocator, prompt: list[int]):
        self.model, self.kv, self.alloc = model, kv, alloc
        self.table = alloc.new_table(CFG, MAX_PAGES)
        alloc.ensure(self.table, len(prompt) - 1)
        if len(prompt) > 1:
            model.forward(torch.tensor(prompt[:-1]), 0, kv, self.table)
        self.pos, self.next = len(prompt) - 1, prompt[-1]  # the token whose row comes next

    def rows(self, draft: list[int]) -> tuple[list[int], int, torch.Tensor]:
        self.alloc.ensure(self.table, self.pos + 1 + len(draft), from_pos=self.pos)
        return [self.next, *draft], self.pos, self.table


def test_verification_rows_equal_steps_of_one_token_beside_plain_rows():
    model = make_model()
    kv, alloc = model.new_kv(BLOCKS), PageAllocator(BLOCKS, seed=SEED)
    # Drafts of 0, 3 and 6 tokens after prompts whose rows cross a page boundary (at 64) and the
    # sliding window.
    prompts = [tokens_of(n, salt=i) for i, n in enumerate([40, 62, 200])]
    drafts = [[], tokens_of(3, salt=10), tokens_of(6, salt=11)]
    streams = [Stream(model, kv, alloc, p) for p in prompts]
    before = kv.k.clone(), kv.v.clone()
    got = model.verify([s.rows(d) for s, d in zip(streams, drafts, strict=True)], kv)
    assert got.shape == (sum(len(d) + 1 for d in drafts), CFG.vocab_size)
    row = 0
    for s, draft in zip(streams, drafts, strict=True):
        alone = model.new_kv(BLOCKS)
        alone.k.copy_(before[0])
        alone.v.copy_(before[1])
        for j, token in enumerate([s.next, *draft]):
            want = model.decode(torch.tensor([token]), torch.tensor([s.pos + j]), alone, [s.table])[0]
            err = float((got[row] - want).abs().max() / want.abs().max())
            assert err < 1e-12, f"seed {SEED}: sequence at {s.pos}, row {j}: {err:.2e}"
            row += 1


def test_verify_refuses_a_sequence_twice_or_empty():
    model = make_model()
    kv, alloc = model.new_kv(BLOCKS), PageAllocator(BLOCKS, seed=SEED)
    s = Stream(model, kv, alloc, tokens_of(10, salt=0))
    with pytest.raises(ValueError, match="appears twice"):
        model.verify([s.rows([1]), s.rows([2])], kv)
    with pytest.raises(ValueError, match="at least one token"):
        model.verify([([], 0, s.table)], kv)


def accepted(draft: list[int], drawn: list[int]) -> int:
    """The longest prefix of `draft` that the rows drew (rust/speculative/verify.rs's rule)."""
    n = 0
    while n < len(draft) and draft[n] == drawn[n]:
        n += 1
    return n


def plain_greedy(model: Model, prompt: list[int], n: int) -> list[int]:
    kv, alloc = model.new_kv(BLOCKS), PageAllocator(BLOCKS, seed=SEED)
    s, out = Stream(model, kv, alloc, prompt), []
    while len(out) < n:
        logits = model.verify([s.rows([])], kv)
        s.pos, s.next = s.pos + 1, int(logits[0].argmax())
        out.append(s.next)
    return out


@pytest.mark.parametrize("right", [0, 1, 3, 4], ids=lambda r: f"{r}-of-4-right")
def test_greedy_speculation_yields_the_plain_tokens(right):
    """Drafts of 4 whose first `right` tokens are the plain run's (the rest wrong): every step
    gains right + 1 tokens, and the tokens are the plain run's."""
    model = make_model()
    prompt, n, k = tokens_of(50, salt=0), 30, 4
    want = plain_greedy(model, prompt, n)
    kv, alloc = model.new_kv(BLOCKS), PageAllocator(BLOCKS, seed=SEED)
    s, out, steps = Stream(model, kv, alloc, prompt), [], 0
    while len(out) < n:
        truth = want[len(out) : len(out) + k]
        draft = truth[:right] + [(t + 1) % CFG.vocab_size for t in truth[right:]]
        logits = model.verify([s.rows(draft)], kv)
        drawn = [int(x) for x in logits.argmax(dim=-1)]
        a = accepted(draft, drawn)
        assert a == min(right, len(truth)), f"seed {SEED}: step {steps} accepted {a}"
        gained = drawn[: a + 1]
        out += gained
        s.pos, s.next = s.pos + len(gained), gained[-1]
        steps += 1
    assert out[:n] == want, f"seed {SEED}"
    assert steps == -(-n // (right + 1))


def test_the_drafter_copies_from_the_text_and_follows_what_was_accepted():
    """mk._native.Speculator: a draft is what followed the latest earlier occurrence of the text's
    longest recurring suffix; after a step it drafts from the text with the gained tokens."""
    speculator = _native.Speculator([5, 6, 7, 8, 9, 5, 6, 7])
    assert speculator.draft(_native.MAX_DRAFT)[:2] == [8, 9]
    assert speculator.draft(1) == [8]
    speculator.advance(2, [8, 9, 5])
    assert speculator.draft(2) == [6, 7]
    with pytest.raises(ValueError, match="gains 1 to drafted"):
        speculator.advance(1, [1, 2, 3])
    assert _native.Speculator([1, 2, 3]).draft(4) == []


# ---- the engine's option ------------------------------------------------------------------------


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("backend", ["pytorch", "megakernel"])
def test_the_option_maps_to_a_draft_limit(cuda, backend):
    def limit(speculative):
        return EngineOptions(speculative=speculative).resolved(cuda=cuda, backend=backend).max_draft

    assert limit(True) == _native.MAX_DRAFT
    assert limit(False) == 0
    assert limit(None) == (_native.MAX_DRAFT if backend == "megakernel" else 0)  # auto: with the megakernel


def test_an_engine_refuses_an_unknown_mode_before_it_builds_anything():
    for bad in ("on", "sometimes", 1):
        with pytest.raises(ValueError, match=f"speculative must be None \\(auto\\), True or False, not {bad!r}"):
            Engine(make_model(), max_context=256, speculative=bad)


def test_the_counters_are_prometheus_counters():
    from mk.server.metrics import Metrics

    page = Metrics("m", lambda: EngineStats(draft_tokens=7, accepted_tokens=5)).render().decode()
    assert 'mk_spec_decode_num_draft_tokens_total{model_name="m"} 7.0' in page
    assert 'mk_spec_decode_num_accepted_tokens_total{model_name="m"} 5.0' in page


# ---- the PyTorch runner's verification rows -----------------------------------------------------


def runner_over(model: Model, prompts: list[list[int]]):
    """A PytorchRunner whose rows 0.. hold `prompts` but their last tokens, prefilled, with every
    page up to MAX_PAGES mapped; (runner, the rows' next positions)."""
    runner = PytorchRunner(model, BLOCKS, len(prompts), MAX_PAGES * 64)
    alloc = PageAllocator(BLOCKS, seed=SEED)
    dirty = []
    for row in range(len(prompts)):
        table = alloc.new_table(CFG, MAX_PAGES)
        alloc.ensure(table, MAX_PAGES * 64)
        dirty.append((row, table.numpy().tobytes()))
    pieces = [(row, p[:-1], 0, True) for row, p in enumerate(prompts)]
    runner.prefill(pieces, dirty)
    return runner, [len(p) - 1 for p in prompts]


def test_the_pytorch_runner_verifies_repeated_rows_as_steps_of_one_token():
    """A step whose rows repeat (a sequence's next token and its draft, consecutive entries of one
    row at consecutive positions) gives each entry the logits that one-token steps give it, beside
    rows without a draft, and leaves the cache as those steps leave it."""
    model = make_model()
    prompts = [tokens_of(n, salt=i) for i, n in enumerate([40, 62, 200])]
    runner, pos = runner_over(model, prompts)
    drafts = [[], tokens_of(5, salt=10), tokens_of(3, salt=11)]  # (row 1's entries cross a page at 64)
    rows, tokens, positions = [], [], []
    for row, (prompt, draft) in enumerate(zip(prompts, drafts, strict=True)):
        for j, token in enumerate([prompt[-1], *draft]):
            rows.append(row)
            tokens.append(token)
            positions.append(pos[row] + j)
    before = runner.kv.k.clone(), runner.kv.v.clone()
    calls, verify = [], model.verify

    def spy(groups, kv):
        calls.append([(t, first) for t, first, _ in groups])
        return verify(groups, kv)

    model.verify = spy
    got = torch.from_numpy(runner.decode(rows, tokens, positions, []))
    del model.verify
    assert calls == [[([p[-1], *d], n) for p, d, n in zip(prompts, drafts, pos, strict=True)]]  # one call, in order
    assert got.shape == (len(rows), CFG.vocab_size)
    after = runner.kv.k.clone(), runner.kv.v.clone()
    runner.kv.k.copy_(before[0])
    runner.kv.v.copy_(before[1])
    # The same entries as steps of one token each: step j decodes entry j of every row that has one.
    want = torch.empty_like(got)
    for j in range(max(len(d) for d in drafts) + 1):
        step = [i for i in range(len(rows)) if positions[i] - pos[rows[i]] == j]
        args = [[values[i] for i in step] for values in (rows, tokens, positions)]
        want[step] = torch.from_numpy(runner.decode(*args, []))
    err = float(((got - want).abs().amax(-1) / want.abs().amax(-1)).max())
    assert err < 1e-12, f"seed {SEED}: {err:.2e}"
    for stepped, verified in ((runner.kv.k, after[0]), (runner.kv.v, after[1])):  # (more rows round apart)
        assert float((stepped - verified).abs().max() / stepped.abs().max()) < 1e-12, f"seed {SEED}"


def test_the_pytorch_runner_refuses_rows_that_are_not_one_run_each():
    model = make_model()
    runner, pos = runner_over(model, [tokens_of(20, salt=0), tokens_of(30, salt=1)])
    with pytest.raises(ValueError, match="not at consecutive positions"):
        runner.decode([0, 0], [1, 2], [pos[0], pos[0] + 2], [])
    with pytest.raises(ValueError, match="apart from its other rows"):
        runner.decode([0, 1, 0], [1, 2, 3], [pos[0], pos[1], pos[0] + 1], [])


# ---- the engine over the built-in model (needs the native engine's max_draft) -------------------

# Prompts the built-in model continues by copying from them (imports, a function again, list
# literals, a class again), and two it does not: drafts are accepted whole, in part and not at all.
PROMPTS = [
    "import os\nimport sys\nimport os\nimport sys\nimport os\n",
    'def area(w, h):\n    """The area of a w by h rectangle."""\n    return w * h\n\n\ndef area(w, h):\n',
    "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2, 3]\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n\n"
    "class Point3:\n    def __init__(self, x, y, z):\n",
    "if a:\n    return 1\nif b:\n    return 2\nif c:\n",
    "def f(x):",
]


def built_in(speculative: str, **options) -> mk.LLM:
    """The built-in model on the CPU in float64, speculative decoding "on" or "off"."""
    options = {"max_batch": 4, "max_context": 512, "prefill_chunk": 128, **options}
    return mk.LLM(device="cpu", dtype=torch.float64, speculative=AUTO_ON_OFF[speculative], **options)


def settled(llm: mk.LLM) -> dict[str, int]:
    """The engine's counters once every request has left (a stop string's cancel lands after its
    text); its whole pool is free again."""
    deadline = time.monotonic() + 10
    while llm.engine.active_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    s = llm.engine.native_stats()
    assert s["kv_blocks_free"] == s["kv_blocks_total"], "KV blocks leaked"
    assert (s["running"], s["waiting"]) == (0, 0)
    return s


@pytest.fixture(scope="module")
def llms():
    made = {mode: built_in(mode) for mode in ("on", "off")}
    assert made["on"].engine.options.max_draft == _native.MAX_DRAFT and made["off"].engine.options.max_draft == 0
    yield made
    for llm in made.values():
        settled(llm)
        llm.close()


def both(llms, prompts, params) -> tuple[list, list, EngineStats, EngineStats]:
    """(outputs with drafts, without, and each engine's stats deltas over the call)."""
    results = []
    for mode in ("on", "off"):
        llm = llms[mode]
        before = llm.engine.stats()
        outs = llm.generate(prompts, params, use_tqdm=False)
        settled(llm)
        after = llm.engine.stats()
        delta = EngineStats(
            generated_tokens=after.generated_tokens - before.generated_tokens,
            draft_tokens=after.draft_tokens - before.draft_tokens,
            accepted_tokens=after.accepted_tokens - before.accepted_tokens,
        )
        results.append((outs, delta))
    (on, on_stats), (off, off_stats) = results
    return on, off, on_stats, off_stats


def assert_same(on, off, logprobs: bool = False) -> None:
    for a_out, b_out in zip(on, off, strict=True):
        for a, b in zip(a_out.outputs, b_out.outputs, strict=True):
            assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason), a_out.prompt
            assert (a.logprobs is None) == (b.logprobs is None)
            # (float64: one step's rows and several steps' round alike to far below this)
            if logprobs and b.logprobs is not None:
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9)
                assert [[t for t, _ in x] for x in a.top_logprobs] == [[t for t, _ in x] for x in b.top_logprobs]


@pytest.mark.slow
def test_greedy_output_is_the_same_with_drafts_and_without(llms):
    """Six prompts on four rows (admission while others draft), greedy, some ending at EOS: the same
    tokens and text; drafts ran, some were accepted, and no more tokens were generated."""
    on, off, on_stats, off_stats = both(llms, PROMPTS, SamplingParams(max_tokens=64, temperature=0))
    assert_same(on, off)
    assert {o.outputs[0].finish_reason for o in off} == {"length", "stop"}
    assert on_stats.generated_tokens == off_stats.generated_tokens
    assert 0 < on_stats.accepted_tokens <= on_stats.draft_tokens
    assert off_stats.draft_tokens == off_stats.accepted_tokens == 0


@pytest.mark.slow
def test_stop_strings_stop_tokens_max_tokens_and_logprobs_are_unchanged(llms):
    """Where a request ends inside an accepted draft (a stop string, a stop token, max_tokens), it
    ends where it would without drafts; logprobs are the plain steps' own."""
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = llms["off"].generate(PROMPTS[:3], greedy, use_tqdm=False)
    texts = [o.outputs[0].text for o in plain]
    # A stop string whose first occurrence is past the first line (where drafts are accepted), and a
    # stop token from the middle of another output.
    at = next(k for k in range(20, len(texts[0])) if texts[0].find(texts[0][k : k + 8]) == k)
    stop_string = texts[0][at : at + 8]
    stop_token = plain[2].outputs[0].token_ids[17]
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop_string]),
        SamplingParams(max_tokens=13, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=30, temperature=0, logprobs=3),
        SamplingParams(max_tokens=1, temperature=0),
    ]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[2], PROMPTS[0], PROMPTS[3]]
    on, off, on_stats, _ = both(llms, prompts, params)
    assert_same(on, off, logprobs=True)
    assert on[0].outputs[0].finish_reason == "stop" and stop_string not in on[0].outputs[0].text
    assert len(on[1].outputs[0].token_ids) == 13
    assert on[2].outputs[0].token_ids[-1] == stop_token and on[2].outputs[0].finish_reason == "stop"
    assert len(on[4].outputs[0].token_ids) == 1
    assert on_stats.accepted_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=48, temperature=0.5, seed=11, n=2),
        SamplingParams(max_tokens=48, temperature=0.9, top_p=0.9, top_k=40, seed=12),
    ],
    ids=["temperature", "top-p-top-k"],
)
def test_seeded_sampling_draws_the_same_tokens(llms, params):
    """A sampled row draws with its generation index's noise whether it is a draft's row or a plain
    step's, so a seed gives the same tokens with drafts and without."""
    on, off, on_stats, _ = both(llms, PROMPTS[:4], params)
    assert_same(on, off)
    assert on_stats.draft_tokens > 0


@pytest.mark.slow
def test_requests_under_a_grammar_draft_within_it(llms):
    """A grammar-held request drafts too (only tokens its grammar takes, each verification row under
    the grammar advanced by the draft before it), alone and beside a free one; the tokens are those
    without drafts. (Token ids: a text prompt would be healed, which holds only its first tokens to a
    grammar.)"""
    ids = llms["on"].encode(PROMPTS[0])
    held = SamplingParams(max_tokens=40, temperature=0, constraint=ConstraintSpec("regex", r"(import [a-z]+\n){1,6}"))
    on, off, on_stats, _ = both(llms, [ids], held)
    assert_same(on, off)
    assert on[0].outputs[0].text.startswith("import ")
    assert on_stats.accepted_tokens > 0
    free = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    on, off, on_stats, _ = both(llms, [ids, ids], [held, free])
    assert_same(on, off)
    assert on_stats.draft_tokens > 0


@pytest.mark.slow
def test_a_small_pool_preempts_drafting_sequences_and_changes_nothing():
    """A pool that holds fewer of these sequences than the batch: drafts map their pages only where the
    free blocks allow, sequences are preempted and resumed, and the tokens are the plain ones."""
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    prompts = PROMPTS[:4]
    with built_in("off", max_context=256, kv_blocks=30) as plain:
        want = plain.generate(prompts, params, use_tqdm=False)
        settled(plain)
        assert plain.engine.stats().preemptions > 0
    with built_in("on", max_context=256, kv_blocks=30) as spec:
        got = spec.generate(prompts, params, use_tqdm=False)
        settled(spec)
        stats = spec.engine.stats()
    assert_same(got, want)
    assert stats.preemptions > 0 and stats.accepted_tokens > 0
