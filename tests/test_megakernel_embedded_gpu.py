"""Greedy generation of 512 tokens on the megakernel, with the trained embedded model (whose output
distribution is peaked, unlike random weights), checked token by token against the reference.

The check is teacher-forced: the reference model (fp32 on the CPU, on the same bf16 weights) reads
the megakernel's whole sequence once and gives, at every generated position, its argmax and its
top-2 gap. Each megakernel token must be the reference's argmax wherever that gap exceeds what bf16
activations can move (GAP_TOL), unless a router near-tie explains it: at that position some MoE
layer's 4th and 5th experts are within ROUTER_TIE of each other in the reference, and with them
swapped the reference's argmax is the megakernel's token (bf16 arithmetic picked the other expert;
an expert more or less moves this model's logits by whole units). Teacher forcing keeps one near-tie
from turning the rest of a run into a comparison of two different texts. The first divergence and
its gap are reported (-s), and so is each router near-tie taken as an explanation.
"""

from __future__ import annotations

import pytest
import torch
from test_engine import run

import mk.model.moe
from mk.default_model import has_embedded, load_default
from mk.engine.engine import Engine
from mk.engine.options import AUTO_ON_OFF
from mk.engine.sampling import SamplingParams
from mk.model.reference import Model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not has_embedded(), reason="python/mk/embedded/ has not been trained yet"),
]

NEW_TOKENS = 512
# bf16 activations move this model's logits by a few hundredths (|logit| up to ~20); a wrong page,
# row or expert moves them by whole units.
GAP_TOL = 0.25
# The widest fp32 margin between an MoE layer's 4th and 5th router logits at which this model's
# bf16 forward chose another top-4 than its fp32 one (measured teacher-forced on the prompts'
# 512-token greedy texts; the margin of record and how it was found: the commit that set it).
ROUTER_TIE = 0.6
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
            if gap <= GAP_TOL:
                continue
            at = len(prompt) + j  # the position whose logits chose token j
            tie = routing_tie(cpu_model, (prompt + tokens)[:at], tokens[j])
            assert tie is not None, f"token {j}: megakernel {tokens[j]}, reference {int(want[j])}, gap {gap:.3f}"
            print(f"  token {j} (gap {gap:.3f}): a router near-tie in layer {tie[0]}, margin {tie[1]:.4f}")
        checked += NEW_TOKENS
        disagreements += len(differ)
    assert disagreements <= 0.02 * checked, f"{disagreements} of {checked} tokens were near-tie flips"


def routing_tie(model: Model, seq: list[int], token: int, within: float = ROUTER_TIE) -> tuple[int, float] | None:
    """(layer, margin) of an MoE layer whose 4th and 5th experts at the last position of `seq` are
    within `within` in the reference and, swapped there, make `token` its argmax; else None."""
    cfg, last = model.config, len(seq) - 1
    layers = [layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe(layer)]
    select, seen, swap = mk.model.moe.select_experts, [], []

    def selecting(logits: torch.Tensor, k: int):  # called once per MoE layer, in order
        layer = layers[len(seen)]
        seen.append(logits[last].clone())
        experts, scores = select(logits, k)
        if swap == [layer]:
            order = torch.sort(logits[last], descending=True, stable=True).indices
            experts = experts.clone()
            experts[last, k - 1] = order[k]
            scores = torch.sigmoid(torch.gather(logits, 1, experts))
        return experts, scores

    mk.model.moe.select_experts = selecting
    try:
        model.logits(seq)
        margins = [
            (layer, float(v[3] - v[4]))
            for layer, v in zip(layers, (r.sort(descending=True).values for r in seen), strict=True)
        ]
        for layer, margin in margins:
            if margin > within:
                continue
            seen.clear()
            swap[:] = [layer]
            if int(model.logits(seq)[last].argmax()) == token:
                return layer, margin
    finally:
        mk.model.moe.select_experts = select
    return None


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
    monkeypatch.setattr("mk.engine.engine.STEP_MAX_ROWS", step_rows)
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
