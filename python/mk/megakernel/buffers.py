"""Every buffer one decode step reads or writes besides weights and the KV pools.

The CUDA megakernel and the CPU interpreter use the same names and shapes; `dtype` is the
activation dtype of the model (bf16 on the GPU, the weights' dtype in the interpreter).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mk.config import ModelConfig


@dataclass
class StepBuffers:
    tokens: torch.Tensor  # int32 [B] input token of each row
    positions: torch.Tensor  # int32 [B] write position of each row
    block_tables: torch.Tensor  # int32 [layers, B, max_pages], -1 unmapped
    x: torch.Tensor  # fp32 [B, hidden] residual
    h: torch.Tensor  # act [B, hidden] normed input of the current layer
    q: torch.Tensor  # fp32 [B, q_width] post-RoPE queries
    attn_o: torch.Tensor  # fp32 [B * kv_heads, max_splits, group, head_dim] unnormalised partials
    attn_ml: torch.Tensor  # fp32 [B * kv_heads, max_splits, group, 2] running max and sum
    attn_out: torch.Tensor  # act [B, q_width]
    y_attn: torch.Tensor  # fp32 [B, hidden]
    router: torch.Tensor  # fp32 [B, experts]
    topk_slot: torch.Tensor  # int32 [B, top_k] slot of each chosen expert
    topk_score: torch.Tensor  # fp32 [B, top_k] sigmoid scores
    slot_expert: torch.Tensor  # int32 [slots] expert of each active slot
    slot_count: torch.Tensor  # int32 [1] active slots
    dense_act: torch.Tensor  # act [B, dense_ffn]
    expert_act: torch.Tensor  # act [slots, B, expert_ffn]
    ffn_out: torch.Tensor  # fp32 [B, hidden]
    expert_out: torch.Tensor  # [slots, B, hidden] in the model dtype
    logits: torch.Tensor  # fp32 [B, vocab]
    sample_score: torch.Tensor  # fp32 [B, parts]
    sample_id: torch.Tensor  # int32 [B, parts]
    sampled: torch.Tensor  # int32 [B]
    routing_log: torch.Tensor  # int32 [layers, B, top_k] every MoE layer's chosen experts
    residual_log: torch.Tensor  # fp32 [layers, B, hidden] x after every layer (debugging, tests)
    rope: torch.Tensor  # fp32 [B, head_dim / 2, 2] (cos, sin) at each row's position

    @classmethod
    def allocate(
        cls,
        cfg: ModelConfig,
        batch: int,
        slots: int,
        max_splits: int,
        max_pages: int,
        parts: int,
        dtype: torch.dtype,
        device: torch.device | str,
        log_residuals: bool = True,
    ) -> StepBuffers:
        f32, i32 = torch.float32, torch.int32
        B, D, hkv, hd = batch, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim
        group = cfg.num_attention_heads // hkv
        shapes = {
            "tokens": ((B,), i32),
            "positions": ((B,), i32),
            "block_tables": ((cfg.num_hidden_layers, B, max_pages), i32),
            "x": ((B, D), f32),
            "h": ((B, D), dtype),
            "q": ((B, cfg.q_width), f32),
            "attn_o": ((B * hkv, max_splits, group, hd), f32),
            "attn_ml": ((B * hkv, max_splits, group, 2), f32),
            "attn_out": ((B, cfg.q_width), dtype),
            "y_attn": ((B, D), f32),
            "router": ((B, cfg.num_experts), f32),
            "topk_slot": ((B, cfg.num_experts_per_tok), i32),
            "topk_score": ((B, cfg.num_experts_per_tok), f32),
            "slot_expert": ((max(slots, 1),), i32),
            "slot_count": ((1,), i32),
            "dense_act": ((B, cfg.prefix_dense_intermediate_size), dtype),
            "expert_act": ((max(slots, 1), B, cfg.intermediate_size), dtype),
            "ffn_out": ((B, D), f32),
            "expert_out": ((max(slots, 1), B, D), dtype),  # bf16 values: the norm loads half the bytes
            "logits": ((B, cfg.vocab_size), f32),
            "sample_score": ((B, parts), f32),
            "sample_id": ((B, parts), i32),
            "sampled": ((B,), i32),
            "routing_log": ((cfg.num_hidden_layers, B, cfg.num_experts_per_tok), i32),
            "residual_log": ((cfg.num_hidden_layers if log_residuals else 0, B, D), f32),
            "rope": ((B, hd // 2, 2), f32),
        }
        return cls(**{name: _poisoned(shape, dt, device) for name, (shape, dt) in shapes.items()})

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """NaN for floats, -7 for ints: a value nothing legitimate writes, so unwritten reads show."""
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.full(shape, -7, dtype=dtype, device=device)
