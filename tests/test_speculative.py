"""Speculative decoding's verification rows on the reference model (CPU, float64): a sequence's
next token and its draft verified in one call give the logits of decoding them one step at a
time, beside sequences without a draft; and the longest-prefix acceptance over such calls yields
exactly the tokens of plain greedy decoding, whatever share of the drafts is right (the drafts
here come from a recorded plain run, so which are right is controlled)."""

from __future__ import annotations

import os

import pytest
import torch

from mk.config import ModelConfig
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
    from mk import _native

    speculator = _native.Speculator([5, 6, 7, 8, 9, 5, 6, 7])
    assert speculator.draft(_native.MAX_DRAFT)[:2] == [8, 9]
    assert speculator.draft(1) == [8]
    speculator.advance(2, [8, 9, 5])
    assert speculator.draft(2) == [6, 7]
    with pytest.raises(ValueError, match="gains 1 to drafted"):
        speculator.advance(1, [1, 2, 3])
    assert _native.Speculator([1, 2, 3]).draft(4) == []
