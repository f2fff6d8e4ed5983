"""The engine on the CPU, as `python -m mk.server` runs it with no arguments: the built-in model
(mk.default_model), float32, the reference backend, the engine's CPU defaults, through
`mk.engine.Engine`'s Python API, every token timed as it arrives (`submit_callback`).

Rows:
- decode: B streams of ctx-token random prompts (B = 1, 4, 8; ctx 256 and 2K), greedy,
  `ignore_eos`; once every stream has its first token, the next NEW_TOKENS steps are timed:
  per-stream and aggregate decode tok/s, ms per step, and the weights' bytes per step over the
  step time (a CPU has no speed-of-light figure of record here: a step of this model is bound by
  dispatch, not by memory).
- ttft: one random prompt alone (64, 512, 2K tokens), one new token: submission to first token;
  the median of TTFT_RUNS prompts.

`--serial-tokens N` sets mk.runner.SERIAL_TOKENS (calls of fewer tokens run on one intra-op
thread; 0: never) for an A/B of that policy.

Usage: python benches/cpu_engine.py [--json out.json] [--serial-tokens N] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mk.runner
from common import print_table, write_json
from engine import random_prompt, submit, wait
from mk.default_model import NAME, load_default
from mk.engine import Engine

NEW_TOKENS = 48
TTFT_RUNS = 5
MAX_CONTEXT = 4096


def decode_row(engine: Engine, batch: int, ctx: int, gen: torch.Generator, weight_bytes: int) -> dict:
    cfg = engine.config
    runs = [submit(engine, random_prompt(cfg, ctx, gen), NEW_TOKENS + 16)[0] for _ in range(batch)]
    deadline = time.perf_counter() + 600
    while not all(r.times for r in runs):
        if time.perf_counter() > deadline:
            raise RuntimeError("the streams did not all start decoding")
        time.sleep(0.001)
    wait(runs)
    # The steps that every stream took part in: from the last first token on.
    start = max(r.times[0] for r in runs)
    spans = [[t for t in r.times if t >= start] for r in runs]
    steps = min(len(s) for s in spans) - 1
    seconds = max(s[steps] - s[0] for s in spans)
    step_ms = seconds / steps * 1e3
    return {
        "batch": batch,
        "ctx": ctx,
        "steps": steps,
        "ms_per_step": step_ms,
        "tok_s_per_stream": 1e3 / step_ms,
        "tok_s_aggregate": batch * 1e3 / step_ms,
        "weight_gb_s": weight_bytes / (step_ms / 1e3) / 1e9,
    }


def ttft_row(engine: Engine, n: int, gen: torch.Generator) -> dict:
    times = []
    for _ in range(TTFT_RUNS):
        timed, start = submit(engine, random_prompt(engine.config, n, gen), 1)
        wait([timed])
        times.append((timed.times[0] - start) * 1e3)
    return {"prompt": n, "ttft_ms": statistics.median(times), "ttft_min_ms": min(times), "ttft_max_ms": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="bench-out/cpu_engine.json")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 at 256, 64- and 512-token prompts")
    parser.add_argument(
        "--serial-tokens",
        type=int,
        default=mk.runner.SERIAL_TOKENS,
        help="calls of fewer tokens run on one intra-op thread (mk.runner.SERIAL_TOKENS; 0: never)",
    )
    args = parser.parse_args()
    mk.runner.SERIAL_TOKENS = args.serial_tokens
    model, _ = load_default()
    weight_bytes = sum(w.numel() * w.element_size() for w in model.weights.values())
    engine = Engine(model, max_context=MAX_CONTEXT, progress=False)
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 256), (8, 256)] if args.quick else [(b, c) for c in (256, 2048) for b in (1, 4, 8)]
    prompts = [64, 512] if args.quick else [64, 512, 2048]
    try:
        submit(engine, random_prompt(model.config, 64, gen), 4)[0].done.wait(60)  # first-call costs
        decode = [decode_row(engine, b, c, gen, weight_bytes) for b, c in shapes]
        ttft = [ttft_row(engine, n, gen) for n in prompts]
    finally:
        engine.close()
    title = f"{NAME} on the CPU ({torch.get_num_threads()} threads, serial below {args.serial_tokens} tokens)"
    print_table(
        f"decode: {title}",
        decode,
        ["batch", "ctx", "steps", "ms_per_step", "tok_s_per_stream", "tok_s_aggregate", "weight_gb_s"],
    )
    print_table(f"time to first token: {title}", ttft, ["prompt", "ttft_ms", "ttft_min_ms", "ttft_max_ms"])
    write_json(
        args.json,
        "cpu_engine",
        [{"kind": "decode", **r} for r in decode] + [{"kind": "ttft", **r} for r in ttft],
        model=NAME,
        threads=torch.get_num_threads(),
        serial_tokens=args.serial_tokens,
    )


if __name__ == "__main__":
    main()
