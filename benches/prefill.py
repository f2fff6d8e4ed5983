"""Prefill speed of mk.prefill.packed at the real geometry (synthetic N(0, 0.01) weights, experts stacked).

Rows: one prompt of 512, 2K, 8K, 32K and 128K tokens (default chunk); the 8K prompt again with
other chunk sizes, without compiled elementwise steps, and with SDPA attention (what the fast
paths buy); a batch of eight 1K prompts in one call against the same eight one call each.
Each request's pages are mapped up front (no window release: it changes no compute), pools are
NaN-poisoned first and every logit must come out finite.

Achieved TFLOP/s = matrix FLOPs (`mk.prefill.packed.prefill_flops`: the active weights per token, the
attention over the visible keys, the LM head for each last token) / wall time of the call,
against the H200's measured rate on large bf16 matmuls (`MATMUL_FLOPS`). Prints a table, writes JSON (and
a PNG when matplotlib is there). A case whose KV pool does not fit the card's free memory (checked
before allocating it), or that runs out of memory, is a row marked `skipped`, and the run goes on.
Usage: python benches/prefill.py [--json out.json] [--quick] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from common import card_name, print_table, pyplot, run_point, write_json
from mk.config import PAGE_SIZE, ModelConfig
from mk.model import synthetic_weights
from mk.model.paged import PagedKV
from mk.model.reference import Model
from mk.prefill.packed import Prefill, PrefillRequest, prefill_flops, stack_experts

MATMUL_FLOPS = 790e12  # measured bf16 dense matmul rate of the H200 (docs/PERF.md, hardware ceilings)


def requests_for(cfg: ModelConfig, lengths: list[int], gen: torch.Generator):
    """A NaN-poisoned pool and one request per length, every page of every layer mapped."""
    pages = [-(-n // PAGE_SIZE) for n in lengths]
    layers = cfg.num_hidden_layers
    kv = PagedKV(cfg, layers * sum(pages), torch.bfloat16, torch.device("cuda"))
    kv.k.fill_(float("nan"))
    kv.v.fill_(float("nan"))
    reqs, base = [], 0
    for n, p in zip(lengths, pages, strict=True):
        table = (base + torch.arange(layers * p, dtype=torch.int32)).view(layers, p)
        base += layers * p
        tokens = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
        reqs.append(PrefillRequest(tokens, 0, table))
    return kv, reqs


def pool_bytes(cfg: ModelConfig, lengths: list[int]) -> int:
    """The bytes of requests_for's pool: K and V of every page of every layer, bf16."""
    blocks = cfg.num_hidden_layers * sum(-(-n // PAGE_SIZE) for n in lengths)
    return 2 * blocks * PAGE_SIZE * cfg.kv_width * 2


def timed(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(prefill: Prefill, cfg, lengths: list[int], reps: int, gen, label: str, singly: bool = False) -> dict:
    kv, reqs = requests_for(cfg, lengths, gen)

    def call():
        return [prefill([r], kv) for r in reqs] if singly else prefill(reqs, kv)

    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    seconds, out = timed(call, reps)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    logits = torch.cat([o.logits for o in out]) if singly else out.logits
    flops = sum(prefill_flops(cfg, 0, n) for n in lengths)
    tokens = sum(lengths)
    row = {
        "case": label,
        "tokens": tokens,
        "chunk": prefill.chunk,
        "paths": f"{prefill.attention}/{prefill.moe}{'/compiled' if prefill.compiled else ''}",
        "ms": seconds * 1e3,
        "tok_s": tokens / seconds,
        "tflop": flops / 1e12,
        "tflop_s": flops / seconds / 1e12,
        "matmul_fraction": flops / seconds / MATMUL_FLOPS,
        "peak_activation_gib": peak,
        "valid_output": bool(torch.isfinite(logits).all()),
    }
    return row


def measure_point(prefill: Prefill, cfg, lengths: list[int], reps: int, gen, label: str, singly: bool = False) -> dict:
    """measure()'s row, or the case marked skipped where its pool or its work does not fit the card."""
    point = {"case": label, "tokens": sum(lengths)}
    fn = partial(measure, prefill, cfg, lengths, reps, gen, label, singly)
    row = run_point(point, fn, pool_bytes(cfg, lengths), "its KV pool")
    torch.cuda.empty_cache()  # this case's pool
    if "skipped" not in row:
        print(row, flush=True)
    return row


def profile(prefill: Prefill, cfg, n: int, gen) -> dict:
    """One n-token prefill under torch.profiler: wall time against the GPU's busy time, and the ops
    that cost the most host and device time (where a short prompt's fixed cost goes)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    kv, reqs = requests_for(cfg, [n], gen)
    prefill(reqs, kv)  # warm
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        prefill(reqs, kv)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    events = prof.key_averages()

    def device_us(e) -> float:
        return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))

    ops = [
        {"name": e.key, "count": e.count, "self_cpu_us": e.self_cpu_time_total, "self_device_us": device_us(e)}
        for e in events
    ]
    busy = sum(o["self_device_us"] for o in ops)
    out = {"tokens": n, "wall_ms": wall * 1e3, "device_busy_ms": busy / 1e3}
    out["by_device"] = sorted(ops, key=lambda o: -o["self_device_us"])[:20]
    out["by_host"] = sorted(ops, key=lambda o: -o["self_cpu_us"])[:20]
    print(f"\nprofile of a {n}-token prefill: wall {wall * 1e3:.1f} ms, GPU busy {busy / 1e3:.1f} ms")
    for key, title in (("by_device", "self device µs"), ("by_host", "self host µs")):
        print(f"{'op':>60} {'calls':>6} {title:>16}")
        for o in out[key]:
            value = o["self_device_us"] if key == "by_device" else o["self_cpu_us"]
            print(f"{o['name'][:60]:>60} {o['count']:>6} {value:>16.0f}")
    return out


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    single = [r for r in rows if r["case"].startswith("prompt ") and "skipped" not in r]
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    ax[0].plot([r["tokens"] for r in single], [r["tok_s"] for r in single], marker="o")
    ax[0].axhline(25000, ls="--", c="gray", lw=0.8, label="bar at 8K: 25,000 tok/s")
    ax[0].set_ylabel("prefill tokens/s")
    ax[1].plot([r["tokens"] for r in single], [r["tflop_s"] for r in single], marker="o")
    ax[1].axhline(MATMUL_FLOPS / 1e12, ls="--", c="gray", lw=0.8, label="bf16 matmul rate")
    ax[1].set_ylabel("achieved TFLOP/s")
    for a in ax:
        a.set_xscale("log", base=2)
        a.set_xlabel("prompt tokens")
        a.legend(fontsize=7)
    fig.suptitle(f"mk prefill, real geometry, synthetic weights ({card_name()})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default="bench-out/prefill.json")
    parser.add_argument("--quick", action="store_true", help="8K prompt and the batch only")
    parser.add_argument("--chunk", type=int, default=8192)
    parser.add_argument(
        "--profile", action="store_true", help="profile a 512-, a 2K- and an 8K-token prefill, then stop"
    )
    args = parser.parse_args()
    cfg = ModelConfig.real()
    t0 = time.perf_counter()
    weights = synthetic_weights(cfg, seed=0, device="cuda")
    stack_experts(weights, cfg)
    torch.cuda.empty_cache()
    model = Model(cfg, weights)
    packed = Prefill(model, chunk=args.chunk)
    gen = torch.Generator().manual_seed(0)
    setup_s = time.perf_counter() - t0

    t0 = time.perf_counter()  # first calls compile (flex attention, elementwise steps)
    for lengths in ([300], [1000, 20]):
        measure(packed, cfg, lengths, 1, gen, "warm-up")
        torch.cuda.empty_cache()
    compile_s = time.perf_counter() - t0
    print(f"weights {setup_s:.0f} s, first calls (compile) {compile_s:.0f} s", flush=True)
    if args.profile:
        profiles = [profile(packed, cfg, n, gen) for n in (512, 2048, 8192)]
        write_json(args.json, "prefill-profile", profiles, setup_s=setup_s, compile_s=compile_s, chunk=args.chunk)
        return

    rows = []
    lengths = [8192] if args.quick else [512, 2048, 8192, 32768, 131072]
    for n in lengths:
        reps = 3 if n <= 8192 else 2 if n <= 32768 else 1
        rows.append(measure_point(packed, cfg, [n], reps, gen, f"prompt {n}"))
    if not args.quick:
        for chunk in (1024, 2048, 4096):
            case = f"prompt 8192, chunk {chunk}"
            rows.append(measure_point(Prefill(model, chunk=chunk), cfg, [8192], 3, gen, case))
        for label, kw in (("eager elementwise", {"compile": False}), ("sdpa attention", {"attention": "sdpa"})):
            case = f"prompt 8192, {label}"
            rows.append(measure_point(Prefill(model, chunk=args.chunk, **kw), cfg, [8192], 2, gen, case))
    batch = measure_point(packed, cfg, [1024] * 8, 3, gen, "8 x 1K, one call")
    singles = measure_point(packed, cfg, [1024] * 8, 3, gen, "8 x 1K, one call each", singly=True)
    if "skipped" not in batch and "skipped" not in singles:
        batch["speedup_vs_singles"] = singles["ms"] / batch["ms"]
    rows += [batch, singles]

    cols = ["case", "tokens", "chunk", "ms", "tok_s", "tflop_s", "matmul_fraction", "peak_activation_gib"]
    print_table("prefill, real geometry, synthetic weights (matmul rate 790 TFLOP/s)", rows, cols)
    if "speedup_vs_singles" in batch:
        print(f"batch of eight 1K prompts: {batch['speedup_vs_singles']:.2f}x eight single prefills")
    print(f"paths: {packed.attention} attention, {packed.moe} MoE, compiled elementwise: {packed.compiled}")
    write_json(args.json, "prefill", rows, setup_s=setup_s, compile_s=compile_s, chunk=args.chunk)
    plot(rows, Path(args.json).with_suffix(".png"))


if __name__ == "__main__":
    main()
