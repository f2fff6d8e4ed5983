"""mk.prefill.packed (chunked, packed prefill into the paged cache) against the reference model, on the CPU.

Tiny geometry (window 96, pages of 64), fresh random weights each run (MK_TEST_SEED replays one;
failures print it). float64 runs check the logic to 1e-10 (SDPA and eager-flex attention, the
reference's per-expert MoE); float32 runs cover the grouped-matmul MoE at float32 tolerance.
Compared: the last position's logits and residual, and every K/V page the prefill wrote.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from routing import RoutingLog, tie_gap

import mk.model.experts as grouped_moe
import mk.model.moe as reference_moe
import mk.prefill.fresh as fresh_module
import mk.prefill.packed as prefill_module
from mk.config import PAGE_SIZE, ModelConfig
from mk.model.names import expected_shapes
from mk.model.paged import UNMAPPED, KVMappingError, PageAllocator, pages_needed
from mk.model.reference import Model
from mk.model.varlen import Piece, attend_causal, interval_block_mask, refresh_block_mask, static_block_mask
from mk.prefill.fresh import SPLIT_MIN_BUCKET, FreshPrompts, fresh_split
from mk.prefill.packed import Prefill, PrefillRequest, Span, plan_chunks, prefill_flops, stack_experts, stacked_experts
from mk.prefill.prefixed import NEXT_TURN_BUCKETS, PACKED_SEQUENCES, PrefixedChunks
from mk.prefill.static import BUCKETS, STATIC_PASSES_MAX

torch.set_num_threads(1)

SEED = int(os.environ.get("MK_TEST_SEED", str(int.from_bytes(os.urandom(4), "little") % 2**31)))
CFG = ModelConfig.tiny()
L = CFG.num_hidden_layers
MAX_PAGES = 8  # 512 positions
TOL = {torch.float64: 1e-10, torch.float32: 1e-4}
# A float32 router logit moves by ~1e-6 between the grouped MoE and the reference's (other
# products, other sums): where the reference's k-th and (k+1)-th logits are closer than this, either
# choice is right, and the rest of that prompt is another computation (seed 1966164398: a gap of
# 3.3e-6 went the other way and the logits then differed by 5e-4).
ROUTER_TIE = 1e-4
MOE_LAYERS = [layer for layer in range(L) if CFG.is_moe(layer)]
# Larger q/k and router weights: attention and routing far from uniform, so a wrong mask,
# position or expert shows in the logits.
STD = {"q_proj": 0.25, "k_proj": 0.25, "mlp.gate.weight": 0.3}


def random_weights(seed: int = SEED, dtype=torch.float64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(CFG).items():
        if name.endswith("norm.weight"):
            t = 1 + 0.2 * torch.randn(shape, generator=g)
        else:
            t = next((s for key, s in STD.items() if key in name), 0.1) * torch.randn(shape, generator=g)
        out[name] = t.to(dtype)
    return out


@pytest.fixture(scope="module")
def weights64():
    return random_weights()


def model_of(weights64, dtype) -> Model:
    return Model(CFG, {k: v.to(dtype) for k, v in weights64.items()})


def tokens_of(n: int, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(SEED + 1 + salt)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.to(torch.float64), b.to(torch.float64)
    return float((a - b).abs().max() / b.abs().max())


class Pool:
    """One shared KV pool and allocator, with the reference run on a twin pool (same tables)."""

    def __init__(self, model: Model, blocks: int = L * 40) -> None:
        self.model = model
        self.alloc = PageAllocator(blocks, seed=SEED)
        self.kv, self.kv_ref = model.new_kv(blocks), model.new_kv(blocks)

    def table(self, upto: int, from_pos: int = 0) -> torch.Tensor:
        t = self.alloc.new_table(CFG, MAX_PAGES)
        self.alloc.ensure(t, upto, from_pos=from_pos)
        return t

    def reference(self, tokens: torch.Tensor, start: int, table: torch.Tensor):
        logits, hidden = self.model.forward(tokens, start, self.kv_ref, table, return_hidden=True, last_only=True)
        return logits[-1], hidden[-1][-1]

    def reference_routed(self, tokens: torch.Tensor, start: int, table: torch.Tensor):
        """`reference`, and its select_experts calls (one per MoE layer, a row per position)."""
        log = RoutingLog()
        with log.patch(reference_moe):
            return (*self.reference(tokens, start, table), log)

    def assert_pages_equal(self, tables: list[torch.Tensor], tol: float, what: str = "") -> None:
        blocks = torch.cat([t[t != UNMAPPED] for t in tables]).long().unique()
        for name, got, want in (("K", self.kv.k, self.kv_ref.k), ("V", self.kv.v, self.kv_ref.v)):
            err = rel_err(got[blocks], want[blocks])
            assert err < tol, f"seed {SEED} {what}: {name} pages differ by {err:.2e}"


def by_position(log: RoutingLog, chunks: list[list[Span]]) -> dict[tuple[int, int, int], frozenset[int]]:
    """The packed prefill's choices per (request, layer, position): its calls go chunk by chunk, one per
    MoE layer, over the chunk's spans packed in order."""
    calls, out = iter(log.calls), {}
    for spans in chunks:
        for layer in MOE_LAYERS:
            idx, _ = next(calls)
            rows = [(sp.request, pos) for sp in spans for pos in range(sp.start, sp.end)]
            assert len(rows) == idx.shape[0]
            for (request, pos), choice in zip(rows, idx.tolist(), strict=True):
                out[request, layer, pos] = frozenset(choice)
    assert next(calls, None) is None
    return out


def tied_flip(packed: dict, request: int, start: int, ref: RoutingLog) -> str | None:
    """Where (in layer, then position order) the packed prefill first chose other experts for `request`
    than the reference did: None if nowhere; a description if the reference's choice there was a
    near-tie (ROUTER_TIE); any other difference fails."""
    k = CFG.num_experts_per_tok
    for layer, (idx, logits) in zip(MOE_LAYERS, ref.calls, strict=True):
        for row, choice in enumerate(idx.tolist()):
            if packed[request, layer, start + row] != frozenset(choice):
                gap = tie_gap(logits[row], k)
                assert gap < ROUTER_TIE, f"seed {SEED}: request {request} layer {layer} routes unlike the reference"
                return f"layer {layer}, position {start + row} (gap {gap:.1e})"
    return None


def run_compared(model, pool, requests, chunk, attention, moe, dtype, what):
    """Prefills `requests` and checks each against the reference; returns the output and the
    indices of the requests compared (whose pages can be compared too). On the grouped MoE
    (float32) a request whose routing went the other way at a near-tie of the reference's router
    logits is reported and left out."""
    packed_log, chunks = RoutingLog(), []
    with packed_log.patch(grouped_moe):
        out = Prefill(model, chunk=chunk, attention=attention, moe=moe)(
            requests, pool.kv, return_hidden=True, before_chunk=chunks.append
        )
    assert out.logits.shape == (len(requests), CFG.vocab_size) and out.logits.dtype == dtype
    packed = by_position(packed_log, chunks) if moe == "grouped" else {}
    compared = []
    for i, r in enumerate(requests):
        want_logits, want_hidden, ref_log = pool.reference_routed(r.tokens, r.start, r.block_table)
        flip = tied_flip(packed, i, r.start, ref_log) if moe == "grouped" else None
        if flip is not None:
            print(f"seed {SEED} {what}: request {i}'s near-tied expert choice at {flip} went the other way")
            continue
        check(out, i, want_logits, want_hidden, dtype, f"{what} request {i}")
        compared.append(i)
    return out, compared


PATHS = [
    ("sdpa", "loop", torch.float64),
    ("flex_eager", "loop", torch.float64),
    ("sdpa", "grouped", torch.float32),
    ("flex_eager", "grouped", torch.float32),
]


def check(out, i: int, want_logits, want_hidden, dtype, what: str) -> None:
    tol = TOL[dtype]
    err = rel_err(out.logits[i], want_logits)
    assert err < tol, f"seed {SEED} {what}: logits differ by {err:.2e}"
    if out.hidden is not None:
        err = rel_err(out.hidden[i], want_hidden)
        assert err < tol, f"seed {SEED} {what}: hidden state differs by {err:.2e}"


# ---- chunk planning, FLOP count, block mask -----------------------------------------------------------
def test_plan_chunks_packs_in_order_and_never_exceeds_the_chunk():
    assert plan_chunks([5], 5) == [[(0, 0, 5)]]
    assert plan_chunks([5], 2) == [[(0, 0, 2)], [(0, 2, 2)], [(0, 4, 1)]]
    assert plan_chunks([3, 4, 1], 4) == [[(0, 0, 3), (1, 0, 1)], [(1, 1, 3), (2, 0, 1)]]
    rng = random.Random(SEED)
    for _ in range(50):
        lengths = [rng.randint(1, 40) for _ in range(rng.randint(1, 6))]
        chunk = rng.randint(1, 50)
        plan = plan_chunks(lengths, chunk)
        assert all(sum(n for _, _, n in c) <= chunk for c in plan)
        assert all(sum(n for _, _, n in c) == chunk for c in plan[:-1])
        flat = [piece for c in plan for piece in c]
        for r, n in enumerate(lengths):
            mine = [(off, cnt) for rr, off, cnt in flat if rr == r]
            assert [off for off, _ in mine] == list(itertools_accumulate([0] + [c for _, c in mine[:-1]]))
            assert sum(c for _, c in mine) == n
    with pytest.raises(ValueError):
        plan_chunks([3], 0)


def itertools_accumulate(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def test_prefill_flops_counts_visible_keys():
    cfg = ModelConfig.tiny()
    d = cfg.hidden_size
    for start, n in ((0, 1), (0, 300), (50, 60), (95, 3), (200, 17)):
        keys = 0
        for layer in range(cfg.num_hidden_layers):
            w = cfg.window(layer)
            keys += sum(p + 1 if w is None else min(p + 1, w) for p in range(start, start + n))
        per_token = prefill_flops(cfg, 0, 1) - 4 * cfg.num_attention_heads * cfg.head_dim * L - 2 * d * cfg.vocab_size
        want = per_token * n + keys * 4 * cfg.num_attention_heads * cfg.head_dim + 2 * d * cfg.vocab_size
        assert prefill_flops(cfg, start, n) == want, (start, n)


def random_intervals(rng: random.Random, pieces: int, window: int | None):
    """lo/hi of packed pieces laid out like mk.prefill.packed lays out one chunk's keys."""
    lo, hi, off = [], [], 0
    for _ in range(pieces):
        first, n = rng.randint(0, 300), rng.randint(1, 200)
        k_first = 0 if window is None else max(0, first - window + 1)
        for p in range(first, first + n):
            lo.append(off + (0 if window is None else max(k_first, p - window + 1)) - k_first)
            hi.append(off + p - k_first)
        off += first + n - k_first
    return torch.tensor(lo, dtype=torch.int32), torch.tensor(hi, dtype=torch.int32), off


@pytest.mark.parametrize("window", [None, 96, 7])
def test_interval_block_mask_classifies_every_block(window):
    """The kernel's view of the block mask (full blocks: everything visible; partial: the
    mask_mod; others skipped) equals the exact mask on every real row."""
    rng = random.Random(SEED + (window or 0))
    block = 16
    for _ in range(5):
        lo, hi, n_keys = random_intervals(rng, rng.randint(1, 4), window)
        k_pad = -(-n_keys // block) * block
        partial, full = interval_block_mask(lo, hi, k_pad, block=block)
        cols = torch.arange(k_pad)
        exact = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
        rows = len(lo)
        q_blocks = -(-rows // block)
        assert partial.shape == full.shape == (q_blocks, k_pad // block)
        assert not (partial & full).any()
        blk = torch.arange(rows) // block
        kblk = cols // block
        seen = torch.where(full[blk][:, kblk], True, exact & partial[blk][:, kblk])
        assert torch.equal(seen, exact), f"seed {SEED}"
        # and nothing visible is left out: every block with a visible entry is listed
        listed = (partial | full)[blk][:, kblk]
        assert not (exact & ~listed).any()


@pytest.mark.parametrize("n", [1, 37, 130])
def test_fused_causal_attention_is_softmax_over_each_rows_earlier_keys(n):
    """`attend_causal` (a fresh prompt's full-attention layers on CUDA) against the definition:
    query head h of row r attends over rows 0..r of KV head h // group."""
    g = torch.Generator().manual_seed(SEED + n)
    hq, hkv, d = 8, 2, 16
    q, k, v = (torch.randn(n, h, d, dtype=torch.float64, generator=g) for h in (hq, hkv, hkv))
    got = attend_causal(q, k, v).view(n, hq, d)
    for h in range(hq):
        kk, vv = k[:, h // (hq // hkv)], v[:, h // (hq // hkv)]
        scores = (q[:, h] @ kk.T) / d**0.5
        scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        want = scores.softmax(-1) @ vv
        assert torch.allclose(got[:, h], want, rtol=0, atol=1e-12), f"seed {SEED}, head {h}"


# ---- one prompt -------------------------------------------------------------------------------------
def _blocks(mask) -> list[torch.Tensor]:
    return [mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices]


def test_a_static_block_mask_is_rewritten_in_place():
    """After its intervals change, `refresh_block_mask` gives the static mask the block tensors a
    mask built from the new intervals has, in the same tensors (a CUDA graph holds their
    addresses). Eager flex applies the mask_mod everywhere, so only this catches a stale block list."""
    rng = torch.Generator().manual_seed(SEED)
    q_pad, k_pad = 256, 512
    # First every row sees part of the first key block, then rows see random spans of the last two.
    lo = torch.zeros(q_pad, dtype=torch.int32)
    hi = torch.randint(0, 100, (q_pad,), generator=rng, dtype=torch.int32)
    mask = static_block_mask(lo, hi, k_pad)
    held, before = _blocks(mask), [t.clone() for t in _blocks(mask)]
    lo.copy_(torch.randint(256, 400, (q_pad,), generator=rng, dtype=torch.int32))
    hi.copy_((lo + torch.randint(0, 200, (q_pad,), generator=rng, dtype=torch.int32)).clamp(max=k_pad - 1))
    refresh_block_mask(mask, lo, hi, k_pad)
    want = static_block_mask(lo.clone(), hi.clone(), k_pad)
    assert all(a is b for a, b in zip(_blocks(mask), held, strict=True)), "rewritten in place"
    assert not torch.equal(before[1], want.kv_indices), "the two masks' blocks differ"
    for got, expected in zip(_blocks(mask), _blocks(want), strict=True):
        assert torch.equal(got, expected), f"seed {SEED}"


@pytest.mark.parametrize("attention,moe,dtype", PATHS)
def test_one_prompt_matches_reference(weights64, attention, moe, dtype):
    """250 tokens: crosses pages (64, 128, 192) and the 96-token window, in chunks of 100."""
    model = model_of(weights64, dtype)
    pool = Pool(model)
    toks = tokens_of(250)
    table = pool.table(250)
    what = f"{attention}/{moe}"
    _, compared = run_compared(model, pool, [PrefillRequest(toks, 0, table)], 100, attention, moe, dtype, what)
    if compared:
        pool.assert_pages_equal([table], TOL[dtype], what)


@pytest.mark.parametrize("chunk", [1, 7, 50, 64, 96, 100, 250, 4096])
def test_chunk_sizes_that_do_and_do_not_divide_the_prompt(weights64, chunk):
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    toks = tokens_of(250)
    table = pool.table(250)
    out = Prefill(model, chunk=chunk)([PrefillRequest(toks, 0, table)], pool.kv, return_hidden=True)
    check(out, 0, *pool.reference(toks, 0, table), torch.float64, f"chunk {chunk}")
    pool.assert_pages_equal([table], 1e-10, f"chunk {chunk}")


def test_one_token_prompts(weights64):
    """A 1-token prompt at position 0, and one token after a cached prefix (a decode step)."""
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    toks = tokens_of(130)
    a = pool.table(1)
    b = pool.table(130)
    model.forward(toks[:129], 0, pool.kv_ref, b)
    pool.kv.k.copy_(pool.kv_ref.k)
    pool.kv.v.copy_(pool.kv_ref.v)
    out = Prefill(model)([PrefillRequest(toks[:1], 0, a), PrefillRequest(toks[129:], 129, b)], pool.kv)
    want_a = model.forward(toks[:1], 0, pool.kv_ref, a)[-1]
    want_b = model.decode(toks[129:], torch.tensor([129]), pool.kv_ref, [b])[0]
    assert rel_err(out.logits[0], want_a) < 1e-10 and rel_err(out.logits[1], want_b) < 1e-10, f"seed {SEED}"
    pool.assert_pages_equal([a, b], 1e-10)


# ---- several prompts at once ----------------------------------------------------------------------------
LENGTHS = [1, 63, 64, 65, 97, 200, 3]


@pytest.mark.parametrize(
    "attention,moe,dtype,chunk",
    [(a, m, d, c) for a, m, d in PATHS for c in (512, 100)] + [("sdpa", "loop", torch.float64, 33)],
)
def test_packed_prompts_of_mixed_lengths(weights64, attention, moe, dtype, chunk):
    model = model_of(weights64, dtype)
    pool = Pool(model)
    prompts = [tokens_of(n, salt=i) for i, n in enumerate(LENGTHS)]
    tables = [pool.table(n) for n in LENGTHS]
    requests = [PrefillRequest(p, 0, t) for p, t in zip(prompts, tables, strict=True)]
    what = f"{attention}/{moe} chunk {chunk}"
    _, compared = run_compared(model, pool, requests, chunk, attention, moe, dtype, what)
    assert len(compared) >= len(requests) - 1, f"seed {SEED}: near-ties in several prompts"
    pool.assert_pages_equal([tables[i] for i in compared], TOL[dtype], what)


def test_before_chunk_sees_each_chunks_spans(weights64):
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    tables = [pool.table(70), pool.table(200)]
    model.forward(tokens_of(170, salt=9), 0, pool.kv, tables[1])  # the second request's cached prefix
    seen: list[list[Span]] = []
    Prefill(model, chunk=64)(
        [PrefillRequest(tokens_of(70), 0, tables[0]), PrefillRequest(tokens_of(30), 170, tables[1])],
        pool.kv,
        before_chunk=seen.append,
    )
    assert seen == [[Span(0, 0, 64)], [Span(0, 64, 70), Span(1, 170, 200)]]


def test_a_sliced_prefill_equals_the_whole_call(weights64):
    """Prefill.sliced runs the same operations a slice of layers at a time: after a cached prefix
    and beside a fresh prompt, the K/V written and the logits are bit for bit the whole call's;
    slices out of order, logits before the last layer and more than one chunk are refused."""
    model = model_of(weights64, torch.float64)
    toks, other = tokens_of(150), tokens_of(40, salt=3)
    outs = []
    for slices in (None, [(0, 1), (1, 3), (3, L)]):
        pool = Pool(model)
        tables = [pool.table(150), pool.table(40)]
        model.forward(toks[:100], 0, pool.kv, tables[0])  # a cached prefix
        requests = [PrefillRequest(toks[100:], 100, tables[0]), PrefillRequest(other, 0, tables[1])]
        prefill = Prefill(model, chunk=128)
        if slices is None:
            logits = prefill(requests, pool.kv).logits
        else:
            sliced = prefill.sliced(requests, pool.kv)
            with pytest.raises(ValueError, match="do not follow"):
                sliced.run(1, 2)
            for start, end in slices:
                if start > 0:
                    with pytest.raises(ValueError, match="layers have run"):
                        sliced.logits()
                sliced.run(start, end)
            logits = sliced.logits()
        outs.append((logits, pool.kv.k.clone(), pool.kv.v.clone()))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="at most one chunk"):
        Prefill(model, chunk=64).sliced([PrefillRequest(toks[:100], 0, Pool(model).table(100))], Pool(model).kv)


def test_a_sliced_prefill_runs_without_autograd_as_the_whole_call(weights64, monkeypatch):
    """The compiled prefill functions are guarded on the grad mode, so slices run with autograd on
    would compile every one of them again on first use (a pause of seconds): every layer and
    the head run under no_grad, as in the whole call, whatever the caller's mode."""
    model = model_of(weights64, torch.float64)
    modes: list[bool] = []
    layers, head = Prefill.layers, Prefill.head
    monkeypatch.setattr(
        Prefill, "layers", lambda self, *a, **k: modes.append(torch.is_grad_enabled()) or layers(self, *a, **k)
    )
    monkeypatch.setattr(Prefill, "head", lambda self, x: modes.append(torch.is_grad_enabled()) or head(self, x))
    pool = Pool(model)
    requests = [PrefillRequest(tokens_of(40), 0, pool.table(40))]
    prefill = Prefill(model, chunk=64)
    assert torch.is_grad_enabled()
    prefill(requests, pool.kv)
    sliced = prefill.sliced(requests, pool.kv)
    sliced.run(0, 1)
    sliced.run(1, L)
    sliced.logits()
    assert len(modes) >= 4 and not any(modes), modes


# ---- prefix reuse -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("attention,moe,dtype", PATHS[:2] + PATHS[3:])
def test_prefix_reuse(weights64, attention, moe, dtype):
    """Request B shares A's first two pages (a cached 128-token prefix) and prefills positions
    128..249; request C shares A's first three pages (192 tokens) with the sliding layers' page 0
    released, as a prefix cache attaches it; a fresh request D rides in the same call."""
    model = model_of(weights64, dtype)
    pool = Pool(model)
    toks = tokens_of(250)
    a = pool.table(192)
    model.forward(toks[:192], 0, pool.kv, a)
    model.forward(toks[:192], 0, pool.kv_ref, a)
    b = pool.alloc.new_table(CFG, MAX_PAGES)
    b[:, :2] = a[:, :2]
    pool.alloc.ensure(b, 250, from_pos=128)
    c = pool.alloc.new_table(CFG, MAX_PAGES)
    c[:, :3] = a[:, :3]
    for layer in range(L):
        if CFG.is_sliding(layer):
            c[layer, 0] = UNMAPPED  # (192 - 96 + 1) // 64 = 1: page 0 is out of every future window
    pool.alloc.ensure(c, 250, from_pos=192)
    d = pool.table(40)
    other = tokens_of(40, salt=5)
    requests = [PrefillRequest(toks[128:], 128, b), PrefillRequest(toks[192:], 192, c), PrefillRequest(other, 0, d)]
    out, compared = run_compared(model, pool, requests, 100, attention, moe, dtype, "prefix 128, prefix 192, fresh")
    assert len(compared) >= 2, f"seed {SEED}: near-ties in several requests"
    whole = model.logits(toks)[-1]
    assert all(rel_err(out.logits[i], whole) < TOL[dtype] for i in compared if i < 2)
    pool.assert_pages_equal([a] + [requests[i].block_table for i in compared], TOL[dtype])


# ---- sliding-window release between chunks ----------------------------------------------------------
@pytest.mark.parametrize("attention", ["sdpa", "flex_eager"])
@pytest.mark.parametrize("poison", [float("nan"), 1e4])
def test_released_window_pages_are_never_read(weights64, attention, poison):
    """Between chunks the caller releases sliding-layer pages below each span's window, poisons
    them and hands them out again (they back a later page of the other prompt): nothing changes."""
    model = model_of(weights64, torch.float64)
    lengths = [400, 230]
    prompts = [tokens_of(n, salt=i) for i, n in enumerate(lengths)]

    def run(release: bool):
        # Released blocks go to the free list's tail; a pool this small hands them out again.
        pool = Pool(model, blocks=52 if release else L * 16)
        tables = [pool.alloc.new_table(CFG, MAX_PAGES) for _ in lengths]
        freed: list[int] = []

        def before(spans: list[Span]) -> None:
            for s in spans:
                t = tables[s.request]
                if release:
                    gone = pool.alloc.release_out_of_window(t, CFG, s.start)
                    pool.kv.fill_blocks(gone, poison)
                    freed.extend(gone)
                pool.alloc.ensure(t, s.end, from_pos=s.start)

        out = Prefill(model, chunk=45, attention=attention)(
            [PrefillRequest(p, 0, t) for p, t in zip(prompts, tables, strict=True)],
            pool.kv,
            return_hidden=True,
            before_chunk=before,
        )
        return out, pool, tables, freed

    kept, _, _, _ = run(release=False)
    out, pool, tables, freed = run(release=True)
    assert len(freed) >= 12, "the test released too little to mean anything"
    assert set(freed) & set(torch.cat(tables, 1).flatten().tolist()), "no released block was reused"
    assert torch.isfinite(out.logits).all()
    assert torch.equal(out.logits, kept.logits) and torch.equal(out.hidden, kept.hidden), f"seed {SEED}"
    for i, p in enumerate(prompts):
        assert rel_err(out.logits[i], model.logits(p)[-1]) < 1e-10, f"seed {SEED}, prompt {i}"


# ---- stacked experts ----------------------------------------------------------------------------------------
def test_stack_experts_in_place_then_prefill_uses_the_stacks_without_copying(weights64):
    w = {k: v.to(torch.float32) for k, v in weights64.items()}
    model = Model(CFG, w)
    toks = tokens_of(150)
    before = model.logits(toks)[-1]
    assert stacked_experts(w, CFG, 1) is None
    assert stack_experts(w, CFG) == sum(CFG.is_moe(i) for i in range(L))
    assert stack_experts(w, CFG) == 0
    w13, w2 = stacked_experts(w, CFG, 2)
    f = CFG.intermediate_size
    assert torch.equal(w13[3, :f], w["model.layers.2.mlp.experts.3.gate_proj.weight"])
    assert torch.equal(w13[3, f:], w["model.layers.2.mlp.experts.3.up_proj.weight"])
    assert torch.equal(w2[5], w["model.layers.2.mlp.experts.5.down_proj.weight"])
    assert torch.equal(model.logits(toks)[-1], before)
    prefill = Prefill(model, moe="grouped")
    assert prefill._stacks[2][0].data_ptr() == w["model.layers.2.mlp.experts.0.gate_proj.weight"].data_ptr()
    pool = Pool(model)
    table = pool.table(150)
    out = prefill([PrefillRequest(toks, 0, table)], pool.kv)
    assert rel_err(out.logits[0], before) < 1e-4, f"seed {SEED}"


# ---- errors -----------------------------------------------------------------------------------------------
def test_missing_pages_raise(weights64):
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    prefill = Prefill(model, chunk=64)
    toks = tokens_of(200)
    with pytest.raises(KVMappingError, match="page 1 is unmapped .* written"):
        prefill([PrefillRequest(toks[:100], 0, pool.table(64))], pool.kv)
    table = pool.table(200)
    model.forward(toks[:160], 0, pool.kv, table)
    full = table.clone()
    full[4, 0] = UNMAPPED  # a full layer's prefix page
    with pytest.raises(KVMappingError, match="layer 4: page 0 is unmapped .* read"):
        prefill([PrefillRequest(toks[100:110], 100, full)], pool.kv)
    sliding = table.clone()
    sliding[1, 0] = UNMAPPED  # position 100 still sees positions 5..63 of page 0 on sliding layers
    with pytest.raises(KVMappingError, match="layer 1: page 0 is unmapped .* read"):
        prefill([PrefillRequest(toks[100:110], 100, sliding)], pool.kv)
    # From position 160 on, sliding layers see [65, ...]: page 0 may be gone.
    for layer in range(L):
        if CFG.is_sliding(layer):
            sliding[layer, 0] = UNMAPPED
    out = prefill([PrefillRequest(toks[160:], 160, sliding)], pool.kv)
    assert rel_err(out.logits[0], model.logits(toks)[-1]) < 1e-10, f"seed {SEED}"
    with pytest.raises(KVMappingError, match="needs page 8"):
        prefill([PrefillRequest(toks[:10], 510, pool.table(512))], pool.kv)


def test_bad_requests_are_rejected(weights64):
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    prefill = Prefill(model)
    t = pool.table(64)
    for bad, match in (
        ([], "no requests"),
        ([PrefillRequest([], 0, t)], "no tokens"),
        ([PrefillRequest([CFG.vocab_size], 0, t)], "token ids"),
        ([PrefillRequest([1], -1, t)], "start must be"),
        ([PrefillRequest([1], 0, t[:2])], "block table must be"),
        ([PrefillRequest([1], 0, t), PrefillRequest([2], 0, t)], "appears twice"),
    ):
        with pytest.raises(ValueError, match=match):
            prefill(bad, pool.kv)
    with pytest.raises(ValueError, match="unknown attention"):
        Prefill(model, attention="magic")
    with pytest.raises(ValueError, match="grouped MoE needs"):
        Prefill(model, moe="grouped")
    with pytest.raises(ValueError, match="fa3"):
        Prefill(model, attention="fa3")
    with pytest.raises(ValueError, match="chunk"):
        Prefill(model, chunk=0)


def test_prefill_writes_only_its_own_positions(weights64):
    """Positions outside [start, end) of every page stay as they were (poisoned here)."""
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    toks = tokens_of(100)
    table = pool.table(100)
    model.forward(toks[:30], 0, pool.kv, table)
    blocks = table[table != UNMAPPED].long()
    k_before = pool.kv.k[blocks].clone()
    Prefill(model)([PrefillRequest(toks[30:90], 30, table)], pool.kv)
    changed = (pool.kv.k[blocks] != k_before).any(-1).any(-1)  # [blocks, 64]
    pages = torch.arange(MAX_PAGES).repeat(L, 1)[table != UNMAPPED]
    pos = pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)[None]
    assert torch.equal(changed, (pos >= 30) & (pos < 90))


# ---- a fresh prompt's static pass (mk.prefill.fresh) ------------------------------------------------
@pytest.mark.parametrize("attention", ["sdpa", "flex_eager"])
@pytest.mark.parametrize("n", [1, 63, 64, 200, 300])
def test_a_fresh_prompt_padded_to_a_bucket_matches_the_reference(weights64, attention, n):
    """The static-shape pass a CUDA graph captures, run eagerly: a fresh prompt padded to a bucket of
    64 or 256 rows (64 fills one exactly; 200 pads 56 rows past the 96-token window; 300 runs its
    first 256 tokens so and the rest, which has a cached prefix, the usual way) gives the
    reference's logits, residual and pages, and writes no slot past its last position."""
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    toks = tokens_of(n)
    table = pool.table(n)
    blocks = table[table != UNMAPPED].long()
    pool.kv.k[blocks] = float("nan")  # what the prompt does not write must stay so
    prefill = Prefill(model, chunk=256, attention=attention, moe="loop", graphs=True)
    prefill.fresh = FreshPrompts(prefill, buckets=(64, 256), capture=False)
    out = prefill([PrefillRequest(toks, 0, table)], pool.kv, return_hidden=True)
    assert list(prefill.fresh._buckets) == [64 if n <= 64 else 256], "the fresh chunk took the static pass"
    check(out, 0, *pool.reference(toks, 0, table), torch.float64, f"{attention} n={n}")
    written = ~pool.kv.k[blocks].isnan().any(-1).any(-1)  # [blocks, 64]
    pages = torch.arange(MAX_PAGES).repeat(L, 1)[table != UNMAPPED]
    pos = pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)[None]
    assert torch.equal(written, pos < n), f"seed {SEED}: slots written beyond the prompt's positions"
    pool.kv.k[blocks] = torch.where(written[..., None, None], pool.kv.k[blocks], pool.kv_ref.k[blocks])
    pool.assert_pages_equal([table], 1e-10, f"{attention} n={n}")


@pytest.mark.parametrize("min_rows", [256, 257])
@pytest.mark.parametrize("n", [300, 512])
def test_a_large_enough_static_pass_takes_the_static_steps_and_nothing_else_does(weights64, monkeypatch, min_rows, n):
    """The elementwise steps compiled per shape (GPU) serve only chunks of a bucket's rows, at least
    STATIC_STEPS_MIN_ROWS: a prompt's first 256 tokens (the fresh pass's bucket 256) take them when
    the bar is 256, not when it is 257; of the rest, on the usual path, 44 rows never do and 256
    rows (a bucket's shape: a long prompt's full chunk) do as the first. (float32 for the grouped
    MoE's steps; the values of the static pass are checked above.)"""
    monkeypatch.setattr(prefill_module, "STATIC_STEPS_MIN_ROWS", min_rows)
    calls = []
    run = prefill_module._Op.__call__
    monkeypatch.setattr(prefill_module._Op, "__call__", lambda op, *a: calls.append(op.static) or run(op, *a))
    model = model_of(weights64, torch.float32)
    pool = Pool(model)
    prefill = Prefill(model, chunk=256, attention="sdpa", moe="grouped", graphs=True)
    prefill.fresh = FreshPrompts(prefill, buckets=(64, 256), capture=False)
    out = prefill([PrefillRequest(tokens_of(n), 0, pool.table(n))], pool.kv)
    assert out.logits.isfinite().all()
    per_pass = sum(2 + 2 * CFG.needs_rope(i) + 2 * CFG.is_moe(i) for i in range(L))  # norm, residual, rope, MoE
    static_passes = (1 + (n == 512)) if min_rows <= 256 else 0
    assert calls.count(True) == static_passes * per_pass
    assert calls.count(False) == (2 - static_passes) * per_pass


def test_a_fresh_prompt_with_another_cache_drops_the_static_buffers(weights64):
    model = model_of(weights64, torch.float64)
    prefill = Prefill(model, chunk=64, graphs=True)
    first, second = Pool(model), Pool(model)
    toks = tokens_of(40)
    buckets = []
    for pool in (first, first, second, first):
        table = pool.table(40)
        out = prefill([PrefillRequest(toks, 0, table)], pool.kv)
        assert rel_err(out.logits[0], pool.reference(toks, 0, table)[0]) < 1e-10, f"seed {SEED}"
        buckets.append(prefill.fresh._buckets[64])
    assert prefill.fresh._kv() is first.kv
    # Kept while the cache stays (on a GPU: its graph), made anew for every other cache.
    assert buckets[0] is buckets[1] and buckets[2] is not buckets[1] and buckets[3] is not buckets[2]


# ---- a chunk after a cached prefix: its static pass (mk.prefill.prefixed.PrefixedChunks) -----------------
def prefixed_prefill(model: Model, attention: str) -> Prefill:
    """A prefill whose chunks after a cached prefix take the static pass, run eagerly: one bucket of
    256 rows, full-attention keys padded to 512 columns (the tiny tables hold 512 positions)."""
    prefill = Prefill(model, chunk=256, attention=attention, moe="loop", graphs=False)
    prefill.prefixed = PrefixedChunks(prefill, buckets=(256,), key_buckets=(512,), capture=False)
    return prefill


@pytest.mark.parametrize("attention", ["sdpa", "flex_eager"])
@pytest.mark.parametrize("start,n", [(1, 1), (64, 63), (100, 200), (130, 256), (255, 1), (300, 212)])
def test_a_chunk_after_a_cached_prefix_padded_to_a_bucket_matches_the_reference(weights64, attention, start, n):
    """The static-shape pass of a chunk at positions start..start+n-1 whose prefix is in the cache
    (written by the reference): keys gathered by static slot tables padded with the first key's
    slot, each row's visible columns as intervals; with the sliding layers' pages below the window
    released and poisoned (never read), it gives the reference's logits, residual and pages, and
    writes no slot outside its own positions."""
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    toks = tokens_of(start + n)
    table = pool.table(start + n)
    model.forward(toks[:start], 0, pool.kv, table)  # the cached prefix, on both pools
    model.forward(toks[:start], 0, pool.kv_ref, table)
    gone = pool.alloc.release_out_of_window(table, CFG, start)
    pool.kv.fill_blocks(gone, float("nan"))
    blocks = table[table != UNMAPPED].long()
    before = pool.kv.k[blocks].clone()
    prefill = prefixed_prefill(model, attention)
    out = prefill([PrefillRequest(toks[start:], start, table)], pool.kv, return_hidden=True)
    assert list(prefill.prefixed._buckets) == [(256, 512)], "the chunk took the static pass"
    check(out, 0, *pool.reference(toks[start:], start, table), torch.float64, f"{attention} {start}+{n}")
    changed = (pool.kv.k[blocks] != before).any(-1).any(-1)  # [blocks, 64]
    pages = torch.arange(MAX_PAGES).repeat(L, 1)[table != UNMAPPED]
    pos = pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)[None]
    assert not (changed & ((pos < start) | (pos >= start + n))).any(), f"seed {SEED}: slots written outside the chunk"
    pool.assert_pages_equal([table], 1e-10, f"{attention} {start}+{n}")


def test_prefixed_chunks_cover_what_their_buckets_hold_and_refuse_unmapped_prefix_pages(weights64):
    model = model_of(weights64, torch.float64)
    prefill = prefixed_prefill(model, "sdpa")
    p = prefill.prefixed
    assert p.covers([(1, 256)]) and p.covers([(256, 256)])
    assert not p.covers([(0, 10)]), "a fresh prompt alone is FreshPrompts' (or the usual path's)"
    assert not p.covers([(10, 257)]) and not p.covers([(300, 213)]), "past the row or key buckets"
    assert p.covers([(0, 10), (5, 20)]) and p.covers([(50, 64)] * PACKED_SEQUENCES), "packed, a fresh one beside"
    assert not p.covers([(1, 1)] * (PACKED_SEQUENCES + 1)), "more sequences than one pass packs"
    assert not p.covers([(100, 200), (10, 57)]) and not p.covers([(300, 100), (200, 13)]), "rows, keys"
    pool = Pool(model)
    toks = tokens_of(200)
    table = pool.table(200)
    table[0, 0] = UNMAPPED  # layer 0 is full attention: its prefix page 0 is read
    with pytest.raises(KVMappingError, match="page 0 is unmapped"):
        prefill([PrefillRequest(toks[100:], 100, table)], pool.kv)
    with pytest.raises(ValueError, match="multiples of 128"):
        PrefixedChunks(prefill, buckets=(100,), capture=False)
    assert Prefill(model, chunk=200, prefix_graphs=True).prefixed is None, "no bucket fits a 200-token chunk"
    assert Prefill(model, chunk=256, prefix_graphs=True).prefixed is not None


@pytest.mark.parametrize("max_end", [2, 200, 257, 300, 513, 1024, 1500, 2048, 5000])
def test_prefixed_warm_up_chunks_take_every_shape_a_context_reaches_once(weights64, max_end):
    """The warm-up's chunks (one per padded shape) against every shape a chunk ending by `max_end`
    can take, tried at the lengths and ends where a bucket changes."""
    prefill = Prefill(model_of(weights64, torch.float64), chunk=512, moe="loop", graphs=False)
    p = PrefixedChunks(prefill, buckets=(256, 512), key_buckets=(512, 1024, 2048), capture=False)
    chunks = p.warm_up_chunks(max_end)
    shapes = [p.shape([(start, n)]) for start, n in chunks]
    assert all(p.covers([(start, n)]) and start + n <= max_end for start, n in chunks), chunks
    assert len(set(shapes)) == len(shapes), f"a shape twice: {chunks}"
    edges = {1, 2, 255, 256, 257, 511, 512, 513, 1023, 1024, 1025, 2047, 2048, max_end - 1, max_end}
    reachable = {
        p.shape([(end - n, n)])
        for n in edges
        for end in edges | {n + 1}
        if 0 < n and end <= max_end and p.covers([(end - n, n)])
    }
    assert set(shapes) == reachable
    # Packed sequences, once limited to what the warm-up captures, take only those shapes.
    p.limit_packing(max_end)
    spans = [(end - n, n) for n in edges for end in edges | {n + 1} if 0 < n and end <= max_end]
    packed = {p.shape([a, b]) for a in spans for b in spans if p.covers([a, b])}
    assert packed <= set(shapes), packed - set(shapes)
    assert max_end < 512 or any(p.covers([a, b]) for a in spans for b in spans), "nothing packs"


def test_prefix_graphs_modes(weights64):
    """Prefill(prefix_graphs=...): "auto" is the next turn's buckets on CUDA (test_prefill_gpu.py),
    none on the CPU; True every bucket the chunk holds; False none."""
    model = model_of(weights64, torch.float64)
    assert Prefill(model, chunk=8192).prefixed is None, "auto: CUDA only"
    assert Prefill(model, chunk=8192, prefix_graphs=True).prefixed.buckets == BUCKETS
    assert Prefill(model, chunk=1024, prefix_graphs=True).prefixed.buckets == (256, 512, 1024)
    assert Prefill(model, chunk=8192, prefix_graphs=False).prefixed is None
    with pytest.raises(ValueError, match="prefix_graphs must be"):
        Prefill(model, prefix_graphs="on")


def test_fresh_split_cuts_only_just_past_a_compute_bound_bucket(weights64):
    """The real buckets: a fresh prompt up to half a bucket of at least SPLIT_MIN_BUCKET past it is
    cut at that bucket, when the next-turn passes cover the rest; nothing else is."""
    prefill = Prefill(model_of(weights64, torch.float64), chunk=16384, moe="loop", graphs=True, prefix_graphs=False)
    fresh = prefill.fresh
    next_turn = PrefixedChunks(prefill, buckets=NEXT_TURN_BUCKETS, capture=False)
    every = PrefixedChunks(prefill, buckets=BUCKETS, capture=False)
    assert SPLIT_MIN_BUCKET == 4096 and fresh.buckets[-1] == 8192
    want = {1: 0, 2048: 0, 2049: 0, 3000: 0, 4096: 0, 4097: 4096, 5281: 4096, 6144: 4096, 6145: 0, 8192: 0}
    assert {n: fresh_split(n, fresh, next_turn) for n in want} == want
    # Past the largest fresh bucket (a chunk of more than 8K tokens): its rest may be half of 8K with
    # every prefixed bucket, at most the largest next-turn bucket by default.
    assert [fresh_split(n, fresh, every) for n in (8193, 12288, 12289)] == [8192, 8192, 0]
    assert [fresh_split(n, fresh, next_turn) for n in (8193, 10240, 10241)] == [8192, 8192, 0]
    assert fresh_split(5281, None, next_turn) == 0 and fresh_split(5281, fresh, None) == 0


@pytest.mark.parametrize("attention", ["sdpa", "flex_eager"])
@pytest.mark.parametrize("n,cut", [(300, 256), (384, 256), (385, 0), (256, 0)])
def test_a_fresh_prompt_just_past_a_bucket_runs_as_two_static_passes(weights64, monkeypatch, attention, n, cut):
    """With SPLIT_MIN_BUCKET at the tiny buckets' 256, a fresh prompt of up to 384 tokens runs as the
    fresh pass of 256 rows, then the rest after it as a chunk after a cached prefix (both static
    passes, run eagerly here), and gives the reference's logits, residual and pages; 385 (a rest of
    more than half the bucket) and 256 (a bucket exactly) stay one chunk, as does any prompt with
    fresh_split off."""
    monkeypatch.setattr(fresh_module, "SPLIT_MIN_BUCKET", 256)
    model = model_of(weights64, torch.float64)
    for split_on in (True, False):
        pool = Pool(model)
        toks = tokens_of(n)
        table = pool.table(n)
        prefill = Prefill(model, chunk=512, attention=attention, moe="loop", graphs=True, fresh_split=split_on)
        prefill.fresh = FreshPrompts(prefill, buckets=(64, 256), capture=False)
        prefill.prefixed = PrefixedChunks(prefill, buckets=(256,), key_buckets=(512,), capture=False)
        chunks = []
        out = prefill([PrefillRequest(toks, 0, table)], pool.kv, return_hidden=True, before_chunk=chunks.append)
        what = f"{attention} n={n} fresh_split={split_on}"
        if cut and split_on:
            assert chunks == [[Span(0, 0, cut)], [Span(0, cut, n)]], what
            assert list(prefill.fresh._buckets) == [256] and list(prefill.prefixed._buckets) == [(256, 512)], what
        else:
            assert chunks == [[Span(0, 0, n)]], what
            assert not prefill.prefixed._buckets, what
        check(out, 0, *pool.reference(toks, 0, table), torch.float64, what)
        pool.assert_pages_equal([table], 1e-10, what)


def test_a_packed_call_is_never_split(weights64, monkeypatch):
    monkeypatch.setattr(fresh_module, "SPLIT_MIN_BUCKET", 256)
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    prefill = Prefill(model, chunk=512, attention="sdpa", moe="loop", graphs=True)
    prefill.fresh = FreshPrompts(prefill, buckets=(64, 256), capture=False)
    prefill.prefixed = PrefixedChunks(prefill, buckets=(256,), key_buckets=(512,), capture=False)
    chunks = []
    requests = [PrefillRequest(tokens_of(300), 0, pool.table(300)), PrefillRequest(tokens_of(20, 1), 0, pool.table(20))]
    out = prefill(requests, pool.kv, before_chunk=chunks.append)
    assert chunks == [[Span(0, 0, 300), Span(1, 0, 20)]]
    for i, r in enumerate(requests):
        assert rel_err(out.logits[i], pool.reference(r.tokens, 0, r.block_table)[0]) < 1e-10, f"seed {SEED}"


def cached(
    pool: Pool, model: Model, spans: list[tuple[int, int]], salt: int = 0, narrow: bool = False
) -> list[PrefillRequest]:
    """A request per (start, n) span: its sequence's first `start` tokens in both pools (the
    reference's forward), the next n to prefill; `narrow`: each block table only as wide as its
    sequence needs (tables of several widths)."""
    requests = []
    for i, (start, n) in enumerate(spans):
        toks = tokens_of(start + n, salt=salt + i)
        if narrow:
            table = pool.alloc.new_table(CFG, pages_needed(start + n))
            pool.alloc.ensure(table, start + n)
        else:
            table = pool.table(start + n)
        for kv in (pool.kv, pool.kv_ref)[: 2 * (start > 0)]:
            model.forward(toks[:start], 0, kv, table)
        requests.append(PrefillRequest(toks[start:], start, table))
    return requests


def check_requests(pool: Pool, out, requests: list[PrefillRequest], what: str) -> None:
    """Each request's logits and residual against the reference, and every page: nothing written
    outside a request's own new positions (the reference writes only those too)."""
    for i, r in enumerate(requests):
        check(out, i, *pool.reference(r.tokens, r.start, r.block_table), torch.float64, f"{what}: request {i}")
    pool.assert_pages_equal([r.block_table for r in requests], 1e-10, what)


@pytest.mark.parametrize("attention", ["sdpa", "flex_eager"])
def test_sequences_after_cached_prefixes_share_one_static_pass(weights64, attention):
    """Up to PACKED_SEQUENCES chunks of different sequences, each after its cached prefix (two past
    the 96-token window, whose sliding keys start inside the prefix; a fresh prompt among them),
    take one static pass of PrefixedChunks, their block tables of several widths: the
    reference's logits, residuals and pages."""
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    prefill = prefixed_prefill(model, attention)
    prefill.fresh = FreshPrompts(prefill, buckets=(64,), capture=False)
    spans = [(0, 40), (100, 30), (130, 70), (30, 50)][:PACKED_SEQUENCES]
    requests = cached(pool, model, spans, narrow=True)
    assert len({r.block_table.shape[1] for r in requests}) > 1
    blocks = torch.cat([r.block_table[r.block_table != UNMAPPED] for r in requests]).long().unique()
    before = pool.kv.k[blocks].clone()
    out = prefill(requests, pool.kv, return_hidden=True)
    assert list(prefill.prefixed._buckets) == [(256, 512)] and not prefill.fresh._buckets, "one packed pass"
    check_requests(pool, out, requests, f"{attention}, packed")
    changed = (pool.kv.k[blocks] != before).any(-1).any(-1)  # [blocks, 64]: compared with the reference's above
    assert changed.any()


@pytest.mark.parametrize("limit", [STATIC_PASSES_MAX, 1])
def test_more_sequences_than_one_pass_packs_take_several_or_the_usual_path(weights64, monkeypatch, limit):
    """Sequences in order, grouped greedily: six short next turns take two packed passes (four,
    then two) within STATIC_PASSES_MAX, else one packed pass on the usual path; a fresh prompt no
    pass takes alone (100 tokens, past the 64-row fresh bucket) may join a group; and one left
    alone (its keys would take the others' past 512 columns) keeps the chunk on the usual path."""
    monkeypatch.setattr(prefill_module, "STATIC_PASSES_MAX", limit)
    model = model_of(weights64, torch.float64)
    for spans, passes in (([(20, 10)] * 6, 2), ([(20, 10), (0, 100)], 1), ([(250, 20), (200, 20), (0, 70)], 0)):
        pool = Pool(model)
        prefill = prefixed_prefill(model, "sdpa")
        prefill.fresh = FreshPrompts(prefill, buckets=(64,), capture=False)
        requests = cached(pool, model, spans, salt=len(spans))
        calls: list[int] = []
        run = prefill.prefixed._run
        prefill.prefixed._run = lambda b, kv, calls=calls, run=run: calls.append(b.n) or run(b, kv)
        out = prefill(requests, pool.kv, return_hidden=True)
        want = passes if passes <= limit else 0
        assert len(calls) == want and not prefill.fresh._buckets, f"{spans}: {calls}"
        check_requests(pool, out, requests, f"{spans}, limit {limit}")


def test_a_missing_page_raises_before_any_pass_of_the_chunk_writes(weights64):
    """Six sequences take two packed passes; the last one's page is unmapped: KVMappingError, and
    the first pass has written nothing (the page contract: a chunk writes nothing before it is
    checked whole)."""
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    prefill = prefixed_prefill(model, "sdpa")
    requests = cached(pool, model, [(20, 10)] * 6)
    requests[-1].block_table[0, 0] = UNMAPPED  # layer 0 (full attention) reads its prefix there
    before = pool.kv.k.clone()
    with pytest.raises(KVMappingError, match="page 0 is unmapped"):
        prefill(requests, pool.kv)
    assert torch.equal(pool.kv.k.nan_to_num(), before.nan_to_num()), "a pass wrote before the chunk was checked"


def test_a_static_pass_out_of_memory_takes_the_usual_path_for_that_chunk_only(weights64, monkeypatch):
    model = model_of(weights64, torch.float64)
    pool = Pool(model)
    prefill = prefixed_prefill(model, "sdpa")
    prefixed = prefill.prefixed

    def out_of_memory(b, kv):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (stand-in)")

    monkeypatch.setattr(prefixed, "_run", out_of_memory)
    requests = cached(pool, model, [(100, 30)])
    with pytest.warns(UserWarning, match="ran out of GPU memory"):
        out = prefill(requests, pool.kv, return_hidden=True)
    check_requests(pool, out, requests, "after an out-of-memory pass")
    assert prefill.prefixed is prefixed, "the static passes stay on for other chunks"


def test_a_shape_whose_capture_fails_runs_eagerly_and_the_others_keep_their_graphs(weights64, monkeypatch):
    """The capture bookkeeping (`_StaticPasses._run`) with a stand-in capture: a shape whose capture
    failed is never tried again and runs its pass each call; a captured one replays; the count of
    failed shapes is what the warm-up reports."""
    prefill = Prefill(model_of(weights64, torch.float64), chunk=256, graphs=True, moe="loop")
    passes = prefill.fresh = FreshPrompts(prefill, buckets=(64, 256), capture=False)
    passes.capture = True  # (a CUDA-only state: the capture and the graph are stood in for below)
    log = []

    class Graph:
        def __init__(self, n):
            self.n = n

        def replay(self):
            log.append(("replay", self.n))

    def capture(b, kv):
        log.append(("capture", b.n))
        passes._pass(b, kv)
        if b.n == 256:
            b.uncapturable = True
        else:
            b.graph = Graph(b.n)

    monkeypatch.setattr(passes, "_capture", capture)
    monkeypatch.setattr(passes, "_pass", lambda b, kv: log.append(("pass", b.n)))
    pool = Pool(model_of(weights64, torch.float64))
    for n in (40, 200, 40, 200):
        table = pool.table(n)
        passes(tokens_of(n), Piece(0, n, 0, table, table), pool.kv)
    assert log == [
        *[("capture", 64), ("pass", 64), ("replay", 64)],
        *[("capture", 256), ("pass", 256)],
        ("replay", 64),
        ("pass", 256),
    ]
    assert passes.uncapturable() == 1 and passes.capture
    table = pool.table(40)
    with pytest.raises(ValueError, match="fresh prompt"):
        passes(tokens_of(40), Piece(8, 40, 0, table, table), pool.kv)


def test_an_invalidated_capture_is_ended_and_later_captures_take_a_new_pool(monkeypatch):
    """PyTorch's capture_end raises on a capture CUDA invalidated before it ends the allocator's
    recording into the pool; `end_abandoned_capture` ends it and renews the prefill's pool. When
    the capture had ended (the allocator refuses to end it again), the pool stays."""
    from types import SimpleNamespace

    from mk.prefill.static import end_abandoned_capture

    ended, renewed = [], []
    prefill = SimpleNamespace(device=torch.device("cuda", 3), renew_graph_pool=lambda: renewed.append(True))

    def end(device, pool):
        ended.append((device, pool))
        if pool == (0, 2):
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end, raising=False)
    end_abandoned_capture(prefill, (0, 1))
    assert ended == [(3, (0, 1))] and renewed == [True]
    end_abandoned_capture(prefill, (0, 2))
    assert ended[-1] == (3, (0, 2)) and renewed == [True], "an ended capture's pool stays"


def test_a_prefixed_chunk_with_another_cache_drops_the_static_buffers(weights64):
    model = model_of(weights64, torch.float64)
    prefill = prefixed_prefill(model, "sdpa")
    first, second = Pool(model), Pool(model)
    toks = tokens_of(120)
    buckets = []
    for pool in (first, first, second):
        table = pool.table(120)
        model.forward(toks[:80], 0, pool.kv, table)
        out = prefill([PrefillRequest(toks[80:], 80, table)], pool.kv)
        assert rel_err(out.logits[0], model.logits(toks)[-1]) < 1e-10, f"seed {SEED}"
        buckets.append(prefill.prefixed._buckets[256, 512])
    assert buckets[0] is buckets[1] and buckets[2] is not buckets[1]
