"""Speculative decoding's verification step on the megakernel at the real geometry, beside the plain
decode step of the same batch measured in the same run.

B sequences, each verifying a draft of K tokens as K + 1 rows of one launch at consecutive
positions that share the sequence's block table (K = 0: the plain step of B rows). Synthetic
N(0, 0.01) weights (decode.py's, `--routing` as there) and random KV (no prefill): every sequence's
first row writes at position ctx - 1. The drafts are a recorded greedy run: from the point, plain
steps of the B sequences (greedy, each writing its KV), one more than the largest K, give each
sequence's next tokens; the verification step is fed its last token and the first K of them, so every draft
is right. Before the first launch of a verification step the positions it writes hold NaN, so the
tokens it draws come from what it wrote itself: `accepted` is, per sequence, the longest prefix of
the draft that the rows drew (rust/speculative/verify.rs's rule), `all_accepted` whether every
draft was accepted whole, `same_tokens` whether every row drew the recorded token (the one past
the draft too). A row that draws another token than the recording at the same position is told
apart from a near-tie by `row0_logit_diff`, the largest difference between the first rows' logits
and the recording's first step's, against `recorded_top_gap`, the smallest gap there between a
sequence's best and second-best logit; `row0_logit_diff_topk` is the same difference against a plain
step that routes with the top-k task as verification steps do (a plain step of one row routes in
every block), which tells a routing near-tie from a difference in the rows' own arithmetic.

Per point: `step_ms`, the verification step of B (K + 1) rows; `plain_ms`, the plain step (K = 0)
of the same B sequences and cache; tokens/s if every draft is accepted (`tok_s_all`, B (K + 1) /
step), if the first K // 2 tokens of each are (`tok_s_half`, B (K // 2 + 1) / step) and if none is
(`tok_s_none`, B / step); the speedup over the plain step's B / plain when all or none are
accepted (`speedup_all`, `speedup_none`). Steps are timed with CUDA events over --iters launches,
in ROUNDS rounds that alternate a point's draft lengths (the median round). SOL (decode.py's, for
sequences whose rows read their KV once): all non-expert weights, the experts selected by at least
one row (the last MoE layer's, times the MoE layers), the LM head, each sequence's KV once (ctx + K
keys on full layers, the window on sliding ones) and every row's embedding row, over the card's
datasheet bandwidth. `distinct_experts`: the experts the step's rows select in a MoE layer, the
mean over the MoE layers.
Points: B in 1, 2, 4, 8 and ctx in 8192, 32768, each with every K of 0, 3, 4, 8 whose B (K + 1)
rows fit one launch (MK_STEP_MAX_ROWS). A point whose KV does not fit the card is marked skipped.
Usage: python benches/speculative.py [--json out.json] [--quick | --points 1x8192,4x8192] [--ks 0,3,4,8]
       [--routing uniform|zipf:S] [--iters N]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial

import torch

from common import card_bandwidth, card_sol, print_table, run_point, write_json
from decode import (
    distinct_experts,
    kv_bytes,
    kv_for,
    parse_routing,
    skew_routing,
    step_bytes,
    synthetic_stacked,
    time_events,
)
from mk.config import PAGE_SIZE, ModelConfig
from mk.megakernel.buffers import StepBuffers
from mk.megakernel.graph import StepGraph
from mk.megakernel.launch import MegakernelStep
from mk.megakernel.support import STEP_MAX_ROWS
from mk.model.paged import PagedKV
from mk.model.reference import Model

GRID = [(b, c) for b in (1, 2, 4, 8) for c in (8192, 32768)]
QUICK = [(1, 8192), (4, 8192)]
DRAFTS = (0, 3, 4, 8)
ROUNDS = 3
TOKEN_SEED = 0


def accepted(draft: list[int], drawn: list[int]) -> int:
    """How many of `draft` a step accepts: the longest prefix that matches `drawn`, the tokens its
    rows drew (rust/speculative/verify.rs `accepted`)."""
    n = 0
    while n < len(draft) and draft[n] == drawn[n]:
        n += 1
    return n


def verify_bytes(cfg: ModelConfig, batch: int, ctx: int, k: int, experts: int) -> int:
    """decode.step_bytes for `batch` sequences of k + 1 rows each: every sequence's KV read once
    (its last row sees ctx + k keys), an embedding row per row."""
    return step_bytes(cfg, batch, ctx + k, experts) + batch * k * cfg.hidden_size * 2


@dataclass
class Launch:
    """A step ready to run: its graph, buffers (inputs filled) and task list on the device."""

    step: MegakernelStep
    g: StepGraph
    buf: StepBuffers
    tasks: torch.Tensor

    def run(self) -> None:
        self.step.run(self.g, self.buf, self.tasks)


def launch(step: MegakernelStep, tables: torch.Tensor, tokens: torch.Tensor, first: int) -> Launch:
    """The step of tokens [B, k + 1]: sequence b's rows at first .. first + k, on its block table."""
    batch, rows = tokens.shape
    positions = [first + i for _ in range(batch) for i in range(rows)]
    g = step.graph(positions)
    buf = step.buffers(g, log_residuals=False)
    buf.tokens.copy_(tokens.flatten())
    buf.positions.copy_(torch.tensor(positions, dtype=torch.int32))
    buf.block_tables.copy_(tables.repeat_interleave(rows, dim=1))
    return Launch(step, g, buf, torch.from_numpy(g.tasks.copy()).cuda())


def record(
    step: MegakernelStep, tables: torch.Tensor, last: torch.Tensor, first: int, n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """int32 [B, n]: the tokens n greedy plain steps from position `first` draw, each fed the one
    before; and fp32 [B, vocab], the first step's logits."""
    out = torch.empty(last.numel(), n, dtype=torch.int32)
    tokens = last
    for j in range(n):
        plain = launch(step, tables, tokens[:, None], first + j)
        plain.run()
        tokens = plain.buf.sampled.cpu()
        out[:, j] = tokens
        if j == 0:
            logits = plain.buf.logits.clone()
    return out, logits


def poison_writes(kv: PagedKV, tables: torch.Tensor, first: int, k: int) -> None:
    """NaN in K and V at positions first .. first + k of every sequence, every layer."""
    pos = torch.arange(first, first + k + 1, device=tables.device)
    blocks = tables[:, :, pos // PAGE_SIZE].long()  # [layers, B, k + 1]
    kv.k[blocks, pos % PAGE_SIZE] = float("nan")
    kv.v[blocks, pos % PAGE_SIZE] = float("nan")


def measure(cfg: ModelConfig, model: Model, batch: int, ctx: int, ks: list[int], iters: int) -> dict:
    """The rows of one (batch, ctx): one per draft length in `ks` (0 among them), in a "rows" list."""
    kv, tables, pages = kv_for(cfg, batch, ctx)
    step = MegakernelStep(model, kv, pages)
    first = ctx - 1
    gen = torch.Generator().manual_seed(TOKEN_SEED)
    last = torch.randint(0, cfg.vocab_size, (batch,), generator=gen, dtype=torch.int32)
    recorded, first_logits = record(step, tables, last, first, max(ks) + 1)
    topk_logits = record(MegakernelStep(model, kv, pages, local_routing=False), tables, last, first, 1)[1]
    top2 = first_logits.topk(2, dim=1).values
    launches, checks = {}, {}
    for k in ks:
        v = launches[k] = launch(step, tables, torch.cat([last[:, None], recorded[:, :k]], dim=1), first)
        poison_writes(kv, tables, first, k)
        v.run()
        drawn = v.buf.sampled.cpu().view(batch, k + 1)
        counts = [accepted(recorded[b, :k].tolist(), drawn[b].tolist()) for b in range(batch)]
        logits_ok = not bool(v.buf.logits.isnan().any())
        row0 = v.buf.logits.view(batch, k + 1, -1)[:, 0]
        checks[k] = {
            "accepted": counts,
            "all_accepted": all(c == k for c in counts),
            "same_tokens": bool(torch.equal(drawn, recorded[:, : k + 1])),
            "valid_output": logits_ok and bool(((drawn >= 0) & (drawn < cfg.vocab_size)).all()),
            "row0_logit_diff": float((row0 - first_logits).abs().max()),
            "row0_logit_diff_topk": float((row0 - topk_logits).abs().max()),
            "recorded_top_gap": float((top2[:, 0] - top2[:, 1]).min()),
            "experts_last_layer": int(v.buf.slot_count[0]),
            "distinct_experts": distinct_experts(cfg, [v.buf.routing_log]),
        }
    times: dict[int, list[float]] = {k: [] for k in ks}
    for _ in range(ROUNDS):
        for k in ks:
            for _ in range(2):
                launches[k].run()
            torch.cuda.synchronize()
            times[k].append(time_events(launches[k].run, iters))
    step_s = {k: sorted(ts)[len(ts) // 2] for k, ts in times.items()}
    plain = step_s[0]
    rows = []
    for k in ks:
        t = step_s[k]
        row = {"batch": batch, "ctx": ctx, "K": k, "rows": batch * (k + 1), "step_ms": t * 1e3, "plain_ms": plain * 1e3}
        row["tok_s_all"] = batch * (k + 1) / t
        row["tok_s_half"] = batch * (k // 2 + 1) / t
        row["tok_s_none"] = batch / t
        row["speedup_all"] = (k + 1) * plain / t
        row["speedup_none"] = plain / t
        row["sol_ms"] = verify_bytes(cfg, batch, ctx, k, checks[k]["experts_last_layer"]) / card_bandwidth() * 1e3
        row["sol_fraction"] = row["sol_ms"] / row["step_ms"]
        row.update(checks[k])
        rows.append(row)
        print(row, flush=True)
    return {"batch": batch, "ctx": ctx, "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default="bench-out/speculative.json")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 4 at 8K only")
    parser.add_argument("--points", help="BATCHxCONTEXT,... instead of the grid (e.g. 1x8192,4x8192)")
    parser.add_argument("--ks", default=",".join(map(str, DRAFTS)), help="draft lengths K (0: the plain step)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--routing", default="uniform", type=parse_routing, help="uniform, or zipf:S (decode.py's skewed routing)"
    )
    args = parser.parse_args()
    ks = sorted({int(k) for k in args.ks.split(",")} | {0})  # the plain step is every point's baseline
    grid = QUICK if args.quick else GRID
    if args.points:
        grid = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    cfg = ModelConfig.real()
    weights, _ = synthetic_stacked(cfg, seed=0)
    if args.routing is not None:
        skew_routing(cfg, weights, args.routing)
    model = Model(cfg, weights)
    routing = "uniform" if args.routing is None else f"zipf:{args.routing:g}"
    rows = []
    for b, c in grid:
        # kv_for maps the pages through ctx's: a draft must end there.
        fits = [k for k in ks if b * (k + 1) <= STEP_MAX_ROWS and (c - 1 + k) // PAGE_SIZE <= c // PAGE_SIZE]
        if not fits:
            print(f"{b}x{c}: {b} rows do not fit one launch ({STEP_MAX_ROWS} rows)")
            continue
        point = partial(measure, cfg, model, b, c, fits, args.iters)
        out = run_point({"batch": b, "ctx": c}, point, kv_bytes(cfg, b, c), "its KV")
        rows += out["rows"] if "rows" in out else [{**out, "K": k} for k in fits]
        torch.cuda.empty_cache()  # the last point's KV pools
    cols = ["batch", "ctx", "K", "rows", "step_ms", "plain_ms", "tok_s_all", "tok_s_half", "tok_s_none"]
    cols += ["speedup_all", "speedup_none", "sol_ms", "sol_fraction", "distinct_experts", "all_accepted"]
    cols += ["row0_logit_diff", "row0_logit_diff_topk", "recorded_top_gap"]
    title = f"verification step, real geometry, synthetic weights, {routing} routing ({card_sol()})"
    print_table(title, rows, cols)
    write_json(args.json, "speculative", rows, routing=routing, rounds=ROUNDS, iters=args.iters)


if __name__ == "__main__":
    main()
