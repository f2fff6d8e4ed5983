"""mk.engine.options: the engine's options stated once, the server's flags generated from them, and
every automatic choice made in one place."""

from __future__ import annotations

import dataclasses

import pytest

from mk import _native
from mk.engine.options import (
    CPU_MAX_BATCH,
    CPU_PREFILL_CHUNK,
    DECODE_PREFILL_BUDGET,
    GPU_MAX_BATCH,
    PREFILL_CHUNK,
    EngineOptions,
    flag_fields,
    from_arguments,
    in_flags_words,
)
from mk.server.__main__ import parse_args

SWITCHES = [f.name for f in dataclasses.fields(EngineOptions) if f.metadata.get("switch")]


def test_every_flag_comes_from_an_option_and_gives_its_default():
    args = parse_args([])
    flags = {f.name for f in flag_fields()}
    assert flags <= set(vars(args)), "a flagged option without its flag"
    assert from_arguments(args) == EngineOptions()
    assert args.max_context is None  # the server decides it from the model (build_state)
    for name in SWITCHES:
        assert getattr(args, name) == "auto"


def test_a_flag_sets_its_option():
    given = {
        "--max-batch": ("max_batch", "3", 3),
        "--prefill-chunk": ("prefill_chunk", "64", 64),
        "--gpu-memory-utilization": ("gpu_memory_utilization", "0.5", 0.5),
        "--backend": ("backend", "pytorch", "pytorch"),
        "--prefill": ("prefill", "plain", "plain"),
        "--whole-chunk-tokens": ("whole_chunk_tokens", "0", 0),
        "--max-waiting": ("max_waiting", "7", 7),
    }
    for flag, (name, text, value) in given.items():
        assert getattr(from_arguments(parse_args([flag, text])), name) == value
    for name in SWITCHES:
        flag = "--" + name.replace("_", "-")
        assert getattr(from_arguments(parse_args([flag])), name) is True  # alone: on
        assert getattr(from_arguments(parse_args([flag, "off"])), name) is False


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(max_batch=0), "max_batch must be at least 1, got 0"),
        (dict(prefill_chunk=8), "prefill_chunk must be at least 16"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization must be in"),
        (dict(backend="cuda"), "backend must be one of 'auto', 'megakernel', 'pytorch', not 'cuda'"),
        (dict(backend="reference"), "backend must be one of 'auto', 'megakernel', 'pytorch', not 'reference'"),
        (dict(prefill="fast"), "prefill must be one of 'auto', 'packed', 'plain', not 'fast'"),
        (dict(launch_ahead="yes"), "launch_ahead must be None \\(auto\\), True or False"),
        (dict(sliced_prefill=True, prefill="plain"), "sliced_prefill needs the packed prefill"),
    ],
)
def test_invalid_options_are_a_value_error(options, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(**options)


def test_an_error_names_the_servers_flags():
    assert in_flags_words("max_batch must be at least 1") == "--max-batch must be at least 1"
    assert in_flags_words("kv_blocks is not a flag") == "kv_blocks is not a flag"


@pytest.mark.parametrize("cuda", [False, True])
@pytest.mark.parametrize("backend", ["pytorch", "megakernel"])
def test_resolving_makes_every_automatic_choice(cuda, backend):
    o = EngineOptions().resolved(cuda=cuda, backend=backend)
    megakernel = backend == "megakernel"
    assert o.backend == backend and o.prefill == ("packed" if cuda else "plain")
    assert o.max_batch == (GPU_MAX_BATCH if cuda else CPU_MAX_BATCH)
    assert o.prefill_chunk == (PREFILL_CHUNK if cuda else CPU_PREFILL_CHUNK)
    assert o.sliced_prefill is cuda
    assert o.decode_prefill_budget == (DECODE_PREFILL_BUDGET if cuda else CPU_PREFILL_CHUNK)
    assert o.launch_ahead is megakernel and o.kernel_masks is megakernel and o.late_masks is megakernel
    assert o.speculative is megakernel and o.max_draft == (_native.MAX_DRAFT if megakernel else 0)
    # What the warm-up decides (Engine) stays open; the rest is decided.
    undecided = {f.name for f in dataclasses.fields(o) if getattr(o, f.name) is None}
    assert undecided <= {"prefill_graphs", "prefix_graphs", "whole_chunk_tokens", "kv_blocks", "kv_bytes", "salt",
                         "tokenizer_json"}  # fmt: skip
    # Given values are kept.
    given = EngineOptions(max_batch=3, prefill_chunk=64, launch_ahead=False, speculative=True)
    kept = given.resolved(cuda=cuda, backend=backend)
    assert (kept.max_batch, kept.prefill_chunk, kept.launch_ahead, kept.speculative) == (3, 64, False, True)


@pytest.mark.parametrize(
    "options,backend,message",
    [
        (dict(kernel_masks=True), "pytorch", "kernel_masks needs the megakernel backend"),
        (dict(late_masks=True, kernel_masks=False), "megakernel", "late_masks needs kernel_masks"),
        (dict(late_masks=True, launch_ahead=False), "megakernel", "late_masks needs launch-ahead"),
        (dict(sliced_prefill=True), "pytorch", "sliced_prefill needs the packed prefill"),
    ],
)
def test_combinations_that_cannot_run_are_refused_when_resolved(options, backend, message):
    with pytest.raises(ValueError, match=message):
        EngineOptions(**options).resolved(cuda=False, backend=backend)
