"""Shared benchmark plumbing: event timing of CUDA graphs, a printed table, a JSON record."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch

# H200 HBM3e datasheet bandwidth: the speed-of-light denominator of every mk benchmark.
HBM_BYTES_PER_S = 4.8e12


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


def print_table(title: str, rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns}
    print(f"\n{title}")
    print("  ".join(c.rjust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).rjust(widths[c]) for c in columns))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return str(v)


def write_json(path: str | Path, name: str, rows: list[dict], **meta) -> None:
    record = {
        "benchmark": name,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
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
