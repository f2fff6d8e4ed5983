"""Model geometry of North Mini Code and mk's smaller test geometries.

`ModelConfig` holds exactly the `config.json` fields the engine reads. Every
dimension the model code uses comes from here, so the same code runs the real model, the GPU test
geometry and the tiny CPU geometry.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FULL = "full_attention"
SLIDING = "sliding_attention"

# Tokens per KV page: MK_PAGE_SIZE in cuda/abi.h. Stated here too because this module must import
# without mk's compiled module (the training script runs on the GPU machine from python/); a test
# compares it with _native.PAGE_SIZE.
PAGE_SIZE = 64


class ConfigError(ValueError):
    """A config.json that mk cannot serve; the message names the field."""


def default_layer_types(num_layers: int, period: int = 4) -> tuple[str, ...]:
    """Full attention every `period` layers starting at 0, sliding elsewhere (the NMC pattern)."""
    return tuple(FULL if i % period == 0 else SLIDING for i in range(num_layers))


@dataclass(frozen=True, slots=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    prefix_dense_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    prefix_dense_sliding_window_pattern: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    sliding_window: int
    layer_types: tuple[str, ...]
    eos_token_id: int
    logit_scale: float = 1.0

    def __post_init__(self) -> None:
        _validate(self)

    # ---- layer predicates -------------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == SLIDING

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def needs_rope(self, layer: int) -> bool:
        """RoPE on sliding layers and on dense-prefix layers when the prefix pattern asks for it."""
        dense_prefix_rope = (
            self.first_k_dense_replace > 0
            and self.prefix_dense_sliding_window_pattern == 1
            and layer < self.first_k_dense_replace
        )
        return self.is_sliding(layer) or dense_prefix_rope

    def window(self, layer: int) -> int | None:
        """Visible keys (current token included) for a sliding layer, None for full attention."""
        return self.sliding_window if self.is_sliding(layer) else None

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def ffn_width(self, layer: int) -> int:
        return self.intermediate_size if self.is_moe(layer) else self.prefix_dense_intermediate_size

    # ---- (de)serialisation ------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        if not isinstance(raw, dict):
            raise ConfigError("config must be a JSON object")
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            if field.name in raw:
                values[field.name] = raw[field.name]
            elif field.default is dataclasses.MISSING:
                raise ConfigError(f"config.json: missing required field '{field.name}'")
        if raw.get("tie_word_embeddings", True) is not True:
            raise ConfigError("config.json: 'tie_word_embeddings' must be true: mk computes logits with the embedding")
        if isinstance(values.get("eos_token_id"), list):
            eos = values["eos_token_id"]
            if len(eos) != 1:
                raise ConfigError(f"config.json: 'eos_token_id' must be one id, got a list of {len(eos)}")
            values["eos_token_id"] = eos[0]
        if isinstance(values.get("layer_types"), list):
            values["layer_types"] = tuple(values["layer_types"])
        return cls(**values)

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no config.json at {path}") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layer_types"] = list(self.layer_types)
        d["tie_word_embeddings"] = True
        return d

    # ---- geometries ---------------------------------------------------------------------------
    @classmethod
    def real(cls) -> ModelConfig:
        """North-Mini-Code-1.0 as published."""
        return cls(
            hidden_size=2048,
            intermediate_size=768,
            prefix_dense_intermediate_size=3072,
            num_hidden_layers=49,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            first_k_dense_replace=1,
            prefix_dense_sliding_window_pattern=1,
            vocab_size=262144,
            rms_norm_eps=1e-6,
            rope_theta=50000.0,
            sliding_window=4096,
            layer_types=default_layer_types(49),
            eos_token_id=255001,
        )

    @classmethod
    def gpu_test(cls) -> ModelConfig:
        """The real kernel widths with 5 layers (dense full, 3 sliding MoE, full NoPE MoE),
        32 experts and a 32K vocabulary: every kernel code path at a few hundred MB."""
        return dataclasses.replace(
            cls.real(),
            num_hidden_layers=5,
            num_experts=32,
            vocab_size=32768,
            layer_types=default_layer_types(5),
            eos_token_id=2,
        )

    @classmethod
    def embedded(cls) -> ModelConfig:
        """The model shipped in the package (python/mk/embedded/, trained by scripts/train_embedded.py).

        Inside the megakernel's limits (head_dim 128, at most 8 query heads per KV head, hidden a
        multiple of 32 and at most 8192, at most 512 experts, top-k at most 8) and small: 16.65M
        parameters, 33.3 MB of bf16 safetensors in three shards of at most 15 MiB (what the device
        machine can return). Six layers give every layer kind: 0 dense full (RoPE), 1-3 and 5 sliding
        MoE, 4 full NoPE MoE. The 256-token window is crossed by prompts of a few pages; the 16K
        vocabulary is a code BPE with the Cohere special tokens at their fixed ids."""
        return cls(
            hidden_size=384,
            intermediate_size=64,
            prefix_dense_intermediate_size=768,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=128,
            num_experts=16,
            num_experts_per_tok=4,
            first_k_dense_replace=1,
            prefix_dense_sliding_window_pattern=1,
            vocab_size=16384,
            rms_norm_eps=1e-6,
            rope_theta=50000.0,
            sliding_window=256,
            layer_types=default_layer_types(6),
            eos_token_id=2,
        )

    @classmethod
    def tiny(cls) -> ModelConfig:
        """A few-MB model for CPU tests: same layer pattern, a 96-token window so tests cross
        both page (64) and window boundaries with prompts of a few hundred tokens."""
        return cls(
            hidden_size=64,
            intermediate_size=32,
            prefix_dense_intermediate_size=96,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            first_k_dense_replace=1,
            prefix_dense_sliding_window_pattern=1,
            vocab_size=512,
            rms_norm_eps=1e-6,
            rope_theta=50000.0,
            sliding_window=96,
            layer_types=default_layer_types(5),
            eos_token_id=2,
        )


def _validate(c: ModelConfig) -> None:
    def need(ok: bool, field: str, why: str) -> None:
        if not ok:
            raise ConfigError(f"config.json: '{field}' {why}")

    for name in (
        "hidden_size",
        "intermediate_size",
        "prefix_dense_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "num_experts",
        "num_experts_per_tok",
        "vocab_size",
        "sliding_window",
    ):
        v = getattr(c, name)
        need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name, f"must be a positive integer, got {v!r}")
    for name in ("first_k_dense_replace", "prefix_dense_sliding_window_pattern", "eos_token_id"):
        v = getattr(c, name)
        need(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0,
            name,
            f"must be a non-negative integer, got {v!r}",
        )
    for name in ("rms_norm_eps", "rope_theta", "logit_scale"):
        v = getattr(c, name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
        need(ok, name, f"must be a positive finite number, got {v!r}")
    need(c.head_dim % 2 == 0, "head_dim", f"must be even for interleaved RoPE, got {c.head_dim}")
    need(
        c.num_attention_heads % c.num_key_value_heads == 0,
        "num_key_value_heads",
        f"({c.num_key_value_heads}) must divide num_attention_heads ({c.num_attention_heads})",
    )
    need(
        c.num_experts_per_tok <= c.num_experts,
        "num_experts_per_tok",
        f"({c.num_experts_per_tok}) must not exceed num_experts ({c.num_experts})",
    )
    need(
        c.first_k_dense_replace <= c.num_hidden_layers,
        "first_k_dense_replace",
        f"({c.first_k_dense_replace}) must not exceed num_hidden_layers ({c.num_hidden_layers})",
    )
    need(c.sliding_window >= 2, "sliding_window", f"must be at least 2, got {c.sliding_window}")
    need(c.eos_token_id < c.vocab_size, "eos_token_id", f"({c.eos_token_id}) must be below vocab_size ({c.vocab_size})")
    lt = c.layer_types
    need(isinstance(lt, tuple), "layer_types", "must be a list of strings")
    need(
        len(lt) == c.num_hidden_layers,
        "layer_types",
        f"has {len(lt)} entries but num_hidden_layers is {c.num_hidden_layers}",
    )
    for i, t in enumerate(lt):
        need(t in (FULL, SLIDING), "layer_types", f"entry {i} is {t!r}; expected '{FULL}' or '{SLIDING}'")
