"""The engine as its users see it, on the GPU: real geometry, synthetic bf16 weights, the
megakernel backend through `mk.engine.engine.Engine`'s Python API, every token timed as it arrives (on
the engine's event thread, `submit_callback`).

Rows:
- decode: B streams of ctx-token random prompts (B = 1, 4, 8 at 8K and 32K, and 16 at 4K and 8K: an 80 GB
  card's pool holds 16 streams of 4K, not of 8K),
  greedy, `ignore_eos`, all submitted at once; once every stream has its first token, the next 64
  steps of all B together are timed (then the streams are cancelled): per-stream and aggregate
  decode tok/s, and the kernel's own step time
  for the same batch and context (`MegakernelStep` on a scratch cache, same process, timed before
  the engine starts so that the engine sizes its KV pool without that cache beside it):
  `host_ms_per_step` is the gap between the two; where the host's time goes inside the launcher
  (µs per launch: `launch_prepare_us` task lists, page tables and checks, `launch_upload_us`,
  `launch_call_us`, `launch_wait_us` the wait for the step and its copies back, which holds the
  kernel) and outside it (`loop_host_us` per loop iteration).
- ttft: one prompt alone (512, 2K, 5,281 (just past the 4K bucket), 8K, 32K tokens), one new token:
  submission to first token, the prompt tokens per second that implies, the prefill chunks it took,
  and how much of it the backend's calls took (the rest: the control plane and the hand-over); the median of TTFT_RUNS
  prompts, with the fastest and slowest (`ttft_min_ms`, `ttft_max_ms`).
- reuse: a conversation's next turn: a 2K, 8K or 32K prompt, then the same tokens and
  REUSE_NEW_TOKENS more, whose prefix the KV cache holds (`cached` tokens): the second prompt's
  time to first token, timed as the ttft rows are.
- burst: 2, 4, 8 and 16 such next turns (2K cached, 256 new tokens each) arriving together: from
  the first submission to the last first token (BURST_SIZES says which path each takes).
- admit: one stream decoding at 8K while a 32K prompt arrives: the stream's longest and median gap
  between tokens while the long prompt is admitted, and the long prompt's time to first token. And
  the same while a next turn of ADMIT_NEXT_TURN new tokens after 8K cached ones arrives: one graph
  replay (`--whole-chunk-tokens 0`: slices of the eager path).
A row that does not fit the card is marked `skipped` with the reason, and the run goes on: a decode
row whose streams (each with DECODE_ROOM tokens past its prompt) need more blocks than the engine's KV
pool has, or any row that runs out of GPU memory (a kernel step alone: `kernel_skipped`).
The engine runs with the server's defaults (`python -m mk.server`: prefill chunk
mk.engine.options.PREFILL_CHUNK, max batch mk.engine.options.GPU_MAX_BATCH, launch-ahead on, the Engine's
share of the card's memory), except speculative decoding, off unless `--speculative` asks;
`--launch-ahead off` runs one step at a time,
`--prefill-chunk N` another chunk, `--prefill-graphs off` prefills fresh prompts without CUDA
graphs, `--prefix-graphs auto|on|off` runs chunks after a cached prefix as CUDA graphs (Engine(prefix_graphs=
...); auto: the next turn's chunks, up to mk.prefill.prefixed.NEXT_TURN_BUCKETS[-1] tokens; on: every
length; captured during the engine's warm-up), `--fresh-split off` runs a fresh prompt just past a
bucket of 4K or more as the next bucket's graph instead of that bucket's and a next-turn graph of the
rest (Engine(fresh_split=...), on by default),
`--decode-prefill-budget N` prefills at most N prompt tokens an iteration while a stream decodes
(through the whole model, with the sliced prefill that is on by default: mk.engine.options.DECODE_PREFILL_BUDGET);
`--sliced-prefill off` cuts the prompt into chunks of the budget instead of running whole chunks a few
layers an iteration; `--whole-chunk-tokens N` slices a lone chunk only past N tokens (Engine(
whole_chunk_tokens=...); default mk.engine.options.WHOLE_CHUNK_TOKENS, where such a chunk replays a graph);
`--prefill-only` runs the ttft and admit rows alone (with `--quick`: 512 and 8K prompts, and admit);
`--prompts N,M` times prompts of those lengths in the ttft rows instead;
`--gpu-memory-utilization U` lets mk use that share of the card's total memory instead of the Engine's
default (Engine(gpu_memory_utilization=...): weights, KV, activations and CUDA graphs together; the
engine sizes its KV pool from what the rest leaves).
`--temperature T` makes the decode streams seeded draws at T, which the kernel draws itself (Gumbel
noise in its sample tasks); with `--top-p P` below 1 as well they come back to the host sampler.
`--grammar` puts the decode streams under a regular expression (GRAMMAR; the built-in model's
tokenizer is the grammar's vocabulary, so ids past its 16,384 are never allowed): their logits are
drawn by the kernel among the mask's tokens (the mask uploaded before each step), or with
`--kernel-masks off` copied back and drawn on the host with the mask; their steps are launched ahead
too, the masks computed while each step runs (Engine(late_masks=...), on by default; `--late-masks off`
uploads the masks before each step instead). `--speculative on` verifies drafts from each stream's
own text or another stream's (Engine(speculative=...)); the decode rows then count the draft tokens verified in their
window and those accepted (random weights' greedy text falls into loops, which drafts copy: most
are accepted, so these rows are no measure of what failing drafts cost).
Usage: python benches/engine.py [--json out.json] [--quick] [--launch-ahead auto|on|off] [--prefill-chunk N]
       [--prefill-graphs auto|on|off] [--prefix-graphs auto|on|off] [--fresh-split on|off]
       [--decode-prefill-budget N] [--sliced-prefill auto|on|off] [--whole-chunk-tokens N]
       [--prefill-only] [--gpu-memory-utilization U] [--temperature T] [--top-p P]
       [--grammar [--kernel-masks auto|on|off] [--late-masks auto|on|off]] [--speculative auto|on|off]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from functools import partial
from pathlib import Path

import torch

import mk
from common import OUT_OF_MEMORY, gib, print_table, run_point, skipped, write_json
from decode import kv_bytes, random_step, time_events
from mk import _native
from mk.config import PAGE_SIZE, ModelConfig
from mk.engine.engine import Engine
from mk.engine.options import AUTO_ON_OFF, GPU_MAX_BATCH, PREFILL_CHUNK, WHOLE_CHUNK_TOKENS
from mk.engine.sampling import ConstraintSpec, SamplingParams
from mk.model import synthetic_weights
from mk.model.reference import Model
from mk.prefill.prefixed import NEXT_TURN_BUCKETS
from mk.text.tokenizer import Tokenizer

NEW_TOKENS = 64
# Room for new tokens past the longest prompt. A decode row's first streams decode while the later
# prompts are admitted (a decode step between prefill slices: ~64 steps a 32K prompt), so 8 x 32K
# needs well over 512 before its timed window starts.
DECODE_ROOM = 2048
# --grammar's rows: letters and spaces until 4,000 characters, so that the grammar never lets a
# row end (EOS) inside the timed window, whatever the random weights prefer.
GRAMMAR = "[a-z ]{4000}"
# A ttft row's prompts: one prompt's time moves by several ms from run to run (outside the
# backend's calls), so a row is the median of several.
TTFT_RUNS = 5
# A reuse row's next turn: the new tokens after the cached prompt (a user's message and the
# assistant's previous answer, say).
REUSE_NEW_TOKENS = 256
# A burst row's conversations: their cached prompts (then REUSE_NEW_TOKENS new tokens each), and how
# many arrive together: 2 and 4 share one graph replay (mk.prefill.prefixed.PACKED_SEQUENCES), 8 take
# two, 16 one packed pass on the usual path (more than STATIC_PASSES_MAX replays).
BURST_PROMPT = 2048
BURST_SIZES = (2, 4, 8, 16)
ADMIT_SLOW_GAP_S = 0.02
# The second admit row's next turn (after 8K cached): within mk.engine.options.WHOLE_CHUNK_TOKENS, so one
# graph replay by default, or slices of the eager path with --whole-chunk-tokens 0.
# (900: with the last partial page of the 8K history not cached, the uncached tokens stay within
# 1024; 1000 made 1,064, past WHOLE_CHUNK_TOKENS, so that row had timed the sliced path.)
ADMIT_NEXT_TURN = 900


class Timed:
    """One request's token arrival times (perf_counter seconds), filled on the event thread."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.finish: str | None = None
        self.error: str | None = None  # why it ended, where it failed
        self.done = threading.Event()
        self.stream = None  # the engine's handle (cancel)

    def __call__(self, event) -> None:
        if event.token_id is not None:
            self.times.append(time.perf_counter())
        if event.finish_reason is not None:
            self.finish = event.finish_reason
            self.error = event.error
            self.done.set()


def submit(
    engine: Engine,
    prompt: list[int],
    max_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    constraint: ConstraintSpec | None = None,
) -> tuple[Timed, float]:
    """Greedy by default; a temperature > 0 draws seeded tokens (on the GPU unless top_p < 1)."""
    t = Timed()
    start = time.perf_counter()
    seed = 7 if temperature else None
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=True, constraint=constraint
    )
    t.stream = engine.submit_callback(prompt, params, t)
    return t, start


def wait(streams: list[Timed], timeout: float = 600.0) -> None:
    for s in streams:
        if not s.done.wait(timeout):
            raise TimeoutError("a request did not finish")
        if s.finish != "length":
            raise RuntimeError(f"a request ended with {s.finish!r}{failures([s])}")


def failures(streams: list[Timed]) -> str:
    """The errors streams ended with, for an exception's message (out of memory, say)."""
    errors = sorted({s.error for s in streams if s.error})
    return f" ({'; '.join(errors)})" if errors else ""


def random_prompt(cfg: ModelConfig, n: int, gen: torch.Generator) -> list[int]:
    return torch.randint(0, cfg.vocab_size, (n,), generator=gen).tolist()


def kernel_step(model: Model, batch: int, ctx: int) -> dict:
    """The megakernel's own step time for `batch` rows at `ctx` (random cache, as benches/decode.py)."""
    step, g, buf, tasks = random_step(model, batch, ctx)
    return {"kernel_ms_per_step": time_events(lambda: step.run(g, buf, tasks), 20) * 1e3}


def kernel_steps(model: Model, points: list[tuple[int, int]]) -> dict[tuple[int, int], dict]:
    """kernel_step at each decode point, or the point marked skipped where its scratch cache
    does not fit; timed before the engine exists, each cache freed before the next."""
    steps = {}
    for b, c in points:
        point = {"row": "kernel step", "batch": b, "ctx": c}
        steps[b, c] = run_point(point, partial(kernel_step, model, b, c), kv_bytes(model.config, b, c), "its KV")
        torch.cuda.empty_cache()  # its scratch cache
    return steps


def decode_misfit(engine: Engine, cfg: ModelConfig, batch: int, ctx: int) -> str | None:
    """Why `batch` streams of `ctx`-token prompts, each with DECODE_ROOM tokens past it, cannot all
    hold their KV in the engine's pool at once (the row would wait for one to end), or None."""
    sliding = [cfg.is_sliding(layer) for layer in range(cfg.num_hidden_layers)]
    per_stream, _ = _native.kv_blocks_needed(
        sliding, cfg.sliding_window, ctx + DECODE_ROOM, engine.options.prefill_chunk
    )
    need, pool = batch * per_stream, engine.native_stats()["kv_blocks_total"]
    if need <= pool:
        return None
    return f"{OUT_OF_MEMORY} (its streams need {need:,} KV blocks, the engine's pool has {pool:,})"


def add_row(rows: list[dict], point: dict, fn, misfit: str | None = None) -> None:
    """fn()'s row into `rows`, printed; or `point` (the keys naming the row) marked skipped, where
    `misfit` says why it cannot fit or where it runs out of GPU memory (common.run_point)."""
    rows.append(skipped(point, misfit) if misfit else run_point(point, fn))
    if "skipped" not in rows[-1]:
        print(rows[-1], flush=True)


def decode_row(
    engine: Engine,
    cfg: ModelConfig,
    batch: int,
    ctx: int,
    gen: torch.Generator,
    kernel: dict,
    temperature: float = 0.0,
    top_p: float = 1.0,
    constraint: ConstraintSpec | None = None,
) -> dict:
    """The row's streams timed over their window, beside the kernel's own step (kernel_steps' row
    for the point: its time, or why it was skipped)."""
    budget = DECODE_ROOM - 8  # new tokens a stream may make (max_context leaves DECODE_ROOM past the prompt)
    runs = [
        submit(engine, random_prompt(cfg, ctx, gen), budget, temperature, top_p, constraint)[0] for _ in range(batch)
    ]
    try:
        marks, before, after = decode_window(engine, runs)
    finally:  # (a row that failed leaves no stream behind to slow the next)
        for r in runs:
            r.stream.cancel()
        for r in runs:
            r.done.wait(60)
    per_stream, aggregate = window_rates(runs, marks, NEW_TOKENS)
    stream_ms = 1e3 / statistics.median(per_stream)
    step_ms = kernel.get("kernel_ms_per_step")
    row = {
        "row": "decode",
        "batch": batch,
        "ctx": ctx,
        "temperature": temperature,
        "top_p": top_p,
        "grammar": constraint is not None,
        "stream_tok_s": statistics.median(per_stream),
        "aggregate_tok_s": aggregate,
        "engine_ms_per_step": stream_ms,
        "kernel_ms_per_step": step_ms,
        "host_ms_per_step": None if step_ms is None else stream_ms - step_ms,
        "kernel_tok_s": None if step_ms is None else batch / step_ms * 1e3,
        # Speculative decoding (--speculative): draft tokens verified in the window, and accepted.
        "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
        "accepted_tokens": after["accepted_tokens"] - before["accepted_tokens"],
        **launch_phases(before, after),
    }
    if "skipped" in kernel:
        row["kernel_skipped"] = kernel["skipped"]
    return row


def decode_window(engine: Engine, runs: list[Timed]) -> tuple[list[int], dict, dict]:
    """Waits until every stream decodes, then for NEW_TOKENS more of each: each stream's token
    count at the window's start, and the engine's counters at its start and end."""
    deadline = time.perf_counter() + 600
    while not all(r.times for r in runs):  # every stream admitted and decoding
        if time.perf_counter() > deadline or any(r.done.is_set() for r in runs):
            raise RuntimeError(f"the streams did not all start decoding{failures(runs)}")
        time.sleep(0.002)
    # The iteration that prefilled the last prompt also ran a decode step of the others, whose
    # tokens may not have arrived yet: two more tokens of every stream start the window after it.
    started = [len(r.times) for r in runs]
    while any(len(r.times) < n + 2 for r, n in zip(runs, started, strict=True)):
        if time.perf_counter() > deadline or any(r.done.is_set() for r in runs):
            raise RuntimeError(f"the streams did not all keep decoding{failures(runs)}")
        time.sleep(0.002)
    marks = [len(r.times) for r in runs]
    before = engine.native_stats()  # the launcher's phases are among the Rust counters, not EngineStats
    while min(len(r.times) - m for r, m in zip(runs, marks, strict=True)) < NEW_TOKENS:
        if any(r.done.is_set() for r in runs):
            raise RuntimeError(f"a stream ended before the timed window did{failures(runs)}")
        time.sleep(0.002)
    return marks, before, engine.native_stats()


def window_rates(runs: list[Timed], marks: list[int], tokens: int) -> tuple[list[float], float]:
    """Each stream's tok/s over its `tokens` tokens after its mark, and the aggregate tok/s over the
    window from the last stream's token at its mark to the first stream's `tokens`-th after it."""
    lo = max(r.times[m - 1] for r, m in zip(runs, marks, strict=True))
    hi = min(r.times[m - 1 + tokens] for r, m in zip(runs, marks, strict=True))
    inside = sum(sum(1 for t in r.times if lo < t <= hi) for r in runs)
    per_stream = [tokens / (r.times[m - 1 + tokens] - r.times[m - 1]) for r, m in zip(runs, marks, strict=True)]
    return per_stream, inside / (hi - lo)


def launch_phases(before: dict, after: dict) -> dict:
    """µs per launch in each phase of the megakernel launcher's host work over the window (its task
    lists and tables, the uploads, the launch call, the wait for the step), and the loop's own host
    time per iteration outside the backend."""
    launches = after.get("launches", 0) - before.get("launches", 0)
    iterations = after["iterations"] - before["iterations"]
    out = {"loop_host_us": (after["host_ns"] - before["host_ns"]) / max(1, iterations) / 1e3}
    for phase in ("prepare", "upload", "call", "wait"):
        key = f"launch_{phase}_ns"
        out[f"launch_{phase}_us"] = (after.get(key, 0) - before.get(key, 0)) / max(1, launches) / 1e3
    return out


def settled_stats(engine: Engine) -> dict:
    """The loop's counters once its iteration has ended (a token is handed over before the
    iteration that made it adds its backend time): read until two reads 20 ms apart agree."""
    stats = engine.native_stats()
    while True:
        time.sleep(0.02)
        again = engine.native_stats()
        if again["iterations"] == stats["iterations"]:
            return again
        stats = again


def ttft_row(engine: Engine, cfg: ModelConfig, n: int, gen: torch.Generator, new_tokens: int | None = None) -> dict:
    """The median of TTFT_RUNS prompts of n tokens (each a fresh one), with the fastest and the
    slowest time beside it; with `new_tokens`, of TTFT_RUNS next turns (ttft_run)."""
    runs = [ttft_run(engine, cfg, n, gen, new_tokens) for _ in range(TTFT_RUNS)]
    runs.sort(key=lambda r: r["ttft_ms"])
    return {**runs[(len(runs) - 1) // 2], "ttft_min_ms": runs[0]["ttft_ms"], "ttft_max_ms": runs[-1]["ttft_ms"]}


def ttft_run(engine: Engine, cfg: ModelConfig, n: int, gen: torch.Generator, new_tokens: int | None = None) -> dict:
    """One prompt. Also splits the time: the backend's calls (the prefill chunks, mostly) and the
    rest (the control plane, the hand-over of the token), from the loop's own counters over the
    request. With `new_tokens`, a conversation's next turn: an n-token prompt first (not timed),
    then the same n tokens and `new_tokens` more, whose prefix the cache holds (`cached`: the
    tokens it reused)."""
    prompt = random_prompt(cfg, n, gen)
    if new_tokens is not None:
        wait([submit(engine, prompt, 1)[0]])
        settled_stats(engine)
        prompt += random_prompt(cfg, new_tokens, gen)
    before = engine.native_stats()
    t, start = submit(engine, prompt, 1)
    wait([t])
    seconds = t.times[0] - start
    after = settled_stats(engine)
    backend_ms = (after["backend_ns"] - before["backend_ns"]) / 1e6
    return {
        "row": "ttft" if new_tokens is None else "reuse",
        "prompt": len(prompt),
        "cached": after["prefix_hit_tokens"] - before["prefix_hit_tokens"],
        "ttft_ms": seconds * 1e3,
        "prompt_tok_s": len(prompt) / seconds,
        "prefill_chunks": after["prefill_chunks"] - before["prefill_chunks"],
        "backend_ms": backend_ms,
        "outside_backend_ms": seconds * 1e3 - backend_ms,
    }


def burst_row(engine: Engine, cfg: ModelConfig, k: int, gen: torch.Generator) -> dict:
    """k conversations' next turns arriving together (each BURST_PROMPT cached tokens and
    REUSE_NEW_TOKENS new ones), nothing else running: from the first submission to the last
    first token; the median of TTFT_RUNS bursts, with the fastest and slowest beside it."""
    runs = []
    for _ in range(TTFT_RUNS):
        prompts = [random_prompt(cfg, BURST_PROMPT, gen) for _ in range(k)]
        wait([submit(engine, p, 1)[0] for p in prompts])
        before = settled_stats(engine)
        turns = [p + random_prompt(cfg, REUSE_NEW_TOKENS, gen) for p in prompts]
        with engine.together():  # one iteration admits them all
            streams = [submit(engine, turn, 1) for turn in turns]
        wait([t for t, _ in streams])
        after = settled_stats(engine)
        seconds = max(t.times[0] for t, _ in streams) - streams[0][1]
        runs.append((seconds * 1e3, after["prefix_hit_tokens"] - before["prefix_hit_tokens"], after, before))
    runs.sort(key=lambda r: r[0])
    ms, cached, after, before = runs[(len(runs) - 1) // 2]
    return {
        "row": "burst",
        "prompt": BURST_PROMPT + REUSE_NEW_TOKENS,
        "sequences": k,
        "cached": cached,
        "ttft_ms": ms,
        "ttft_min_ms": runs[0][0],
        "ttft_max_ms": runs[-1][0],
        "prefill_chunks": after["prefill_chunks"] - before["prefill_chunks"],
        "backend_ms": (after["backend_ns"] - before["backend_ns"]) / 1e6,
    }


def admit_row(engine: Engine, cfg: ModelConfig, gen: torch.Generator, new: int = 32768, cached: int = 0) -> dict:
    """A stream decoding at 8K while a prompt of `new` tokens is admitted; with `cached`, after that
    many tokens the prefix cache holds (a conversation's next turn, its history sent before)."""
    history = random_prompt(cfg, cached, gen) if cached else []
    if history:
        wait([submit(engine, history, 1)[0]])
    stream, _ = submit(engine, random_prompt(cfg, 8192, gen), 2000)
    while len(stream.times) < 20:
        time.sleep(0.005)
    hits = engine.native_stats()["prefix_hit_tokens"]
    long, start = submit(engine, history + random_prompt(cfg, new, gen), 1)
    wait([long])
    wait([stream])
    during = [b - a for a, b in zip(stream.times, stream.times[1:], strict=False) if start <= b <= long.times[0] + 0.05]
    gaps = [b - a for a, b in zip(stream.times, stream.times[1:], strict=False)]
    slow = sorted(g * 1e3 for g in during if g > ADMIT_SLOW_GAP_S)
    return {
        "row": "admit",
        "prompt": cached + new,
        "cached": engine.native_stats()["prefix_hit_tokens"] - hits,
        "ttft_ms": (long.times[0] - start) * 1e3,
        "longest_gap_ms": max(during) * 1e3 if during else None,
        "median_gap_ms": statistics.median(gaps) * 1e3,
        # The pauses a reader notices, in order: one a chunk, or a few long ones?
        "slow_gaps_ms": [round(g, 1) for g in slow],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench-out/engine.json")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 at 8K, 512- and 8K-token prompts")
    parser.add_argument("--prompts", default="", help="the ttft rows' prompt lengths, e.g. 3000,5281 (tokens)")
    parser.add_argument(
        "--launch-ahead", choices=list(AUTO_ON_OFF), default="auto", help="Engine(launch_ahead=...); auto: on"
    )
    parser.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK, help="Engine(prefill_chunk=...)")
    parser.add_argument(
        "--prefill-graphs", choices=list(AUTO_ON_OFF), default="auto", help="Engine(prefill_graphs=...); auto: on"
    )
    parser.add_argument(
        "--prefix-graphs",
        choices=list(AUTO_ON_OFF),
        default="auto",
        help=f"Engine(prefix_graphs=...); auto: chunks of up to {NEXT_TURN_BUCKETS[-1]} tokens",
    )
    parser.add_argument(
        "--prefill-only", action="store_true", help="only the time-to-first-token and admission rows (no decode rows)"
    )
    parser.add_argument(
        "--fresh-split", choices=["on", "off"], default="on", help="Engine(fresh_split=...): on (the default)"
    )
    parser.add_argument(
        "--whole-chunk-tokens",
        type=int,
        default=None,
        help=f"Engine(whole_chunk_tokens=...): default the engine's ({WHOLE_CHUNK_TOKENS}, with the graphs)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="Engine(gpu_memory_utilization=...): the share of the card's total memory mk may use (default: the "
        "Engine's)",
    )
    parser.add_argument(
        "--decode-prefill-budget",
        type=int,
        default=None,
        help="Engine(decode_prefill_budget=...): default the engine's",
    )
    parser.add_argument(
        "--sliced-prefill", choices=list(AUTO_ON_OFF), default="auto", help="Engine(sliced_prefill=...); auto: on"
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="decode rows' sampling temperature (0: greedy; > 0: seeded draws, by the kernel unless --top-p < 1)",
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="decode rows' top_p (< 1: sampled on the host)")
    parser.add_argument(
        "--grammar",
        action="store_true",
        help="decode rows under a grammar (GRAMMAR, the built-in model's tokenizer as its vocabulary)",
    )
    parser.add_argument(
        "--kernel-masks", choices=list(AUTO_ON_OFF), default="auto", help="Engine(kernel_masks=...), auto: on"
    )
    parser.add_argument(
        "--speculative",
        choices=["auto", "on", "off"],
        default="off",
        help="Engine(speculative=...): drafts from each stream's own text or another's; off by default, so that "
        "the rows measure plain decoding (the synthetic weights' greedy text loops, so with drafts most are "
        "accepted)",
    )
    parser.add_argument(
        "--late-masks",
        choices=list(AUTO_ON_OFF),
        default="auto",
        help="Engine(late_masks=...), auto: on where kernel masks and launch-ahead are",
    )
    args = parser.parse_args()
    cfg = ModelConfig.real()
    model = Model(cfg, synthetic_weights(cfg, seed=0, device="cuda", dtype=torch.bfloat16, std=0.01))
    gen = torch.Generator().manual_seed(0)
    full = [(b, c) for c in (8192, 32768) for b in (1, 4, 8)] + [
        (GPU_MAX_BATCH, c) for c in (4096, 8192) if GPU_MAX_BATCH > 8
    ]
    points = [(1, 8192), (8, 8192)] if args.quick else full
    # (5281: just past the 4K bucket, where the fresh split replays two graphs)
    prompts = [512, 8192] if args.quick else [512, 2048, 5281, 8192, 32768]
    if args.prompts:
        prompts = [int(n) for n in args.prompts.split(",")]
    reuse = [8192] if args.quick else [2048, 8192, 32768]
    # The kernel's own steps first, each scratch cache freed before the next: the engine then sizes its
    # KV pool from the card's memory with nothing of the bench's beside it, and needs to leave no room.
    kernels = {} if args.prefill_only else kernel_steps(model, points)
    memory = {} if args.gpu_memory_utilization is None else {"gpu_memory_utilization": args.gpu_memory_utilization}
    torch.cuda.empty_cache()  # building the synthetic weights peaks higher than serving: not counted
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()  # the engine's start: its prefill warm-up (compiles, graph captures)
    engine = Engine(
        model,
        backend="megakernel",
        max_batch=GPU_MAX_BATCH,
        max_context=32768 + DECODE_ROOM,
        prefill_chunk=args.prefill_chunk,
        **memory,
        launch_ahead=AUTO_ON_OFF[args.launch_ahead],
        prefill_graphs=AUTO_ON_OFF[args.prefill_graphs],
        prefix_graphs=AUTO_ON_OFF[args.prefix_graphs],
        fresh_split=args.fresh_split == "on",
        whole_chunk_tokens=args.whole_chunk_tokens,
        decode_prefill_budget=args.decode_prefill_budget,
        sliced_prefill=AUTO_ON_OFF[args.sliced_prefill],
        kernel_masks=AUTO_ON_OFF[args.kernel_masks],
        late_masks=AUTO_ON_OFF[args.late_masks],
        speculative=AUTO_ON_OFF[args.speculative],
        tokenizer_json=Tokenizer.from_dir(Path(mk.__file__).parent / "embedded").hf.to_str() if args.grammar else None,
    )
    start_s = time.perf_counter() - started
    free_gib = torch.cuda.mem_get_info()[0] / 2**30
    kv_blocks = engine.native_stats()["kv_blocks_total"]
    kv_pool = gib(2 * kv_blocks * PAGE_SIZE * cfg.kv_width * model.dtype.itemsize)
    print(
        f"engine start (prefill warm-up included): {start_s:.1f} s, {free_gib:.1f} GiB of GPU memory left, "
        f"KV pool {kv_blocks:,} blocks ({kv_pool})",
        flush=True,
    )
    grammar = ConstraintSpec("regex", GRAMMAR) if args.grammar else None
    rows = []
    try:
        submit_warm, _ = submit(engine, random_prompt(cfg, 600, gen), 8)  # first-call costs out of the way
        wait([submit_warm])
        for n in prompts:
            add_row(rows, {"row": "ttft", "prompt": n}, partial(ttft_row, engine, cfg, n, gen))
        for n in reuse:
            fn = partial(ttft_row, engine, cfg, n, gen, REUSE_NEW_TOKENS)
            add_row(rows, {"row": "reuse", "prompt": n + REUSE_NEW_TOKENS}, fn)
        for k in [] if args.quick else BURST_SIZES:
            point = {"row": "burst", "prompt": BURST_PROMPT + REUSE_NEW_TOKENS, "sequences": k}
            add_row(rows, point, partial(burst_row, engine, cfg, k, gen))
        for b, c in [] if args.prefill_only else points:
            fn = partial(decode_row, engine, cfg, b, c, gen, kernels[b, c], args.temperature, args.top_p, grammar)
            add_row(rows, {"row": "decode", "batch": b, "ctx": c}, fn, decode_misfit(engine, cfg, b, c))
        if not args.quick or args.prefill_only:
            add_row(rows, {"row": "admit", "prompt": 32768}, partial(admit_row, engine, cfg, gen))
            fn = partial(admit_row, engine, cfg, gen, ADMIT_NEXT_TURN, cached=8192)
            add_row(rows, {"row": "admit", "prompt": 8192 + ADMIT_NEXT_TURN}, fn)
        peak, total = torch.cuda.max_memory_reserved() / 2**30, torch.cuda.mem_get_info()[1] / 2**30
        print(f"GPU memory reserved by torch at its peak since the engine's start: {peak:.1f} GiB of {total:.0f}")
    finally:
        engine.close()
    decode = [r for r in rows if r["row"] == "decode"]
    cols = ["batch", "ctx", "temperature", "top_p", "grammar", "stream_tok_s", "aggregate_tok_s"]
    cols += ["engine_ms_per_step", "kernel_ms_per_step"]
    if any(r.get("draft_tokens") for r in decode):
        cols += ["draft_tokens", "accepted_tokens"]
    if decode:
        title = "engine decode (megakernel backend, real geometry, synthetic weights)"
        skips = ["kernel_skipped"] if any("kernel_skipped" in r for r in decode) else []
        print_table(title, decode, cols + ["host_ms_per_step", *skips])
        phases = ["launch_prepare_us", "launch_upload_us", "launch_call_us", "launch_wait_us", "loop_host_us"]
        print_table("host time of a decode step (µs)", decode, ["batch", "ctx", *phases])
    other = [r for r in rows if r["row"] != "decode"]
    cols = [
        "row",
        "prompt",
        "sequences",
        "cached",
        "ttft_ms",
        "ttft_min_ms",
        "ttft_max_ms",
        "prompt_tok_s",
        "prefill_chunks",
    ]
    cols += ["backend_ms", "outside_backend_ms"]
    cols += ["longest_gap_ms", "median_gap_ms"]
    print_table("time to first token", other, cols)
    write_json(
        args.json,
        "engine",
        rows,
        engine_start_s=start_s,
        free_after_start_gib=free_gib,
        kv_pool_blocks=kv_blocks,
        torch_peak_reserved_gib=peak,
        gpu_gib=total,
        settings=vars(args),
    )


if __name__ == "__main__":
    main()
