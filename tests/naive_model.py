"""A deliberately naive float64 North Mini Code, written from the model's definition.

It shares no code with mk.model: one contiguous sequence, dense attention with an explicit
causal/window mask, per-token loops for routing, RoPE through complex multiplication. Slow and
obvious on purpose: it checks the reference model, which in turn checks the kernels.
"""

from __future__ import annotations

import math

import torch

from mk.config import ModelConfig


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps) * w


def _rope_complex(x: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, head_dim]: pair (2i, 2i+1) is the complex number x_2i + j·x_2i+1, turned by
    e^{j·p·theta^(-2i/head_dim)} at position p."""
    t, heads, hd = x.shape
    out = torch.empty_like(x)
    for p in range(t):
        for i in range(hd // 2):
            turn = complex(math.cos(p * theta ** (-2 * i / hd)), math.sin(p * theta ** (-2 * i / hd)))
            z = torch.complex(x[p, :, 2 * i], x[p, :, 2 * i + 1]) * turn
            out[p, :, 2 * i] = z.real
            out[p, :, 2 * i + 1] = z.imag
    return out


def _mask(t: int, window: int | None) -> torch.Tensor:
    """mask[i, j] is True when query i may see key j."""
    return torch.tensor([[j <= i and (window is None or i - j < window) for j in range(t)] for i in range(t)])


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def _swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return (_silu(h @ gate.T) * (h @ up.T)) @ down.T


def naive_logits(cfg: ModelConfig, weights: dict[str, torch.Tensor], tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), vocab] in float64 for the whole sequence from position 0."""
    w = {k: v.detach().to(torch.float64).cpu() for k, v in weights.items()}
    t = len(tokens)
    heads, kv_heads, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    per_kv = heads // kv_heads
    masks = {None: _mask(t, None), cfg.sliding_window: _mask(t, cfg.sliding_window)}

    x = torch.stack([w["model.embed_tokens.weight"][tok] for tok in tokens])
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        h = _rmsnorm(x, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)

        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(t, heads, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(t, kv_heads, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(t, kv_heads, hd)
        if cfg.is_sliding(layer) or (
            cfg.first_k_dense_replace > 0
            and cfg.prefix_dense_sliding_window_pattern == 1
            and layer < cfg.first_k_dense_replace
        ):
            q, k = _rope_complex(q, cfg.rope_theta), _rope_complex(k, cfg.rope_theta)
        mask = masks[cfg.sliding_window if cfg.is_sliding(layer) else None]
        attn = torch.zeros(t, heads, hd, dtype=torch.float64)
        for head in range(heads):
            kvh = head // per_kv
            s = (q[:, head, :] @ k[:, kvh, :].T) / math.sqrt(hd)
            s = torch.where(mask, s, torch.tensor(-math.inf, dtype=torch.float64))
            prob = torch.exp(s - s.max(dim=1, keepdim=True).values)
            prob = prob / prob.sum(dim=1, keepdim=True)
            attn[:, head, :] = prob @ v[:, kvh, :]
        attn_out = attn.reshape(t, heads * hd) @ w[p + "self_attn.o_proj.weight"].T

        if layer < cfg.first_k_dense_replace:
            ffn = _swiglu(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"], w[p + "mlp.down_proj.weight"])
        else:
            ffn = torch.zeros_like(h)
            for i in range(t):
                score = 1 / (1 + torch.exp(-(w[p + "mlp.gate.weight"] @ h[i])))
                ranked = sorted(range(cfg.num_experts), key=lambda e: (-float(score[e]), e))
                for e in ranked[: cfg.num_experts_per_tok]:
                    q_ = f"{p}mlp.experts.{e}."
                    y = _swiglu(h[i], w[q_ + "gate_proj.weight"], w[q_ + "up_proj.weight"], w[q_ + "down_proj.weight"])
                    ffn[i] += score[e] * y
        x = x + attn_out + ffn

    final = _rmsnorm(x, w["model.norm.weight"], cfg.rms_norm_eps)
    return final @ w["model.embed_tokens.weight"].T * cfg.logit_scale
