"""The embedded GPU test's explanation of a wrong-looking token by a router near-tie
(test_megakernel_embedded_gpu.routing_tie), checked on the CPU: it finds the tokens a swap of an MoE
layer's 4th and 5th experts makes the reference's argmax, and only those."""

from __future__ import annotations

import pytest
import torch
from test_megakernel_embedded_gpu import PROMPTS, routing_tie

from mk.default_model import has_embedded, load_default

pytestmark = pytest.mark.skipif(not has_embedded(), reason="python/mk/embedded/ has not been trained yet")


def test_a_swap_of_near_tied_experts_explains_a_token_and_nothing_else_does():
    model, tok = load_default(device="cpu", dtype=torch.float32)
    seq = tok.encode(PROMPTS[2])
    explained = []
    for end in range(4, len(seq) + 1):
        logits = model.logits(seq[:end])[-1]
        runner_up = int(logits.topk(2).indices[1])
        # The least likely token is what no single swap makes the argmax.
        assert routing_tie(model, seq[:end], int(logits.argmin()), within=float("inf")) is None
        tie = routing_tie(model, seq[:end], runner_up, within=float("inf"))
        if tie is not None:
            explained.append((end, tie))
            # Within no margin at all, nothing is a near-tie.
            assert routing_tie(model, seq[:end], runner_up, within=-1.0) is None
    assert explained, "no position's runner-up is any single swap's argmax: the check would explain nothing"
