"""The memory plan's arithmetic (mk.engine.memory) and the engine's context check, on the CPU; the
measurement itself runs on a GPU (test_memory_gpu.py)."""

from __future__ import annotations

import re

import pytest
import torch

from mk import _native
from mk.config import ModelConfig
from mk.engine import memory
from mk.engine.engine import Engine
from mk.model import synthetic_weights
from mk.model.reference import Model

GiB = memory.GiB


def test_the_kv_budget_is_the_share_left_by_the_measured_rest():
    total, before, rest = 80 * GiB, 58 * GiB, 4 * GiB
    budget = memory.kv_budget(total, 0.9, before, rest)
    assert budget == int(total * 0.9) - before - rest - memory.MARGIN
    assert memory.kv_budget(total, 1.0, before, rest) == total - before - rest - memory.MARGIN
    # Nothing left: zero, not a negative pool.
    assert memory.kv_budget(total, 0.7, before, rest) == 0
    for bad in (0, -0.1, 1.01):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            memory.kv_budget(total, bad, before, rest)


@pytest.mark.parametrize("chunk", [512, 8192])
def test_the_largest_context_is_the_last_that_fits(chunk):
    cfg = ModelConfig.real()
    for blocks in (0, 49, 2000, 6272, 40_000, 123_457):
        n = memory.largest_context(cfg, blocks, chunk, 1 << 20)
        if n == 0:
            assert memory.blocks_needed(cfg, 1, chunk) > blocks
            continue
        assert memory.blocks_needed(cfg, n, chunk) <= blocks < memory.blocks_needed(cfg, n + 1, chunk)
    assert memory.largest_context(cfg, 10**9, chunk, 4096) == 4096  # capped by the bound asked


@pytest.fixture(scope="module")
def model() -> Model:
    cfg = ModelConfig.tiny()
    return Model(cfg, synthetic_weights(cfg, seed=0, dtype=torch.float32, std=0.1))


def test_a_context_beyond_the_whole_share_is_refused_before_the_warm_up_or_fitted():
    """The ceiling: all the share leaves as KV cache. A context past it is refused (naming the
    bound, which itself fits), or with `fit` cut to that bound; one within it passes unchanged."""
    cfg, chunk, total, in_use = ModelConfig.real(), 8192, 80 * GiB, 59 * GiB
    blocks = _native.kv_pool_blocks(memory.kv_budget(total, 0.9, in_use, 0), cfg.num_key_value_heads, cfg.head_dim, 2)
    bound = memory.largest_context(cfg, blocks, chunk, 1 << 24)
    assert 0 < bound < 1 << 24
    args = (cfg, 2, chunk)
    assert memory.context_ceiling(*args, bound, in_use, total, 0.9, fit=False) == bound
    assert memory.context_ceiling(*args, 1 << 24, in_use, total, 0.9, fit=True) == bound
    with pytest.raises(memory.MemoryPlanError) as e:
        memory.context_ceiling(*args, bound + 1, in_use, total, 0.9, fit=False)
    assert int(re.search(r"holds at most (\d+) tokens", str(e.value)).group(1)) == bound
    assert "--max-context" in str(e.value) and "--gpu-memory-utilization" in str(e.value)
    # No room at all: refused even with `fit`.
    with pytest.raises(memory.MemoryPlanError, match="at most 0 tokens"):
        memory.context_ceiling(*args, 4096, 75 * GiB, total, 0.9, fit=True)


def test_a_context_the_pool_cannot_hold_names_the_longest_that_fits(model):
    blocks = 40 * model.config.num_hidden_layers
    with pytest.raises(memory.MemoryPlanError) as e:
        Engine(model, kv_blocks=blocks, max_context=1 << 16, prefill_chunk=64)
    longest = int(re.search(r"the longest that fits is (\d+) tokens", str(e.value)).group(1))
    assert f"--max-context {longest}" in str(e.value)
    assert 64 < longest < 1 << 16
    with Engine(model, kv_blocks=blocks, max_context=longest, prefill_chunk=64) as engine:
        assert engine.max_context == longest
    with pytest.raises(memory.MemoryPlanError):
        Engine(model, kv_blocks=blocks, max_context=longest + 1, prefill_chunk=64)
    # Asked to fit (the server without --max-context): the longest, with a warning in the log.
    with Engine(model, kv_blocks=blocks, max_context=1 << 16, prefill_chunk=64, fit_context=True) as engine:
        assert engine.max_context == longest


def test_no_room_at_all_says_what_to_change(model):
    with pytest.raises(memory.MemoryPlanError, match="kv_blocks"):
        Engine(model, kv_blocks=1, max_context=256, prefill_chunk=64, fit_context=True)


def test_a_utilization_out_of_range_is_refused_before_anything_runs(model):
    for bad in (0, 1.5, -1):
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            Engine(model, max_context=256, prefill_chunk=64, gpu_memory_utilization=bad)


def test_a_released_runner_holds_no_pool_and_no_sliced_prefill(model):
    """What a closed engine's runner lets go of (a sliced prefill's state holds the pool too)."""
    from mk.engine.runner import PytorchRunner

    runner = PytorchRunner(model, 64, 2, 256)
    runner.sliced = object()  # (a layer-sliced prefill the engine stopped in the middle of)
    runner.release()
    assert runner.kv is None and runner.sliced is None
