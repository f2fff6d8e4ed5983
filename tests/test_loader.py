"""Checkpoint writing and loading, synthetic weights, the test tokenizer and the chat template (CPU, tiny)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mk.config import ConfigError, ModelConfig
from mk.model import CheckpointError, load_checkpoint, load_weights, synthetic_weights, write_checkpoint
from mk.model.names import expected_shapes
from mk.text.tokenizer_files import BOS_ID

CFG = ModelConfig.tiny()
L1 = "model.layers.1."


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return synthetic_weights(CFG, seed=0)


def write_bad(tmp_path: Path, weights: dict[str, torch.Tensor], **kw) -> Path:
    return write_checkpoint(tmp_path / "ckpt", CFG, weights, check=False, **kw)


def load_error(path: Path) -> str:
    with pytest.raises(CheckpointError) as e:
        load_weights(path, CFG, progress=False)
    return str(e.value)


# ---- round trip -------------------------------------------------------------------------------------


def test_round_trip_sharded_bit_identical(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    extra = dict(weights)
    extra["lm_head.weight"] = torch.zeros(7, 3)  # skipped: tied head, any shape
    extra[L1 + "self_attn.q_proj.bias"] = torch.zeros(5)  # skipped: biases
    path = write_checkpoint(tmp_path / "ckpt", CFG, extra, max_shard_bytes=64 * 1024, check=False)
    shards = sorted(path.glob("model-*.safetensors"))
    assert len(shards) > 3
    assert shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(extra)
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert json.loads((path / "config.json").read_text())["layer_types"] == list(CFG.layer_types)
    assert ModelConfig.from_json(path) == CFG

    got = load_weights(path, CFG, dtype=torch.bfloat16, progress=False)
    assert list(got) == list(expected_shapes(CFG))  # load order, skipped names dropped
    for name, t in weights.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name].view(torch.int16), t.view(torch.int16)), name

    config, got32 = load_checkpoint(path, dtype=torch.float32, progress=False)
    assert config == CFG
    assert all(t.dtype == torch.float32 for t in got32.values())
    assert torch.equal(got32["model.norm.weight"], weights["model.norm.weight"].float())


def test_worker_shards_fallback(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    path = write_checkpoint(tmp_path / "ckpt", CFG, weights, max_shard_bytes=256 * 1024)
    for shard in path.glob("model-*.safetensors"):
        shard.rename(path / shard.name.replace("model-", "worker-"))
    got = load_weights(path, CFG, dtype=torch.bfloat16, progress=False)
    assert torch.equal(got["model.embed_tokens.weight"], weights["model.embed_tokens.weight"])


def test_rewrite_removes_stale_shards(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    path = write_checkpoint(tmp_path / "ckpt", CFG, weights, max_shard_bytes=64 * 1024)
    write_checkpoint(path, CFG, weights)
    assert [s.name for s in path.glob("model-*.safetensors")] == ["model-00001-of-00001.safetensors"]
    load_weights(path, CFG, progress=False)


# ---- malformed checkpoints ---------------------------------------------------------------------------


def test_missing_tensor(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    w = dict(weights)
    del w[L1 + "mlp.experts.3.up_proj.weight"]
    del w["model.norm.weight"]
    msg = load_error(write_bad(tmp_path, w))
    assert "missing tensors (2)" in msg
    assert L1 + "mlp.experts.3.up_proj.weight" in msg and "model.norm.weight" in msg


def test_many_missing_tensors_are_counted(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    w = {n: t for n, t in weights.items() if "experts" not in n}
    n_missing = len(weights) - len(w)
    msg = load_error(write_bad(tmp_path, w))
    assert f"missing tensors ({n_missing})" in msg and f"and {n_missing - 10} more" in msg


def test_unknown_tensor(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    w = dict(weights)
    w["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    w["model.layers.7.input_layernorm.weight"] = torch.ones(64)  # layer out of range
    msg = load_error(write_bad(tmp_path, w))
    assert "unknown tensors (2)" in msg
    assert "model.layers.0.self_attn.q_norm.weight" in msg and "model.layers.7.input_layernorm.weight" in msg
    assert "missing" not in msg


def test_wrong_shape(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    w = dict(weights)
    w[L1 + "mlp.gate.weight"] = torch.zeros(CFG.num_experts + 1, CFG.hidden_size)
    msg = load_error(write_bad(tmp_path, w))
    assert L1 + "mlp.gate.weight" in msg
    assert "expected shape [8, 64], got [9, 64]" in msg


def test_all_problems_in_one_error(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    w = dict(weights)
    del w["model.norm.weight"]
    w["model.extra.weight"] = torch.zeros(2)
    w["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    msg = load_error(write_bad(tmp_path, w))
    assert "3 problem(s)" in msg
    assert "model.norm.weight" in msg and "model.extra.weight" in msg and "got [3, 3]" in msg


def test_duplicate_tensor_across_shards(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    path = write_checkpoint(tmp_path / "ckpt", CFG, weights, max_shard_bytes=256 * 1024)
    name = L1 + "self_attn.o_proj.weight"
    save_file({name: weights[name].clone()}, path / "model-99999-of-99999.safetensors")
    msg = load_error(path)
    assert "more than once" in msg and name in msg and "model-99999-of-99999.safetensors" in msg


def test_non_float_tensor(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    w = dict(weights)
    w["model.norm.weight"] = torch.ones(CFG.hidden_size, dtype=torch.int32)
    msg = load_error(write_bad(tmp_path, w))
    assert "non-float" in msg and "model.norm.weight (I32)" in msg


def test_corrupt_shard(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    path = write_checkpoint(tmp_path / "ckpt", CFG, weights, max_shard_bytes=256 * 1024)
    (path / "model-00002-of-00099.safetensors").write_bytes(b"not a safetensors file")
    msg = load_error(path)
    assert "model-00002-of-00099.safetensors: not a readable safetensors file" in msg


def test_no_shards(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path / "ckpt", CFG, synthetic_weights(CFG))
    for shard in path.glob("*.safetensors"):
        shard.unlink()
    msg = load_error(path)
    assert "no weight shards" in msg and "model-*.safetensors" in msg
    assert "not a directory" in load_error(tmp_path / "nowhere")


def test_writer_refuses_bad_weights(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    w = dict(weights)
    del w["model.norm.weight"]
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        write_checkpoint(tmp_path / "ckpt", CFG, w)
    assert not (tmp_path / "ckpt").exists()


def _edit_config(tmp_path: Path, weights: dict[str, torch.Tensor], edit) -> Path:
    path = write_checkpoint(tmp_path / "ckpt", CFG, weights)
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_config_missing_field(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    path = _edit_config(tmp_path, weights, lambda raw: raw.pop("num_key_value_heads"))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_checkpoint(path, progress=False)


def test_config_layer_types_wrong_length(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    path = _edit_config(tmp_path, weights, lambda raw: raw["layer_types"].pop())
    with pytest.raises(ConfigError, match="layer_types.*4 entries.*num_hidden_layers is 5"):
        load_checkpoint(path, progress=False)


def test_config_layer_types_bad_value(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    path = _edit_config(tmp_path, weights, lambda raw: raw["layer_types"].__setitem__(2, "chunked_attention"))
    with pytest.raises(ConfigError, match="layer_types.*entry 2 is 'chunked_attention'"):
        load_checkpoint(path, progress=False)


def test_config_corrupt_json(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    path = write_checkpoint(tmp_path / "ckpt", CFG, weights)
    (path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(ConfigError, match="config.json: not valid JSON"):
        load_checkpoint(path, progress=False)
    (path / "config.json").unlink()
    with pytest.raises(ConfigError, match="no config.json"):
        load_checkpoint(path, progress=False)


# ---- synthetic weights -------------------------------------------------------------------------------


def test_synthetic_deterministic_per_seed(weights: dict[str, torch.Tensor]) -> None:
    again = synthetic_weights(CFG, seed=0)
    other = synthetic_weights(CFG, seed=1)
    assert list(again) == list(expected_shapes(CFG))
    for name, t in weights.items():
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == expected_shapes(CFG)[name]
        assert torch.equal(t, again[name]), name
        assert not torch.equal(t, other[name]), name


def test_synthetic_statistics() -> None:
    w = synthetic_weights(CFG, seed=3, dtype=torch.float32, std=0.02)
    mats = torch.cat([t.flatten() for t in w.values() if t.dim() == 2])
    assert abs(mats.mean().item()) < 1e-3
    assert mats.std().item() == pytest.approx(0.02, rel=0.02)
    gains = torch.cat([t for t in w.values() if t.dim() == 1])
    assert gains.mean().item() == pytest.approx(1.0, abs=2e-3)
    assert gains.std().item() == pytest.approx(0.02, rel=0.1)
    # Streams are per tensor: no two tensors of the same shape share values.
    assert not torch.equal(w[L1 + "mlp.experts.0.up_proj.weight"], w[L1 + "mlp.experts.1.up_proj.weight"])
    assert not torch.equal(w[L1 + "mlp.experts.0.up_proj.weight"], w[L1 + "mlp.experts.0.gate_proj.weight"])


# ---- the reference model through mk.model.load ---------------------------------------------------------


def test_load_reference_model(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    from mk.model import load

    path = write_checkpoint(tmp_path / "ckpt", CFG, weights, max_shard_bytes=256 * 1024)
    model = load(path, progress=False)
    ids = [BOS_ID, 4, 5, 100, 200, 2]
    logits = model.logits(ids)
    assert tuple(logits.shape) == (len(ids), CFG.vocab_size)
    assert torch.isfinite(logits).all()


def test_index_matches_shard_contents(tmp_path: Path, weights: dict[str, torch.Tensor]) -> None:
    path = write_checkpoint(tmp_path / "ckpt", CFG, weights, max_shard_bytes=100 * 1024)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    total = 0
    for shard in sorted(path.glob("model-*.safetensors")):
        tensors = load_file(shard)
        assert all(index["weight_map"][n] == shard.name for n in tensors)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        assert size <= 100 * 1024 or len(tensors) == 1, shard.name
        total += size
    assert index["metadata"]["total_size"] == total == sum(t.numel() * 2 for t in weights.values())
