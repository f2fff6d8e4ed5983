"""The HF checkpoint tensor names of North Mini Code and their shapes.

The reference model, the loader, the synthetic-weight generator and the checkpoint writer all
take their list of tensors from `expected_shapes`, so they cannot drift apart.
"""

from __future__ import annotations

from mk.config import ModelConfig


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of this geometry must hold, in load order."""
    d = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, d),
        "model.norm.weight": (d,),
    }
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (cfg.q_width, d)
        shapes[p + "self_attn.k_proj.weight"] = (cfg.kv_width, d)
        shapes[p + "self_attn.v_proj.weight"] = (cfg.kv_width, d)
        shapes[p + "self_attn.o_proj.weight"] = (d, cfg.q_width)
        if cfg.is_moe(layer):
            f = cfg.intermediate_size
            shapes[p + "mlp.gate.weight"] = (cfg.num_experts, d)
            for e in range(cfg.num_experts):
                q = f"{p}mlp.experts.{e}."
                shapes[q + "gate_proj.weight"] = (f, d)
                shapes[q + "up_proj.weight"] = (f, d)
                shapes[q + "down_proj.weight"] = (d, f)
        else:
            f = cfg.prefix_dense_intermediate_size
            shapes[p + "mlp.gate_proj.weight"] = (f, d)
            shapes[p + "mlp.up_proj.weight"] = (f, d)
            shapes[p + "mlp.down_proj.weight"] = (d, f)
    return shapes


def is_skipped(name: str) -> bool:
    """Tensors a checkpoint may carry that mk ignores: biases, RoPE buffers, the tied head."""
    return name.endswith(".bias") or "rotary_emb.inv_freq" in name or name == "lm_head.weight"
