"""ModelConfig: presets follow the published layer rules; bad configs name the field."""

import pytest

from mk.config import FULL, SLIDING, ConfigError, ModelConfig


def test_real_geometry_layer_rules():
    c = ModelConfig.real()
    assert sum(c.is_sliding(i) for i in range(49)) == 36
    assert [i for i in range(49) if not c.is_sliding(i)] == list(range(0, 49, 4))
    # RoPE on sliding layers and the dense layer 0; NoPE on full-attention MoE layers.
    assert c.needs_rope(0) and c.needs_rope(1) and not c.needs_rope(4) and not c.needs_rope(48)
    assert not c.is_moe(0) and all(c.is_moe(i) for i in range(1, 49))
    assert c.q_width == 4096 and c.kv_width == 512


@pytest.mark.parametrize("preset", [ModelConfig.real, ModelConfig.gpu_test, ModelConfig.embedded, ModelConfig.tiny])
def test_presets_round_trip_through_json_dict(preset):
    c = preset()
    assert ModelConfig.from_dict(c.to_dict()) == c


def test_gpu_test_geometry_keeps_kernel_widths_and_every_layer_kind():
    g, r = ModelConfig.gpu_test(), ModelConfig.real()
    for f in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size"):
        assert getattr(g, f) == getattr(r, f)
    assert g.num_experts_per_tok == 8
    kinds = {(g.is_moe(i), g.is_sliding(i), g.needs_rope(i)) for i in range(g.num_hidden_layers)}
    assert {(False, False, True), (True, True, True), (True, False, False)} <= kinds


@pytest.mark.parametrize(
    "field,value,words",
    [
        ("hidden_size", 0, "hidden_size"),
        ("num_key_value_heads", 3, "num_key_value_heads"),
        ("num_experts_per_tok", 200, "num_experts_per_tok"),
        ("head_dim", 15, "head_dim"),
        ("rms_norm_eps", -1.0, "rms_norm_eps"),
        ("layer_types", [FULL] * 3, "layer_types"),
        ("layer_types", [FULL, SLIDING, "global", SLIDING, FULL], "entry 2"),
        ("eos_token_id", 10**9, "eos_token_id"),
        ("tie_word_embeddings", False, "tie_word_embeddings"),
    ],
)
def test_bad_values_name_the_field(field, value, words):
    raw = ModelConfig.tiny().to_dict()
    raw[field] = value
    with pytest.raises(ConfigError, match=words):
        ModelConfig.from_dict(raw)
