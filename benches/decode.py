"""Decode-step speed of the megakernel at the real geometry, beside the PyTorch CUDA-graph
yardstick measured in the same run.

Synthetic N(0, 0.01) weights and random KV (no prefill): every row writes at position ctx - 1.
Speed of light (SOL) = bytes the step must move / the card's datasheet HBM bandwidth
(benches/cards.py, HBM_BYTES_PER_S; recorded in the JSON): all non-expert weights, the experts
selected by at least one row (the kernel's routing of the last layer, times the MoE layers), the
LM head, the KV each row reads (full layers: the whole context; sliding: the window) and the
embedding rows. Prints a table, writes JSON (and a PNG plot when matplotlib is there).
A point whose KV does not fit the card's free memory (checked before allocating it), or that runs out
of memory, is a row marked `skipped` (the yardstick's column alone: `yardstick_skipped`), and the
run goes on.

Unless --plain, every point is also timed, in the same run, with the tasks dealt onto the SMs by
the cost model instead of round-robin (rust/graph/deal.rs): `mk_balanced_ms` (its modelled step
time beside the round-robin one: `model_balanced_us`, `model_rr_us`). `--sizes` adds variants of
the GEMV task sizes and other BuildOptions, e.g. `gate_up_groups=3,expert_queue=false`: one variant per entry
(options of one variant joined by '+': `expert_queue=1+attn_chunk=512`),
`mk_<entry>_ms`, and `<entry>_same_logits` whether it gives the default's logits bit for bit (GEMV sizes and
dealings do; attention split sizes change the merge). With --trace, one step of each variant records
when every task waited and ran, summarized per task family (mk.megakernel.trace) into the JSON;
with --ledger (implies --trace; a kernel built with -DMK_STREAM_LEDGER=1 loaded through
$MK_MEGAKERNEL_CUBIN, e.g. NVCC_FLAGS=-DMK_STREAM_LEDGER=1 BENCH_ARGS=--ledger scripts/device-kernel.sh),
also every ring stage's issue and arrival: the rate at which all blocks stream over a MoE layer.
Where $MK_MEGAKERNEL_CUBIN lists several variants (a:b:...), each point also times every loaded
kernel on the same buffers, in KERNEL_ROUNDS alternating rounds (between processes the step time
varies more than in one process: docs/PERF.md, "Noise"): `mk_kernel<k>_ms` (the median),
`kernel<k>_same_logits`.
A batch larger than one launch takes (MK_STEP_MAX_ROWS: 16, or 8 in the swizzled variant) runs as the
engine runs it: consecutive launches of at most that many rows, timed together, each reading the
weights again (`launches` in its row; the variants, traces and kernel comparisons are skipped).
`distinct_experts`: the experts the batch's rows select in a MoE layer, the mean over the MoE layers.
Synthetic routing is near-uniform, so a batch touches more experts than a real checkpoint's would;
`--routing zipf:S` scales each MoE layer's router rows (seeded, the popular experts differ per
layer) so that how often a token selects each expert follows a Zipf law of exponent S, capped at
ZIPF_CAP (a linear router over activations that are as often negative as positive selects an
expert for at most about half the tokens); such a record is named `decode_zipf`, not `decode`.
Usage: python benches/decode.py [--json out.json] [--quick | --points 1x8192,8x8192] [--trace] [--ledger] [--plain]
       [--routing uniform|zipf:S]
"""

from __future__ import annotations

import argparse
import re
from functools import partial
from pathlib import Path

import torch

from common import (
    OUT_OF_MEMORY,
    card_bandwidth,
    card_sol,
    free_bytes,
    gib,
    out_of_memory,
    print_table,
    pyplot,
    run_point,
    write_json,
)
from mk import _native
from mk.config import PAGE_SIZE, ModelConfig
from mk.megakernel.launch import MegakernelStep, ledger_of, trace_buffer
from mk.megakernel.support import STEP_MAX_ROWS
from mk.megakernel.trace import print_stream_profile, print_summary, stream_profile, summarize
from mk.model.names import expected_shapes
from mk.model.paged import PagedKV
from mk.model.reference import Model
from yardstick import TorchDecode, gathered_bytes

EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")


def synthetic_stacked(cfg: ModelConfig, seed: int, std: float = 0.01):
    """Weights by HF name, experts as views of stacked [layers, experts, ...] tensors (which the
    yardstick's grouped matmuls need), generated on the GPU."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    L, E, F_, D = cfg.num_hidden_layers, cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
    bf = dict(dtype=torch.bfloat16, device="cuda")
    stacked = {"gate": torch.empty(L, E, F_, D, **bf), "up": torch.empty(L, E, F_, D, **bf)}
    stacked["down"] = torch.empty(L, E, D, F_, **bf)
    for t in stacked.values():
        t.normal_(0, std, generator=gen)
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        m = EXPERT.fullmatch(name)
        if m:
            weights[name] = stacked[m[3]][int(m[1]), int(m[2])]
            continue
        t = torch.empty(shape, **bf).normal_(0, std, generator=gen)
        weights[name] = t + 1 if name.endswith("norm.weight") else t
    return weights, stacked


# --routing zipf:S: the most a token selects one expert (its share of tokens), and the Monte Carlo
# fit of the router scales that give the law (fixed samples of independent Gaussian logits).
ZIPF_CAP = 0.35
ROUTING_SEED = 0
ZIPF_SAMPLES = 1 << 14
ZIPF_ITERS = 150
ZIPF_STEP = 0.2


def parse_routing(value: str) -> float | None:
    """--routing: None for uniform, else the Zipf exponent S of `zipf:S` (S >= 0)."""
    if value == "uniform":
        return None
    m = re.fullmatch(r"zipf:(\d+(?:\.\d*)?|\.\d+)", value)
    if not m:
        raise argparse.ArgumentTypeError(f"routing must be uniform or zipf:S (S >= 0), not {value!r}")
    return float(m[1])


def zipf_popularity(experts: int, top_k: int, s: float, cap: float) -> torch.Tensor:
    """How often a token selects the expert of each popularity rank (they sum to top_k): a Zipf law
    of exponent s, ranks above `cap` held at it and their excess spread over the rest by the law."""
    law = torch.arange(1, experts + 1, dtype=torch.float64) ** -s
    capped = torch.zeros(experts, dtype=torch.bool)
    while True:
        rest = top_k - cap * int(capped.sum())
        p = torch.where(capped, torch.full_like(law, cap), law * rest / law[~capped].sum())
        over = (p > cap) & ~capped
        if not over.any():
            return p
        capped |= over


def zipf_scales(cfg: ModelConfig, s: float, device) -> torch.Tensor:
    """A scale per popularity rank for the router's rows: with logits independent Gaussians of those
    scales (random router rows over isotropic activations), the top-k selects each rank as often as
    zipf_popularity says. Fitted by a damped multiplicative update on fixed samples."""
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    gen = torch.Generator(device=device).manual_seed(ROUTING_SEED)
    z = torch.randn(ZIPF_SAMPLES, E, generator=gen, device=device)
    target = zipf_popularity(E, k, s, max(ZIPF_CAP, k / E)).to(device=device, dtype=torch.float32)
    log_scale = torch.zeros(E, device=device)
    for _ in range(ZIPF_ITERS):
        chosen = (z * log_scale.exp()).topk(k, dim=1).indices.flatten()
        p = torch.bincount(chosen, minlength=E).float() / ZIPF_SAMPLES
        log_scale += ZIPF_STEP * (target.log() - p.clamp_min(0.5 / ZIPF_SAMPLES).log())
        log_scale -= log_scale.mean()
    return log_scale.exp()


def skew_routing(cfg: ModelConfig, weights: dict, s: float) -> None:
    """Scales every MoE layer's router rows in place (zipf_scales), the ranks dealt to the experts
    by a permutation seeded per layer."""
    scales = zipf_scales(cfg, s, weights["model.embed_tokens.weight"].device)
    for layer in range(cfg.num_hidden_layers):
        if not cfg.is_moe(layer):
            continue
        order = torch.randperm(cfg.num_experts, generator=torch.Generator().manual_seed(ROUTING_SEED + layer))
        per_expert = torch.empty_like(scales)
        per_expert[order.to(scales.device)] = scales
        w = weights[f"model.layers.{layer}.mlp.gate.weight"]
        w.copy_((w.float() * per_expert[:, None]).to(w.dtype))


def distinct_experts(cfg: ModelConfig, routing_logs: list[torch.Tensor]) -> float:
    """The experts the rows of `routing_logs` (StepBuffers.routing_log of one step's launches)
    select in a MoE layer, the mean over the MoE layers."""
    layers = [layer for layer in range(cfg.num_hidden_layers) if cfg.is_moe(layer)]
    counts = [torch.cat([log[layer].flatten() for log in routing_logs]).unique().numel() for layer in layers]
    return sum(counts) / len(counts)


def first_page(cfg: ModelConfig, layer: int, ctx: int) -> int:
    """The first page a row at `ctx` maps on `layer` (sliding layers: the window's)."""
    window = cfg.window(layer)
    return 0 if window is None else max(0, ctx - window) // PAGE_SIZE


def kv_bytes(cfg: ModelConfig, batch: int, ctx: int) -> int:
    """The bytes of kv_for's pools: K and V of every block its tables map, bf16."""
    pages = ctx // PAGE_SIZE + 1
    blocks = batch * sum(pages - first_page(cfg, layer, ctx) for layer in range(cfg.num_hidden_layers))
    return 2 * blocks * PAGE_SIZE * cfg.kv_width * 2


def kv_for(cfg: ModelConfig, batch: int, ctx: int):
    """Pools and per-layer tables mapping `ctx` tokens per row (sliding layers: the window)."""
    pages = ctx // PAGE_SIZE + 1
    tables = torch.full((cfg.num_hidden_layers, batch, pages), -1, dtype=torch.int32)
    n = 0
    for layer in range(cfg.num_hidden_layers):
        first = first_page(cfg, layer, ctx)
        for b in range(batch):
            k = pages - first
            tables[layer, b, first:] = torch.arange(n, n + k, dtype=torch.int32)
            n += k
    kv = PagedKV(cfg, n, torch.bfloat16, torch.device("cuda"))
    kv.k.normal_(0, 0.5)
    kv.v.normal_(0, 0.5)
    return kv, tables.cuda(), pages


def random_step(model: Model, batch: int, ctx: int):
    """A MegakernelStep of `batch` rows at `ctx` on a random cache (kv_for), ready to run: the
    step, its graph, its buffers (random tokens, every row at position ctx - 1) and its task list
    on the device, run 3 times to warm up."""
    kv, tables, pages = kv_for(model.config, batch, ctx)
    step = MegakernelStep(model, kv, pages)
    g = step.graph([ctx - 1] * batch)
    buf = step.buffers(g, log_residuals=False)
    buf.tokens.copy_(torch.randint(0, model.config.vocab_size, (batch,), dtype=torch.int32))
    buf.positions.fill_(ctx - 1)
    buf.block_tables.copy_(tables)
    tasks = torch.from_numpy(g.tasks.copy()).cuda()
    for _ in range(3):
        step.run(g, buf, tasks)
    return step, g, buf, tasks


def step_bytes(cfg: ModelConfig, batch: int, ctx: int, experts_per_layer: int) -> int:
    d, qw, kvw = cfg.hidden_size, cfg.q_width, cfg.kv_width
    attn = (qw * d + 2 * kvw * d + d * qw) * 2 * cfg.num_hidden_layers
    moe_layers = sum(cfg.is_moe(i) for i in range(cfg.num_hidden_layers))
    dense = 3 * cfg.prefix_dense_intermediate_size * d * 2 * (cfg.num_hidden_layers - moe_layers)
    router = cfg.num_experts * d * 2 * moe_layers
    experts = experts_per_layer * 3 * cfg.intermediate_size * d * 2 * moe_layers
    head = cfg.vocab_size * d * 2 + batch * d * 2
    keys = sum(ctx if cfg.window(i) is None else min(ctx, cfg.sliding_window) for i in range(cfg.num_hidden_layers))
    return attn + dense + router + experts + head + batch * keys * 2 * kvw * 2


def _option(value: str) -> int | bool:
    """A --sizes value: a number, or true / false (BuildOptions' switches)."""
    if value in ("true", "false"):
        return value == "true"
    return int(value)


def time_events(fn, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


KERNEL_ROUNDS = 3


def compare_kernels(step, g, buf, tasks, iters: int, row: dict) -> None:
    """Times every loaded megakernel image on the same buffers, alternating, into `row`."""
    # Wheels from before megakernel_count (an earlier ABI's, timed by scripts/device-ab.sh) load one.
    count = _native.megakernel_count(buf.x.device.index or 0) if hasattr(_native, "megakernel_count") else 1
    if count < 2:
        return
    times: dict[int, list[float]] = {k: [] for k in range(count)}
    logits = {}
    for _ in range(KERNEL_ROUNDS):
        for k in range(count):
            for _ in range(2):
                step.run(g, buf, tasks, kernel=k)
            torch.cuda.synchronize()
            times[k].append(time_events(lambda k=k: step.run(g, buf, tasks, kernel=k), iters))
            logits[k] = buf.logits.clone()
    for k, ts in times.items():
        row[f"mk_kernel{k}_ms"] = sorted(ts)[len(ts) // 2] * 1e3
        row[f"kernel{k}_same_logits"] = bool(torch.equal(logits[0], logits[k]))


def measure(
    cfg,
    model,
    stacked,
    batch: int,
    ctx: int,
    iters: int,
    trace=False,
    plain=False,
    sizes=(),
    torch_graph=True,
    ledger=False,
) -> dict:
    kv, tables, pages = kv_for(cfg, batch, ctx)
    positions = [ctx - 1] * batch
    step = MegakernelStep(model, kv, pages)
    g = step.graph(positions)
    sized_steps = {}
    for entry in sizes:
        options = {name: _option(value) for name, value in (part.split("=") for part in entry.split("+"))}
        sized = MegakernelStep(model, kv, pages, **options)
        sized_steps[entry] = (sized, sized.graph(positions))
    # One set of buffers serves every variant: room for the most attention splits any of them has.
    splits = max([g.max_splits] + [gs.max_splits for _, gs in sized_steps.values()])
    buf = step.buffers(g, log_residuals=False, max_splits=splits)
    buf.tokens.copy_(torch.randint(0, cfg.vocab_size, (batch,), dtype=torch.int32))
    buf.positions.fill_(ctx - 1)
    buf.block_tables.copy_(tables)
    tasks = torch.from_numpy(g.tasks.copy()).cuda()
    for _ in range(3):
        step.run(g, buf, tasks)
    torch.cuda.synchronize()
    t_mk = time_events(lambda: step.run(g, buf, tasks), iters)
    ok = bool((buf.sampled >= 0).all() and (buf.sampled < cfg.vocab_size).all() and not buf.logits.isnan().any())
    plain_logits = buf.logits.clone()
    variants = {}
    for entry, (sized, g_sized) in sized_steps.items():
        variants[entry] = (sized, g_sized, torch.from_numpy(g_sized.tasks.copy()).cuda())
    balanced = MegakernelStep(model, kv, pages, dealing="balanced")
    g_bal = balanced.graph(positions)
    if not plain:
        variants["balanced"] = (balanced, g_bal, torch.from_numpy(g_bal.tasks.copy()).cuda())
    times, same = {}, {}
    for name, (variant, graph, graph_tasks) in variants.items():
        for _ in range(3):
            variant.run(graph, buf, graph_tasks)
        torch.cuda.synchronize()
        times[name] = time_events(lambda v=variant, gr=graph, gt=graph_tasks: v.run(gr, buf, gt), iters)
        same[name] = bool(torch.equal(plain_logits, buf.logits))
    traces = {}
    if trace:
        for name, (variant, graph, graph_tasks) in {"plain": (step, g, tasks), **variants}.items():
            tr = trace_buffer(graph, buf.x.device)
            variant.run(graph, buf, graph_tasks, trace=tr)
            torch.cuda.synchronize()
            traces[name] = summarize(graph, tr.cpu().numpy())
            print_summary(f"batch {batch}, context {ctx}, {name}", traces[name])
            if ledger:
                profile = stream_profile(graph, tr.cpu().numpy(), ledger_of(tr).cpu().numpy())
                if not profile["stages_recorded"]:
                    print("--ledger: the kernel recorded no stage (build it with -DMK_STREAM_LEDGER=1)")
                traces[name]["stream_profile"] = profile
                print_stream_profile(f"batch {batch}, context {ctx}, {name}", profile)
    experts = int(buf.slot_count[0])
    row = {"batch": batch, "ctx": ctx, "mk_ms": t_mk * 1e3, "mk_tok_s": batch / t_mk, "valid_output": ok, "launches": 1}
    compare_kernels(step, g, buf, tasks, iters, row)
    for name, t in times.items():
        row[f"mk_{name}_ms"] = t * 1e3
        row[f"{name}_gain"] = t_mk / t
        row[f"{name}_same_logits"] = same[name]
    row["model_rr_us"], row["model_balanced_us"] = g.modelled_ns / 1e3, g_bal.modelled_ns / 1e3
    if traces:
        row["trace"] = traces
    row["sol_ms"] = step_bytes(cfg, batch, ctx, experts) / card_bandwidth() * 1e3
    row["sol_fraction"] = row["sol_ms"] / row["mk_ms"]
    row["experts_last_layer"] = experts
    row["distinct_experts"] = distinct_experts(cfg, [buf.routing_log])
    row["tasks"] = int(g.order.shape[0])
    if not torch_graph:
        row["torch_graph_ms"] = None
        return row
    return yardstick(row, cfg, model, stacked, kv, tables, buf.positions, buf.tokens, iters)


def measure_launches(cfg, model, stacked, batch: int, ctx: int, iters: int, torch_graph=True) -> dict:
    """`batch` rows past one launch's, as consecutive launches of at most STEP_MAX_ROWS rows
    (the engine's backend does the same), timed together."""
    kv, tables, pages = kv_for(cfg, batch, ctx)
    launches = []
    for r0 in range(0, batch, STEP_MAX_ROWS):
        rows = min(STEP_MAX_ROWS, batch - r0)
        step = MegakernelStep(model, kv, pages)
        g = step.graph([ctx - 1] * rows)
        buf = step.buffers(g, log_residuals=False)
        buf.tokens.copy_(torch.randint(0, cfg.vocab_size, (rows,), dtype=torch.int32))
        buf.positions.fill_(ctx - 1)
        buf.block_tables.copy_(tables[:, r0 : r0 + rows])
        launches.append((step, g, buf, torch.from_numpy(g.tasks.copy()).cuda()))

    def run_all():
        for step, g, buf, tasks in launches:
            step.run(g, buf, tasks)

    for _ in range(3):
        run_all()
    torch.cuda.synchronize()
    t_mk = time_events(run_all, iters)
    bufs = [buf for _, _, buf, _ in launches]
    ok = all(bool((b.sampled >= 0).all() and (b.sampled < cfg.vocab_size).all()) for b in bufs)
    ok = ok and not any(bool(b.logits.isnan().any()) for b in bufs)
    # The experts the whole batch touches in the last MoE layer: the union of the launches' slots.
    experts = len({e for b in bufs for e in b.slot_expert[: int(b.slot_count[0])].tolist()})
    row = {"batch": batch, "ctx": ctx, "mk_ms": t_mk * 1e3, "mk_tok_s": batch / t_mk, "valid_output": ok}
    row["launches"] = len(launches)
    row["sol_ms"] = step_bytes(cfg, batch, ctx, experts) / card_bandwidth() * 1e3
    row["sol_fraction"] = row["sol_ms"] / row["mk_ms"]
    row["experts_last_layer"] = experts
    row["distinct_experts"] = distinct_experts(cfg, [b.routing_log for b in bufs])
    if not torch_graph:
        row["torch_graph_ms"] = None
        return row
    positions = torch.cat([b.positions for b in bufs])
    tokens = torch.cat([b.tokens for b in bufs])
    return yardstick(row, cfg, model, stacked, kv, tables, positions, tokens, iters)


def yardstick(row: dict, cfg, model, stacked, kv, tables, positions, tokens, iters: int) -> dict:
    """benches/yardstick.py's CUDA-graph step of the same batch into `row` (torch_graph_ms); where
    it does not fit the memory mk's step left, `yardstick_skipped` says so and mk's numbers stay."""
    t_mk = row["mk_ms"] / 1e3
    point = f"yardstick {row['batch']}x{row['ctx']}"
    need, free = gathered_bytes(cfg, row["batch"], row["ctx"]), free_bytes()
    if need > free:
        row["torch_graph_ms"] = None
        row["yardstick_skipped"] = f"{OUT_OF_MEMORY} (its gathered K and V need {gib(need)}, {gib(free)} free)"
        print(f"skipped {point}: {row['yardstick_skipped']}", flush=True)
        return row
    ys = graph = None
    try:
        ys = TorchDecode(cfg, model.weights, stacked, kv.k, kv.v, tables, positions)
        tok = tokens.long()
        ys.step_checked(tok)
        row["yardstick_moe"] = "grouped_mm" if ys.grouped else "gathered"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            ys.step(tok)
        graph.replay()
        torch.cuda.synchronize()
        t_pt = time_events(graph.replay, max(3, iters // 4))
        row["torch_graph_ms"] = t_pt * 1e3
        row["speedup_vs_torch"] = t_pt / t_mk
    except Exception as e:  # the yardstick is informative; its failure must not hide mk's numbers
        row["torch_graph_ms"] = None
        if out_of_memory(e):
            row["yardstick_skipped"] = OUT_OF_MEMORY
        else:
            row["yardstick_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    del ys, graph  # (their memory, before the free figure below)
    if "yardstick_skipped" in row:  # (past the except clause: the error's frames are gone)
        print(f"skipped {point}: {OUT_OF_MEMORY} ({gib(free_bytes())} free)", flush=True)
    return row


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in rows if "skipped" not in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    for b in sorted({r["batch"] for r in rows}):
        rs = [r for r in rows if r["batch"] == b]
        ax.plot([r["ctx"] for r in rs], [r["mk_tok_s"] for r in rs], marker="o", label=f"mk batch {b}")
        ys = [r for r in rs if r.get("torch_graph_ms")]
        ax.plot([r["ctx"] for r in ys], [b / r["torch_graph_ms"] * 1e3 for r in ys], ls="--", label=f"torch b{b}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("tokens/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default="bench-out/decode.json")
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8 at 8K only")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--trace", action="store_true", help="trace one step per point and variant")
    parser.add_argument(
        "--ledger",
        action="store_true",
        help="a traced step of a -DMK_STREAM_LEDGER=1 kernel ($MK_MEGAKERNEL_CUBIN): the weight stream over a layer",
    )
    parser.add_argument("--plain", action="store_true", help="time only the default variant (not the balanced dealing)")
    parser.add_argument("--points", help="BATCHxCONTEXT,... instead of the grid (e.g. 1x8192,8x8192)")
    parser.add_argument(
        "--sizes",
        default="",
        help="BuildOptions variants timed beside the default, e.g. gate_up_groups=3,expert_queue=1+attn_chunk=512",
    )
    parser.add_argument("--no-torch", action="store_true", help="skip benches/yardstick.py's CUDA-graph column")
    parser.add_argument(
        "--routing", default="uniform", type=parse_routing, help="uniform, or zipf:S (skewed expert popularity)"
    )
    args = parser.parse_args()
    cfg = ModelConfig.real()
    weights, stacked = synthetic_stacked(cfg, seed=0)
    if args.routing is not None:
        skew_routing(cfg, weights, args.routing)
    model = Model(cfg, weights)
    grid = [(b, c) for b in (1, 2, 4, 8) for c in (1024, 8192, 32768, 131072)] + [(1, 262144)]
    if args.quick:
        grid = [(1, 8192), (8, 8192)]
    if args.points:
        grid = [tuple(int(v) for v in p.split("x")) for p in args.points.split(",")]
    sizes = [s for s in args.sizes.split(",") if s]
    rows = []
    for b, c in grid:
        if b > STEP_MAX_ROWS:
            point = partial(measure_launches, cfg, model, stacked, b, c, args.iters, not args.no_torch)
        else:
            trace = args.trace or args.ledger
            point = partial(
                measure, cfg, model, stacked, b, c, args.iters, trace, args.plain, sizes, not args.no_torch, args.ledger
            )
        rows.append(run_point({"batch": b, "ctx": c}, point, kv_bytes(cfg, b, c), "its KV"))
        torch.cuda.empty_cache()  # the last size's KV pools
        if "skipped" not in rows[-1]:
            print({k: v for k, v in rows[-1].items() if k != "trace"}, flush=True)
    cols = [
        "batch",
        "ctx",
        "launches",
        "mk_ms",
        "mk_tok_s",
        "sol_ms",
        "sol_fraction",
        "torch_graph_ms",
        "speedup_vs_torch",
        "distinct_experts",
    ]
    cols += ["mk_balanced_ms", "balanced_gain", "model_rr_us", "model_balanced_us"]
    cols += [f"mk_{s}_ms" for s in args.sizes.split(",") if s]
    cols += sorted({k for r in rows for k in r if re.fullmatch(r"mk_kernel\d+_ms", k)})
    if any("yardstick_skipped" in r for r in rows):
        cols.append("yardstick_skipped")
    if args.routing is None:
        print_table(f"decode step, real geometry, synthetic weights ({card_sol()})", rows, cols)
        write_json(args.json, "decode", rows)
    else:
        routing = f"zipf:{args.routing:g}"
        print_table(f"decode step, real geometry, synthetic weights, {routing} routing ({card_sol()})", rows, cols)
        write_json(args.json, "decode_zipf", rows, routing=routing)
    plot(rows, Path(args.json).with_suffix(".png"))


if __name__ == "__main__":
    main()
