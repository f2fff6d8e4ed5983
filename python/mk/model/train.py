"""A training forward of North Mini Code: the reference model's math over contiguous [batch, seq] blocks.

`mk.model.reference.Model` is the oracle but serves one sequence at a time through a paged cache under
`no_grad`. Training needs batches and gradients, so this module computes the same function (tests check it
equals `Model.logits`) over a plain [B, T] token block starting at position 0:

    x = embed[tokens];  per layer: h = RMSNorm(x)·w;  x = x + Attn(h) + FFN(h)  (parallel block)
    logits = RMSNorm(x)·w_final @ embed^T · logit_scale  (tied head)

with GPT-J RoPE on sliding and dense-prefix layers, causal (and on sliding layers windowed) GQA attention,
SwiGLU on dense layers and the sigmoid top-k MoE with raw-score combine on the others. The weights are the
same dict of HF-named tensors the reference model, loader and checkpoint writer use. Training-only extras:
dropout on each block's attention and FFN outputs, and the router statistics of a load-balancing loss.

Under CUDA autocast the matmuls run in bf16 and the residual, norms, RoPE and MoE combine in fp32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mk.config import ModelConfig
from mk.model.moe import acc_dtype, select_experts, swiglu
from mk.model.names import expected_shapes
from mk.model.reference import rms_norm
from mk.model.rope import cos_sin


@dataclass
class TrainOutput:
    logits: torch.Tensor  # [B, T, vocab]
    balance_loss: torch.Tensor  # scalar: mean over MoE layers of E · Σ_e f_e · p_e (1 when perfectly balanced)
    expert_load: torch.Tensor  # [moe layers, experts]: fraction of the (token, slot) assignments per expert


def init_weights(
    config: ModelConfig,
    seed: int = 0,
    std: float = 0.02,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Fresh trainable weights (requires_grad) for every tensor of `expected_shapes(config)`.

    Matrices N(0, std); the projections that write into the residual (o_proj, down_proj) N(0, std/√(2L));
    RMSNorm gains 1. One CPU generator seeded with `seed` draws them in `expected_shapes` order, so the
    values do not depend on the device.
    """
    gen = torch.Generator().manual_seed(seed)
    out_std = std / math.sqrt(2 * config.num_hidden_layers)
    weights: dict[str, torch.Tensor] = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:
            t = torch.ones(shape)
        else:
            s = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std
            t = torch.randn(shape, generator=gen) * s
        weights[name] = t.to(device=device, dtype=dtype).requires_grad_(True)
    return weights


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J interleaved-pair rotation of x [B, T, heads, head_dim] by tables [T, head_dim // 2] (as
    mk.model.rope.apply_rope, written out of place for autograd); math in the tables' dtype."""
    x = x.to(cos.dtype)
    xe, xo = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((xe * c - xo * s, xo * c + xe * s), dim=-1).flatten(-2)


def _sliding_mask(t: int, window: int, device: torch.device) -> torch.Tensor:
    """bool [T, T]: query i sees key j iff i - window < j <= i."""
    i = torch.arange(t, device=device)[:, None]
    j = torch.arange(t, device=device)[None, :]
    return (j <= i) & (j > i - window)


def _moe(
    h: torch.Tensor, w: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Σ_k sigmoid(logit_{e_k}) · Expert_{e_k}(h) for h [N, d]: (ffn [N, d] in the acc dtype, balance loss,
    load [E]). Every expert runs on every token as one wide SwiGLU (the experts' gate and up rows side by
    side, their down columns likewise), each expert's activations scaled by its combine weight, which is
    its score where it was selected and 0 elsewhere: the same function and gradients as gathering each
    expert's tokens, with a few large matmuls instead of a loop over the experts that waits on the GPU
    for every layer's counts. It costs E / k times the selected experts' arithmetic (4× for the embedded
    model's 16 experts of width 64): meant for the small models this module trains."""
    e_count, k, width = cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size
    acc = acc_dtype(h.dtype)
    logits = (h @ w[prefix + "gate.weight"].T).to(acc)
    idx, scores = select_experts(logits, k)  # [N, k] each; same selection rule as the reference
    combine = torch.zeros_like(logits).scatter(1, idx, scores)  # [N, E]
    experts = [f"{prefix}experts.{e}." for e in range(e_count)]
    gate = torch.cat([w[q + "gate_proj.weight"] for q in experts])  # [E * width, d]
    up = torch.cat([w[q + "up_proj.weight"] for q in experts])
    down = torch.cat([w[q + "down_proj.weight"] for q in experts], dim=1)  # [d, E * width]
    n = h.shape[0]
    g = (h @ gate.T).to(acc).view(n, e_count, width)
    u = (h @ up.T).to(acc).view(n, e_count, width)
    a = (F.silu(g) * u * combine[:, :, None]).to(h.dtype).view(n, e_count * width)
    out = (a @ down.T).to(acc)
    load = torch.bincount(idx.reshape(-1), minlength=e_count).to(acc) / idx.numel()
    probs = torch.sigmoid(logits)
    probs = probs / probs.sum(-1, keepdim=True)
    balance = e_count * (load.detach() * probs.mean(0)).sum()
    return out, balance, load


def forward(
    config: ModelConfig,
    weights: dict[str, torch.Tensor],
    tokens: torch.Tensor,
    dropout: float = 0.0,
) -> TrainOutput:
    """Logits [B, T, vocab] for token blocks [B, T] at positions 0..T-1 (dropout > 0 only while training).

    The residual stays in the embedding's dtype when that is float64 (tests), else fp32."""
    cfg, w = config, weights
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be [batch, seq], got shape {tuple(tokens.shape)}")
    b, t = tokens.shape
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group = hq // hkv
    embed = w["model.embed_tokens.weight"]
    acc = torch.float64 if embed.dtype == torch.float64 else torch.float32
    device = tokens.device
    cos, sin = cos_sin(cfg, torch.arange(t, device=device), acc)
    # Sliding layers: a band mask once the block is longer than the window (plain causal before).
    band = _sliding_mask(t, cfg.sliding_window, device) if t > cfg.sliding_window else None

    x = embed[tokens].to(acc)
    balances, loads = [], []
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps).to(embed.dtype)

        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(b, t, hq, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(b, t, hkv, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(b, t, hkv, hd)
        if cfg.needs_rope(layer):
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        # [B, heads, T, hd]; query head i reads KV head i // group (the reference's head order).
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        q, k, v = q.to(v.dtype), k.to(v.dtype), v
        mask = band if cfg.is_sliding(layer) else None
        if mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        o = o.transpose(1, 2).reshape(b, t, hq * hd)
        attn = (o @ w[p + "self_attn.o_proj.weight"].T).to(acc)

        hf = h.reshape(b * t, -1)
        if cfg.is_moe(layer):
            ffn, balance, load = _moe(hf, w, p + "mlp.", cfg)
            balances.append(balance)
            loads.append(load)
        else:
            m = p + "mlp."
            ffn = swiglu(hf, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
        ffn = ffn.view(b, t, -1).to(acc)
        if dropout > 0:
            attn, ffn = F.dropout(attn, dropout), F.dropout(ffn, dropout)
        x = x + attn + ffn

    h = rms_norm(x, w["model.norm.weight"], cfg.rms_norm_eps).to(embed.dtype)
    logits = (h @ embed.T).to(acc) * cfg.logit_scale
    zero = torch.zeros((), device=device)
    balance = torch.stack(balances).mean() if balances else zero
    load = torch.stack(loads) if loads else torch.zeros(0, cfg.num_experts, device=device)
    return TrainOutput(logits, balance, load)
