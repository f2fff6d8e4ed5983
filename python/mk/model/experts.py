"""Experts stacked per layer and the grouped-matmul MoE of the packed prefill.

`torch._grouped_mm` takes one weight tensor per layer: w13 [E, 2F, D] (each expert's gate rows,
then its up rows) and w2 [E, D, F]. The model's weights are HF-named per-expert tensors; when they
already lie stacked in memory `stacked_experts` views them without copying, and `stack_experts`
restacks a weights dict in place once (peak extra memory: one layer's experts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mk.config import ModelConfig
from mk.model.moe import acc_dtype, select_experts


def expert_names(layer: int, e: int) -> tuple[str, str, str]:
    p = f"model.layers.{layer}.mlp.experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def _back_to_back(parts: list[torch.Tensor]) -> bool:
    """Whether the contiguous tensors `parts` lie back to back, in order, in one storage."""
    first = parts[0]
    base, off, n = first.untyped_storage().data_ptr(), first.storage_offset(), first.numel()
    for j, t in enumerate(parts):
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != base or t.storage_offset() != off + j * n:
            return False
    return True


def stacked_experts(
    weights: dict[str, torch.Tensor], cfg: ModelConfig, layer: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Zero-copy (w13, w2) views of one MoE layer's experts if they lie stacked in memory, else None."""
    e_, f, d = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
    names = [expert_names(layer, e) for e in range(e_)]
    gate_up = [weights[n] for g, u, _ in names for n in (g, u)]
    down = [weights[dn] for _, _, dn in names]
    if not (_back_to_back(gate_up) and _back_to_back(down)):
        return None
    w13 = gate_up[0].as_strided((e_, 2 * f, d), (2 * f * d, d, 1))
    w2 = down[0].as_strided((e_, d, f), (d * f, f, 1))
    return w13, w2


def copy_stacks(weights: dict[str, torch.Tensor], cfg: ModelConfig, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """New (w13, w2) tensors holding a copy of one MoE layer's experts."""
    e_, f, d = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
    ref = weights[expert_names(layer, 0)[0]]
    w13 = torch.empty((e_, 2 * f, d), dtype=ref.dtype, device=ref.device)
    w2 = torch.empty((e_, d, f), dtype=ref.dtype, device=ref.device)
    for e in range(e_):
        g, u, dn = expert_names(layer, e)
        w13[e, :f].copy_(weights[g])
        w13[e, f:].copy_(weights[u])
        w2[e].copy_(weights[dn])
    return w13, w2


def stack_experts(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> int:
    """Restack every MoE layer's experts in place: copy them into one (w13, w2) pair per layer and
    rebind each expert's entries of `weights` to views of it (the old tensors are freed when
    nothing else holds them). Returns the number of layers restacked.

    Call it once right after loading, before anything records weight addresses (the megakernel's
    pointer tables): the views live at new addresses."""
    restacked = 0
    f = cfg.intermediate_size
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe(layer) or stacked_experts(weights, cfg, layer) is not None:
            continue
        w13, w2 = copy_stacks(weights, cfg, layer)
        for e in range(cfg.num_experts):
            g, u, dn = expert_names(layer, e)
            weights[g], weights[u], weights[dn] = w13[e, :f], w13[e, f:], w2[e]
        restacked += 1
    return restacked


def swiglu_act(gu: torch.Tensor, f: int) -> torch.Tensor:
    """silu(gate) · up from a fused [rows, 2F] gate|up product, in the acc dtype, rounded back."""
    acc = acc_dtype(gu.dtype)
    return (F.silu(gu[:, :f].to(acc)) * gu[:, f:].to(acc)).to(gu.dtype)


def combine(y: torch.Tensor, scores: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """Σ_k score_k · y_k per token: y [N·k, D] in expert order, `inverse` (long [N·k]) the row of y
    holding each (token, choice) pair in (token, choice) order, scores [N, k] (acc dtype). The
    gather is part of the weighted sum, so a compiled combine reads y once (an unsorting
    `index_copy_` and then the sum would be two passes over y). The choices are added one by one (a
    pointwise kernel with k gathered loads per element): the same sum written as a reduction over k
    compiles to a far slower kernel (docs/PERF.md, tuning decisions)."""
    n, k = scores.shape
    rows = inverse.view(n, k)
    out = y.index_select(0, rows[:, 0]).to(scores.dtype) * scores[:, :1]
    for j in range(1, k):
        out = out + y.index_select(0, rows[:, j]).to(scores.dtype) * scores[:, j : j + 1]
    return out


def moe_grouped(
    h: torch.Tensor,
    router: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    k: int,
    act_fn=swiglu_act,
    combine_fn=combine,
) -> torch.Tensor:
    """Sigmoid top-k MoE with two grouped matmuls; result [N, D] in the acc dtype.

    The (token, choice) pairs are sorted by expert on the device (no host sync, no per-token or
    per-expert loop): one grouped GEMM for gate|up, one for down, then a combine weighted by the raw
    sigmoid scores that gathers each token's rows back out of expert order. `act_fn` and `combine_fn` may be compiled
    versions of `swiglu_act` and `combine`."""
    f, e_ = w2.shape[2], w13.shape[0]
    idx, scores = select_experts((h @ router.T).to(acc_dtype(h.dtype)), k)
    flat = idx.reshape(-1)
    order = torch.argsort(flat.to(torch.int32), stable=True)  # 32-bit keys: half a 64-bit radix sort's passes
    counts = torch.zeros(e_, dtype=torch.int32, device=h.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = h.index_select(0, order // k)
    gu = torch._grouped_mm(rows, w13.transpose(-2, -1), offs=offs)
    y = torch._grouped_mm(act_fn(gu, f), w2.transpose(-2, -1), offs=offs)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    return combine_fn(y, scores, inverse)
