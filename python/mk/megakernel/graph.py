"""A decode step's task graph (built in Rust) as numpy arrays, with the ABI's names."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from mk import _native
from mk.config import ModelConfig

TASK_WORDS = _native.TASK_WORDS
ARG = _native.TASK_ARG_WORD  # index of arg[0] in a task's words

# The ABI's values, from the Rust mirror of cuda/abi.h (which a Rust test checks against nvcc).
Op = IntEnum("Op", _native.TASK_OPS)
Matrix = IntEnum("Matrix", _native.TASK_MATRICES)


@dataclass(frozen=True)
class StepGraph:
    tasks: np.ndarray  # int32 [num_sms, per_sm, 16], NOP-padded per-SM lists
    order: np.ndarray  # int32 [n, 16], one global order in which producers come first
    num_counters: int
    slots: int
    max_splits: int
    positions: tuple[int, ...]
    modelled_ns: float = 0.0  # the step's time in the dealing's cost model (rust/graph/deal.rs)

    @property
    def batch(self) -> int:
        return len(self.positions)


def build(
    cfg: ModelConfig,
    positions: list[int],
    num_sms: int = 132,
    attn_chunk: int = 0,
    row_groups: int = _native.ROW_GROUPS,
    sample_parts: int = _native.SAMPLE_PARTS,
    check: bool = False,
    dealing: str = "round_robin",
    qkv_groups: int | None = None,
    gate_up_groups: int | None = None,
    attention_first: bool | None = None,
    expert_queue: bool | None = None,
    local_routing: bool | None = None,
) -> StepGraph:
    """`dealing`: "round_robin" (task i to SM i mod num_sms) or "balanced" (list scheduling under a
    cost model); see rust/graph/deal.rs. `row_groups`, `qkv_groups` and `gate_up_groups` size the
    GEMV tasks and `attention_first` orders a MoE layer's attention before or after its expert
    gate/up tiles, `expert_queue` has the expert tiles claimed at run time and `local_routing` has
    every block choose a MoE layer's experts itself (rust/graph/mod.rs BuildOptions; None: its
    default)."""
    raw = _native.build_step_graph(
        cfg,
        list(positions),
        num_sms,
        attn_chunk,
        row_groups,
        sample_parts,
        check,
        dealing,
        qkv_groups,
        gate_up_groups,
        None if attention_first is None else bool(attention_first),
        None if expert_queue is None else bool(expert_queue),
        None if local_routing is None else bool(local_routing),
    )
    tasks = np.frombuffer(raw["tasks"], dtype=np.int32).reshape(raw["num_sms"], raw["per_sm"], TASK_WORDS)
    order = np.frombuffer(raw["order"], dtype=np.int32).reshape(-1, TASK_WORDS)
    return StepGraph(
        tasks, order, raw["num_counters"], raw["slots"], raw["max_splits"], tuple(positions), raw["modelled_ns"]
    )
