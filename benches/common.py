"""Shared benchmark plumbing: event timing of CUDA graphs, a printed table, a JSON record, the card's
speed-of-light bandwidth, and points skipped where they do not fit the card's memory."""

from __future__ import annotations

import gc
import json
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import torch

from cards import HBM_BYTES_PER_S, card_of

# The card whose figure stands for one HBM_BYTES_PER_S does not name (the card mk was sized on).
DEFAULT_CARD = "H200"
# What a point that does not fit is recorded as (the shared yardstick of record's words).
OUT_OF_MEMORY = "out of memory on this card"


def card_name() -> str | None:
    """The GPU's device name (None without one)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def card_kind() -> str:
    """The key of HBM_BYTES_PER_S that the device name contains, else DEFAULT_CARD."""
    return card_of(card_name()) or DEFAULT_CARD


def card_bandwidth() -> float:
    """Speed-of-light HBM bandwidth of this card, bytes/s (card_kind's datasheet figure)."""
    return HBM_BYTES_PER_S[card_kind()]


def card_sol() -> str:
    """The bandwidth in a table's title, e.g. `SOL 3.35 TB/s, H100`; a card known by no figure of
    its own says whose figure stands for it."""
    name = card_name() or "no GPU"
    kind = card_kind()
    whose = kind if kind in name else f"{name}, {kind}'s figure"
    return f"SOL {card_bandwidth() / 1e12:.3g} TB/s, {whose}"


def time_graph(fn, iters_per_graph: int = 20, replays: int = 30, warmup: int = 3) -> float:
    """Median seconds per call of `fn`, captured `iters_per_graph` times in one CUDA graph so
    launch overhead stays out of the number."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters_per_graph):
            fn()
    for _ in range(warmup):
        graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters_per_graph)
    return statistics.median(times)


def out_of_memory(e: BaseException | None) -> bool:
    """Whether `e`, or an error it was raised from or while handling, is the GPU running out of
    memory: torch's own error, or one from an extension or library whose message says so (a graph
    capture that failed on it ends in a capture error whose context is the out-of-memory one)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.cuda.OutOfMemoryError):
            return True
        if isinstance(e, RuntimeError) and says_out_of_memory(str(e)):
            return True
        e = e.__cause__ or e.__context__
    return False


def says_out_of_memory(text: str) -> bool:
    """Whether an error's text (or a server's log) says the GPU ran out of memory."""
    return "out of memory" in text.lower().replace("_", " ")


def free_bytes() -> int:
    """Bytes free on the card once garbage is collected and PyTorch hands back the blocks it caches."""
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def skipped(point: dict, reason: str = OUT_OF_MEMORY, note: str = "") -> dict:
    """`point` (the keys naming it, e.g. batch and ctx) marked skipped, with a printed line."""
    print(f"skipped {_label(point)}: {reason}{note}", flush=True)
    return {**point, "skipped": reason}


def run_point(point: dict, fn: Callable[[], dict], need_bytes: int | None = None, need: str = "it") -> dict:
    """`fn()`'s row for one benchmark point, or `point` marked skipped where it does not fit the
    card, so that the run goes on to the next point: before anything is allocated where
    `need_bytes` (what `need` names, e.g. the KV) is more than is free, else when the GPU runs out
    of memory while it runs, after handing back what the point took."""
    if need_bytes is not None:
        free = free_bytes()
        if need_bytes > free:
            return skipped(point, f"{OUT_OF_MEMORY} ({need} needs {gib(need_bytes)}, {gib(free)} free)")
    try:
        return fn()
    except Exception as e:
        if not out_of_memory(e):
            raise
    # Past the except clause the error's frames, and the tensors they held, are gone.
    return skipped(point, note=f" ({gib(free_bytes())} free)")


def _label(point: dict) -> str:
    """`8x131072`, `decode 8x32768`, `ttft prompt 131072`: a point as its skip line names it (a
    prefill case by its own name)."""
    if "case" in point:
        return str(point["case"])
    rest = dict(point)
    words = [str(rest.pop("row"))] if "row" in rest else []
    if "batch" in rest and "ctx" in rest:
        words.append(f"{rest.pop('batch')}x{rest.pop('ctx')}")
    return " ".join(words + [f"{k} {v}" for k, v in rest.items()])


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    """A column for each name (`-` where a row has no such key), and the reason of any row skipped."""
    if any("skipped" in r for r in rows) and "skipped" not in columns:
        columns = [*columns, "skipped"]
    widths = {c: max([len(c)] + [len(_cell(r, c)) for r in rows]) for c in columns}
    print(f"\n{title}")
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_cell(r, c).rjust(widths[c]) for c in columns))


def _cell(row: dict, column: str) -> str:
    return _fmt(row[column]) if column in row else "-"


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def write_json(path: str | Path, name: str, rows: list[dict], **meta) -> None:
    """The rows, with the card, the bandwidth its speed of light is taken at and the versions."""
    gpu = card_name() is not None
    record = {
        "benchmark": name,
        "device": card_name(),
        "sol_card": card_kind() if gpu else None,
        "sol_bytes_per_s": card_bandwidth() if gpu else None,
        "torch": torch.__version__,
        "host": platform.node(),
        **meta,
        "rows": rows,
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=2))


def pyplot():
    """matplotlib's pyplot on a file-only backend, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
