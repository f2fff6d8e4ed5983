"""Runs ON the GPU machine: where a decode step's layers spend their time, from the kernel's trace
(mk.megakernel.trace.task_times). For each MoE layer, every task family's first and median start
(after its wait) and last end, in µs after the previous layer's norm ended; the medians over the
full-attention and the sliding layers of 5 traced steps; for the gate/up -> down hand-off, how
long after the layer's last gate/up tile the down tiles arrive and start; and what finer counters
could save: how much earlier each KV head's QKV tasks (each slot's gate/up tiles) end than the
layer's last, which every attention split (down tile) waits for today. With --sms, one
step's task rows (first weight copy issued, arrival, start, end) on those SMs in layers 24 and 25.
Real geometry, synthetic weights, a random cache (benches/decode.py's).
Usage: python3 scripts/layer_timeline.py [--batch 1] [--ctx 8192] [--sms 0,37,90]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benches"))
from decode import random_step, synthetic_stacked  # noqa: E402
from mk.config import ModelConfig  # noqa: E402
from mk.megakernel.graph import ARG, Matrix, Op  # noqa: E402
from mk.megakernel.launch import trace_buffer  # noqa: E402
from mk.megakernel.trace import task_family, task_times  # noqa: E402
from mk.model.reference import Model  # noqa: E402

TRACED_STEPS = 5


def expert_tiles(g, sel: np.ndarray, matrix: Matrix) -> list[tuple[int, int]]:
    return [
        (s, i)
        for s, i in zip(*np.nonzero(sel), strict=True)
        if g.tasks[s, i, 0] == Op.GEMV and g.tasks[s, i, ARG] == matrix
    ]


def qkv_heads(cfg: ModelConfig, task: np.ndarray) -> range:
    """The KV heads whose rows (Q, K or V) a QKV task writes."""
    hd, qw, kvw = cfg.head_dim, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    r0, r1 = int(task[ARG + 1]), int(task[ARG + 1]) + 16 * int(task[ARG + 2])
    if r0 < qw:
        per_head, base, end = qw // cfg.num_key_value_heads, 0, qw
    else:
        base = qw if r0 < qw + kvw else qw + kvw
        per_head, end = hd, base + kvw
    return range((r0 - base) // per_head, (min(r1, end) - 1 - base) // per_head + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ctx", type=int, default=8192)
    parser.add_argument("--sms", default="", help="SMs whose task rows to print (layers 24 and 25), e.g. 0,37,90")
    args = parser.parse_args()
    cfg = ModelConfig.real()
    model = Model(cfg, synthetic_stacked(cfg, seed=0)[0])
    step, g, buf, tasks = random_step(model, args.batch, args.ctx)
    ops, layers = g.tasks[..., 0], g.tasks[..., 1]
    figures: dict[str, dict[str, list[float]]] = {}
    for _ in range(TRACED_STEPS):
        tr = trace_buffer(g, buf.x.device)
        step.run(g, buf, tasks, trace=tr)
        torch.cuda.synchronize()
        trace = tr.cpu().numpy()
        t = task_times(g, trace)
        begin = t.start + t.wait / t.hz * 1e9
        for layer in range(1, cfg.num_hidden_layers):
            t0 = t.end[t.real & (ops == Op.RESIDUAL_NORM) & (layers == layer - 1)].max()
            sel = t.real & (layers == layer)
            d = figures.setdefault("full" if cfg.window(layer) is None else "sliding", {})
            families: dict[str, list[tuple[int, int]]] = {}
            for s, i in zip(*np.nonzero(sel), strict=True):
                families.setdefault(task_family(g.tasks[s, i]), []).append((s, i))
            for name, where in families.items():
                idx = tuple(np.array(where).T)
                d.setdefault(f"{name} first start", []).append((begin[idx].min() - t0) / 1e3)
                d.setdefault(f"{name} median start", []).append((np.median(begin[idx]) - t0) / 1e3)
                d.setdefault(f"{name} last end", []).append((t.end[idx].max() - t0) / 1e3)
            # What per-KV-head QKV counters could save: each split waits for every QKV task of the
            # layer, not only its own head's.
            qkv = [(s, i) for s, i in zip(*np.nonzero(sel), strict=True) if task_family(g.tasks[s, i]) == "gemv:qkv"]
            head_end: dict[int, float] = {}
            for s, i in qkv:
                for h in qkv_heads(cfg, g.tasks[s, i]):
                    head_end[h] = max(head_end.get(h, 0.0), t.end[s, i])
            last_qkv = max(head_end.values())
            d.setdefault("qkv: last end - its own head's last end (mean)", []).append(
                np.mean([last_qkv - e for e in head_end.values()]) / 1e3
            )
            up, down = expert_tiles(g, sel, Matrix.EXPERT_GATE_UP), expert_tiles(g, sel, Matrix.EXPERT_DOWN)
            if up and down:  # per-(slot, tile) tasks (no expert queues)
                last_up = max(t.end[s, i] for s, i in up)
                slot_end: dict[int, float] = {}
                for s, i in up:
                    slot = int(g.tasks[s, i, ARG + 3])
                    slot_end[slot] = max(slot_end.get(slot, 0.0), t.end[s, i])
                # What per-slot gate/up -> down counters could save.
                d.setdefault("up: last end - its own slot's last end (mean)", []).append(
                    np.mean([last_up - e for e in slot_end.values()]) / 1e3
                )
                d.setdefault("down: median arrival - last gate/up end", []).append(
                    np.median([t.start[s, i] - last_up for s, i in down]) / 1e3
                )
                d.setdefault("down: median start - last gate/up end", []).append(
                    np.median([begin[s, i] - last_up for s, i in down]) / 1e3
                )
    sms = [int(s) for s in args.sms.split(",") if s]
    for layer in (24, 25) if sms else ():
        t0 = t.end[t.real & (ops == Op.RESIDUAL_NORM) & (layers == layer - 1)].max()
        for sm in sms:
            print(f"-- the last traced step, layer {layer}, SM {sm}: family, µs of: stream arrive start end")
            for i in np.nonzero(t.real[sm] & (layers[sm] == layer))[0]:
                issued = trace[sm, i, 2]
                stream = (issued - t.first - t0) / 1e3 if issued != 0 else float("nan")
                print(
                    f"   {task_family(g.tasks[sm, i]):26s} {stream:7.2f} {(t.start[sm, i] - t0) / 1e3:7.2f}"
                    f" {(begin[sm, i] - t0) / 1e3:7.2f} {(t.end[sm, i] - t0) / 1e3:7.2f}"
                )
    print(f"== batch {args.batch}, context {args.ctx}: medians over layers and {TRACED_STEPS} traced steps")
    print("   (µs after the previous layer's norm ended)")
    for kind, d in figures.items():
        print(f"-- {kind} MoE layers")
        for k in sorted(d, key=lambda k: np.median(d[k])):
            print(f"  {k:45s} {np.median(d[k]):7.2f}")


if __name__ == "__main__":
    main()
