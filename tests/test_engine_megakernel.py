"""The megakernel backend's host side without a GPU: which backend `Engine` picks and why it refuses
the megakernel, the MkStepArgs template the runner hands to Rust, and the Rust glue's argument
checks. (Row and table compaction, launch splitting and the sampling fallback are Rust unit tests:
rust/gpu/compact.rs, rust/engine/megakernel.rs; the GPU runs are test_engine_megakernel_gpu.py.)"""

from __future__ import annotations

import dataclasses
import struct
from types import SimpleNamespace

import pytest
import torch

from mk import _native
from mk.config import ModelConfig
from mk.engine.engine import Engine
from mk.engine.options import EngineOptions
from mk.megakernel import support
from mk.megakernel.buffers import StepBuffers
from mk.megakernel.launch import ModelTables, kv_maps
from mk.megakernel.runner import PER_STEP_FIELDS, MegakernelRunner, step_template
from mk.megakernel.support import MegakernelUnavailable, choose_backend, geometry_unsupported
from mk.model import synthetic_weights
from mk.model.reference import Model

_FORMATS = {"u64": "<Q", "i32": "<i", "f32": "<f"}


@pytest.fixture(scope="module")
def tiny() -> Model:
    cfg = ModelConfig.tiny()
    return Model(cfg, synthetic_weights(cfg, seed=0, dtype=torch.float32, std=0.1))


def fake_gpu_model(cfg: ModelConfig):
    """What `megakernel_unsupported` looks at, claiming a bf16 model on cuda:0."""
    return SimpleNamespace(device=torch.device("cuda", 0), dtype=torch.bfloat16, config=cfg)


def test_geometry_limits():
    for cfg in (ModelConfig.real(), ModelConfig.gpu_test(), ModelConfig.embedded()):
        assert geometry_unsupported(cfg) is None
    assert "head_dim is 16" in geometry_unsupported(ModelConfig.tiny())
    # The task builder's shape rules (rust/graph validate_geometry) are the support check's too.
    odd_vocab = dataclasses.replace(ModelConfig.gpu_test(), vocab_size=1000)
    assert "the vocabulary of 16" in geometry_unsupported(odd_vocab)
    narrow_ffn = dataclasses.replace(ModelConfig.gpu_test(), intermediate_size=100)
    assert "FFN widths must be multiples of 32" in geometry_unsupported(narrow_ffn)


def test_auto_takes_pytorch_on_the_cpu_and_megakernel_is_refused(tiny):
    assert choose_backend(tiny, "auto") == "pytorch"
    assert choose_backend(tiny, "pytorch") == "pytorch"
    with pytest.raises(MegakernelUnavailable, match="backend='megakernel' cannot run here: the model is on cpu"):
        choose_backend(tiny, "megakernel")
    with pytest.raises(ValueError, match="backend must be one of 'auto', 'megakernel', 'pytorch', not 'gpu'"):
        choose_backend(tiny, "gpu")
    bf16 = Model(tiny.config, {k: v.to(torch.bfloat16) for k, v in tiny.weights.items()})
    with pytest.raises(MegakernelUnavailable, match="on cpu"):
        choose_backend(bf16, "megakernel")


def test_each_reason_the_megakernel_cannot_run(monkeypatch):
    gpu_model = fake_gpu_model(ModelConfig.gpu_test())
    f32 = SimpleNamespace(**{**vars(gpu_model), "dtype": torch.float32})
    assert "torch.float32; the megakernel runs bf16" in support.megakernel_unsupported(f32)

    monkeypatch.setattr(support._native, "gpu_available", lambda: False)
    assert "no CUDA driver or device" in support.megakernel_unsupported(gpu_model)
    with pytest.raises(MegakernelUnavailable, match="no CUDA driver"):
        choose_backend(gpu_model, "megakernel")
    assert choose_backend(gpu_model, "auto") == "pytorch"

    monkeypatch.setattr(support._native, "gpu_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "NVIDIA A100 is compute capability 8.0" in support.megakernel_unsupported(gpu_model)

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert choose_backend(gpu_model, "auto") == "megakernel"
    tiny_on_gpu = fake_gpu_model(ModelConfig.tiny())
    assert choose_backend(tiny_on_gpu, "auto") == "pytorch"
    with pytest.raises(MegakernelUnavailable, match="unsupported geometry: head_dim"):
        choose_backend(tiny_on_gpu, "megakernel")


def test_engine_backend_selection(tiny):
    with Engine(tiny, max_context=256, prefill_chunk=64) as e:
        assert e.options.backend == "pytorch"
    with pytest.raises(MegakernelUnavailable, match="on cpu"):
        Engine(tiny, max_context=256, backend="megakernel")
    with pytest.raises(ValueError, match="backend must be one of"):
        Engine(tiny, max_context=256, backend="cuda")
    with pytest.raises(MegakernelUnavailable):
        MegakernelRunner(tiny, 64, 8, 256)
    with pytest.raises(ValueError, match="kernel_masks needs the megakernel backend; .* 'pytorch'"):
        Engine(tiny, max_context=256, kernel_masks=True)


def unpack(raw: bytes) -> dict[str, int | float]:
    layout, size = _native.step_args_layout()
    assert len(raw) == size
    return {name: struct.unpack_from(_FORMATS[kind], raw, offset)[0] for name, offset, kind in layout}


def test_the_template_holds_every_address_python_owns(tiny):
    cfg = tiny.config
    kv = tiny.new_kv(32)
    tables = ModelTables.build(tiny)
    buf = StepBuffers.allocate(cfg, 8, 16, 132, 1, 16, torch.float32, "cpu", log_residuals=False)
    v = unpack(step_template(tiny, kv, tables, buf))
    for name in PER_STEP_FIELDS:
        assert v[name] == 0, name
    assert v["residual_log"] == 0  # logging off
    for name in ("x", "h", "attn_o", "expert_act", "logits", "sampled", "routing_log"):
        assert v[name] == getattr(buf, name).data_ptr(), name
    assert (v["k_pool"], v["v_pool"]) == (kv.k.data_ptr(), kv.v.data_ptr())
    # The pools' tensor maps: encoded once per cache (zeros off the GPU), kept alive with it.
    maps = kv_maps(kv)
    assert v["kv_maps"] == maps.data_ptr() and kv_maps(kv) is maps
    assert maps.shape == (2, _native.TENSOR_MAP_BYTES) and not maps.any()
    assert kv_maps(tiny.new_kv(32)) is not maps
    assert v["embed"] == tiny.weights["model.embed_tokens.weight"].data_ptr()
    assert v["final_norm"] == tiny.weights["model.norm.weight"].data_ptr()
    assert v["layer_weights"] == tables.layer_weights.data_ptr()
    for name in ("layer_maps", "expert_maps", "embed_map"):
        assert v[name] == getattr(tables, name).data_ptr(), name
    assert tables.layer_maps.shape == (cfg.num_hidden_layers, _native.LAYER_WEIGHT_COUNT, _native.TENSOR_MAP_BYTES)
    assert tables.expert_maps.shape == (cfg.num_hidden_layers, cfg.num_experts, 3, _native.TENSOR_MAP_BYTES)
    # Layer 0 is dense (no router), layer 1 is MoE: its expert 3's down projection is where it says.
    assert tables.layer_weights[0, 5] == 0 and tables.layer_weights[1, 5] != 0
    assert tables.expert_weights[1, 3, 2] == tiny.weights["model.layers.1.mlp.experts.3.down_proj.weight"].data_ptr()
    assert tables.layer_window.tolist() == [cfg.window(i) or 0 for i in range(cfg.num_hidden_layers)]
    dims = {
        "layers": cfg.num_hidden_layers,
        "hidden": cfg.hidden_size,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "experts": cfg.num_experts,
        "top_k": cfg.num_experts_per_tok,
        "expert_ffn": cfg.intermediate_size,
        "dense_ffn": cfg.prefix_dense_intermediate_size,
        "vocab": cfg.vocab_size,
    }
    assert {k: v[k] for k in dims} == dims
    assert v["eps"] == pytest.approx(cfg.rms_norm_eps) and v["rope_theta"] == cfg.rope_theta


class FakeRunner:
    """Just enough of MegakernelRunner for the Rust glue to read (it never prefills here)."""

    def __init__(self, setup: dict, cfg: ModelConfig) -> None:
        self.setup = setup
        self.model = SimpleNamespace(config=cfg)

    def megakernel_setup(self) -> SimpleNamespace:
        return SimpleNamespace(**self.setup)


def native_engine(runner, backend: str = "megakernel"):
    cfg = ModelConfig.gpu_test()
    resolved = EngineOptions().resolved(cuda=False, backend="megakernel")
    decided = {"whole_chunk_tokens": 0, "max_draft": resolved.max_draft}  # (the warm-up's; a property)
    return _native.Engine(
        runner,
        # (a namespace: the Rust side's own check of the backend's name is under test too)
        SimpleNamespace(**{**dataclasses.asdict(resolved), **decided, "backend": backend}),
        sliding=[cfg.is_sliding(i) for i in range(cfg.num_hidden_layers)],
        window=cfg.sliding_window,
        num_blocks=4096,
        vocab_size=cfg.vocab_size,
    )


def test_the_rust_glue_checks_its_arguments():
    cfg = ModelConfig.gpu_test()
    _, size = _native.step_args_layout()
    good = {
        "device": 0,
        "stream": 0,
        "step_args": bytes(size),
        "rows": 8,
        "max_splits": 132,
        "slots": 32,
        "max_pages": 64,
        "num_blocks": 4096,
        "attn_chunk": 0,
        "row_groups": 4,
        "sample_parts": 16,
        "dealing": "round_robin",
        "kernel_masks": False,
        "late_masks": False,
    }
    with pytest.raises(ValueError, match="backend must be one of 'megakernel', 'pytorch', not 'reference'"):
        native_engine(FakeRunner(good, cfg), backend="reference")
    with pytest.raises(ValueError, match="megakernel_setup\\(\\): .*no attribute 'rows'"):
        native_engine(FakeRunner({k: v for k, v in good.items() if k != "rows"}, cfg))
    with pytest.raises(ValueError, match=f"MkStepArgs is {size} bytes, got 3"):
        native_engine(FakeRunner({**good, "step_args": b"abc"}, cfg))
    with pytest.raises(ValueError, match="dealing must be 'round_robin' or 'balanced'"):
        native_engine(FakeRunner({**good, "dealing": "random"}, cfg))
    for key in ("kernel_masks", "late_masks"):
        with pytest.raises(ValueError, match=f"megakernel_setup\\(\\): .*no attribute '{key}'"):
            native_engine(FakeRunner({k: v for k, v in good.items() if k != key}, cfg))
    if _native.gpu_available():
        # An all-zero template describes no model: refused before anything is allocated.
        with pytest.raises(ValueError, match="MkStepArgs.layers is 0, the model's geometry says 5"):
            native_engine(FakeRunner(good, cfg))
    else:
        with pytest.raises(_native.GpuError, match="no CUDA driver|does not exist"):
            native_engine(FakeRunner(good, cfg))


def test_python_constants_equal_the_abis():
    from mk.config import PAGE_SIZE

    assert PAGE_SIZE == _native.PAGE_SIZE
    assert support.STEP_MAX_ROWS == _native.STEP_MAX_ROWS


def test_row_samples_pack_as_the_abis_mk_row_sample():
    """1 / T as float32, the seed's low and high words, the step index, the masked flag: one row
    per rule, as many int32 words as MkRowSample has bytes / 4."""
    from mk.megakernel.launch import ROW_SAMPLE_WORDS, row_samples_tensor

    assert 4 * ROW_SAMPLE_WORDS == _native.ROW_SAMPLE_BYTES
    seed = (7 << 32) | 5
    words = row_samples_tensor([(0.5, seed, 9), (0.0, 1, 2)], torch.device("cpu"), masked=[True, False])
    assert words.shape == (2, ROW_SAMPLE_WORDS)
    first = struct.pack("<5i", *words[0].tolist())
    assert struct.unpack("<f4I", first) == (0.5, 5, 7, 9, 1)
    assert words[1].tolist()[1:] == [1, 0, 2, 0]
    assert row_samples_tensor([(0.5, seed, 9)], torch.device("cpu")).tolist()[0][4] == 0, "unmasked by default"
