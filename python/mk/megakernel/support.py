"""Whether the decode megakernel can run a model here, and which engine backend to use.

`backend="auto"` takes the megakernel when the model is bf16 on a Hopper GPU that mk's native
module can open and its geometry is within the kernel's limits; otherwise "pytorch" (the PyTorch
model's forward). Asking for the megakernel explicitly where it cannot run is an error that says why.
"""

from __future__ import annotations

import torch

from mk import _native
from mk.config import ModelConfig

# The engine's `backend` option's values (mk.engine.options.EngineOptions.backend).
BACKENDS = ("auto", "megakernel", "pytorch")

# Rows one launch takes (MK_STEP_MAX_ROWS in cuda/abi.h: 1-8 rows run the narrow megakernel image,
# 9-16 the wide one). A larger engine batch runs as several launches per step.
STEP_MAX_ROWS = _native.STEP_MAX_ROWS


class MegakernelUnavailable(RuntimeError):
    """backend="megakernel" was asked for where the megakernel cannot run."""


def geometry_unsupported(cfg: ModelConfig) -> str | None:
    """Why the kernel cannot run this geometry (cuda/ops limits), or None."""
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    longest_k = max(cfg.hidden_size, cfg.q_width, cfg.intermediate_size, cfg.prefix_dense_intermediate_size)
    n = _native  # the kernel's limits, from cuda/abi.h
    checks = [
        (
            cfg.head_dim == n.STEP_HEAD_DIM,
            f"head_dim is {cfg.head_dim} (the kernel's attention is built for {n.STEP_HEAD_DIM})",
        ),
        (
            cfg.num_attention_heads % cfg.num_key_value_heads == 0 and group <= n.STEP_MAX_GROUP,
            f"{cfg.num_attention_heads} query heads over {cfg.num_key_value_heads} KV heads "
            f"(groups of at most {n.STEP_MAX_GROUP})",
        ),
        (
            longest_k <= _native.STEP_MAX_K,
            f"a reduction over {longest_k} values (hidden, q width or FFN width; at most {_native.STEP_MAX_K})",
        ),
        (
            cfg.num_experts_per_tok <= n.STEP_MAX_TOP_K,
            f"top-{cfg.num_experts_per_tok} routing (at most {n.STEP_MAX_TOP_K})",
        ),
        (cfg.num_experts <= n.STEP_MAX_EXPERTS, f"{cfg.num_experts} experts (at most {n.STEP_MAX_EXPERTS})"),
    ]
    for ok, why in checks:
        if not ok:
            return f"unsupported geometry: {why}"
    tasks = n.graph_dims_error(cfg)  # the task builder's own shape rules
    return None if tasks is None else f"unsupported geometry: {tasks}"


def megakernel_unsupported(model) -> str | None:
    """Why the megakernel cannot run `model` (an mk Model) here, or None when it can."""
    if model.device.type != "cuda":
        return f"the model is on {model.device}; the megakernel runs on an NVIDIA Hopper GPU"
    if model.dtype != torch.bfloat16:
        return f"the model is {model.dtype}; the megakernel runs bf16 weights"
    if not _native.gpu_available():
        return "mk's native module finds no CUDA driver or device"
    major, minor = torch.cuda.get_device_capability(model.device)
    if (major, minor) != (9, 0):
        name = torch.cuda.get_device_name(model.device)
        return f"{name} is compute capability {major}.{minor}; mk's kernels are built for Hopper (sm_90a)"
    return geometry_unsupported(model.config)


def choose_backend(model, backend: str) -> str:
    """ "megakernel" or "pytorch" for `backend` in BACKENDS."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(map(repr, BACKENDS))}, not {backend!r}")
    if backend == "pytorch":
        return backend
    why = megakernel_unsupported(model)
    if why is None:
        return "megakernel"
    if backend == "megakernel":
        raise MegakernelUnavailable(f"backend='megakernel' cannot run here: {why}")
    return "pytorch"
