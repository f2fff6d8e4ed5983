"""The engine on the CPU, as `python -m mk.server` runs it with no arguments: the built-in model
(mk.default_model), float32, the PyTorch backend, the engine's CPU defaults, through
`mk.engine.engine.Engine`'s Python API, every token timed as it arrives (`submit_callback`).

Rows:
- decode: B streams of ctx-token random prompts (B = 1, 4, 8; ctx 256 and 2K), greedy,
  `ignore_eos`, timed as benches/engine.py times them (NEW_TOKENS steps once every stream decodes):
  per-stream and aggregate decode tok/s, ms per step, and the weights' bytes per step over the
  step time (a CPU has no speed-of-light figure of record here: a step of this model is bound by
  dispatch, not by memory).
- ttft: one random prompt alone (64, 512, 2K tokens), one new token: submission to first token,
  benches/engine.py's ttft rows (the median of its TTFT_RUNS prompts).

`--serial-tokens N` sets mk.engine.runner.SERIAL_TOKENS (calls of fewer tokens run on one intra-op
thread; 0: never) for an A/B of that policy.

Usage: python benches/cpu_engine.py [--json out.json] [--serial-tokens N] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mk.engine.runner
from common import print_table, write_json
from engine import NEW_TOKENS, Timed, random_prompt, submit, ttft_row, window_rates
from mk.default_model import NAME, load_default
from mk.engine.engine import Engine

MAX_CONTEXT = 4096


def cpu_decode_row(engine: Engine, batch: int, ctx: int, gen: torch.Generator, weight_bytes: int) -> dict:
    """B streams decoding together: NEW_TOKENS steps timed from two tokens after the last stream's
    first (the iteration that prefilled the last prompt also made the others' tokens), then cancelled."""
    room = engine.max_context - ctx
    runs: list[Timed] = [submit(engine, random_prompt(engine.config, ctx, gen), room)[0] for _ in range(batch)]
    deadline = time.perf_counter() + 600

    def until(done) -> None:
        while not done():
            if time.perf_counter() > deadline or any(r.done.is_set() for r in runs):
                raise RuntimeError("the streams did not all keep decoding")
            time.sleep(0.001)

    until(lambda: all(r.times for r in runs))
    started = [len(r.times) for r in runs]
    until(lambda: all(len(r.times) >= n + 2 for r, n in zip(runs, started, strict=True)))
    marks = [len(r.times) for r in runs]
    until(lambda: min(len(r.times) - m for r, m in zip(runs, marks, strict=True)) >= NEW_TOKENS)
    for r in runs:
        r.stream.cancel()
    for r in runs:
        r.done.wait(60)
    per_stream, aggregate = window_rates(runs, marks, NEW_TOKENS)
    step_ms = 1e3 / statistics.median(per_stream)
    return {
        "batch": batch,
        "ctx": ctx,
        "ms_per_step": step_ms,
        "tok_s_per_stream": statistics.median(per_stream),
        "tok_s_aggregate": aggregate,
        "weight_gb_s": weight_bytes / (step_ms / 1e3) / 1e9,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="bench-out/cpu_engine.json")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 at 256, 64- and 512-token prompts")
    parser.add_argument(
        "--serial-tokens",
        type=int,
        default=mk.engine.runner.SERIAL_TOKENS,
        help="calls of fewer tokens run on one intra-op thread (mk.engine.runner.SERIAL_TOKENS; 0: never)",
    )
    args = parser.parse_args()
    mk.engine.runner.SERIAL_TOKENS = args.serial_tokens
    model, _ = load_default()
    weight_bytes = sum(w.numel() * w.element_size() for w in model.weights.values())
    engine = Engine(model, max_context=MAX_CONTEXT, progress=False)
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 256), (8, 256)] if args.quick else [(b, c) for c in (256, 2048) for b in (1, 4, 8)]
    prompts = [64, 512] if args.quick else [64, 512, 2048]
    try:
        submit(engine, random_prompt(model.config, 64, gen), 4)[0].done.wait(60)  # first-call costs
        decode = [cpu_decode_row(engine, b, c, gen, weight_bytes) for b, c in shapes]
        ttft = [ttft_row(engine, model.config, n, gen) for n in prompts]
    finally:
        engine.close()
    title = f"{NAME} on the CPU ({torch.get_num_threads()} threads, serial below {args.serial_tokens} tokens)"
    print_table(
        f"decode: {title}",
        decode,
        ["batch", "ctx", "ms_per_step", "tok_s_per_stream", "tok_s_aggregate", "weight_gb_s"],
    )
    columns = ["prompt", "ttft_ms", "ttft_min_ms", "ttft_max_ms", "prompt_tok_s", "backend_ms"]
    print_table(f"time to first token: {title}", ttft, columns)
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
