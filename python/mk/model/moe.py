"""SwiGLU FFN and the sigmoid-routed mixture of experts (top-k of sigmoid router scores, no shared expert).

Matmuls run in the weights' dtype; activations, scores and the combine run in `acc` (fp32, or
fp64 for a float64 model).
"""

from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of norm math, activations, softmax and sums: fp32, except fp64 stays fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(h)) * up(h)); h [N, d] in the weights' dtype, result [N, d] in that dtype."""
    acc = acc_dtype(h.dtype)
    g = (h @ gate.T).to(acc)
    u = (h @ up.T).to(acc)
    a = (torch.nn.functional.silu(g) * u).to(h.dtype)
    return a @ down.T


def select_experts(router_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts per row and their raw sigmoid scores; ties go to the lower expert index.

    Selection orders by logit, which is the score order (sigmoid is monotone) without the ties
    that fp32 sigmoid saturation near 1 would add. A stable descending sort keeps equal logits in
    index order, which torch.topk does not promise.
    """
    order = torch.sort(router_logits, dim=-1, descending=True, stable=True).indices[:, :k]
    scores = torch.sigmoid(torch.gather(router_logits, 1, order))
    return order, scores


def moe_ffn(
    h: torch.Tensor,
    router: torch.Tensor,
    experts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    k: int,
) -> torch.Tensor:
    """Σ_k sigmoid(logit_{e_k}) · Expert_{e_k}(h), no renormalisation; result in the acc dtype.

    Tokens are gathered per expert (a loop over the experts in use, not over tokens).
    """
    acc = acc_dtype(h.dtype)
    logits = (h @ router.T).to(acc)
    idx, scores = select_experts(logits, k)
    out = torch.zeros(h.shape, dtype=acc, device=h.device)
    for e in torch.unique(idx).tolist():
        rows, slots = (idx == e).nonzero(as_tuple=True)
        y = swiglu(h[rows], *experts[e]).to(acc)
        out.index_add_(0, rows, y * scores[rows, slots, None])
    return out
