"""Where a decode step's time goes, from the kernel's task trace (`MegakernelStep.run(trace=...)`).

Each executed task left: the %globaltimer time its block reached it, the clock cycles it waited on
its counters and the cycles it ran; a task whose bytes were streamed (GEMV, expert-claim and
attention split tasks) also when the block's weight producer issued its first copy, and the cycles the producer
waited for free ring stages (the compute warps were behind) and for the layer's top-k (expert
tiles). The SM clock is estimated from the trace itself (a block's consecutive tasks start
`wait + run` cycles apart), so no clock query is needed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mk import _native
from mk.megakernel.graph import ARG, Matrix, Op, StepGraph

TRACE_WORDS = _native.TRACE_ENTRY_BYTES // 8  # int64 words of one MkTraceEntry (cuda/abi.h)
TRACE_MARKED = _native.TRACE_MARKED  # in word 3's high half: the two halves are the task's marks
LEDGER_STAGES = _native.LEDGER_STAGES  # ring stages per block in a ledger build's rows (cuda/abi.h)


@dataclass(frozen=True)
class Family:
    name: str
    count: int
    wait_us: float  # mean per task
    run_us: float  # mean per task
    run_sm_us: float  # total: SM-time it kept blocks busy
    streamed: int  # tasks whose bytes the producer streamed (GEMV tasks with weights, claim tasks, splits)
    ring_wait_us: float  # mean per streamed task: the producer waiting for free ring stages
    topk_wait_us: float  # mean per streamed task: the producer waiting for the layer's top-k
    lead_us: float  # mean per streamed task: first copy issued to the compute warps' start of work
    # A kernel built with -DMK_TRACE_MARKS=1: mean per task that marked its points (PhaseMarks in
    # cuda/ops/step_common.cuh), µs from the end of its wait; 0 without marks.
    mark1_us: float = 0.0
    mark2_us: float = 0.0


def cycles(trace, word: int = 1):
    """The two cycle counts packed in one word of every entry (a torch tensor or numpy array), low
    half first: word 1 the (wait, run) cycles of the compute warps, word 3 the producer's (ring
    wait, top-k wait)."""
    w = trace[..., word]
    return w & 0xFFFFFFFF, (w >> 32) & 0xFFFFFFFF


def task_family(words: np.ndarray) -> str:
    op = Op(int(words[0]))
    if op == Op.GEMV:
        return f"gemv:{Matrix(int(words[ARG])).name.lower()}"
    if op == Op.EXPERT_CLAIM:
        return f"claim:{Matrix(int(words[ARG])).name.lower()}"
    return op.name.lower()


@dataclass(frozen=True)
class Times:
    """When each task of a traced step ran: `start` and `end` in ns from `first` (the earliest
    start, in %globaltimer ns), `wait` and `run` in cycles of the estimated clock `hz`."""

    real: np.ndarray  # bool [num_sms, per_sm]: not a NOP
    first: int
    start: np.ndarray
    wait: np.ndarray
    run: np.ndarray
    hz: float
    end: np.ndarray


def task_times(g: StepGraph, trace: np.ndarray) -> Times:
    real = g.tasks[..., 0] != Op.NOP
    # %globaltimer counts ns since an epoch (~2^60): subtract the first start before going to float64.
    first = int(trace[..., 0][real].min()) if real.any() else 0
    start = np.where(real, trace[..., 0] - first, 0).astype(np.float64)
    wait, run = (c.astype(np.float64) for c in cycles(trace))
    hz = clock_hz(real, start, wait, run)
    return Times(real, first, start, wait, run, hz, start + (wait + run) / hz * 1e9)


def summarize(g: StepGraph, trace: np.ndarray) -> dict:
    """Per-family and whole-step figures of one traced step; `trace` is the int64 [num_sms, per_sm,
    TRACE_WORDS] `trace_buffer` copied to the host."""
    t = task_times(g, trace)
    real, first, start, wait, run, hz, end = t.real, t.first, t.start, t.wait, t.run, t.hz, t.end
    streamed = real & (trace[..., 2] != 0)
    stream = np.where(streamed, (trace[..., 2] - first).astype(np.float64), np.nan)  # NaN: nothing streamed
    ring_wait, topk_raw = cycles(trace, 3)
    marked_all = (topk_raw & TRACE_MARKED) != 0  # word 3 holds the task's marks, not the producer's
    ring_wait, topk_wait = ring_wait.astype(np.float64), (topk_raw & ~TRACE_MARKED).astype(np.float64)
    t0, t1 = start[real].min(), end[real].max()
    span_us = (t1 - t0) / 1e3
    num_sms = real.shape[0]

    families: dict[str, list[tuple[int, int]]] = {}
    for s, i in zip(*np.nonzero(real), strict=True):
        families.setdefault(task_family(g.tasks[s, i]), []).append((s, i))
    rows = []
    for name, where in sorted(families.items()):
        idx = tuple(np.array(where).T)
        st = streamed[idx]
        marked = marked_all[idx]
        work_start = start[idx] + wait[idx] / hz * 1e9

        def mean_us(v, over):
            return float(v[over].mean() / 1e3) if over.any() else 0.0

        producer = st & ~marked  # whose word 3 is the producer's waits

        marks = (ring_wait[idx][marked], topk_wait[idx][marked])
        mark1, mark2 = (float(v.mean() / hz * 1e6) if marked.any() else 0.0 for v in marks)

        rows.append(
            Family(
                name=name,
                count=len(where),
                wait_us=float(wait[idx].mean() / hz * 1e6),
                run_us=float(run[idx].mean() / hz * 1e6),
                run_sm_us=float(run[idx].sum() / hz * 1e6),
                streamed=int(st.sum()),
                ring_wait_us=mean_us(ring_wait[idx] / hz * 1e9, producer),
                topk_wait_us=mean_us(topk_wait[idx] / hz * 1e9, producer),
                lead_us=mean_us(work_start - stream[idx], st),
                mark1_us=mark1,
                mark2_us=mark2,
            )
        )
    layers = g.tasks[..., 1]
    layer_us = []
    for layer in range(int(layers[real].max()) + 1):
        sel = real & (layers == layer)
        if sel.any():
            layer_us.append(float((end[sel].max() - start[sel].min()) / 1e3))
    middle = int(layers[real].max()) // 2
    return {
        "span_us": float(span_us),
        "sm_clock_mhz": hz / 1e6,
        "tasks": int(real.sum()),
        "busy_fraction": float(run[real].sum() / hz * 1e6 / (num_sms * span_us)),
        "wait_fraction": float(wait[real].sum() / (wait[real].sum() + run[real].sum())),
        # The weight stream stalled because the ring was full (the compute warps were behind).
        "producer_ring_wait_fraction": float(ring_wait[streamed & ~marked_all].sum() / hz * 1e6 / (num_sms * span_us)),
        # First-to-last task of each layer (they overlap: layer l + 1 starts before l ends).
        "layer_us": layer_us,
        "families": [f.__dict__ for f in sorted(rows, key=lambda f: -f.run_sm_us)],
        "layer_phases_us": layer_phases(g, families, end),
        "timeline_layer": middle,
        "timeline": layer_timeline(g, real, start, wait / hz * 1e9, end, middle, stream),
        # The layer after the middle one as well: in the real model the middle layer (24) has
        # full attention and the next a sliding window, whose splits fill only part of the SMs.
        "next_timeline": layer_timeline(g, real, start, wait / hz * 1e9, end, middle + 1, stream)
        if (real & (layers == middle + 1)).any()
        else [],
    }


# A layer's phases, each the task families whose last end marks it.
PHASES = {
    "qkv": ("gemv:qkv",),
    "attention": ("attn_split", "attn_combine"),
    "gate_up": ("gemv:expert_gate_up", "claim:expert_gate_up"),
    "o_proj": ("gemv:o_proj",),
    "down": ("gemv:expert_down", "claim:expert_down"),
    "norm": ("residual_norm",),
}


def layer_phases(g: StepGraph, families: dict[str, list[tuple[int, int]]], end: np.ndarray) -> dict:
    """When each phase of a MoE layer ends, in µs from the end of the previous layer's last norm
    (the moment its input is ready), averaged over the MoE layers after the first; `layers` is how
    many. The whole layer is `norm`; the gaps between phases say what its critical path is."""
    layer_of = g.tasks[..., 1]
    num_layers = int(layer_of[g.tasks[..., 0] != Op.NOP].max()) + 1
    last = {}
    for phase, names in PHASES.items():
        ends = np.full(num_layers, -np.inf)
        for name in names:
            if name in families:
                idx = tuple(np.array(families[name]).T)
                np.maximum.at(ends, layer_of[idx], end[idx])
        last[phase] = ends
    moe = [
        layer
        for layer in range(1, num_layers)
        if last["gate_up"][layer] > -np.inf and last["norm"][layer - 1] > -np.inf
    ]
    out: dict = {"layers": len(moe)}
    for phase in PHASES:
        values = [last[phase][layer] - last["norm"][layer - 1] for layer in moe if last[phase][layer] > -np.inf]
        out[phase] = float(np.mean(values) / 1e3) if values else None
    return out


def layer_timeline(g: StepGraph, real, start, wait_ns, end, layer: int, stream) -> list[dict]:
    """When each task family of `layer` ran, in µs from the end of the previous layer's last
    residual-norm task (the moment the layer's input is ready): the first weight copy (`stream`,
    NaN where none), the first block's arrival, the first and median start of work (after the
    wait), the median and last end. Families sorted by first start: the layer's critical path
    reads top down."""
    ops, layers = g.tasks[..., 0], g.tasks[..., 1]
    norms = real & (ops == Op.RESIDUAL_NORM) & (layers == layer - 1)
    if not norms.any():
        norms = real & (ops == Op.EMBED)
    t0 = end[norms].max() if norms.any() else start[real].min()
    sel = real & (layers == layer)
    groups: dict[str, list[tuple[int, int]]] = {}
    for s, i in zip(*np.nonzero(sel), strict=True):
        groups.setdefault(task_family(g.tasks[s, i]), []).append((s, i))
    out = []
    for name, where in groups.items():
        idx = tuple(np.array(where).T)
        begin = start[idx] + wait_ns[idx]
        streams = stream[idx][~np.isnan(stream[idx])]
        out.append(
            {
                "name": name,
                "count": len(where),
                "stream_us": float((streams.min() - t0) / 1e3) if streams.size else None,
                "arrive_us": float((start[idx].min() - t0) / 1e3),
                "first_start_us": float((begin.min() - t0) / 1e3),
                "median_start_us": float((np.median(begin) - t0) / 1e3),
                "median_end_us": float((np.median(end[idx]) - t0) / 1e3),
                "last_end_us": float((end[idx].max() - t0) / 1e3),
            }
        )
    return sorted(out, key=lambda r: r["first_start_us"])


def clock_hz(real: np.ndarray, start: np.ndarray, wait: np.ndarray, run: np.ndarray) -> float:
    """Cycles per second: a block's next task starts about wait + run cycles after this one."""
    cycles = ns = 0.0
    for s in range(real.shape[0]):
        n = int(real[s].sum())
        if n < 2:
            continue
        cycles += float((wait[s, : n - 1] + run[s, : n - 1]).sum())
        ns += float(start[s, n - 1] - start[s, 0])
    if cycles == 0 or ns <= 0:
        raise ValueError("the trace has no block with two timed tasks")
    return cycles / ns * 1e9


def print_summary(title: str, summary: dict, top: int = 12) -> None:
    print(f"\n{title}: {summary['tasks']} tasks in {summary['span_us']:.0f} µs at ~{summary['sm_clock_mhz']:.0f} MHz")
    print(
        f"blocks busy {summary['busy_fraction']:.0%} of the span; {summary['wait_fraction']:.0%} of block time "
        f"spent waiting; layer first-to-last task: mean {np.mean(summary['layer_us']):.0f} µs; the weight "
        f"producers waited for a free ring stage {summary['producer_ring_wait_fraction']:.0%} of the span"
    )
    print("per streamed task: the producer's ring and top-k waits, its first copy's lead on the work")
    print(f"{'family':>22} {'tasks':>7} {'wait µs':>9} {'run µs':>8} {'SM-µs':>9} {'ring':>6} {'top-k':>6} {'lead':>6}")
    for f in summary["families"][:top]:
        print(
            f"{f['name']:>22} {f['count']:>7} {f['wait_us']:>9.2f} {f['run_us']:>8.2f} {f['run_sm_us']:>9.0f} "
            f"{f['ring_wait_us']:>6.1f} {f['topk_wait_us']:>6.1f} {f['lead_us']:>6.1f}"
        )
    marked = [f for f in summary["families"] if f.get("mark1_us")]
    if marked:
        print("marks (a -DMK_TRACE_MARKS=1 kernel): µs from the end of a task's wait to its op's two points")
        for f in marked:
            print(f"{f['name']:>22}  mark1 {f['mark1_us']:6.2f}  mark2 {f['mark2_us']:6.2f}  run {f['run_us']:6.2f}")
    phases = summary.get("layer_phases_us", {})
    if phases.get("layers"):
        ends = ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k != "layers" and v is not None)
        print(f"a MoE layer's phases end (µs after the previous norm, mean of {phases['layers']} layers): {ends}")
    layer = summary["timeline_layer"]
    for offset, rows in enumerate((summary["timeline"], summary.get("next_timeline", []))):
        if not rows:
            continue
        print(f"layer {layer + offset}, µs from the end of the previous layer's norm:")
        heads = ("stream", "arrive", "start", "med st", "med end", "end")
        print(f"{'family':>22} {'tasks':>6} " + " ".join(f"{h:>7}" for h in heads))
        for r in rows:
            stream = "" if r["stream_us"] is None else f"{r['stream_us']:.1f}"
            print(
                f"{r['name']:>22} {r['count']:>6} {stream:>7} {r['arrive_us']:>7.1f} {r['first_start_us']:>7.1f} "
                f"{r['median_start_us']:>7.1f} {r['median_end_us']:>7.1f} {r['last_end_us']:>7.1f}"
            )


def stream_profile(g: StepGraph, trace: np.ndarray, ledger: np.ndarray, bin_us: float = 2.0) -> dict:
    """The weight stream of a MoE layer, from a -DMK_STREAM_LEDGER=1 kernel's ledger (`ledger_of`
    copied to the host) beside its trace: for each `bin_us` after the previous layer's last norm
    ended (the layer's input ready), averaged over the MoE layers, the rate at which all blocks
    issued ring stages and the rate at which their compute warps found them full (a stage found
    full without a wait counts when they looked, later than it landed), in TB/s; and per task
    family, the share of its stages some compute warp had to wait for, the mean number of warps
    that did, and the mean time from a stage's issue to its being found full. Where the issue rate
    falls well below the card's copy bandwidth, the stream idles; where no warp waits, the stream is
    ahead."""
    t = task_times(g, trace)
    ops, layer_of = g.tasks[..., 0], g.tasks[..., 1]
    raw = ledger.view(np.uint64)
    used = raw[..., 0] != 0
    sm, stage = np.nonzero(used)
    rows = raw[sm, stage]
    issue = (rows[:, 0] - np.uint64(t.first)).astype(np.int64).astype(np.float64)
    seen = (rows[:, 1] - np.uint64(t.first)).astype(np.int64).astype(np.float64)
    seen[rows[:, 1] == 0] = np.nan
    size = (rows[:, 2] & np.uint64(0xFFFFFFFF)).astype(np.float64)
    task = (rows[:, 3] & np.uint64(0xFFFFFFFF)).astype(np.int64)
    warps = np.unpackbits((rows[:, 3] >> np.uint64(32)).astype(np.uint32).view(np.uint8).reshape(-1, 4), axis=1)
    warps_waited = warps.sum(axis=1)

    norms = t.real & (ops == Op.RESIDUAL_NORM)
    norm_end = {int(layer): float(t.end[norms & (layer_of == layer)].max()) for layer in np.unique(layer_of[norms])}
    moe = sorted({int(layer) for layer in layer_of[t.real & (ops == Op.TOPK)]})
    windows = [(norm_end[layer - 1], norm_end[layer]) for layer in moe if layer - 1 in norm_end and layer in norm_end]
    bin_ns = bin_us * 1e3
    bins = int(np.ceil(max((b - a for a, b in windows), default=0) / bin_ns))

    def binned(times: np.ndarray, a: float, b: float) -> np.ndarray:
        """Bytes of the stages whose time falls in [a, b), per bin after a (NaN times: none)."""
        inside = (times >= a) & (times < b)
        k = ((times[inside] - a) // bin_ns).astype(np.int64)
        return np.bincount(k, weights=size[inside], minlength=bins)[:bins]

    issued, found, cover, layer_bytes = np.zeros(bins), np.zeros(bins), np.zeros(bins), []
    for a, b in windows:
        cover += np.clip((b - a) / bin_ns - np.arange(bins), 0, 1)  # the window's share of each bin
        in_window = binned(issue, a, b)
        issued += in_window
        found += binned(seen, a, b)
        layer_bytes.append(in_window.sum())
    per_bin = np.maximum(cover, 1e-9) * bin_ns  # ns of windows each bin saw
    families: dict[str, list[int]] = {}
    for i, (s, j) in enumerate(zip(sm, task, strict=True)):
        families.setdefault(task_family(g.tasks[s, j]), []).append(i)
    fam = []
    for name, idx in sorted(families.items()):
        sel = np.array(idx)
        lead = seen[sel] - issue[sel]
        fam.append(
            {
                "name": name,
                "stages": len(idx),
                "mb": float(size[sel].sum() / 1e6),
                "waited": float((warps_waited[sel] > 0).mean()),
                "warps_waited": float(warps_waited[sel].mean()),
                "issue_to_found_us": float(np.nanmean(lead) / 1e3) if np.isfinite(lead).any() else None,
            }
        )
    return {
        "bin_us": bin_us,
        "layers": len(windows),
        "layer_us": float(np.mean([b - a for a, b in windows]) / 1e3) if windows else None,
        "layer_mb": float(np.mean(layer_bytes) / 1e6) if windows else None,
        "issued_tb_s": [float(v) for v in issued / per_bin / 1e3],
        "found_tb_s": [float(v) for v in found / per_bin / 1e3],
        "families": sorted(fam, key=lambda f: -f["mb"]),
        "stages_recorded": int(used.sum()),
        "ledger_full": bool(used[:, -1].any()),  # a block had more stages than the ledger holds
    }


def print_stream_profile(title: str, p: dict) -> None:
    if not p["layers"]:
        print(f"\n{title}: no MoE layer in the ledger")
        return
    print(
        f"\n{title}: the weight stream over a MoE layer (mean of {p['layers']}: {p['layer_us']:.1f} µs, "
        f"{p['layer_mb']:.1f} MB issued in it, {p['layer_mb'] / p['layer_us']:.2f} TB/s)"
        + ("; some block's stages overflowed the ledger" if p["ledger_full"] else "")
    )
    print(f"{'µs after the norm':>18} {'issued TB/s':>12} {'found TB/s':>11}")
    for k, (a, b) in enumerate(zip(p["issued_tb_s"], p["found_tb_s"], strict=True)):
        print(f"{k * p['bin_us']:>18.0f} {a:>12.2f} {b:>11.2f}")
    print(f"{'family':>22} {'stages':>7} {'MB':>8} {'waited':>7} {'warps':>6} {'issue→found µs':>15}")
    for f in p["families"]:
        lead = "" if f["issue_to_found_us"] is None else f"{f['issue_to_found_us']:.2f}"
        print(
            f"{f['name']:>22} {f['stages']:>7} {f['mb']:>8.1f} {f['waited']:>7.0%} {f['warps_waited']:>6.1f} {lead:>15}"
        )
