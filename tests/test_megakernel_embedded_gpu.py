"""Greedy generation of 512 tokens on the megakernel, with the trained embedded model (whose output
distribution is peaked, unlike random weights), checked token by token against the reference.

The check is teacher-forced: the reference model (fp32 on the CPU, on the same bf16 weights) reads
the megakernel's whole sequence once and gives, at every generated position, its argmax and its
top-2 gap. Each megakernel token must be the reference's argmax wherever that gap exceeds what bf16
activations can move (GAP_TOL). Teacher forcing keeps one near-tie from turning the rest of a run
into a comparison of two different texts. The first divergence and its gap are reported (-s).
"""

from __future__ import annotations

import pytest
import torch
from test_engine import run

from mk.default_model import has_embedded, load_default
from mk.engine import Engine
from mk.options import AUTO_ON_OFF
from mk.sampling import SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not has_embedded(), reason="python/mk/embedded/ has not been trained yet"),
]

NEW_TOKENS = 512
# bf16 activations move this model's logits by a few hundredths (|logit| up to ~20); a wrong page,
# row or expert moves them by whole units.
GAP_TOL = 0.25
PROMPTS = [
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "# " + "a long comment line that fills pages " * 30 + "\ndef main():\n",
]


def follow_the_reference(prompts: list[str], max_batch: int, **engine_options) -> None:
    """NEW_TOKENS greedy tokens of each prompt on the megakernel, submitted 20 ms apart, checked
    teacher-forced against the reference (the module's docstring)."""
    gpu_model, tok = load_default(device="cuda", dtype=torch.bfloat16)
    cpu_model, _ = load_default(device="cpu", dtype=torch.float32)
    requests = [
        (0.02 * i, tok.encode(p), SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
        for i, p in enumerate(prompts)
    ]
    blocks = 128 * len(prompts)
    with Engine(
        gpu_model, backend="megakernel", max_batch=max_batch, max_context=2048, kv_blocks=blocks, **engine_options
    ) as e:
        assert e.options.backend == "megakernel"
        results = run(e, requests)
    checked = disagreements = 0
    for (_, prompt, _), (tokens, finish, _) in zip(requests, results, strict=True):
        assert finish == "length" and len(tokens) == NEW_TOKENS
        # Logits at position j predict token j + 1: the generated tokens sit at len(prompt) .. end.
        logits = cpu_model.logits(prompt + tokens)[len(prompt) - 1 : -1]
        top2 = logits.topk(2, dim=-1)
        gaps = top2.values[:, 0] - top2.values[:, 1]
        want = top2.indices[:, 0]
        got = torch.tensor(tokens)
        differ = (got != want).nonzero().flatten().tolist()
        first = f"first at token {differ[0]}, gap {float(gaps[differ[0]]):.4f}" if differ else "none"
        print(f"{len(prompt)}-token prompt: {len(differ)} of {NEW_TOKENS} tokens differ from the reference ({first})")
        for j in differ:
            gap = float(gaps[j])
            assert gap <= GAP_TOL, f"token {j}: megakernel {tokens[j]}, reference {int(want[j])}, gap {gap:.3f}"
        checked += NEW_TOKENS
        disagreements += len(differ)
    assert disagreements <= 0.02 * checked, f"{disagreements} of {checked} tokens were near-tie flips"


def test_512_greedy_tokens_follow_the_reference_where_it_is_not_tied():
    follow_the_reference(PROMPTS, max_batch=4)


def test_a_batch_of_one_whole_launch_follows_the_reference():
    """16 rows: the wide megakernel image (two n-tiles of 8 rows) on this model's geometry, which a
    batch of 4 never reaches (verification rows of drafts do)."""
    variants = [p.replace("def ", "def my_") for p in PROMPTS] + [p + "\n" for p in PROMPTS]
    follow_the_reference(PROMPTS + variants + PROMPTS[:4], max_batch=16)


@pytest.mark.parametrize("step_rows", [8, 16])
def test_greedy_tokens_with_drafts_follow_the_reference(monkeypatch, step_rows):
    """Speculative decoding at batch 4, its verification rows within one narrow launch (8 rows) or
    one wide one (16)."""
    monkeypatch.setattr("mk.engine.MAX_STEP_ROWS", step_rows)
    follow_the_reference(PROMPTS, max_batch=4, speculative=True)


def test_drafts_change_no_greedy_token_and_are_accepted():
    """Speculative decoding on the megakernel: the same greedy tokens with drafts as without, for
    prompts whose continuation copies their own text (a function rewritten under a new name), and
    the drafts are accepted often enough to save steps."""
    gpu_model, tok = load_default(device="cuda", dtype=torch.bfloat16)
    source = PROMPTS[2] + "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n"
    prompts = [PROMPTS[0], source + "\n\n# The same class, named Pile:\nclass Pile:\n"]
    requests = [(0.0, tok.encode(p), SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)) for p in prompts]
    runs = {}
    for speculative in ("off", "on"):
        with Engine(
            gpu_model,
            backend="megakernel",
            max_batch=2,
            max_context=2048,
            kv_blocks=256,
            speculative=AUTO_ON_OFF[speculative],
        ) as e:
            runs[speculative] = ([tokens for tokens, _, _ in run(e, requests)], e.stats(), e.native_stats())
    (plain, _, plain_native), (drafted, stats, native) = runs["off"], runs["on"]
    print(
        f"drafted {stats.draft_tokens}, accepted {stats.accepted_tokens}, steps {native['decode_steps']} "
        f"against {plain_native['decode_steps']}"
    )
    assert drafted == plain
    assert stats.accepted_tokens > 0 and native["decode_steps"] < plain_native["decode_steps"]
