"""Recording the experts a MoE path chooses, to tell a near-tie of router logits (which rounding may
send either way) from a routing bug, in tests that compare two paths."""

from __future__ import annotations

from unittest import mock

import torch


class RoutingLog:
    """Every select_experts call of a module: (choices [rows, k], router logits [rows, experts])."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def patch(self, module):
        """A context in which `module.select_experts` (mk.model.moe's or mk.model.experts') records."""
        select = module.select_experts

        def record(logits, k):
            idx, scores = select(logits, k)
            self.calls.append((idx, logits))
            return idx, scores

        return mock.patch.object(module, "select_experts", record)


def tie_gap(logits: torch.Tensor, k: int) -> float:
    """How far the k-th and the (k+1)-th largest of one row's router logits are apart."""
    top = logits.double().sort(descending=True).values
    return float(top[k - 1] - top[k])
