"""The GPU memory plan, made once at the engine's start: how large the KV pool may be.

mk may use `gpu_memory_utilization` of the card's total memory, everything included. What is not
KV is measured rather than guessed: once the weights are on the card, the engine warms a runner up
over a scratch pool just large enough for the warm-up (`PrefillRunner.warm_up`: the compilation,
every CUDA graph's capture, one whole chunk on the usual path) and reads PyTorch's peak over it
(activations, the graphs' pool, the decode buffers) and what the driver lost besides (kernel
images, library workspaces). The KV pool gets the rest, less `MARGIN`; then the runner is built
again over that pool and warmed up again, the same passes in the same order (its graphs must hold
its addresses; the compilation is not repeated).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mk import _native
from mk.config import ModelConfig

if TYPE_CHECKING:
    from mk.engine.runner import PrefillRunner

log = logging.getLogger("mk")

GiB = 1 << 30
# Kept out of the KV pool beyond the measured peak: what the warm-up does not allocate (the Rust
# engine's device buffers and the megakernel's image, the task lists' device copies, a few MiB per
# cached shape of step and launch, a layer-sliced chunk's residual) and the caching allocator's
# growth under other shapes.
MARGIN = GiB // 2


class MemoryPlanError(ValueError):
    """The configuration does not fit the card (the message says what would)."""


@dataclass(frozen=True)
class MemoryPlan:
    """What the card holds once the engine has started, in bytes (see the module doc)."""

    total: int  # the card's memory
    utilization: float  # the share of `total` mk may use
    before: int  # in use before the plan: the weights, the CUDA context, other processes
    peak: int  # PyTorch's peak beyond `before` over the warm-up, its scratch KV pool left out
    graphs: int  # of which the prefill's CUDA-graph pool at the warm-up's end
    outside_torch: int  # what the driver lost beyond PyTorch's reservations over the warm-up
    kv_bytes: int  # the KV pool's budget
    kv_blocks: int  # the blocks that budget holds

    def describe(self, tokens: int) -> str:
        """The start's log line; `tokens`: one sequence's tokens the pool holds."""
        gib = {name: f"{getattr(self, name) / GiB:.2f}" for name in ("peak", "graphs", "outside_torch", "kv_bytes")}
        return (
            f"GPU memory plan, {self.utilization:g} of {self.total / GiB:.1f} GiB: weights {self.before / GiB:.1f} "
            f"GiB (with the CUDA context and others' memory), prefill peak {gib['peak']} (CUDA graphs "
            f"{gib['graphs']}), outside PyTorch {gib['outside_torch']}, margin {MARGIN / GiB:.2f}, KV "
            f"{gib['kv_bytes']} GiB = {self.kv_blocks} blocks, {tokens} tokens of one sequence"
        )

    def check(self, device: torch.device) -> None:
        """Logs the memory in use once the engine has started against the plan's share, with a
        warning where it took more."""
        free, total = torch.cuda.mem_get_info(device)
        share = int(total * self.utilization)
        in_use = total - free
        if in_use > share:
            log.warning(
                "%.2f GiB of the GPU in use after the start, %.2f more than --gpu-memory-utilization's share",
                in_use / GiB,
                (in_use - share) / GiB,
            )
        else:
            log.info("%.2f GiB of the GPU in use after the start (the plan's share: %.2f)", in_use / GiB, share / GiB)


def check_utilization(utilization: float) -> None:
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")


def kv_budget(total: int, utilization: float, before: int, non_kv: int) -> int:
    """Bytes the KV pool may take: the utilization's share of the card less what was in use before
    the plan and what the rest needs at its peak, less MARGIN (never below zero)."""
    check_utilization(utilization)
    return max(0, int(total * utilization) - before - non_kv - MARGIN)


def blocks_needed(cfg: ModelConfig, context: int, chunk: int) -> int:
    """KV blocks one sequence of `context` tokens needs at its worst (prefilled in `chunk`s, or
    decoded), as the scheduler counts them."""
    sliding = [cfg.is_sliding(layer) for layer in range(cfg.num_hidden_layers)]
    return max(_native.kv_blocks_needed(sliding, cfg.sliding_window, context, chunk))


def largest_context(cfg: ModelConfig, blocks: int, chunk: int, upper: int) -> int:
    """The longest context of at most `upper` tokens whose sequence fits `blocks`; 0 if none does."""
    lo, hi = 0, upper
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if blocks_needed(cfg, mid, chunk) <= blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo


def settled(device: torch.device) -> tuple[int, int]:
    """(bytes in use, the card's total) once what was freed has gone back to the driver."""
    torch.cuda.synchronize(device)
    gc.collect()  # (an engine dropped in a reference cycle still holds its pool until collected)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total - free, total


def context_ceiling(
    cfg: ModelConfig, elem_bytes: int, chunk: int, context: int, in_use: int, total: int, utilization: float, fit: bool
) -> int:
    """`context`, or with `fit` the longest one sequence could have were the KV pool given all that
    `utilization`'s share leaves beside `in_use` (a bound: the prefill's own memory is measured
    next). Where even that pool cannot hold `context` and not `fit`, a MemoryPlanError at once,
    not after a warm-up whose passes after the longest prefix grow with the context."""
    budget = kv_budget(total, utilization, in_use, 0)
    blocks = _native.kv_pool_blocks(budget, cfg.num_key_value_heads, cfg.head_dim, elem_bytes)

    def explain(largest: int) -> str:
        return (
            f"a context of {context} tokens cannot fit: {utilization:g} of the card's {total / GiB:.1f} GiB, with "
            f"{in_use / GiB:.1f} GiB in use (the weights, the CUDA context and others' memory), holds at most "
            f"{largest} tokens of one sequence even were it all KV cache: ask for less (--max-context), or raise "
            "--gpu-memory-utilization"
        )

    return fitting_context(cfg, blocks, chunk, context, fit, explain)


def fitting_context(
    cfg: ModelConfig, blocks: int, chunk: int, context: int, fit: bool, explain: Callable[[int], str]
) -> int:
    """`context` where one sequence of it fits `blocks` (prefilled in chunks of `chunk`), else with
    `fit` the longest that does (at least 2 tokens); else a MemoryPlanError saying `explain(the
    longest that fits)`."""
    if blocks_needed(cfg, context, chunk) <= blocks:
        return context
    largest = largest_context(cfg, blocks, chunk, context)
    if fit and largest >= 2:
        return largest
    raise MemoryPlanError(explain(largest))


def measure(
    device: torch.device,
    cfg: ModelConfig,
    elem_bytes: int,
    utilization: float,
    runner_over: Callable[[int], PrefillRunner],
    scratch_blocks: int,
    progress: bool = True,
) -> MemoryPlan:
    """Plans the KV pool (module doc): `runner_over(blocks)` builds a runner over a pool of that many
    blocks; one over `scratch_blocks` is warmed up (a progress bar with `progress`), measured and
    dropped."""
    before, total = settled(device)
    reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    log.info("measuring the memory the prefill takes beside the KV cache (a warm-up over scratch pages)")
    runner = runner_over(scratch_blocks)
    try:
        scratch = runner.kv.k.nbytes + runner.kv.v.nbytes
        try:
            runner.warm_up(progress)
        except torch.cuda.OutOfMemoryError as e:
            what, free = str(e).split(".")[0], (total - before) / GiB
            raise MemoryPlanError(
                f"the prefill's warm-up does not fit the {free:.1f} GiB the weights leave free ({what}): "
                "lower --prefill-chunk or turn off --prefill-graphs"
            ) from None
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_reserved(device) - reserved - scratch
        torch.cuda.empty_cache()
        with_graphs = torch.cuda.memory_reserved(device)
    except BaseException:
        runner.release()  # (after the device has finished with the scratch pool)
        raise
    runner.release_graphs()
    torch.cuda.empty_cache()
    graphs = with_graphs - torch.cuda.memory_reserved(device)
    in_use = total - torch.cuda.mem_get_info(device)[0]
    outside = (in_use - before) - (torch.cuda.memory_reserved(device) - reserved)
    del runner
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    non_kv = peak + max(0, outside)
    budget = kv_budget(total, utilization, before, non_kv)
    blocks = _native.kv_pool_blocks(budget, cfg.num_key_value_heads, cfg.head_dim, elem_bytes)
    return MemoryPlan(total, utilization, before, peak, graphs, max(0, outside), budget, blocks)
