"""End-to-end serving benchmark: concurrent streaming clients against `python -m mk.server` over loopback.

For each concurrency level, that many clients each send streaming completions back to back (fixed prompt
and output lengths: greedy, EOS ignored) until the level's request count is done. Identical clients that
start together stay in step, so their requests arrive in bursts; `--rates` sends them instead at random
times (a Poisson process at each rate, seeded), as independent users would. Reports requests/s,
output tokens/s, time to first token and inter-token latency percentiles, as a table and JSON.

Tokens are timed, not text: every request asks for continuous usage stats (`stream_options`:
`continuous_usage_stats`, vLLM's extension), so the server streams each token as it is sampled, with the
usage so far, even when its text is empty (a partial character, or the synthetic model's ids past its
tokenizer's vocabulary), and the benchmark counts each chunk's new tokens. (Asking for logprobs would
do that too, but such rows are sampled on the host, one step at a time: not what a client gets.)

  python benches/serve.py                                  # starts the default server itself
  python benches/serve.py --url http://127.0.0.1:8000      # an already running server
  python benches/serve.py --server-args=--synthetic        # a server started with these flags (with "=":
                                                           # a value starting with "--" is a flag otherwise)
  python benches/serve.py --rates 2,5,10                   # open loop: requests arriving at these rates a second

A level whose requests fail because the server's GPU ran out of memory (their error, or the log of a
server this script started, says so) is a row marked `skipped`, as is every level after the server
it started has exited, and the run goes on; any other failure stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import OUT_OF_MEMORY, print_table, says_out_of_memory, skipped, write_json  # noqa: E402


class RequestFailed(RuntimeError):
    """The server answered a request with an error: an error status, or an error chunk in its stream."""


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    start = time.perf_counter()
    arrivals: list[float] = []
    tokens, most_per_chunk = 0, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.is_error:
            await r.aread()
            raise RequestFailed(f"HTTP {r.status_code}: {r.text[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RequestFailed(str(chunk["error"].get("message", chunk["error"])))
            done = chunk["usage"]["completion_tokens"]
            if done > tokens:
                # a chunk's tokens arrived together: the first after the gap, the others at once
                arrivals += [time.perf_counter()] * (done - tokens)
                most_per_chunk = max(most_per_chunk, done - tokens)
                tokens = done
    end = time.perf_counter()
    ttft = arrivals[0] - start if arrivals else float("nan")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    return {"ttft": ttft, "gaps": gaps, "e2e": end - start, "tokens": tokens, "most_per_chunk": most_per_chunk}


def request_body(prompt: str, max_tokens: int) -> dict:
    return {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }


async def run_level(url: str, concurrency: int, requests: int, prompt: str, max_tokens: int) -> dict:
    """Closed loop: `concurrency` clients, each sending its next request when its last one ends."""
    body = request_body(prompt, max_tokens)
    queue = list(range(requests))
    results: list[dict] = []
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def worker() -> None:
            while queue:
                queue.pop()
                results.append(await one_request(client, url, body))

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - start
    return {"concurrency": concurrency, "rate": None, **summarise(results, wall)}


async def run_rate(url: str, rate: float, requests: int, prompt: str, max_tokens: int, seed: int = 0) -> dict:
    """Open loop: requests arriving at random (a Poisson process of `rate` a second, seeded), each
    sent when it arrives whatever the others do, as independent users' would be."""
    body = request_body(prompt, max_tokens)
    rng = random.Random(seed)
    arrivals = list(itertools.accumulate(rng.expovariate(rate) for _ in range(requests)))
    limits = httpx.Limits(max_connections=requests + 4, max_keepalive_connections=requests + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def arrive(at: float) -> dict:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await one_request(client, url, body)

        start = time.perf_counter()
        results = await asyncio.gather(*(arrive(at) for at in arrivals))
        wall = time.perf_counter() - start
    return {"concurrency": None, "rate": rate, **summarise(list(results), wall)}


def summarise(results: list[dict], wall: float) -> dict:
    ttfts = [r["ttft"] for r in results]
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    return {
        "requests": len(results),
        "req_per_s": len(results) / wall,
        "out_tok_per_s": tokens / wall,
        "ttft_p50_ms": 1e3 * pct(ttfts, 0.5),
        "ttft_p90_ms": 1e3 * pct(ttfts, 0.9),
        "ttft_p99_ms": 1e3 * pct(ttfts, 0.99),
        "itl_p50_ms": 1e3 * pct(gaps, 0.5),
        "itl_p90_ms": 1e3 * pct(gaps, 0.9),
        "itl_p99_ms": 1e3 * pct(gaps, 0.99),
        "e2e_p50_s": statistics.median(r["e2e"] for r in results),
        "tokens_per_request": tokens / max(1, len(results)),
        # every token reached the client in a chunk of its own, as it was sampled
        "every_token_streamed": all(r["most_per_chunk"] <= 1 for r in results),
    }


def run_point(point: dict, run, server) -> dict:
    """One level's row (`run`: its coroutine), or `point` (the level's concurrency or rate) marked
    skipped where its requests failed because the server's GPU ran out of memory: what they were
    answered says so or, for a server this script started, its log since the level began does."""
    if server is not None and server.proc.poll() is not None:
        run.close()  # (never awaited)
        return skipped(point, f"the server exited with {server.proc.returncode}")
    logged = len(server.output()) if server is not None else 0
    try:
        return asyncio.run(run)
    except (RequestFailed, httpx.HTTPError) as e:
        said = str(e) + (server.output()[logged:] if server is not None else "")
        if not says_out_of_memory(said):
            raise
    return skipped(point, OUT_OF_MEMORY)


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from server_util import ServerProcess

    server = ServerProcess(*extra).wait_ready(timeout=600)
    return server, server.url


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an already running server (default: start one)")
    p.add_argument(
        "--server-args",
        default="--device cpu",
        help='flags of the server this script starts, one string: --server-args="--synthetic --max-batch 16" '
        "(with --synthetic, add --speculative off to measure plain decoding: the synthetic weights' greedy text "
        "loops, so most drafts are accepted)",
    )
    p.add_argument("--concurrency", default="1,8,16,64", help="comma-separated client counts (closed loop)")
    p.add_argument(
        "--rates",
        default="",
        help="comma-separated request rates per second instead (open loop: Poisson arrivals, seeded), e.g. 2,5,10",
    )
    p.add_argument(
        "--requests", type=int, default=0, help="requests per level (default: 4 x concurrency, >= 8; 32 per rate)"
    )
    p.add_argument("--prompt-words", type=int, default=100, help="words in the prompt (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (default: %(default)s)")
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args()
    server = None
    url = args.url
    if url is None:
        server, url = start_server(shlex.split(args.server_args))
    try:
        prompt = " ".join(f"w{i % 50}" for i in range(args.prompt_words))
        asyncio.run(run_level(url, 1, 2, prompt, 4))  # warm-up
        rows = []
        if args.rates:
            for rate in (float(x) for x in args.rates.split(",")):
                run = run_rate(url, rate, args.requests or 32, prompt, args.max_tokens)
                rows.append(run_point({"rate": rate}, run, server))
        else:
            for c in (int(x) for x in args.concurrency.split(",")):
                run = run_level(url, c, args.requests or max(8, 4 * c), prompt, args.max_tokens)
                rows.append(run_point({"concurrency": c}, run, server))
        columns = ["rate" if args.rates else "concurrency", "requests", "req_per_s", "out_tok_per_s",
                   "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p90_ms", "itl_p99_ms",
                   "e2e_p50_s", "every_token_streamed"]  # fmt: skip
        title = f"serving: {args.prompt_words}-word prompts, {args.max_tokens} output tokens, {url}"
        print_table(title, rows, columns)
        if args.json:
            write_json(args.json, "serve", rows, server_args=args.server_args, max_tokens=args.max_tokens)
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    main()
